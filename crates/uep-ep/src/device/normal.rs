//! Normal mode's data-moving phases: the dispatch's notify, its pack with its plan
//! (destinations, which tokens go where, where each lane's rows start, the areas they
//! land in), the relay's forward, and the combine's send.

use std::ops::Range;

use crate::area::Area;
use crate::config::Shape;
use crate::error::Result;
use crate::layout::WeightLanes;
use crate::net::{KernelPort, Staged, Write};
use crate::packet::RowFormat;
use crate::symm;
use crate::tokens::Tokens;
use crate::topology::Topology;

/// Where a normal dispatch's notify puts this rank's counts for one rank.
#[derive(Clone, Copy, Debug)]
pub enum NotifySink {
    /// Nowhere: the rank is masked, or lost while its packet was staged.
    Skip,
    /// A same-node rank's notify slot for this source, published by its epoch word.
    Slot {
        /// The rank whose memory holds the slot.
        rank: usize,
        /// The slot's areas there.
        slot: crate::map::NotifySlot,
    },
    /// The packet to a rank of another node, staged in this rank's memory at these
    /// areas (the host sends it after the phase).
    Packet(crate::packet::NotifyPacket),
}

/// The notify phase of a normal dispatch (the send half of DeepEP's
/// `intranode::notify_dispatch` and `internode::notify_dispatch`): this rank's token
/// count and its tokens per rank and per expert, into every same-node rank's slot (the
/// epoch stored last, with release) and into the packets for the other nodes. Reading
/// every rank's counts follows the host's waits.
#[derive(Debug)]
pub struct NotifyPhase<'a> {
    /// The dispatch's number: the epoch the slots are published with.
    pub seq: u32,
    /// This rank's tokens.
    pub head: crate::packet::NotifyHead,
    /// `[R + E]` tokens per rank, then per expert.
    pub counts: &'a [u32],
    /// `[R]` where each rank's copy goes.
    pub sinks: &'a [NotifySink],
    /// This rank's memory (the packets) and its node's ranks' (their slots).
    pub(crate) memory: &'a symm::Symmetric,
}

impl NotifyPhase<'_> {
    /// The address and length of `rank`'s memory (see
    /// [`LlPackPhase::region`](super::LlPackPhase::region)).
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }

    /// The address and length of this rank's memory, where the packets are staged.
    pub fn local_region(&self) -> (usize, usize) {
        self.memory.local_address()
    }
}

/// Where dispatch sends a token: a rank of this node, or another node (through the rank
/// there that relays for this one, the second field).
#[derive(Clone, Copy, Debug)]
pub enum Dest {
    /// A rank of this node.
    Rank(usize),
    /// Node `.0`, through its rank `.1` that relays for this one.
    Node(usize, usize),
}

/// Where one destination's rows go: a same-node rank's output areas (from this
/// source's first row there), or the staged packet for another node.
#[derive(Debug)]
pub struct RowSink {
    /// The rank whose memory the rows go to (this rank for a node's packet).
    pub rank: usize,
    /// x rows (a packet's: those not sent straight to the relay).
    pub x: Area<u8>,
    /// Their scales.
    pub scales: Area<f32>,
    /// `[K]` expert ids a row (local to a same-node rank; global in a packet).
    pub topk: Area<i64>,
    /// `[K]` weights a row.
    pub weights: Area<f32>,
    /// Each row's source token.
    pub src: Area<i32>,
    /// Node packets only: each token's mask of the node's ranks that need it.
    pub mask: Area<u64>,
    /// Node packets only: the rows that go straight to the relay's output rows, staged.
    pub direct_x: Area<u8>,
    /// Their scales, staged.
    pub direct_scales: Area<f32>,
    /// Node packets only: where direct rows land, the relay's output rows from this
    /// source's first row there.
    pub relay_x: Area<u8>,
    /// Their scales there.
    pub relay_scales: Area<f32>,
}

impl RowSink {
    /// The one-sided writes of direct rows `rows` of a node's packet (x and, with
    /// `groups` scales a row, the scales) into the relay's output rows.
    pub(crate) fn direct_writes(
        &self,
        rows: Range<usize>,
        fmt: RowFormat,
        total: usize,
    ) -> Result<Vec<Write>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut writes = vec![Write::new(
            self.direct_x.rows(rows.clone(), fmt.row_bytes)?,
            self.relay_x.rows(rows.clone(), fmt.row_bytes)?,
            total,
        )?];
        if fmt.groups > 0 {
            writes.push(Write::new(
                self.direct_scales.rows(rows.clone(), fmt.groups)?.cast(),
                self.relay_scales.rows(rows, fmt.groups)?.cast(),
                total,
            )?);
        }
        Ok(writes)
    }
}

