//! Normal (high-throughput) mode: dispatch, combine, and the relay that carries both
//! across nodes, as DeepEP's intranode and internode kernels.
//!
//! Dispatch runs in named phases ([`dispatch`]):
//!
//! 1. **notify**: each rank tells every rank how many tokens it sends to each rank and
//!    expert (a store into a same-node peer's notify slot, a packet to another node);
//!    after it, every rank knows the whole `[R, R]` count matrix, so a sender knows
//!    where its rows go in every receiver's output, with no second round trip;
//! 2. **plan**: where each token goes (same-node ranks, other nodes) and where each
//!    kernel thread's first row lands;
//! 3. **pack**: kernel threads store each token once into every same-node rank that
//!    needs it, straight into its output rows, and once into the packet for every other
//!    node that needs it; in stages of tokens, and after each stage the rows that go
//!    straight to another node's relay are handed to the proxy (**stream**), so they
//!    are on the wire while the next stage packs;
//! 4. **publish**: an epoch store per same-node rank, a packet per other node (whose
//!    announcement covers the rows streamed before it);
//! 5. **relay** ([`relay`]): each rank takes the packets of the other nodes' ranks with
//!    its local index and stores their tokens into its node's ranks;
//! 6. **finish**: wait for every source, pad, and build the handle.
//!
//! Rows are ordered by source rank, then source token, on every path.
//!
//! Combine ([`combine`]) sends row `i` back to `(source rank, source token)`: into the
//! source's `[sending rank][token]` slot on the same node, or into the relay's slot on
//! the source's behalf across nodes; the relay reduces its node's rows and sends one
//! partial row per token; the source sums in f32 in rank order and rounds once to bf16.

mod combine;
mod dispatch;
mod elastic;
mod paths;
mod relay;

use half::bf16;

use crate::layout::DispatchLayout;
pub use crate::layout::WeightLanes;
use crate::symm::Bank;
use crate::tokens::{RecvTokens, Tokens};

/// What normal mode keeps between calls: the calls' numbers (equal on every rank
/// between calls) and the two output banks, one per call in turn.
#[derive(Debug, Default)]
pub(crate) struct NormalState {
    pub dispatch: u32,
    pub combine: u32,
    pub banks: Option<[Bank; 2]>,
}

/// Arguments of [`Buffer::dispatch`](crate::Buffer::dispatch); build with
/// [`DispatchArgs::new`] and the setters.
#[derive(Clone, Copy, Debug)]
pub struct DispatchArgs<'a> {
    /// Activations `[T, H]`.
    pub x: Tokens<'a>,
    /// `[T, K]` expert ids, `-1` for an empty slot (not with a cached handle).
    pub topk_idx: Option<&'a [i64]>,
    /// `[T, K]` gate weights (needs `topk_idx`).
    pub topk_weights: Option<&'a [f32]>,
    /// A precomputed layout; computed from `topk_idx` when absent.
    pub layout: Option<&'a DispatchLayout>,
    /// A handle from an earlier dispatch with the same routing: skips the layout.
    pub handle: Option<&'a NormalHandle>,
    /// Round each expert's received count up to a multiple of this (1 = none).
    pub expert_alignment: usize,
    /// If non-zero, pad the outputs to this many rows (top-k ids `-1` in the padding).
    pub num_worst_tokens: usize,
    /// Which weight lanes a receiver gets ([`WeightLanes::Local`]: DeepEP v1's).
    pub weight_lanes: WeightLanes,
}

impl<'a> DispatchArgs<'a> {
    /// Dispatch `x`; add routing with [`Self::topk`], [`Self::layout`] or [`Self::cached`].
    pub fn new(x: Tokens<'a>) -> Self {
        DispatchArgs {
            x,
            topk_idx: None,
            topk_weights: None,
            layout: None,
            handle: None,
            expert_alignment: 1,
            num_worst_tokens: 0,
            weight_lanes: WeightLanes::Local,
        }
    }

    /// Route by top-k expert ids (and carry the weights, if given).
    pub fn topk(mut self, topk_idx: &'a [i64], topk_weights: Option<&'a [f32]>) -> Self {
        self.topk_idx = Some(topk_idx);
        self.topk_weights = topk_weights;
        self
    }

