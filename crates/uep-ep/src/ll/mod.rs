//! Low-latency (LL) mode: decode-sized batches, fixed layouts, as DeepEP's
//! `internode_ll` kernels.
//!
//! Dispatch ([`dispatch`]) sends each (token, slot) to its expert's rank (to a rank on
//! another node, each token once, expanded there), optionally cast to FP8 on the way
//! (one f32 scale per 128 channels). The receiver's
//! layout is fixed and pre-sized, `[E/R, R * M, H]`: source `s` owns rows
//! `s*M..(s+1)*M` of every local expert, so senders need no offsets from anyone and no
//! count exchange comes before the data. It runs in two halves, so that the receive
//! can be deferred (DeepEP's `return_recv_hook`):
//!
//! * **send**: enter the step → quantise → pack each copy into its place at the
//!   receiver (a same-node peer's rows, or each token once into a packet for another
//!   node) → signal one count per (expert, receiver), or send the packet;
//! * **receive**: wait for every source's counts → pack each expert's rows to the front
//!   (sources ascending, `(token, slot)` order inside a source), with the scales
//!   column-major as DeepEP returns them.
//!
//! Step `s` uses buffer `s % LL_BUFFERS`. A sender writes a peer's buffer for step `s`
//! only once the peer has entered step `s - 1`: on this node it reads the peer's
//! `ll_entered` word; a peer on another node has said so with its packet of step
//! `s - 1` (each step sends one to every peer on another node, so its number among
//! the sends of its buffer is the same as ours to it). Entering `s - 1` needs step
//! `s - 3` received, and at most two dispatches may wait for their receive, so the
//! buffer is free and the outputs of step `s - 1` stay valid while step `s` runs.
//!
//! Combine ([`combine`]) returns each expert output row to its source's
//! `[token, slot]` row; the source computes `sum_k w_k * y_k` in f32, in slot order,
//! and rounds once. Combine `c` uses combine area `c % LL_BUFFERS` under the same
//! rules (its own `ll_combine_entered` word and fence keys; at most two combines may
//! wait for their receive), so one handle may be combined more than once.
//!
//! Across nodes both kinds go through the proxy's partial-completion fence, not an
//! ordered stream: the receiver's counter of each (kind, buffer, local expert, source)
//! counts the count signals applied, each only once the writes it counts have landed. A
//! dispatch's packet is one block (each token once, for all its experts there); a
//! combine fences groups of adjacent local experts (at least
//! [`LL_COMBINE_GROUP_BYTES`](crate::packet::LL_COMBINE_GROUP_BYTES) each, cut
//! from counts both sides know), each usable as soon as its own signal is in. Receives
//! may be deferred past later calls
//! (DeepEP's hooks; a combine between two dispatches and their receives): a receive
//! waits for its own packet's number on its buffer's keys.

mod combine;
mod dispatch;

use half::bf16;

use crate::area::Area;
use crate::ctx::Ctx;
use crate::device::pack::Sink;
use crate::device::{Until, Word};
use crate::error::Result;
use crate::invalid;
use crate::packet::{Channel, LL_BUFFERS};
use crate::quant::Cast;
use crate::symm::{Bank, Exclusive};
use crate::tokens::{RecvTokens, TokenFormat};
use crate::wait::Wait;