/// The plan of one dispatch: destinations, which tokens go where, and where each kernel
/// thread's rows start.
#[derive(Debug)]
pub struct NormalPlan {
    /// The destinations.
    pub dests: Vec<Dest>,
    /// `[T][dest]`: the token goes there.
    pub hit: Vec<bool>,
    /// `[T][dest]`: the token goes straight to the relay's output rows.
    pub direct: Vec<bool>,
    /// `[block + 1][dest]`: (tokens, direct tokens) before the block's first token (and
    /// after the last block); a block is one kernel thread's share of the tokens.
    pub block_start: Vec<(usize, usize)>,
    /// `[dest]`: (tokens, direct tokens) in all.
    pub totals: Vec<(usize, usize)>,
    /// `[dest]`: where its rows go.
    pub sinks: Vec<RowSink>,
    /// `[dest]`: the staging area of a node's packet, and the port the kernel pushes
    /// its direct rows through.
    pub(crate) staged: Vec<Option<Staged>>,
    /// `[R]`: this source's first row in each rank's output.
    pub out_base: Vec<usize>,
    /// What a row carries.
    pub fmt: RowFormat,
    /// Rows are FP8 with scales.
    pub fp8: bool,
    /// Rows carry expert ids.
    pub with_topk: bool,
    /// Rows carry weights.
    pub with_weights: bool,
    /// Which weight lanes the receivers get.
    pub weight_lanes: WeightLanes,
    /// Rows into the node's ranks go with streaming stores (many of them, past a
    /// cache's worth).
    pub streaming: bool,
}

/// Whether rows starting at row `at` of a bank are 16-byte aligned (x and scales), as a
/// one-sided write needs.
pub(crate) fn rows_aligned(at: usize, fmt: RowFormat) -> bool {
    (at * fmt.row_bytes) % 16 == 0 && (at * fmt.groups * 4) % 16 == 0
}

impl NormalPlan {
    /// The fewest rows whose x and scales are whole 16-byte words: a write of direct
    /// rows that a kernel pushes starts and ends on such a boundary, so that every
    /// write is aligned.
    pub fn row_quantum(&self) -> usize {
        (1..16).find(|&q| rows_aligned(q, self.fmt)).unwrap_or(16)
    }

    /// The port node destination `d`'s direct rows are pushed through, as a kernel
    /// pushes into it (`None` for a same-node destination).
    pub fn kernel_port(&self, d: usize) -> Option<Result<KernelPort<'_>>> {
        Some(self.staged.get(d)?.as_ref()?.kernel_port(0))
    }
}

/// The pack phase of a normal dispatch (the senders of DeepEP's `intranode::dispatch`
/// and `internode::dispatch`): each token stored once into each destination its plan
/// names, a same-node rank's output rows or another node's packet, and the rows that
/// go straight to another node's relay pushed as `Write`s in runs of about a write's
/// size while later tokens pack. A lane's first rows are where the plan says, so the
/// launch must cut the tokens as [`Device::split`](super::Device::split) does.
#[derive(Debug)]
pub struct NormalPackPhase<'a> {
    /// The plan the host made (and publishes from afterwards).
    pub plan: &'a NormalPlan,
    /// The rows to send.
    pub x: Tokens<'a>,
    /// `[T, K]` expert ids (where the dispatch carries them).
    pub topk_idx: Option<&'a [i64]>,
    /// `[T, K]` gate weights (where the dispatch carries them).
    pub topk_weights: Option<&'a [f32]>,
    /// `[T, R]` whether a token goes to a rank.
    pub in_rank: &'a [bool],
    /// The job's ranks and nodes.
    pub topo: Topology,
    /// The normal-mode shape.
    pub shape: Shape,
    /// This rank's memory (the packets) and its node's ranks' (their outputs).
    pub(crate) memory: &'a symm::Symmetric,
}

impl NormalPackPhase<'_> {
    /// Tokens packed.
    pub fn tokens(&self) -> usize {
        self.plan.hit.len() / self.plan.dests.len().max(1)
    }

    /// The address and length of `rank`'s memory (see
    /// [`LlPackPhase::region`](super::LlPackPhase::region)).
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }
}

