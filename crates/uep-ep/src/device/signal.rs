//! The signal and wait phases' descriptors: words of symmetric memory that a rank
//! stores with release once it wrote what they publish (an epoch, a count, a "done"),
//! and that its peers wait on, named as a rank and an [`Area`] (an offset, the same on
//! every device), never as a host pointer.
//!
//! A GPU signals and waits as DeepEP's kernels do: a release store at the end of a
//! send, and a kernel spinning on the words in the memory it owns at the start of a
//! receive while the host watches ([`Wait`]: the deadline, the abort word, the peer's
//! process and the other nodes) and stops the kernel if the wait is hopeless. The host
//! device stores and spins on the calling thread, where its kernels run.

use std::sync::atomic::AtomicU64;

use crate::area::{Area, Mem};
use crate::error::{EpError, Result};
use crate::symm;
use crate::wait::{Peer, Seen, Wait};

/// What a waited word must reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// The word is at least this (a sequence number stored as the whole word).
    AtLeast(u64),
    /// The word's high 32 bits are this epoch; the low 32 bits are the value published
    /// with it (a count), which the wait returns.
    Epoch(u32),
}

impl Until {
    /// Whether `word` holds what this asks for, and the value the wait returns then:
    /// the word (at least), or its low half (epoch).
    ///
    /// ```
    /// use uep_ep::device::Until;
    /// assert_eq!(Until::AtLeast(5).met(7), Some(7));
    /// assert_eq!(Until::AtLeast(5).met(4), None);
    /// assert_eq!(Until::Epoch(3).met((3 << 32) | 42), Some(42));
    /// assert_eq!(Until::Epoch(3).met((2 << 32) | 42), None);
    /// ```
    pub fn met(self, word: u64) -> Option<u64> {
        match self {
            Until::AtLeast(t) => (word >= t).then_some(word),
            Until::Epoch(e) => ((word >> 32) as u32 == e).then_some(u64::from(word as u32)),
        }
    }
}

/// One word a wait phase waits on: the single word `area` of `rank`'s symmetric
/// memory (this rank's own, or a same-node peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word {
    /// Whose memory the word is in.
    pub rank: usize,
    /// The word: an area of one `u64`.
    pub area: Area<u64>,
    /// What it must reach.
    pub until: Until,
}

impl Word {
    /// Word `i` of `words` in `rank`'s memory.
    ///
    /// ```
    /// use uep_ep::device::{Until, Word};
    /// use uep_ep::Area;
    /// let w = Word::at(1, Area::<u64>::new(64, 4), 2, Until::AtLeast(9)).unwrap();
    /// assert_eq!((w.area.offset(), w.area.len()), (80, 1));
    /// assert!(Word::at(1, Area::<u64>::new(64, 4), 4, Until::AtLeast(9)).is_err());
    /// ```
    pub fn at(rank: usize, words: Area<u64>, i: usize, until: Until) -> Result<Word> {
        Ok(Word {
            rank,
            area: words.slice(i..i + 1)?,
            until,
        })
    }
}

/// The wait phase (the spin that opens DeepEP's receive kernels, and its barrier's):
/// until every one of `words`, all stored by rank `peer`, reaches its [`Until`], in
/// order; the first that cannot (the deadline passed, the peer died or was lost, a
/// rank aborted, the proxy failed: what `watch` checks) ends it with that error, whose
/// message `what(i)` names.
pub struct WaitPhase<'a> {
    /// The words, in the order they are waited for.
    pub words: &'a [Word],
    /// The rank whose stores they wait for (watched for its death or loss).
    pub peer: usize,
    /// Who waits for what, for word `i`'s errors.
    pub what: &'a dyn Fn(usize) -> String,
    /// The call's watch over its waits.
    pub watch: &'a Wait<'a>,
    /// This rank's memory and its node's ranks'.
    pub(crate) memory: &'a symm::Symmetric,
}

impl std::fmt::Debug for WaitPhase<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitPhase")
            .field("words", &self.words)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl WaitPhase<'_> {
    /// Word `i` in the host's mapping of its rank's memory: how a device whose
    /// symmetric memory is host memory (the host's, or pages registered with a GPU's
    /// driver) reads it.
    pub fn host_word(&self, i: usize) -> Result<&AtomicU64> {
        let w = self.words[i];
        self.memory.peer_region(w.rank)?.word(w.area, 0)
    }

    /// What a device's wait returns for word `i`, which it saw hold `word` with an
    /// acquire load (a kernel's spin, its value copied out once the kernel ended):
    /// refused unless the word meets its [`Until`]. The [`Seen`] then lets the EP layer
    /// read what the word publishes.
    pub fn seen(&self, i: usize, word: u64) -> Result<Seen> {
        let w = self.words.get(i).ok_or_else(|| {
            EpError::internal(format!(
                "a wait of {} words has no word {i}",
                self.words.len()
            ))
        })?;
        match w.until.met(word) {
            Some(value) => Ok(Seen::acquired(value)),
            None => Err(EpError::internal(format!(
                "a device saw {word:#x} in rank {}'s word {:?}, which does not meet {:?}",
                w.rank, w.area, w.until
            ))),
        }
    }

    /// The peer as the watch knows it: with its region where it shares this host, so
    /// that its process is watched.
    pub fn watched_peer(&self) -> Peer<'_> {
        Peer {
            rank: self.peer,
            region: self.memory.peer(self.peer),
        }
    }
}

/// One store of a signal phase: `value` into the single word `area` of `rank`'s
/// memory (this rank's own, or a same-node peer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Store {
    /// Whose memory the word is in.
    pub rank: usize,
    /// The word: an area of one `u64`.
    pub area: Area<u64>,
    /// What to store.
    pub value: u64,
}

impl Store {
    /// `value` into word `i` of `words` in `rank`'s memory.
    ///
    /// ```
    /// use uep_ep::device::Store;
    /// use uep_ep::Area;
    /// let s = Store::at(0, Area::<u64>::new(0, 8), 7, 3).unwrap();
    /// assert_eq!((s.area.offset(), s.value), (56, 3));
    /// ```
    pub fn at(rank: usize, words: Area<u64>, i: usize, value: u64) -> Result<Store> {
        Ok(Store {
            rank,
            area: words.slice(i..i + 1)?,
            value,
        })
    }
}

/// The signal phase (the release stores that end DeepEP's send kernels and open its
/// barriers): every store in order, each with release, so that a peer that sees it
/// also sees everything this rank stored before it (rows, counts, slots).
pub struct SignalPhase<'a> {
    /// The stores, in order.
    pub stores: &'a [Store],
    /// This rank's memory and its node's ranks'.
    pub(crate) memory: &'a symm::Symmetric,
}

impl std::fmt::Debug for SignalPhase<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalPhase")
            .field("stores", &self.stores)
            .finish_non_exhaustive()
    }
}

impl SignalPhase<'_> {
    /// Store `i`'s word in the host's mapping of its rank's memory (see
    /// [`WaitPhase::host_word`]).
    pub fn host_word(&self, i: usize) -> Result<&AtomicU64> {
        let s = self.stores[i];
        self.memory.peer_region(s.rank)?.word(s.area, 0)
    }
}