/// Where every packed LL row came from; combine needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct LlHandle {
    pub(crate) buffer_id: u64,
    /// The dispatch step.
    pub(crate) seq: u32,
    /// Which buffer the step used.
    pub buffer: usize,
    /// Tokens this rank dispatched.
    pub num_tokens: usize,
    /// `[E/R, R*M]`: source token of each packed row (`-1` past the count).
    pub src_info: Vec<i32>,
    /// `[E/R, R*M]`: top-k slot that produced each packed row (`-1` past the count).
    pub src_slot: Vec<i32>,
    /// `[E/R, R*M]`: the source's gate weight of the (token, slot) of each packed row
    /// (0 past the count); empty unless the dispatch passed weights (every rank passes
    /// them or none, as DeepEP's kernels assume).
    pub src_weight: Vec<f32>,
    /// `[E/R, R]`: (begin, count) of each source's block among an expert's rows.
    pub layout_range: Vec<(i32, i32)>,
    /// `[E/R]`: rows received per local expert.
    pub recv_count: Vec<i32>,
    /// What the rows are made of.
    pub format: TokenFormat,
    /// Fingerprint of the `topk_idx` dispatched, so combine can check it gets the same.
    pub(crate) topk_hash: u64,
    /// `[R]`: the ranks masked in this dispatch (elastic mode; all `false` otherwise):
    /// they sent nothing here.
    pub masked: Vec<bool>,
}

/// Arguments of [`Buffer::low_latency_dispatch`](crate::Buffer::low_latency_dispatch);
/// build with [`LlDispatchArgs::new`] and the setters.
///
/// ```
/// use half::bf16;
/// use uep_ep::{Cast, LlDispatchArgs};
/// let (x, idx, w) = (vec![bf16::ONE; 2 * 128], vec![0i64, 3, -1, 1], vec![0.5f32; 4]);
/// let args = LlDispatchArgs::new(&x, &idx)
///     .cast(Cast::fp8_if(true, false))
///     .weights(&w);
/// assert_eq!(args.topk_weights.map(|w| w.len()), Some(4));
/// ```
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchArgs<'a> {
    /// `[T, H]` bf16 activations.
    pub x: &'a [bf16],
    /// `[T, K]` expert ids, `-1` for an empty slot.
    pub topk_idx: &'a [i64],
    /// `[T, K]` gate weights: each received row then carries its (token, slot)'s
    /// ([`LlHandle::src_weight`]), as DeepEP's hybrid-ep branch returns them.
    pub topk_weights: Option<&'a [f32]>,
    /// The cast on the way (`None`: bf16 as given).
    pub cast: Option<Cast>,
}

impl<'a> LlDispatchArgs<'a> {
    /// Dispatch bf16 `x` by `topk_idx`, uncast and unweighted.
    pub fn new(x: &'a [bf16], topk_idx: &'a [i64]) -> Self {
        LlDispatchArgs {
            x,
            topk_idx,
            topk_weights: None,
            cast: None,
        }
    }

    /// Cast the rows on the way ([`Cast::fp8_if`] takes DeepEP's FP8 flags).
    pub fn cast(mut self, cast: Option<Cast>) -> Self {
        self.cast = cast;
        self
    }

    /// Carry the gate weights to the received rows.
    pub fn weights(mut self, topk_weights: &'a [f32]) -> Self {
        self.topk_weights = Some(topk_weights);
        self
    }
}

/// A low-latency dispatch whose send half ran: pass it to
/// [`Buffer::low_latency_dispatch_recv`](crate::Buffer::low_latency_dispatch_recv).
#[derive(Debug)]
#[must_use = "the dispatch's rows are only received by low_latency_dispatch_recv"]
pub struct LlPending {
    pub(crate) buffer_id: u64,
    pub(crate) seq: u32,
    pub(crate) buffer: usize,
    pub(crate) num_tokens: usize,
    pub(crate) format: TokenFormat,
    /// Whether the dispatch carried gate weights (its receive then reads them).
    pub(crate) weighted: bool,
    pub(crate) topk_hash: u64,
    /// `[R]`: the number of the packet sent to each rank on another node among the
    /// fenced sends of this buffer to it (0: none); the peer's packet of this step has
    /// the same number.
    pub(crate) packets: Vec<u64>,
}

