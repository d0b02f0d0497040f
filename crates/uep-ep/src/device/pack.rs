//! The low-latency data-moving phases' descriptors: where a kernel stores each row it
//! moves, as ranks and areas of symmetric memory (offsets and shapes) and staged
//! packets whose port the kernel pushes its writes into.
//!
//! [`LlPackPhase`]'s fields are public and plain (areas, offsets, counts, the packets'
//! layouts, a [`KernelPort`] for each packet), so a device outside the crate runs it
//! as a kernel; the others' fields are still the crate's own types, and such a device
//! runs their host definitions over its [`Device::launch`](super::Device::launch),
//! which each phase's default method does.

use std::ops::Range;

use half::bf16;

use crate::area::{Area, SliceRows};
use crate::error::Result;
use crate::map::LlAreas;
use crate::net::{KernelPort, Staged};
use crate::packet::LlDispatchPacket;
use crate::symm;

/// Whether the kernel pushes a packet's rows itself: where each row is whole 16-byte
/// words, as one-sided writes of any run of rows need.
pub(crate) fn kernel_pushes_rows(row_bytes: usize) -> bool {
    row_bytes % uep_wire::OFFSET_ALIGN as usize == 0
}

/// Whether expert `e` (`-1` for none) is on rank `r`.
pub(crate) fn on_rank(e: i64, r: usize, epr: usize) -> bool {
    e >= 0 && e as usize / epr == r
}

/// A token's slots as a packet to rank `r` carries them: each slot's local expert there,
/// or `-1`.
pub(crate) fn slots_on(chosen: &[i64], r: usize, epr: usize, out: &mut [i32]) {
    for (l, &e) in out.iter_mut().zip(chosen) {
        *l = if on_rank(e, r, epr) {
            (e as usize % epr) as i32
        } else {
            -1
        };
    }
}

/// The tokens a low-latency dispatch sends, one row each: the caller's bf16 rows, or
/// their codes with scale words (FP8, NVFP4) after the cast phase.
#[derive(Clone, Copy, Debug)]
pub struct LlTokens<'a> {
    /// `[T, row_bytes]` bytes as sent.
    pub bytes: &'a [u8],
    /// Bytes a row.
    pub row_bytes: usize,
    /// `[T, scale_words]` scale words (empty for bf16).
    pub scales: &'a [f32],
    /// Scale words a row (0 for bf16).
    pub scale_words: usize,
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
    pub fn len(&self) -> usize {
        self.bytes.len() / self.row_bytes.max(1)
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

/// Where a low-latency kernel puts one rank's rows: nowhere, straight into a rank of
/// this node, or into a packet staged for a rank on another node (`P` says where).
#[derive(Debug)]
pub enum Sink<P> {
    /// Nothing: a masked rank (elastic mode).
    Skip,
    /// A same-node rank: each row straight into its place in that rank's areas (a
    /// dispatch copy into this source's block of its expert's rows; a combine row at
    /// its `[token, slot]` row of the combine rows).
    Peer(usize),
    /// A rank on another node.
    Packet(P),
}

/// Where the pack phase of a low-latency dispatch puts one rank's copies.
pub type LlSink = Sink<Box<DispatchRemote>>;

/// A dispatch's packet to a rank on another node: each token once, at row `row_of[t]`
/// of `packet` in the staging area (`u32::MAX` for a token that goes nowhere there).
/// Where rows are whole 16-byte words ([`DispatchRemote::pushes_rows`]) the kernel
/// pushes them through the staging area's port as they fill, under the packet's one
/// fence key; the signal sends the rest.
#[derive(Debug)]
pub struct DispatchRemote {
    /// The packet's areas in this rank's memory.
    pub packet: LlDispatchPacket,
    /// `[T]` each token's row in the packet.
    pub row_of: Vec<u32>,
    pub(crate) staged: Staged,
}

impl DispatchRemote {
    /// Whether the kernel pushes the packet's rows, rows of `row_bytes` bytes each.
    pub fn pushes_rows(row_bytes: usize) -> bool {
        kernel_pushes_rows(row_bytes)
    }

    /// The packet's port as a kernel pushes its rows into it.
    pub fn kernel_port(&self) -> Result<KernelPort<'_>> {
        self.staged.kernel_port(0)
    }

    /// Rows in the packet.
    pub fn rows(&self) -> usize {
        self.row_of.iter().filter(|&&r| r != u32::MAX).count()
    }
}

