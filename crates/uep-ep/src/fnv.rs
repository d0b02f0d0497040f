//! FNV-1a over 64-bit words: the cheap digests uep compares between ranks (a routing,
//! a config, the masks agreed so far) and the name of an elastic job's door. Not for
//! anything an adversary picks.

/// The digest of nothing.
pub(crate) const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// `h` with `word` folded in.
pub(crate) fn step(h: u64, word: u64) -> u64 {
    (h ^ word).wrapping_mul(0x100_0000_01b3)
}

/// The digest of `words`.
pub(crate) fn hash(words: impl IntoIterator<Item = u64>) -> u64 {
    words.into_iter().fold(OFFSET, step)
}
