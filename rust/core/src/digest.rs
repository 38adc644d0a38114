//! FNV-1a over little-endian integers: a stable, dependency-free fingerprint that is the
//! same on every rank and platform (std's hashers are not guaranteed stable).

/// The two's-complement bits of a signed 32-bit value (a token, a page or a batch slot),
/// zero-extended: the word a digest mixes in for it.
#[expect(
    clippy::cast_sign_loss,
    reason = "a reinterpretation of the bits, not a conversion of the value"
)]
pub(crate) fn bits(v: i32) -> u64 {
    u64::from(v as u32)
}

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

/// A four-lane word digest for long arrays: each lane folds every fourth word with the
/// same bijective step as [`Fnv64::word`], so the multiplies of neighbouring words run in
/// parallel instead of in one dependency chain, and the lanes are folded together at the
/// end. Any single-word difference still always changes the result.
#[derive(Debug, Clone, Copy)]
pub struct LaneDigest {
    lanes: [u64; 4],
}

impl Default for LaneDigest {
    fn default() -> Self {
        Self::new()
    }
}

impl LaneDigest {
    /// A fresh digest.
    pub fn new() -> Self {
        Self {
            lanes: [
                Fnv64::OFFSET,
                Fnv64::OFFSET ^ 1,
                Fnv64::OFFSET ^ 2,
                Fnv64::OFFSET ^ 3,
            ],
        }
    }

    fn mix(state: u64, word: u64) -> u64 {
        let mixed = (state ^ word).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        mixed ^ (mixed >> 32)
    }

    /// Mixes in one word (into the first lane).
    pub fn word(&mut self, word: u64) {
        self.lanes[0] = Self::mix(self.lanes[0], word);
    }

    /// Mixes in a sequence of words, its length first, dealing them over the lanes.
    pub fn stream(&mut self, words: impl ExactSizeIterator<Item = u64>) {
        self.word(words.len() as u64);
        let mut words = words;
        let [mut a, mut b, mut c, mut d] = self.lanes;
        // Four independent chains in registers; the loop ends wherever the input does.
        while let Some(word) = words.next() {
            a = Self::mix(a, word);
            let Some(word) = words.next() else { break };
            b = Self::mix(b, word);
            let Some(word) = words.next() else { break };
            c = Self::mix(c, word);
            let Some(word) = words.next() else { break };
            d = Self::mix(d, word);
        }
        self.lanes = [a, b, c, d];
    }

    /// [`Self::stream`] of `word(i)` for `i in 0..len`, dealt four at a time: the same
    /// digest, without the per-word iterator checks (`word` reads slices cut to `len`, so
    /// its bound checks fold away).
    #[inline]
    pub fn stream_indexed(&mut self, len: usize, word: impl Fn(usize) -> u64) {
        self.word(len as u64);
        let mut lanes = self.lanes;
        let whole = len - len % 4;
        for four in (0..whole).step_by(4) {
            // Four independent chains: their multiplies overlap.
            for (k, lane) in lanes.iter_mut().enumerate() {
                *lane = Self::mix(*lane, word(four + k));
            }
        }
        for (lane, i) in lanes.iter_mut().zip(whole..len) {
            *lane = Self::mix(*lane, word(i));
        }
        self.lanes = lanes;
    }

    /// Mixes in a slice of words, its length first.
    pub fn words(&mut self, words: &[u64]) {
        self.stream(words.iter().copied());
    }

    /// Mixes in a slice of 32-bit values (two per word), its length first.
    pub fn halves(&mut self, values: &[u32]) {
        self.word(values.len() as u64);
        let pairs = values
            .chunks(2)
            .map(|pair| u64::from(pair[0]) | (u64::from(pair.get(1).copied().unwrap_or(0)) << 32));
        self.stream(pairs);
    }

    /// Mixes in a slice of flags (eight per word), its length first.
    pub fn flags(&mut self, flags: &[bool]) {
        self.word(flags.len() as u64);
        for chunk in flags.chunks(8) {
            let word = chunk
                .iter()
                .enumerate()
                .fold(0u64, |acc, (i, &flag)| acc | (u64::from(flag) << (8 * i)));
            self.word(word);
        }
    }

    /// The digest so far.
    pub fn finish(self) -> u64 {
        self.lanes
            .iter()
            .fold(Fnv64::OFFSET, |state, &lane| Self::mix(state, lane))
    }
}

#[cfg(test)]
mod tests {
    use super::LaneDigest;

    #[test]
    fn indexed_streams_digest_like_the_iterated_stream() {
        for len in 0..11u64 {
            let words: Vec<u64> = (0..len).map(|i| i * 0x1234_5678 + 1).collect();
            let mut iterated = LaneDigest::new();
            iterated.word(3);
            iterated.stream(words.iter().copied());
            let mut indexed = LaneDigest::new();
            indexed.word(3);
            indexed.stream_indexed(words.len(), |i| words[i]);
            assert_eq!(indexed.finish(), iterated.finish(), "length {len}");
        }
    }

    #[test]
    fn any_single_word_change_changes_the_digest() {
        let base: Vec<u64> = (0..23).map(|i| i * 0x1234_5678_9abc).collect();
        let digest = |words: &[u64]| {
            let mut d = LaneDigest::new();
            d.words(words);
            #[expect(clippy::cast_possible_truncation, reason = "the low halves")]
            let halves: Vec<u32> = words.iter().map(|&w| w as u32).collect();
            d.halves(&halves);
            d.finish()
        };
        let reference = digest(&base);
        for i in 0..base.len() {
            for bit in [0, 17, 63] {
                let mut changed = base.clone();
                changed[i] ^= 1 << bit;
                assert_ne!(digest(&changed), reference, "word {i} bit {bit}");
            }
        }
        assert_ne!(digest(&base[..22]), reference, "the length counts");
    }
}
