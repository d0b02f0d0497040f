//! The data-moving phases' descriptors: where a kernel stores each row it moves, as
//! ranks and areas of symmetric memory (offsets and shapes) and staged packets whose
//! port the kernel pushes its writes into.
//!
//! Their fields are the crate's own types (areas of the symmetric layout, staged
//! packets): a device outside the crate runs the host definition over its
//! [`Device::launch`](super::Device::launch), which each phase's default method does.

use half::bf16;

use crate::area::SliceRows;
use crate::map::LlAreas;
use crate::net::Staged;
use crate::packet::LlDispatchPacket;
use crate::symm;

/// The tokens a low-latency dispatch sends, one row each: the caller's bf16 rows, or
/// their codes with scale words (FP8, NVFP4) after the cast phase.
#[derive(Clone, Copy, Debug)]
pub struct LlTokens<'a> {
    /// `[T, row_bytes]` bytes as sent.
    pub(crate) bytes: &'a [u8],
    /// Bytes a row.
    pub(crate) row_bytes: usize,
    /// `[T, scale_words]` scale words (empty for bf16).
    pub(crate) scales: &'a [f32],
    /// Scale words a row (0 for bf16).
    pub(crate) scale_words: usize,
}

impl<'a> LlTokens<'a> {
    /// The caller's bf16 rows of `hidden` values, sent as they are.
    pub(crate) fn bf16(x: &'a [bf16], hidden: usize) -> Self {
        LlTokens {
            bytes: bytemuck::cast_slice(x),
            row_bytes: 2 * hidden,
            scales: &[],
            scale_words: 0,
        }
    }

    /// Tokens.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len() / self.row_bytes.max(1)
    }

    /// Token `t`'s bytes as sent.
    pub(crate) fn row(&self, t: usize) -> &'a [u8] {
        self.bytes.row(t, self.row_bytes)
    }

    /// Token `t`'s scale words (none for bf16).
    pub(crate) fn scales(&self, t: usize) -> Option<&'a [f32]> {
        (self.scale_words > 0).then(|| self.scales.row(t, self.scale_words))
    }
}

/// Where the pack phase of a low-latency dispatch puts one rank's copies.
#[derive(Debug)]
pub(crate) enum LlSink {
    /// Nothing: a masked rank (elastic mode).
    Skip,
    /// A same-node rank: each copy straight into this source's block of its expert's
    /// rows in that rank's receive areas.
    Peer(usize),
    /// A rank on another node: each token once, at row `row_of[t]` of `packet` in the
    /// staging area (`u32::MAX` for a token that goes nowhere there). Where rows are
    /// whole 16-byte words the kernel pushes them through the staging area's port as
    /// they fill; the signal sends the rest.
    Packet {
        packet: LlDispatchPacket,
        row_of: Vec<u32>,
        staged: Box<Staged>,
    },
}

/// The pack phase of a low-latency dispatch (the send half of DeepEP's
/// `low_latency_dispatch` kernel): every (token, slot) copy into its row at a
/// same-node rank, and every token once into the packet of each rank on another node
/// it goes to. Signals are not part of it: they follow once every row is stored.
#[derive(Debug)]
pub struct LlPackPhase<'a> {
    /// The rows to send.
    pub(crate) tokens: LlTokens<'a>,
    /// `[T, K]` expert ids, `-1` for an empty slot.
    pub(crate) topk_idx: &'a [i64],
    /// `[T, K]` gate weights, carried with each copy when given.
    pub(crate) topk_weights: Option<&'a [f32]>,
    /// `[T * K]` each copy's row in its expert's block (`u32::MAX` for a `-1` slot).
    pub(crate) pos: &'a [u32],
    /// The receive areas of the dispatch's buffer (the same offsets on every rank).
    pub(crate) areas: &'a LlAreas,
    /// This rank and the job's ranks.
    pub(crate) rank: usize,
    pub(crate) num_ranks: usize,
    /// `[rank]` where each rank's copies go.
    pub(crate) sinks: &'a [LlSink],
    /// This rank's memory (the packets) and its node's ranks' (the copies).
    pub(crate) memory: &'a symm::Symmetric,
}

impl LlPackPhase<'_> {
    /// Tokens packed.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }
}
