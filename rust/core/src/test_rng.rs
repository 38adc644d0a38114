//! The seeded generator the unit tests share (xorshift64): reproducible streams without a
//! dependency. Integration tests have their own in `tests/common`.

/// Each call gives the next value of the stream seeded `seed` (not 0).
pub(crate) fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
    move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    }
}

/// [`xorshift`] reduced: each call gives a value below its argument.
pub(crate) fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut next = xorshift(seed);
    move |n| next() % n
}