/// Where a normal combine returns the rows of one source rank.
#[derive(Clone, Copy, Debug)]
pub enum ReturnSink {
    /// Nowhere: this rank reduces them itself (its own tokens, those it relays), or the
    /// source is masked.
    Stays,
    /// Into a slot at a rank of this node: the source's own combine rows, or the relay
    /// slot at the rank that relays them to the source's node.
    Slot {
        /// The rank whose memory holds the slot.
        rank: usize,
        /// `[T, H]` rows of the slot, indexed by source token.
        x: Area<u16>,
        /// `[T, K]` weights of the slot, indexed by source token.
        weights: Area<f32>,
    },
}

/// The send phase of a normal combine (the senders of DeepEP's `intranode::combine`
/// and `internode::combine`): every received row back towards its source, at the row
/// of the source's token in the slot its sink names, with its gate weights where the
/// combine carries them.
#[derive(Debug)]
pub struct NormalCombineSendPhase<'a> {
    /// `[N, H]` the rows to return, in the order the dispatch received them.
    pub x: &'a [half::bf16],
    /// `[N, K]` their gate weights, where the combine returns them.
    pub topk_weights: Option<&'a [f32]>,
    /// `[N]` each row's source rank.
    pub src_rank: &'a [i32],
    /// `[N]` each row's token at its source.
    pub src_idx: &'a [i32],
    /// `[R]` where each source's rows go.
    pub sinks: &'a [ReturnSink],
    /// The normal-mode shape.
    pub shape: Shape,
    /// Rows go with streaming stores (many of them, past a cache's worth).
    pub streaming: bool,
    /// This node's ranks' memory.
    pub(crate) memory: &'a symm::Symmetric,
}

impl NormalCombineSendPhase<'_> {
    /// Rows the phase returns or keeps.
    pub fn rows(&self) -> usize {
        self.src_idx.len()
    }

    /// The address and length of `rank`'s memory (see
    /// [`LlPackPhase::region`](super::LlPackPhase::region)).
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }
}

/// Where a relayed token's x row (and scales) is read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayedRow {
    /// Row `j` of the packet's rows for other ranks.
    Packet(u32),
    /// This rank's own output row: the source sent it straight there.
    Own,
}

/// A token's output row at a rank of this node that the token does not go to.
pub const NOT_SENT: u32 = u32::MAX;

/// The forward phase of a normal dispatch across nodes (DeepEP's `internode::dispatch`
/// forwarders with their NVL receivers), on the rank that relays for one source of
/// another node: every token of the source's landed packet stored into the output rows
/// of each rank of this node its mask names (x and scales, its expert ids made local to
/// that rank, its weights, its source index). The host read and checked the packet and
/// placed every row (its output row at each rank of the node) before the launch, so a
/// device only stores.
#[derive(Debug)]
pub struct RelayPhase<'a> {
    /// The landed packet, laid out at its landing area in this rank's memory.
    pub packet: crate::packet::DispatchPacket,
    /// What a row carries.
    pub fmt: RowFormat,
    /// Which weight lanes the receivers get.
    pub lanes: WeightLanes,
    /// `[n, K]` global expert ids, as the packet carries them (empty where none).
    pub idx: &'a [i64],
    /// `[n, K]` weights, as the packet carries them (empty where none).
    pub weights: &'a [f32],
    /// `[n]` each token's index at its source.
    pub tokens: &'a [i32],
    /// `[n]` where each token's row is read from.
    pub from: &'a [RelayedRow],
    /// `[n, ranks per node]` each token's output row at each rank of this node
    /// ([`NOT_SENT`] where it does not go).
    pub rows: &'a [u32],
    /// The output bank the rows go to.
    pub bank: crate::map::NormalBank,
    /// The source indices' area.
    pub recv_src_idx: Area<i32>,
    /// The job's ranks and nodes.
    pub topo: Topology,
    /// The normal-mode shape.
    pub shape: Shape,
    /// This rank's memory (the packet) and its node's ranks' (their outputs).
    pub(crate) memory: &'a symm::Symmetric,
}

impl RelayPhase<'_> {
    /// Tokens relayed.
    pub fn tokens(&self) -> usize {
        self.from.len()
    }

    /// The address and length of `rank`'s memory (see
    /// [`LlPackPhase::region`](super::LlPackPhase::region)).
    pub fn region(&self, rank: usize) -> Result<(usize, usize)> {
        self.memory.peer_address(rank)
    }
}
