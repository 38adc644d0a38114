//! FNV-1a over little-endian integers: a stable, dependency-free fingerprint that is the
//! same on every rank and platform (std's hashers are not guaranteed stable).

/// Incremental 64-bit FNV-1a.
#[derive(Debug, Clone, Copy)]
pub struct Fnv64(u64);

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;

    /// A fresh hasher.
    pub fn new() -> Self {
        Self(Self::OFFSET)
    }
    /// Mixes in raw bytes.
    pub fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= u64::from(b);
            self.0 = self.0.wrapping_mul(Self::PRIME);
        }
    }
    /// Mixes in one `u64`.
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    /// Mixes in a slice of `u32` (its length first, so `[1],[2]` differs from `[1,2]`).
    pub fn u32s(&mut self, vs: &[u32]) {
        self.u64(vs.len() as u64);
        for &v in vs {
            self.bytes(&v.to_le_bytes());
        }
    }
    /// Mixes in one whole word: one multiply by a dense odd constant, then a fold of the
    /// high half down. Cheaper than [`Fnv64::u64`] (one multiply instead of eight) for
    /// the per-step schedule digest, and each call is a bijection of the state, so two
    /// inputs that differ in exactly one word always give different digests.
    pub fn word(&mut self, v: u64) {
        let mixed = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = mixed ^ (mixed >> 32);
    }
    /// The fingerprint so far.
    pub fn finish(self) -> u64 {
        self.0
    }
}