/// Where a low-latency combine reads this rank's expert outputs from.
#[derive(Clone, Copy, Debug)]
pub enum LlCombineInput<'a> {
    /// `[E/R, R*M, H]` bf16 rows laid out like the dispatch's `recv_x`, anywhere in
    /// memory: rows for a rank on another node are copied into its packet first.
    Rows(&'a [bf16]),
    /// The rows were written into the next combine buffer
    /// ([`crate::Buffer::low_latency_combine_buffer`], or a dispatch's
    /// [`LlDispatchOutput::combine_buffer`]) and are sent from there with no staging
    /// copy: DeepEP's `zero_copy`.
    ZeroCopy,
}

impl<'a> From<&'a [bf16]> for LlCombineInput<'a> {
    fn from(y: &'a [bf16]) -> Self {
        LlCombineInput::Rows(y)
    }
}

impl<'a> From<&'a Vec<bf16>> for LlCombineInput<'a> {
    fn from(y: &'a Vec<bf16>) -> Self {
        LlCombineInput::Rows(y)
    }
}

/// What a low-latency dispatch returns; slices live until the Buffer's next call.
#[derive(Debug)]
pub struct LlDispatchOutput<'b> {
    /// `[E/R, R*M, H]` rows (rows `..recv_count[e]` of expert `e` are valid); FP8
    /// scales `[E/R, H/128, R*M]` (column-major in the last two dimensions).
    pub recv_x: RecvTokens<'b>,
    /// `[E/R]` valid rows per local expert.
    pub recv_count: Vec<i32>,
    /// For combine.
    pub handle: LlHandle,
    /// `[R]`: nanoseconds the receive waited for each source's rows.
    pub wait_ns: Vec<u64>,
    /// `[E/R, R*M, H]` bf16: where the expert outputs go for a
    /// [`LlCombineInput::ZeroCopy`] combine (the next combine's buffer, as
    /// [`crate::Buffer::low_latency_combine_buffer`] returns it). `None` only while a combine
    /// that last used it waits for its receive.
    pub combine_buffer: Option<&'b mut [bf16]>,
}

/// A low-latency combine whose send half ran: pass it to
/// [`Buffer::low_latency_combine_recv`](crate::Buffer::low_latency_combine_recv).
#[derive(Debug)]
#[must_use = "the combine's rows are only reduced by low_latency_combine_recv"]
pub struct LlCombinePending {
    pub(crate) buffer_id: u64,
    /// The combine's number (its area is `seq % LL_BUFFERS`).
    pub(crate) seq: u32,
    pub(crate) num_tokens: usize,
    pub(crate) topk_idx: Vec<i64>,
    pub(crate) topk_weights: Vec<f32>,
    /// `[(token * K + slot, row of y)]`: this rank's own expert outputs, read from `y`.
    pub(crate) own: Vec<(usize, usize)>,
    pub(crate) y_len: usize,
    /// Whether the rows were sent from the combine buffer ([`LlCombineInput::ZeroCopy`]).
    pub(crate) zero_copy: bool,
    /// `[R]`: packet numbers, as [`LlPending`]'s.
    pub(crate) packets: Vec<u64>,
}

impl LlPending {
    /// The low-latency buffer the dispatch uses.
    pub fn buffer_index(&self) -> usize {
        self.buffer
    }
}

/// What low-latency mode keeps between calls: the numbers of its dispatches and
/// combines (equal on every rank between calls), the calls whose receive has not run
/// yet, and the output banks, one per LL buffer.
#[derive(Debug)]
pub(crate) struct LlState {
    pub dispatch: u32,
    pub combine: u32,
    /// Per LL buffer: a dispatch whose receive (hook) has not run yet.
    pub unreceived: [Option<u32>; LL_BUFFERS],
    /// Per LL combine area: a combine whose receive has not run yet.
    pub combine_unreceived: [Option<u32>; LL_BUFFERS],
    pub banks: Option<[Bank; LL_BUFFERS]>,
    /// The key to the combine buffers, which this rank alone writes.
    pub key: Exclusive,
}