/// The pack phase of a low-latency dispatch (the send half of DeepEP's
/// `low_latency_dispatch` kernel): every (token, slot) copy into its row at a
/// same-node rank, and every token once into the packet of each rank on another node
/// it goes to. Signals are not part of it: they follow once every row is stored.
///
/// A copy of token `t`, slot `j`, for local expert `le` of rank `r` lands at row
/// `le * R * M + rank * M + pos[t * K + j]` of `r`'s `recv_x` (and of `recv_scales`,
/// `recv_src` = `t * K + j`, `recv_weight`); a packet's row `row_of[t]` holds the token,
/// its scales, its index `t`, its slots' local experts on `r` (or `-1`) and all its
/// weights (0 without them).
#[derive(Debug)]
pub struct LlPackPhase<'a> {
    /// The rows to send.
    pub tokens: LlTokens<'a>,
    /// `[T, K]` expert ids, `-1` for an empty slot.
    pub topk_idx: &'a [i64],
    /// `[T, K]` gate weights, carried with each copy when given.
    pub topk_weights: Option<&'a [f32]>,
    /// `[T * K]` each copy's row in its expert's block (`u32::MAX` for a `-1` slot).
    pub pos: &'a [u32],
    /// The receive areas of the dispatch's buffer (the same offsets on every rank).
    pub areas: &'a LlAreas,
    /// This rank.
    pub rank: usize,
    /// The job's ranks.
    pub num_ranks: usize,
    /// `[rank]` where each rank's copies go.
    pub sinks: &'a [LlSink],
    /// This rank's memory (the packets) and its node's ranks' (the copies).
    pub(crate) memory: &'a symm::Symmetric,
}

impl LlPackPhase<'_> {
    /// Tokens packed.
    pub fn tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The address and length of `rank`'s memory (this rank's, or a same-node rank's)
    /// in this process, where its areas' offsets start: what a kernel of a device whose
    /// symmetric memory is host memory stores into.
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }
}

/// Where the pack phase of a low-latency combine puts the rows it returns to one
/// source rank (on another node: each expert's block into a staged packet).
pub type LlCombineSink = Sink<Box<CombineRemote>>;

/// A combine's packet to a source on another node: where each local expert's rows
/// start in it, how many there are, and the fence groups of adjacent experts, under
/// whose keys the kernel pushes each expert's block.
#[derive(Debug)]
pub struct CombineRemote {
    /// The packet's rows in the staging area.
    pub rows: Area<u16>,
    /// `[local expert]`: its first row in the packet.
    pub first: Vec<usize>,
    /// `[local expert]`: its rows in the packet.
    pub counts: Vec<usize>,
    /// The fence groups, each a run of adjacent local experts.
    pub groups: Vec<Range<usize>>,
    /// `[local expert]`: its group.
    pub group_of: Vec<usize>,
    /// The staging area and its port.
    pub(crate) staged: Staged,
}

impl CombineRemote {
    /// The packet's port as a kernel pushes group `g`'s writes into it (under the
    /// group's fence key).
    pub fn kernel_port(&self, g: usize) -> Result<KernelPort<'_>> {
        self.staged.kernel_port(g)
    }
}

/// The pack phase of a low-latency combine (the send half of DeepEP's
/// `low_latency_combine` kernel), in parallel over local experts: each expert output
/// row to its source's `[token, slot]` row on this node, or into the packet for a
/// source on another node, whose block (the expert's rows) it pushes as soon as it is
/// copied. This rank's own rows stay where they are: the reduction reads them.
///
/// Row `le * R * M + j` of `y` (source `src`'s block `begin..begin + n` of expert `le`)
/// goes to row `src_info * K + src_slot` of a same-node source's `combine_x`, or to row
/// `first[le] + j - begin` of the packet for a source on another node.
#[derive(Debug)]
pub struct LlCombinePackPhase<'a> {
    /// `[E/R * R * M, hidden]` the expert outputs, in the dispatch's row order.
    pub y: &'a [bf16],
    /// `[E/R, R]` (begin, count) of each source's block among an expert's rows.
    pub layout_range: &'a [(i32, i32)],
    /// `[E/R, R*M]` source token of each row.
    pub src_info: &'a [i32],
    /// `[E/R, R*M]` top-k slot of each row.
    pub src_slot: &'a [i32],
    /// The areas of the combine's buffer (the same offsets on every rank).
    pub areas: &'a LlAreas,
    /// This rank.
    pub rank: usize,
    /// The job's ranks.
    pub num_ranks: usize,
    /// `[rank]` where each source's rows go.
    pub sinks: &'a [LlCombineSink],
    /// This rank's memory (the packets) and its node's ranks' (the combine rows).
    pub(crate) memory: &'a symm::Symmetric,
}

impl LlCombinePackPhase<'_> {
    /// Local experts the phase runs over.
    pub fn experts(&self) -> usize {
        self.areas.shape.experts_per_rank(self.num_ranks)
    }

    /// The address and length of `rank`'s memory (see [`LlPackPhase::region`]).
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }
}