    /// Use a layout computed earlier by `get_dispatch_layout`.
    pub fn layout(mut self, layout: &'a DispatchLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// Reuse the routing of an earlier dispatch (its handle).
    pub fn cached(mut self, handle: &'a NormalHandle) -> Self {
        self.handle = Some(handle);
        self
    }

    /// Pad per-expert counts to multiples of `alignment`.
    pub fn expert_alignment(mut self, alignment: usize) -> Self {
        self.expert_alignment = alignment;
        self
    }

    /// Pad the outputs to `rows` rows.
    pub fn num_worst_tokens(mut self, rows: usize) -> Self {
        self.num_worst_tokens = rows;
        self
    }

    /// Which weight lanes the receivers get.
    pub fn weight_lanes(mut self, lanes: WeightLanes) -> Self {
        self.weight_lanes = lanes;
        self
    }
}

/// Where every received row came from; combine and cached dispatch need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NormalHandle {
    pub(crate) buffer_id: u64,
    /// `[R, R]`: entry `[s][r]` = tokens ranks `0..=s` send to rank `r` (DeepEP's meaning).
    pub rank_prefix_matrix: Vec<i32>,
    /// `[T, R]`: whether this rank's token `t` went to rank `r`.
    pub is_token_in_rank: Vec<bool>,
    /// `[R]`: tokens this rank sent to each rank.
    pub num_tokens_per_rank: Vec<i32>,
    /// `[E]`: (token, slot) pairs this rank sent to each expert.
    pub num_tokens_per_expert: Vec<i32>,
    /// `[N]`: source token index of every received row.
    pub recv_src_idx: Vec<i32>,
    /// `[E/R]`: received tokens per local expert, rounded up to the alignment.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// Tokens this rank dispatched.
    pub num_tokens: usize,
    /// Rows this rank received.
    pub num_recv_tokens: usize,
    /// Rows of the outputs (`num_recv_tokens`, or `num_worst_tokens` when padding).
    pub num_rows: usize,
    /// Top-k slots of a token.
    pub topk: usize,
    /// The bank the outputs are in.
    pub(crate) bank: usize,
    /// Whether the dispatch carried FP8 rows.
    pub fp8: bool,
    /// Whether it carried top-k ids, and weights.
    pub(crate) with_topk: bool,
    pub(crate) with_weights: bool,
    /// Several nodes: the tokens this rank relayed into its node, per source on
    /// another node.
    pub(crate) relay: Vec<Relayed>,
    /// `[R]`: the ranks this dispatch left out (elastic mode; all `false` otherwise).
    pub masked: Vec<bool>,
}

impl NormalHandle {
    /// Source rank of every received row, from the prefix matrix.
    pub fn recv_src_rank(&self, rank: usize) -> Vec<i32> {
        let r = self.num_tokens_per_rank.len();
        let mut out = Vec::with_capacity(self.num_recv_tokens);
        let mut prev = 0;
        for s in 0..r {
            let end = self.rank_prefix_matrix[s * r + rank];
            out.extend(std::iter::repeat_n(s as i32, (end - prev) as usize));
            prev = end;
        }
        out
    }

    /// Whether the dispatch carried top-k ids (its outputs have `recv_topk_idx`).
    pub fn carries_topk(&self) -> bool {
        self.with_topk
    }

    /// Whether the dispatch carried top-k weights.
    pub fn carries_weights(&self) -> bool {
        self.with_weights
    }

    /// Where rows from source `s` start among this rank's received rows.
    pub(crate) fn recv_base(&self, rank: usize, s: usize) -> usize {
        let r = self.num_tokens_per_rank.len();
        match s {
            0 => 0,
            _ => self.rank_prefix_matrix[(s - 1) * r + rank] as usize,
        }
    }

    /// Rows this rank received from source `s`.
    pub(crate) fn rows_from(&self, rank: usize, s: usize) -> std::ops::Range<usize> {
        let r = self.num_tokens_per_rank.len();
        self.recv_base(rank, s)..self.rank_prefix_matrix[s * r + rank] as usize
    }
}

/// The tokens one source on another node sent through this rank, in packet order;
/// combine returns their node's partial sums in the same order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Relayed {
    /// The source rank.
    pub src: usize,
    /// Source token index of each relayed token.
    pub tokens: Vec<i32>,
    /// Bit `l`: local rank `l` of this node received the token.
    pub masks: Vec<u64>,
}

/// What [`Buffer::dispatch`](crate::Buffer::dispatch) returns; the slices live in the
/// Buffer until its next call.
#[derive(Debug)]
pub struct DispatchOutput<'b> {
    /// `[rows, H]` received activations.
    pub recv_x: RecvTokens<'b>,
    /// `[rows, K]` local expert ids (`-1` where the expert is elsewhere), unless cached or no top-k.
    pub recv_topk_idx: Option<&'b [i64]>,
    /// `[rows, K]` weights (0 where the id is `-1`), if weights were sent.
    pub recv_topk_weights: Option<&'b [f32]>,
    /// `[E/R]` received tokens per local expert, aligned.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// For combine and cached dispatch.
    pub handle: NormalHandle,
}

/// What [`Buffer::combine`](crate::Buffer::combine) returns.
#[derive(Clone, Debug, PartialEq)]
pub struct CombineOutput {
    /// `[T, H]`: per token, the sum of the rows returned for it.
    pub combined_x: Vec<bf16>,
    /// `[T, K]`: per token, the sum of the returned weight rows (if weights were passed).
    pub combined_topk_weights: Option<Vec<f32>>,
}

/// Arguments of [`Buffer::combine_into`](crate::Buffer::combine_into) beyond the rows.
#[derive(Clone, Copy, Debug, Default)]
pub struct CombineArgs<'a> {
    /// `[rows, K]` weights to sum alongside the rows.
    pub topk_weights: Option<&'a [f32]>,
    /// Up to two `[T, H]` bf16 biases added to every token's sum before rounding
    /// (DeepEP's `bias`).
    pub bias: [Option<&'a [bf16]>; 2],
}

/// Tokens ranks `0..upto` send to rank `r`, from the `[R, R]` count matrix: where rows
/// from rank `upto` start among rank `r`'s received rows.
pub(crate) fn column_sum(matrix: &[u32], r_n: usize, upto: usize, r: usize) -> usize {
    (0..upto).map(|s| matrix[s * r_n + r] as usize).sum()
}