impl LlState {
    /// The state of a new Buffer, with its output `banks`.
    pub fn new(banks: Option<[Bank; LL_BUFFERS]>) -> LlState {
        LlState {
            dispatch: 0,
            combine: 0,
            unreceived: [None; LL_BUFFERS],
            combine_unreceived: [None; LL_BUFFERS],
            banks,
            key: Exclusive::for_new_buffer(),
        }
    }
}

/// Checks that low-latency call `seq` (a dispatch step, or a combine) may start while
/// the calls in `unreceived` (one slot per buffer) wait for their receive: at most
/// two, and the one that last used `seq`'s buffer received. Peers may write call
/// `seq + 1` once this rank entered `seq`, into the buffer of `seq - 2`, so that one
/// must have been received too.
pub(crate) fn check_window(
    unreceived: &[Option<u32>; LL_BUFFERS],
    seq: u32,
    (what, plural): (&str, &str),
) -> Result<()> {
    let (b, older) = (seq as usize % LL_BUFFERS, (seq as usize + 1) % LL_BUFFERS);
    match unreceived[older].or(unreceived[b]) {
        Some(p) => Err(invalid!(
            "low-latency {what} {p} was never received: at most two low-latency {plural} may wait for their receive (call the hook of the older one first)"
        )),
        None => Ok(()),
    }
}

impl Ctx {
    /// Where each rank's rows of LL call `seq` on `ch` go, once it released the area
    /// the call writes (`entered`: the word saying which call a same-node rank
    /// entered): nowhere for a masked rank or one found gone meanwhile, straight into a
    /// rank of this node, else `remote(r)`'s packet. `what` names the call and area
    /// for the waits' messages.
    pub(crate) fn ll_sinks<P>(
        &self,
        (seq, ch, entered): (u32, Channel, Area<u64>),
        what: (&str, &str),
        mut remote: impl FnMut(usize, &Wait<'_>) -> Result<P>,
    ) -> Result<Vec<Sink<P>>> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let wait = self.call_wait();
        let mut sinks = Vec::with_capacity(r_n);
        for r in 0..r_n {
            // Rank r's area was last used by its call seq - 3.
            let released = || {
                format!(
                    "rank {me}: {} {seq}: waiting for rank {r} to release {}",
                    what.0, what.1
                )
            };
            let sink = if self.masked(r)
                || !self.ll_peer_released(r, seq, entered, ch, &wait, &released)?
            {
                Sink::Skip
            } else if self.topo.is_local(r) {
                Sink::Peer(r)
            } else {
                Sink::Packet(remote(r, &wait)?)
            };
            sinks.push(sink);
        }
        Ok(sinks)
    }

    /// Waits until rank `r` has entered call `seq - 1` of a kind of low-latency call, so
    /// that the buffer call `seq` writes there is free (it received the call that last
    /// used it): on this node its `entered` word says so, across nodes a count signal
    /// of its call `seq - 1` of the kind of `ch` (numbered as ours to it). `false`: `r`
    /// is gone (elastic mode) and gets nothing.
    pub(crate) fn ll_peer_released(
        &self,
        r: usize,
        seq: u32,
        entered: Area<u64>,
        ch: Channel,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<bool> {
        let released = if self.topo.is_local(r) {
            let word = Word::at(r, entered, 0, Until::AtLeast(u64::from(seq) - 1))?;
            self.await_word(word, r, wait, what).map(drop)
        } else {
            let net = self.net()?;
            // Any count signal of `r`'s call `seq - 1` of this kind says it entered it.
            let prev = match ch {
                Channel::LlCombine(_) => Channel::ll_combine,
                _ => Channel::ll_dispatch,
            }((seq as usize).wrapping_sub(1) % LL_BUFFERS);
            match net.last_fenced(prev, r) {
                0 => Ok(()),
                n => net.wait_fenced(prev, r, 0, n, wait, what),
            }
        };
        Ok(self.unless_lost(r, released)?.is_some())
    }
}