/// What a rank on another node sent in one low-latency dispatch packet, read and
/// checked: its rows stay in the landing area until the receive packs them to the
/// front.
#[derive(Debug)]
pub struct LlLanded {
    /// The packet's areas in this rank's landing area.
    pub packet: LlDispatchPacket,
    /// `[experts]` (row in the packet, token * K + slot) of each copy, in (token, slot)
    /// order.
    pub by_expert: Vec<Vec<(u32, i32)>>,
    /// `[n, words]` the tokens' scale words (none for bf16).
    pub scales: Vec<f32>,
    /// `[n, K]` the tokens' gate weights.
    pub weights: Vec<f32>,
}

/// The receive phase of a low-latency dispatch (the receive half of DeepEP's
/// `low_latency_dispatch` kernel) once every source's rows arrived: each local
/// expert's rows packed to the front of its block, sources ascending, the scales into
/// their column-major place, and where every row came from recorded. A same-node
/// source's rows move down in place (moves only go down); a packet's are copied out of
/// the landing area, which never overlaps the rows.
///
/// A same-node source's rows sit at `le * R * M + src * M ..` of `recv_x` (with
/// `recv_scales`, `recv_src`, `recv_weight` as it wrote them); a packet's rows in the
/// landing area. Source `src`'s rows of expert `le` go to `le * R * M + base ..`, `base`
/// the rows of the sources before it; its scale words column-major into `out_scales`
/// (`[E/R, words, R * M]`).
#[derive(Debug)]
pub struct LlUnpackPhase<'a> {
    /// The receive areas of the dispatch's buffer.
    pub areas: &'a LlAreas,
    /// The job's ranks.
    pub num_ranks: usize,
    /// `[E/R, R]` rows from each source (0 from a masked one).
    pub counts: &'a [u32],
    /// `[R]` the packet of each source on another node.
    pub landed: &'a [Option<LlLanded>],
    /// Bytes a row.
    pub row_bytes: usize,
    /// Scale words a row.
    pub scale_words: usize,
    /// Whether the dispatch carried gate weights.
    pub weighted: bool,
    /// This rank's memory, published by every source.
    pub(crate) memory: &'a symm::Symmetric,
}

impl LlUnpackPhase<'_> {
    /// The address and length of this rank's memory in this process, where the areas'
    /// offsets start (see [`LlPackPhase::region`]).
    pub fn region(&self) -> Result<(usize, usize)> {
        Ok(self.memory.local_address())
    }
}

/// Where every row of a received low-latency dispatch came from: the handle's tables,
/// as [`Device::ll_unpack`](super::Device::ll_unpack) makes them
/// ([`LlUnpacked::new`] for a device's own).
#[derive(Debug)]
pub struct LlUnpacked {
    /// `[E/R, R]` (begin, count) of each source's block among an expert's rows.
    pub(crate) layout_range: Vec<(i32, i32)>,
    /// `[E/R]` rows a local expert received.
    pub(crate) recv_count: Vec<i32>,
    /// `[E/R, R*M]` source token and top-k slot of each row (`-1` past the count).
    pub(crate) src_info: Vec<i32>,
    pub(crate) src_slot: Vec<i32>,
    /// `[E/R, R*M]` each row's gate weight (weighted dispatches; empty otherwise).
    pub(crate) src_weight: Vec<f32>,
}

impl LlUnpacked {
    /// The tables of a receive of `experts` local experts from `ranks` ranks, `rows`
    /// rows an expert (`R * M`): `layout_range` `[E/R, R]`, `recv_count` `[E/R]`,
    /// `src_info` and `src_slot` `[E/R, R*M]`, `src_weight` the same or empty (an
    /// unweighted dispatch); refused if a length is not that.
    pub fn new(
        (experts, ranks, rows): (usize, usize, usize),
        layout_range: Vec<(i32, i32)>,
        recv_count: Vec<i32>,
        (src_info, src_slot, src_weight): (Vec<i32>, Vec<i32>, Vec<f32>),
    ) -> Result<LlUnpacked> {
        let n = experts * rows;
        let fits = layout_range.len() == experts * ranks
            && recv_count.len() == experts
            && src_info.len() == n
            && src_slot.len() == n
            && (src_weight.is_empty() || src_weight.len() == n);
        if !fits {
            return Err(crate::error::EpError::internal(format!(
                "an LL receive's tables for {experts} experts of {ranks} ranks, {rows} rows each, have the wrong lengths"
            )));
        }
        Ok(LlUnpacked {
            layout_range,
            recv_count,
            src_info,
            src_slot,
            src_weight,
        })
    }
}
