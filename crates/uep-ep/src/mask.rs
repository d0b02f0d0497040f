//! The state of elastic mode: which ranks are masked and why (see [`crate::elastic`]
//! for what masking does and how the survivors agree on it).

/// Fault injection (`Buffer::fault_in_agreement`): run `run` in agreement `k` once
/// `sends` messages are sent.
pub(crate) struct Fault {
    pub(crate) k: u64,
    pub(crate) sends: usize,
    pub(crate) run: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fault {{ k: {}, sends: {} }}", self.k, self.sends)
    }
}

/// The mask and what led to it.
#[derive(Debug)]
pub(crate) struct Elastic {
    /// `[rank]`: masked (sticky).
    pub(crate) masked: Vec<bool>,
    /// `[rank]`: why it was masked.
    pub(crate) why: Vec<Option<String>>,
    /// `[rank]`: when it was masked (this time).
    pub(crate) masked_at: Vec<Option<std::time::SystemTime>>,
    /// `[rank]`: found gone (dead or unreachable) rather than masked by the caller:
    /// nothing is sent to it any more, not even agreement messages.
    pub(crate) gone: Vec<bool>,
    /// `[rank]`: found unreachable (for the partition rule).
    pub(crate) unreachable: Vec<bool>,
    /// `[rank]`: found gone during the last agreement round, which did not use it:
    /// masked for every later wait, but left out of what the caller reads until the
    /// next call begins (module docs).
    pub(crate) deferred: Vec<bool>,
    /// Agreements so far (the same count on every survivor).
    pub(crate) round: u64,
    /// `[rank]`: in the mask the last agreement decided (ranks not awaited in the
    /// next).
    pub(crate) agreed: Vec<bool>,
    /// A digest of every decided mask so far (FNV-1a over their bits).
    pub(crate) digest: u64,
    /// Fault injection: what to run, in which agreement, before which send.
    pub(crate) fault: Option<Fault>,
    /// `[rank]`: a rank on another node whose decided mask the last agreement did not
    /// read, and how many of its round messages it read (`elastic::mailbox`).
    pub(crate) unsettled: Vec<Option<u32>>,
    /// `[rank]`: agreements before this rank's process and the one there now took
    /// part together (0 for founding ranks): a rank's decisions are counted by its
    /// proxy per process pair, so the count of agreement `k`'s is `k` minus this.
    pub(crate) decided_base: Vec<u64>,
    /// The mask the last combine (either mode) used.
    pub(crate) last_combine: Vec<bool>,
    /// Letting replacements in (`elastic::join`).
    pub(crate) doorway: Doorway,
}

/// A replacement process asking to take a masked rank's place, its memory mapped here.
#[derive(Debug)]
pub(crate) struct Joiner {
    /// Its request (`elastic::door`).
    pub(crate) stamp: u64,
    pub(crate) process: crate::door::Process,
    /// How its memory is opened.
    pub(crate) handle: crate::symm::MemHandle,
    /// Its memory, mapped here (a joiner on this node).
    pub(crate) region: Option<uep_shm::Region>,
    /// How it is reached across nodes (a job of several nodes).
    pub(crate) reach: Option<crate::door::Reach>,
}

/// What the survivors know of replacements (see `elastic::join`).
#[derive(Debug)]
pub(crate) struct Doorway {
    /// Let in every replacement that asks (`BufferConfig::auto_admit`).
    pub(crate) auto: bool,
    /// `[rank]`: the caller admits a replacement of this rank (`Buffer::admit`).
    pub(crate) admit: Vec<bool>,
    /// `[rank]`: a replacement that asked, whose memory this rank mapped: proposed
    /// unmasked at the next agreement that may let ranks in.
    pub(crate) asking: Vec<Option<Joiner>>,
    /// `[rank]`: let in by an agreement, taking part from the next dispatch or barrier.
    pub(crate) let_in: Vec<Option<Joiner>>,
    /// `[rank]`: the stamp of the last request let in (not read again).
    pub(crate) answered: Vec<u64>,
    /// The caller's step (`Buffer::set_step`), told to a replacement let in.
    pub(crate) step: u64,
}

impl Doorway {
    /// Ranks let in but not yet taking part.
    pub(crate) fn waiting(&self) -> bool {
        self.let_in.iter().any(Option::is_some)
    }
}

impl Elastic {
    /// Mask `rank` (sticky), noting when if it was not masked.
    pub(crate) fn mask(&mut self, rank: usize) {
        self.masked[rank] = true;
        self.masked_at[rank].get_or_insert_with(std::time::SystemTime::now);
    }

    /// `rank` has no process, as every rank agrees without a round (a rank masked
    /// before a joiner came in, a reserved rank): masked by the agreements so far,
    /// because `why`.
    pub(crate) fn mask_absent(&mut self, rank: usize, why: String) {
        self.mask(rank);
        self.gone[rank] = true;
        self.agreed[rank] = true;
        self.why[rank] = Some(why);
    }

    /// Unmask `rank`.
    pub(crate) fn unmask(&mut self, rank: usize) {
        self.masked[rank] = false;
        self.masked_at[rank] = None;
        self.why[rank] = None;
    }

    /// Let `rank` (a replacement) take part: nothing of its predecessor's masking stays.
    pub(crate) fn readmit(&mut self, rank: usize) {
        self.unmask(rank);
        self.gone[rank] = false;
        self.unreachable[rank] = false;
        self.deferred[rank] = false;
        self.agreed[rank] = false;
        self.unsettled[rank] = None;
    }

    /// The state of a job of `num_ranks` with nobody masked; `auto_admit`:
    /// `BufferConfig::auto_admit`.
    pub(crate) fn new(num_ranks: usize, auto_admit: bool) -> Elastic {
        Elastic {
            masked: vec![false; num_ranks],
            why: vec![None; num_ranks],
            masked_at: vec![None; num_ranks],
            gone: vec![false; num_ranks],
            unreachable: vec![false; num_ranks],
            deferred: vec![false; num_ranks],
            round: 0,
            agreed: vec![false; num_ranks],
            unsettled: vec![None; num_ranks],
            decided_base: vec![0; num_ranks],
            digest: crate::fnv::OFFSET,
            fault: None,
            last_combine: vec![false; num_ranks],
            doorway: Doorway {
                auto: auto_admit,
                admit: vec![false; num_ranks],
                asking: (0..num_ranks).map(|_| None).collect(),
                let_in: (0..num_ranks).map(|_| None).collect(),
                answered: vec![0; num_ranks],
                step: 0,
            },
        }
    }
}
