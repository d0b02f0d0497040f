//! Normal (high-throughput) dispatch and combine.
//!
//! Dispatch, on every rank at once:
//! 1. **notify**: each rank stores its `tokens_per_rank` and `tokens_per_expert` rows
//!    into every peer's notify slot and publishes them with a release store of the
//!    call's epoch; each rank then knows the whole `[R, R]` count matrix, so a sender
//!    knows where its rows go in every receiver's output (no second round trip);
//! 2. **data**: each token is stored once into every rank that hosts one of its
//!    experts, straight into the receiver's output rows (grouped by source rank
//!    ascending, token order kept), with its local top-k ids, weights and source index;
//! 3. **done**: a release store of the epoch per peer; the receiver acquires all of them.
//!
//! Combine sends row `i` back to `(src rank, src token)`, landing in the source's
//! `[sending rank][token]` slot, and the source sums the slots of each token in rank
//! order in f32 and rounds once to bf16 (SPEC.md §5), exactly as the reference does.
//!
//! Entering the next dispatch requires every peer's notify, which a peer writes only
//! from its own next call, so no peer overwrites rows a rank still exposes as views.

use std::sync::atomic::Ordering;

use half::bf16;

use crate::buffer::{Buffer, RecvTokens, Tokens};
use crate::device::Until;
use crate::error::Result;
use crate::invalid;
use crate::layout::{get_dispatch_layout, DispatchLayout};
use crate::quant::reduce_rows;
use crate::symm::{packet, Channel};
use uep_shm::Region;

/// Arguments of [`Buffer::dispatch`]; build with [`DispatchArgs::new`] and the setters.
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
    /// Multi-node: the tokens this rank relayed into its node, per source on another node.
    pub(crate) relay: Vec<Relayed>,
}

/// The tokens one source on another node sent through this rank, in packet order;
/// combine returns their node's partial sums in the same order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Relayed {
    /// The source rank.
    src: usize,
    /// Source token index of each relayed token.
    tokens: Vec<i32>,
    /// Bit `l`: local rank `l` of this node received the token.
    masks: Vec<u64>,
}

/// Where dispatch sends a token: a rank of this node, or another node (through the rank
/// there that relays for this one).
#[derive(Clone, Copy, Debug)]
enum Dest {
    Rank(usize),
    Node(usize),
}

/// Local top-k ids and weights of a token for rank `r`: `e - r * epr` where expert `e`
/// lives on `r`, else `-1` and weight 0.
fn localize(
    idx: &[i64],
    w: Option<&[f32]>,
    r: usize,
    epr: usize,
    idx_row: &mut [i64],
    w_row: &mut [f32],
) {
    for (s, &e) in idx.iter().enumerate() {
        let local = e >= 0 && e as usize / epr == r;
        idx_row[s] = if local { e - (r * epr) as i64 } else { -1 };
        w_row[s] = match w {
            Some(w) if local => w[s],
            _ => 0.0,
        };
    }
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
}

/// What [`Buffer::dispatch`] returns; the slices live in the Buffer until its next call.
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

/// What [`Buffer::combine`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct CombineOutput {
    /// `[T, H]`: per token, the sum of the rows returned for it.
    pub combined_x: Vec<bf16>,
    /// `[T, K]`: per token, the sum of the returned weight rows (if weights were passed).
    pub combined_topk_weights: Option<Vec<f32>>,
}

/// Where one kernel stores the rows (and their metadata) bound for one rank.
#[derive(Clone, Copy)]
struct RowSink {
    region: Region,
    x: usize,
    scales: usize,
    topk: usize,
    weights: usize,
    src: usize,
    /// Node packets only: the mask of local ranks that need each token.
    mask: usize,
    /// Node packets only: x and scales of the rows sent straight to the relay.
    direct: [usize; 2],
}

/// Tokens ranks `0..upto` send to rank `r`, from the `[R, R]` count matrix: where rows
/// from rank `upto` start among rank `r`'s received rows.
fn column_sum(matrix: &[u32], r_n: usize, upto: usize, r: usize) -> usize {
    (0..upto).map(|s| matrix[s * r_n + r] as usize).sum()
}

/// Offsets of row `j` of the x and scales areas at `x` and `scales`.
fn row_at(x: usize, scales: usize, j: usize, row_bytes: usize, groups: usize) -> (usize, usize) {
    (x + j * row_bytes, scales + j * groups * 4)
}

/// The routing one dispatch works with, whichever way it was given.
struct Routing<'a> {
    in_rank: std::borrow::Cow<'a, [bool]>,
    per_rank: std::borrow::Cow<'a, [i32]>,
    per_expert: std::borrow::Cow<'a, [i32]>,
}

impl Buffer {
    /// Compute the dispatch layout of `topk_idx` (`[T, K]`) for this Buffer's ranks.
    pub fn get_dispatch_layout(&self, topk_idx: &[i64]) -> Result<DispatchLayout> {
        get_dispatch_layout(
            topk_idx,
            self.cfg.topk,
            self.cfg.num_experts,
            self.num_ranks,
            self.group.local_world_size(),
        )
    }

    /// Normal dispatch: every token once to every rank hosting one of its experts.
    /// Collective. Bad input is rejected before anything is sent, and peers are told.
    pub fn dispatch(&mut self, args: DispatchArgs<'_>) -> Result<DispatchOutput<'_>> {
        self.ensure_usable()?;
        let routing = match self.check_dispatch(&args) {
            Ok(r) => r,
            Err(e) => return self.fail(e),
        };
        self.dispatch_seq = self.dispatch_seq.wrapping_add(1);
        let seq = self.dispatch_seq;
        let (r_n, me, e_n, k, h) = (
            self.num_ranks,
            self.rank,
            self.cfg.num_experts,
            self.cfg.topk,
            self.cfg.hidden,
        );
        let t_n = args.x.num_tokens(h)?;
        let epr = e_n / r_n;
        let map = self.map.clone();
        let parity = (seq % 2) as usize;

        // 1. notify: my counts into every peer's slot (or packet), then the epoch.
        let mut counts: Vec<u32> = Vec::with_capacity(r_n + e_n);
        counts.extend(routing.per_rank.iter().map(|&c| c as u32));
        counts.extend(routing.per_expert.iter().map(|&c| c as u32));
        let counts_bytes: &[u8] = bytemuck::cast_slice(&counts);
        let slot = map.notify_slot(parity, me);
        let until = self.until()?;
        for peer in 0..r_n {
            if self.is_local(peer) {
                let region = self.peer_region(peer)?;
                region.write(slot + 16, counts_bytes)?;
                region
                    .atomic_u64(slot)?
                    .store(seq as u64, Ordering::Release);
            } else {
                self.stage_and_send(
                    Channel::Notify,
                    peer,
                    counts_bytes.len(),
                    until,
                    |local, at| local.write(at, counts_bytes),
                )?;
            }
        }
        let mut matrix = vec![0u32; r_n * r_n];
        let mut recv_per_expert = vec![0usize; epr];
        let mut row = vec![0u32; r_n + e_n];
        for src in 0..r_n {
            let what = || {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s token counts (notify[{parity}][{src}])")
            };
            let at = if self.is_local(src) {
                let slot = map.notify_slot(parity, src);
                self.wait_local(slot, seq as u64, src, until, what)?;
                slot + 16
            } else {
                self.wait_packet(src, until, what)?;
                map.net.landing(Channel::Notify, src)
            };
            self.symm
                .local()
                .read(at, bytemuck::cast_slice_mut(&mut row))?;
            matrix[src * r_n..(src + 1) * r_n].copy_from_slice(&row[..r_n]);
            for (le, n) in recv_per_expert.iter_mut().enumerate() {
                *n += row[r_n + me * epr + le] as usize;
            }
        }
        let column_sum = |upto: usize, r: usize| column_sum(&matrix, r_n, upto, r);
        let num_recv = column_sum(r_n, me);
        let rows = if args.num_worst_tokens > 0 {
            args.num_worst_tokens
        } else {
            num_recv
        };
        if rows < num_recv {
            return self.fail(invalid!(
                "rank {me} receives {num_recv} tokens, more than num_worst_tokens = {}",
                args.num_worst_tokens
            ));
        }
        let align = args.expert_alignment.max(1);
        let recv_per_expert: Vec<usize> = recv_per_expert
            .iter()
            .map(|n| n.div_ceil(align) * align)
            .collect();

        // 2. data: each token once to each same-node rank that needs it, straight into
        // its final output row there, and once to each other node that needs it, into
        // a packet for the rank there that relays it to the node's ranks (SPEC.md §1.3).
        let out_base: Vec<usize> = (0..r_n).map(|r| column_sum(me, r)).collect();
        let row_bytes = args.x.row_bytes(h);
        let groups = h / 128;
        let fp8 = args.x.is_fp8();
        let with_topk = args.handle.is_none() && args.topk_idx.is_some();
        let with_weights = with_topk && args.topk_weights.is_some();
        let topo = self.topology();
        let in_rank = &routing.in_rank;
        let dests: Vec<Dest> = (0..r_n)
            .filter(|&r| self.is_local(r))
            .map(Dest::Rank)
            .chain(topo.remote_nodes().map(Dest::Node))
            .collect();
        let nd = dests.len();
        let hit: Vec<bool> = (0..t_n)
            .flat_map(|t| {
                let row = &in_rank[t * r_n..(t + 1) * r_n];
                dests.iter().map(move |d| match *d {
                    Dest::Rank(r) => row[r],
                    Dest::Node(m) => row[topo.node_ranks(m)].contains(&true),
                })
            })
            .collect();
        // A token that another node's relay itself receives goes straight into the
        // relay's output rows (its rows from this rank are contiguous there), so the
        // relay unpacks only the rows of the node's other ranks; where those rows do not
        // start 16-byte aligned, as one-sided writes need, they travel in the packet.
        let direct_ok = |r: usize| {
            out_base[r] * row_bytes % 16 == 0 && (!fp8 || out_base[r] * groups * 4 % 16 == 0)
        };
        let direct: Vec<bool> = (0..t_n)
            .flat_map(|t| {
                dests.iter().map(move |d| match *d {
                    Dest::Rank(_) => false,
                    Dest::Node(m) => {
                        let relay = topo.relay(me, m);
                        in_rank[t * r_n + relay] && direct_ok(relay)
                    }
                })
            })
            .collect();
        // Position of chunk c's first token among the tokens sent to each destination,
        // and among those of them sent direct.
        let threads = self.device.threads().min(t_n.max(1));
        let per_chunk = t_n.div_ceil(threads.max(1)).max(1);
        let mut chunk_start = vec![(0usize, 0usize); threads * nd];
        // Ends as the number of tokens (and direct ones) sent to each destination.
        let mut running = vec![(0usize, 0usize); nd];
        for c in 0..threads {
            chunk_start[c * nd..(c + 1) * nd].copy_from_slice(&running);
            for t in (c * per_chunk).min(t_n)..((c + 1) * per_chunk).min(t_n) {
                for (d, (n, n_direct)) in running.iter_mut().enumerate() {
                    *n += hit[t * nd + d] as usize;
                    *n_direct += direct[t * nd + d] as usize;
                }
            }
        }
        let sections = |(n, n_direct): (usize, usize)| {
            packet::dispatch(
                n,
                n - n_direct,
                row_bytes,
                if fp8 { groups } else { 0 },
                if with_topk { k } else { 0 },
                if with_weights { k } else { 0 },
            )
        };
        let mut sinks = Vec::with_capacity(nd);
        for (d, dest) in dests.iter().enumerate() {
            sinks.push(match *dest {
                Dest::Rank(r) => {
                    let j = out_base[r];
                    RowSink {
                        region: self.peer_region(r)?,
                        x: map.recv_x + j * row_bytes,
                        scales: map.recv_scales + j * groups * 4,
                        topk: map.recv_topk_idx + j * k * 8,
                        weights: map.recv_topk_weights + j * k * 4,
                        src: map.recv_src_idx + j * 4,
                        mask: 0,
                        direct: [0; 2],
                    }
                }
                Dest::Node(m) => {
                    let relay = topo.relay(me, m);
                    self.reclaim(Channel::Dispatch, relay, until)?;
                    let base = map.net.staging(Channel::Dispatch, relay);
                    let sec = sections(running[d]);
                    let direct = packet::dispatch_direct(&sec, running[d].1, row_bytes);
                    RowSink {
                        region: *self.symm.local(),
                        x: base + sec.at[1],
                        scales: base + sec.at[2],
                        topk: base + sec.at[3],
                        weights: base + sec.at[4],
                        src: base + sec.at[5],
                        mask: base + sec.at[6],
                        direct: direct.map(|at| base + at),
                    }
                }
            });
        }
        let x = args.x;
        let (topk_idx, topk_weights) = (args.topk_idx, args.topk_weights);
        self.device.launch(t_n, |range| {
            let chunk = range.start / per_chunk;
            let mut pos = chunk_start[chunk * nd..(chunk + 1) * nd].to_vec();
            let mut idx_row = vec![0i64; k];
            let mut w_row = vec![0f32; k];
            for t in range {
                for (d, dest) in dests.iter().enumerate() {
                    if !hit[t * nd + d] {
                        continue;
                    }
                    let sink = &sinks[d];
                    let (j, j_direct) = pos[d];
                    // The row's place: its own, among the direct rows, or among the rest.
                    let (x_at, scales_at) = if direct[t * nd + d] {
                        pos[d].1 += 1;
                        row_at(sink.direct[0], sink.direct[1], j_direct, row_bytes, groups)
                    } else if matches!(dest, Dest::Node(_)) {
                        row_at(sink.x, sink.scales, j - j_direct, row_bytes, groups)
                    } else {
                        row_at(sink.x, sink.scales, j, row_bytes, groups)
                    };
                    pos[d].0 += 1;
                    sink.region.write(x_at, x.row(t, h))?;
                    if fp8 {
                        sink.region
                            .write(scales_at, bytemuck::cast_slice(x.row_scales(t, h)))?;
                    }
                    let idx: &[i64] = match topk_idx {
                        Some(all) if with_topk => &all[t * k..(t + 1) * k],
                        _ => &[],
                    };
                    let w = topk_weights.map(|w| &w[t * k..(t + 1) * k]);
                    match *dest {
                        Dest::Rank(r) if with_topk => {
                            localize(idx, w, r, epr, &mut idx_row, &mut w_row);
                            sink.region
                                .write(sink.topk + j * k * 8, bytemuck::cast_slice(&idx_row))?;
                            if with_weights {
                                sink.region.write(
                                    sink.weights + j * k * 4,
                                    bytemuck::cast_slice(&w_row),
                                )?;
                            }
                        }
                        Dest::Rank(_) => {}
                        Dest::Node(m) => {
                            // Global ids and all weights: the relaying rank localises them.
                            if with_topk {
                                sink.region
                                    .write(sink.topk + j * k * 8, bytemuck::cast_slice(idx))?;
                            }
                            if let (true, Some(w)) = (with_weights, w) {
                                sink.region
                                    .write(sink.weights + j * k * 4, bytemuck::cast_slice(w))?;
                            }
                            let mask = topo
                                .node_ranks(m)
                                .enumerate()
                                .filter(|&(_, r)| in_rank[t * r_n + r])
                                .fold(0u64, |acc, (l, _)| acc | 1 << l);
                            sink.region.write(sink.mask + j * 8, &mask.to_le_bytes())?;
                        }
                    }
                    sink.region
                        .write(sink.src + j * 4, &(t as i32).to_le_bytes())?;
                }
            }
            Ok(())
        })?;

        // 3. done: a release store of the epoch for each same-node rank; the packet and
        // its announcement for each other node.
        for (d, dest) in dests.iter().enumerate() {
            match *dest {
                Dest::Rank(_) => sinks[d]
                    .region
                    .atomic_u64(map.dispatch_done + 8 * me)?
                    .store(seq as u64, Ordering::Release),
                Dest::Node(m) => {
                    let (n, n_direct) = running[d];
                    let relay = topo.relay(me, m);
                    let header = packet::DispatchHeader {
                        tokens: n as u32,
                        direct: direct_ok(relay).then_some(n_direct as u32),
                        fp8,
                        topk: with_topk,
                        weights: with_weights,
                    };
                    self.symm.local().write(
                        map.net.staging(Channel::Dispatch, relay),
                        &header.to_bytes(),
                    )?;
                    let at = out_base[relay];
                    let mut direct = vec![(
                        sinks[d].direct[0],
                        map.recv_x + at * row_bytes,
                        n_direct * row_bytes,
                    )];
                    if fp8 {
                        direct.push((
                            sinks[d].direct[1],
                            map.recv_scales + at * groups * 4,
                            n_direct * groups * 4,
                        ));
                    }
                    self.send_staged_with(
                        Channel::Dispatch,
                        relay,
                        sections(running[d]).len,
                        &direct,
                    )?;
                }
            }
        }
        // 4. relay: the packet of each rank on another node with this rank's local index
        // goes on to the ranks of this node named in each token's mask.
        let relay = self.relay_dispatch(seq as u64, &matrix, until)?;
        // 5. wait for every source: a same-node source publishes itself, a source on
        // another node is published by the rank of this node that relays it.
        for src in 0..r_n {
            let n = matrix[src * r_n + me] as usize;
            let publisher = if self.is_local(src) {
                src
            } else {
                topo.relay(src, topo.node)
            };
            let what = || {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s {n} rows (dispatch_done[{src}], published by rank {publisher})")
            };
            self.wait_local(
                map.dispatch_done + 8 * src,
                seq as u64,
                publisher,
                until,
                what,
            )?;
        }
        if rows > num_recv && with_topk {
            self.symm
                .view_mut::<i64>(map.recv_topk_idx + num_recv * k * 8, (rows - num_recv) * k)?
                .fill(-1);
            if topk_weights.is_some() {
                self.symm
                    .view_mut::<f32>(
                        map.recv_topk_weights + num_recv * k * 4,
                        (rows - num_recv) * k,
                    )?
                    .fill(0.0);
            }
        }

        let mut prefix = vec![0i32; r_n * r_n];
        for s in 0..r_n {
            for r in 0..r_n {
                prefix[s * r_n + r] =
                    matrix[s * r_n + r] as i32 + if s > 0 { prefix[(s - 1) * r_n + r] } else { 0 };
            }
        }
        let handle = NormalHandle {
            buffer_id: self.id,
            rank_prefix_matrix: prefix,
            is_token_in_rank: routing.in_rank.into_owned(),
            num_tokens_per_rank: routing.per_rank.into_owned(),
            num_tokens_per_expert: routing.per_expert.into_owned(),
            recv_src_idx: self.symm.view::<i32>(map.recv_src_idx, num_recv)?.to_vec(),
            num_recv_tokens_per_expert: recv_per_expert.clone(),
            num_tokens: t_n,
            num_recv_tokens: num_recv,
            num_rows: rows,
            relay,
        };
        let recv_x = self.recv_tokens(map.recv_x, map.recv_scales, rows, x.is_fp8())?;
        Ok(DispatchOutput {
            recv_x,
            recv_topk_idx: if with_topk {
                Some(self.symm.view::<i64>(map.recv_topk_idx, rows * k)?)
            } else {
                None
            },
            recv_topk_weights: if with_topk && topk_weights.is_some() {
                Some(self.symm.view::<f32>(map.recv_topk_weights, rows * k)?)
            } else {
                None
            },
            num_recv_tokens_per_expert: recv_per_expert,
            handle,
        })
    }

    /// Validate a dispatch before anything is sent.
    fn check_dispatch<'a>(&self, args: &DispatchArgs<'a>) -> Result<Routing<'a>> {
        let (r_n, k, h) = (self.num_ranks, self.cfg.topk, self.cfg.hidden);
        let t_n = args.x.num_tokens(h)?;
        let max = self.cfg.num_max_dispatch_tokens_per_rank;
        if t_n > max {
            return Err(invalid!(
                "rank {} dispatches {t_n} tokens, more than num_max_dispatch_tokens_per_rank = {max}",
                self.rank
            ));
        }
        if args.num_worst_tokens > r_n * max {
            return Err(invalid!(
                "num_worst_tokens = {} exceeds the Buffer's receive rows (ranks * num_max_dispatch_tokens_per_rank = {})",
                args.num_worst_tokens,
                r_n * max
            ));
        }
        if args.x.is_fp8() && h % 128 != 0 {
            return Err(invalid!(
                "FP8 dispatch needs hidden to be a multiple of 128, got {h}"
            ));
        }
        if let Some(w) = args.topk_weights {
            if args.topk_idx.is_none() {
                return Err(invalid!("topk_weights were given without topk_idx"));
            }
            if w.len() != t_n * k {
                return Err(invalid!(
                    "topk_weights has {} values, expected [tokens = {t_n}, topk = {k}]",
                    w.len()
                ));
            }
        }
        if let Some(handle) = args.handle {
            if handle.buffer_id != self.id {
                return Err(invalid!(
                    "the handle was made by another Buffer (or another rank)"
                ));
            }
            if args.topk_idx.is_some() || args.layout.is_some() {
                return Err(invalid!(
                    "a cached dispatch reuses the handle's routing: pass no topk_idx and no layout"
                ));
            }
            if handle.num_tokens != t_n {
                return Err(invalid!(
                    "the handle routes {} tokens but x has {t_n}",
                    handle.num_tokens
                ));
            }
            return Ok(Routing {
                in_rank: handle.is_token_in_rank.as_slice().into(),
                per_rank: handle.num_tokens_per_rank.as_slice().into(),
                per_expert: handle.num_tokens_per_expert.as_slice().into(),
            });
        }
        if let Some(idx) = args.topk_idx {
            if idx.len() != t_n * k {
                return Err(invalid!(
                    "topk_idx has {} values, expected [tokens = {t_n}, topk = {k}]",
                    idx.len()
                ));
            }
        }
        if args.expert_alignment == 0 {
            return Err(invalid!("expert_alignment must be at least 1"));
        }
        let layout = match (args.layout, args.topk_idx) {
            (Some(layout), idx) => {
                if layout.num_tokens != t_n
                    || layout.num_ranks != r_n
                    || layout.num_experts != self.cfg.num_experts
                {
                    return Err(invalid!(
                        "the layout is for {} tokens, {} ranks, {} experts; this call has {t_n}, {r_n}, {}",
                        layout.num_tokens,
                        layout.num_ranks,
                        layout.num_experts,
                        self.cfg.num_experts
                    ));
                }
                if let Some(idx) = idx {
                    // Validates the ids too, and proves the layout belongs to them.
                    let own = self.get_dispatch_layout(idx)?;
                    if own.is_token_in_rank != layout.is_token_in_rank {
                        return Err(invalid!(
                            "the layout was computed from a different topk_idx"
                        ));
                    }
                }
                std::borrow::Cow::Borrowed(layout)
            }
            (None, Some(idx)) => std::borrow::Cow::Owned(self.get_dispatch_layout(idx)?),
            (None, None) => {
                return Err(invalid!(
                    "dispatch needs topk_idx, a layout, or a cached handle"
                ))
            }
        };
        Ok(match layout {
            std::borrow::Cow::Borrowed(l) => Routing {
                in_rank: l.is_token_in_rank.as_slice().into(),
                per_rank: l.num_tokens_per_rank.as_slice().into(),
                per_expert: l.num_tokens_per_expert.as_slice().into(),
            },
            std::borrow::Cow::Owned(l) => Routing {
                in_rank: l.is_token_in_rank.into(),
                per_rank: l.num_tokens_per_rank.into(),
                per_expert: l.num_tokens_per_expert.into(),
            },
        })
    }

    /// Normal combine: every received row back to its source, summed there per token.
    /// `x` is `[rows, H]` bf16 (rows past the received count are ignored), `topk_weights`
    /// `[rows, K]`. Collective.
    pub fn combine(
        &mut self,
        x: &[bf16],
        topk_weights: Option<&[f32]>,
        handle: &NormalHandle,
    ) -> Result<CombineOutput> {
        let t_n = handle.num_tokens;
        let mut combined_x = vec![bf16::ZERO; t_n * self.cfg.hidden];
        let mut combined_w = topk_weights.map(|_| vec![0f32; t_n * self.cfg.topk]);
        self.combine_into(
            x,
            topk_weights,
            handle,
            &mut combined_x,
            combined_w.as_deref_mut(),
        )?;
        Ok(CombineOutput {
            combined_x,
            combined_topk_weights: combined_w,
        })
    }

    /// [`Buffer::combine`] into caller-owned outputs (`[T, H]` and `[T, K]`), so a loop
    /// of steps allocates nothing.
    pub fn combine_into(
        &mut self,
        x: &[bf16],
        topk_weights: Option<&[f32]>,
        handle: &NormalHandle,
        combined_x: &mut [bf16],
        combined_topk_weights: Option<&mut [f32]>,
    ) -> Result<()> {
        self.ensure_usable()?;
        let (r_n, me, k, h) = (self.num_ranks, self.rank, self.cfg.topk, self.cfg.hidden);
        let n = handle.num_recv_tokens;
        let check = || -> Result<()> {
            if handle.buffer_id != self.id {
                return Err(invalid!(
                    "the handle was made by another Buffer (or another rank)"
                ));
            }
            if x.len() != n * h && x.len() != handle.num_rows * h {
                return Err(invalid!(
                    "combine x has {} values, expected [rows = {n}, hidden = {h}]",
                    x.len()
                ));
            }
            if combined_x.len() != handle.num_tokens * h
                || combined_topk_weights
                    .as_ref()
                    .is_some_and(|w| w.len() != handle.num_tokens * k)
            {
                return Err(invalid!(
                    "combine outputs have {} and {:?} values; expected [tokens = {}, hidden = {h}] = {} and [tokens, topk = {k}] = {}",
                    combined_x.len(),
                    combined_topk_weights.as_ref().map(|w| w.len()),
                    handle.num_tokens,
                    handle.num_tokens * h,
                    handle.num_tokens * k
                ));
            }
            if let Some(w) = topk_weights {
                if w.len() != n * k && w.len() != handle.num_rows * k {
                    return Err(invalid!(
                        "combine topk_weights has {} values, expected [rows = {n}, topk = {k}]",
                        w.len()
                    ));
                }
            }
            Ok(())
        };
        if let Err(e) = check() {
            return self.fail(e);
        }
        self.combine_seq = self.combine_seq.wrapping_add(1);
        let seq = self.combine_seq;
        let map = self.map.clone();
        let t_max = self.cfg.num_max_dispatch_tokens_per_rank;
        let until = self.until()?;
        let src_rank = handle.recv_src_rank(me);
        let recv_base = |s: usize| {
            if s == 0 {
                0
            } else {
                handle.rank_prefix_matrix[(s - 1) * r_n + me] as usize
            }
        };
        let rows_from = |s: usize| handle.rank_prefix_matrix[s * r_n + me] as usize - recv_base(s);
        // Rows for a same-node source land in its [this rank][token] slot; rows for a
        // source on another node go to the rank of this node that relays it, into its
        // [source node][this rank][token] relay slot.
        let topo = self.topology();
        let mut sinks = Vec::with_capacity(r_n);
        for s in 0..r_n {
            sinks.push(if self.is_local(s) {
                (
                    self.peer_region(s)?,
                    map.combine_x + me * t_max * h * 2,
                    map.combine_weights + me * t_max * k * 4,
                )
            } else {
                let slot = (topo.node_of(s) * topo.ranks_per_node + topo.local) * t_max;
                (
                    self.peer_region(topo.relay(s, topo.node))?,
                    map.relay_x + slot * h * 2,
                    map.relay_weights + slot * k * 4,
                )
            });
        }
        let reads_from_x: Vec<bool> = (0..r_n)
            .map(|s| !self.is_local(s) && topo.relay(s, topo.node) == me)
            .collect();
        self.device.launch(n, |range| {
            for i in range {
                let (s, t) = (src_rank[i] as usize, handle.recv_src_idx[i] as usize);
                if s == me || reads_from_x[s] {
                    // Rows that this rank reduces itself (its own tokens, and the tokens
                    // it relays) are read straight from `x`.
                    continue;
                }
                let (region, x0, w0) = &sinks[s];
                region.write(x0 + t * h * 2, bytemuck::cast_slice(&x[i * h..(i + 1) * h]))?;
                if let Some(w) = topk_weights {
                    region.write(w0 + t * k * 4, bytemuck::cast_slice(&w[i * k..(i + 1) * k]))?;
                }
            }
            Ok(())
        })?;
        for s in topo.node_ranks(topo.node) {
            let region = self.peer_region(s)?;
            region
                .atomic_u64(map.combine_done + 8 * me)?
                .store(seq as u64, Ordering::Release);
            if topo.num_nodes > 1 {
                region
                    .atomic_u64(map.relay_done + 8 * me)?
                    .store(seq as u64, Ordering::Release);
            }
        }
        self.relay_combine(seq as u64, handle, x, topk_weights, until)?;

        // Wait for the node's ranks, and for one packet of partial sums from each other
        // node; partial row j of node m is this rank's j-th token that went to node m.
        // The reduction reads it where it landed.
        let t_n = handle.num_tokens;
        let in_rank = &handle.is_token_in_rank;
        let node_hit = |t: usize, m: usize| {
            in_rank[t * r_n..(t + 1) * r_n][topo.node_ranks(m)].contains(&true)
        };
        for src in topo.node_ranks(topo.node) {
            let what = || {
                format!(
                    "rank {me}: combine {seq}: waiting for rank {src}'s rows (combine_done[{src}])"
                )
            };
            self.wait_local(map.combine_done + 8 * src, seq as u64, src, until, what)?;
        }
        // `[relay rank]`: each token's row in that relay's packet, and the packet's rows.
        let mut packet_row: Vec<Vec<usize>> = vec![Vec::new(); r_n];
        let mut partial_x: Vec<&[u16]> = vec![&[]; r_n];
        let mut partial_w: Vec<&[f32]> = vec![&[]; r_n];
        for m in topo.remote_nodes() {
            let relay = topo.relay(me, m);
            let what = || {
                format!(
                    "rank {me}: combine {seq}: waiting for node {m}'s partial sums from rank {relay}"
                )
            };
            self.wait_packet(relay, until, what)?;
            // (Meaningless for a token that did not go to node m: never read.)
            let mut j = 0;
            packet_row[relay] = (0..t_n)
                .map(|t| {
                    j += node_hit(t, m) as usize;
                    j.wrapping_sub(1)
                })
                .collect();
            let sec = packet::combine(j, h, k);
            let base = map.net.landing(Channel::Combine, relay);
            partial_x[relay] = self.symm.view(base + sec.at[0], j * h)?;
            if topk_weights.is_some() {
                partial_w[relay] = self.symm.view(base + sec.at[1], j * k)?;
            }
        }

        // Reduce: per token, in f32 and rounded once, the rows of this node's ranks and
        // the partial sum of each other node, in rank order (a node's partial in the
        // place of the rank that relayed it), as the reference does.
        let rows: &[u16] = self.symm.view(map.combine_x, r_n * t_max * h)?;
        let wrows: &[f32] = self.symm.view(map.combine_weights, r_n * t_max * k)?;
        let parts_of = |t: usize, r: usize| {
            if topo.node_of(r) == topo.node {
                in_rank[t * r_n + r]
            } else {
                r == topo.relay(me, topo.node_of(r)) && node_hit(t, topo.node_of(r))
            }
        };
        // Where this rank's own rows for its tokens are in `x`.
        let mut own_row = vec![usize::MAX; t_n];
        let own = recv_base(me)..recv_base(me) + rows_from(me);
        for i in own {
            own_row[handle.recv_src_idx[i] as usize] = i;
        }
        let x_bits: &[u16] = bytemuck::cast_slice(x);
        self.device.launch_rows(combined_x, h, |first, out| {
            let mut parts = Vec::with_capacity(r_n);
            for (t, out_row) in (first..).zip(out.chunks_exact_mut(h)) {
                parts.clear();
                for r in (0..r_n).filter(|&r| parts_of(t, r)) {
                    let row = if r == me {
                        &x_bits[own_row[t] * h..(own_row[t] + 1) * h]
                    } else if packet_row[r].is_empty() {
                        &rows[(r * t_max + t) * h..(r * t_max + t + 1) * h]
                    } else {
                        let j = packet_row[r][t];
                        &partial_x[r][j * h..(j + 1) * h]
                    };
                    parts.push((row, 1.0));
                }
                reduce_rows(&parts, false, out_row);
            }
            Ok(())
        })?;
        if let (Some(out), Some(own_w)) = (combined_topk_weights, topk_weights) {
            out.fill(0.0);
            for (t, out_row) in out.chunks_exact_mut(k).enumerate() {
                for r in (0..r_n).filter(|&r| parts_of(t, r)) {
                    let w = if r == me {
                        &own_w[own_row[t] * k..(own_row[t] + 1) * k]
                    } else if packet_row[r].is_empty() {
                        &wrows[(r * t_max + t) * k..(r * t_max + t + 1) * k]
                    } else {
                        let j = packet_row[r][t];
                        &partial_w[r][j * k..(j + 1) * k]
                    };
                    for (a, &b) in out_row.iter_mut().zip(w) {
                        *a += b;
                    }
                }
            }
        }
        Ok(())
    }

    /// Dispatch step 4 on several nodes: take the packet of each rank on another node
    /// that has this rank's local index, and store each token into the output rows of
    /// the ranks of this node its mask names, in the order the reference gives them
    /// (source rank ascending, token order kept); then publish the source to them.
    fn relay_dispatch(&self, seq: u64, matrix: &[u32], until: Until<'_>) -> Result<Vec<Relayed>> {
        let topo = self.topology();
        let (r_n, me, k, h) = (self.num_ranks, self.rank, self.cfg.topk, self.cfg.hidden);
        let epr = self.cfg.num_experts / r_n;
        let map = &self.map;
        let local = *self.symm.local();
        let mut relayed = Vec::new();
        for m in topo.remote_nodes() {
            let src = topo.relay(me, m);
            self.wait_packet(src, until, || {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s tokens to relay")
            })?;
            let base = map.net.landing(Channel::Dispatch, src);
            let mut hb = [0u8; packet::DispatchHeader::BYTES];
            local.read(base, &mut hb)?;
            let head = packet::DispatchHeader::from_bytes(hb);
            let n = head.tokens as usize;
            if n > self.cfg.num_max_dispatch_tokens_per_rank {
                return self.fail(invalid!(
                    "rank {me}: rank {src}'s dispatch packet announces {n} tokens, more than num_max_dispatch_tokens_per_rank = {}",
                    self.cfg.num_max_dispatch_tokens_per_rank
                ));
            }
            let n_direct = head.direct.unwrap_or(0) as usize;
            if head.direct.is_some() && n_direct != matrix[src * r_n + me] as usize || n_direct > n
            {
                return self.fail(invalid!(
                    "rank {me}: rank {src}'s dispatch packet says {n_direct} of its {n} tokens came straight here; its counts announced {}",
                    matrix[src * r_n + me]
                ));
            }
            let (row_bytes, groups) = (if head.fp8 { h } else { 2 * h }, h / 128);
            let sec = packet::dispatch(
                n,
                n - n_direct,
                row_bytes,
                if head.fp8 { groups } else { 0 },
                if head.topk { k } else { 0 },
                if head.weights { k } else { 0 },
            );
            let mut tokens = vec![0i32; n];
            let mut masks = vec![0u64; n];
            let mut idx = vec![0i64; if head.topk { n * k } else { 0 }];
            let mut w = vec![0f32; if head.weights { n * k } else { 0 }];
            local.read(base + sec.at[3], bytemuck::cast_slice_mut(&mut idx))?;
            local.read(base + sec.at[4], bytemuck::cast_slice_mut(&mut w))?;
            local.read(base + sec.at[5], bytemuck::cast_slice_mut(&mut tokens))?;
            local.read(base + sec.at[6], bytemuck::cast_slice_mut(&mut masks))?;
            // Rows from `src` start, on each rank of this node, after those of ranks 0..src.
            let start = |r: usize| column_sum(matrix, r_n, src, r);
            let mut pos: Vec<usize> = topo.node_ranks(topo.node).map(start).collect();
            let (mut idx_row, mut w_row) = (vec![0i64; k], vec![0f32; k]);
            // Rows of the packet that went to none but this rank are not in it.
            let mut rest = 0;
            for j in 0..n {
                if masks[j]
                    .checked_shr(topo.ranks_per_node as u32)
                    .unwrap_or(0)
                    != 0
                {
                    return self.fail(invalid!(
                        "rank {me}: rank {src}'s dispatch packet names local ranks {:#x} of a node of {}",
                        masks[j],
                        topo.ranks_per_node
                    ));
                }
                // Where the token's x row (and scales) is: in this rank's own output
                // rows when it went straight there, else the next row of the packet.
                let (x_at, scales_at) = if head.direct.is_some() && masks[j] >> topo.local & 1 != 0
                {
                    let at = pos[topo.local];
                    (
                        map.recv_x + at * row_bytes,
                        map.recv_scales + at * groups * 4,
                    )
                } else {
                    rest += 1;
                    let b = rest - 1;
                    (
                        base + sec.at[1] + b * row_bytes,
                        base + sec.at[2] + b * groups * 4,
                    )
                };
                for (l, r) in topo.node_ranks(topo.node).enumerate() {
                    if masks[j] >> l & 1 == 0 {
                        continue;
                    }
                    let region = self.peer_region(r)?;
                    let at = pos[l];
                    pos[l] += 1;
                    if at >= start(r) + matrix[src * r_n + r] as usize {
                        return self.fail(invalid!(
                            "rank {me}: rank {src}'s dispatch packet sends rank {r} more tokens than its counts announced ({})",
                            matrix[src * r_n + r]
                        ));
                    }
                    // (This rank's own rows went straight into place, unless unaligned.)
                    if l != topo.local || head.direct.is_none() {
                        region.copy_from(map.recv_x + at * row_bytes, &local, x_at, row_bytes)?;
                        if head.fp8 {
                            region.copy_from(
                                map.recv_scales + at * groups * 4,
                                &local,
                                scales_at,
                                groups * 4,
                            )?;
                        }
                    }
                    if head.topk {
                        let w = head.weights.then(|| &w[j * k..(j + 1) * k]);
                        localize(
                            &idx[j * k..(j + 1) * k],
                            w,
                            r,
                            epr,
                            &mut idx_row,
                            &mut w_row,
                        );
                        region.write(
                            map.recv_topk_idx + at * k * 8,
                            bytemuck::cast_slice(&idx_row),
                        )?;
                        if head.weights {
                            region.write(
                                map.recv_topk_weights + at * k * 4,
                                bytemuck::cast_slice(&w_row),
                            )?;
                        }
                    }
                    region.write(map.recv_src_idx + at * 4, &tokens[j].to_le_bytes())?;
                }
            }
            if rest != n - n_direct {
                return self.fail(invalid!(
                    "rank {me}: rank {src}'s dispatch packet carries {} rows for other ranks, but its masks name {rest}",
                    n - n_direct
                ));
            }
            for (l, r) in topo.node_ranks(topo.node).enumerate() {
                let expected = start(r) + matrix[src * r_n + r] as usize;
                if pos[l] != expected {
                    return self.fail(invalid!(
                        "rank {me}: rank {src}'s dispatch packet sends rank {r} {} tokens, but its counts announced {}",
                        pos[l] - start(r),
                        matrix[src * r_n + r]
                    ));
                }
                self.peer_region(r)?
                    .atomic_u64(map.dispatch_done + 8 * src)?
                    .store(seq, Ordering::Release);
            }
            relayed.push(Relayed { src, tokens, masks });
        }
        Ok(relayed)
    }

    /// Combine on several nodes, on the relaying rank: once every rank of this node has
    /// written its rows for the sources this rank relays, reduce each token's rows (in
    /// f32, rank order, rounded once to bf16, as [`reduce_rows`]) and send the node's
    /// partial sums to the source in one packet.
    fn relay_combine(
        &self,
        seq: u64,
        handle: &NormalHandle,
        x: &[bf16],
        topk_weights: Option<&[f32]>,
        until: Until<'_>,
    ) -> Result<()> {
        let topo = self.topology();
        if topo.num_nodes == 1 {
            return Ok(());
        }
        let (r_n, me, k, h) = (self.num_ranks, self.rank, self.cfg.topk, self.cfg.hidden);
        let x_bits: &[u16] = bytemuck::cast_slice(x);
        let t_max = self.cfg.num_max_dispatch_tokens_per_rank;
        let map = &self.map;
        for r in topo.node_ranks(topo.node) {
            let what = || {
                format!("rank {me}: combine {seq}: waiting for rank {r}'s rows to relay (relay_done[{r}])")
            };
            self.wait_local(map.relay_done + 8 * r, seq, r, until, what)?;
        }
        let local = *self.symm.local();
        let rows: &[u16] = self.symm.view(map.relay_x, self.num_ranks * t_max * h)?;
        let wrows: &[f32] = self
            .symm
            .view(map.relay_weights, self.num_ranks * t_max * k)?;
        let mut out = vec![bf16::ZERO; h];
        let mut w_out = vec![0f32; k];
        let mut parts = Vec::with_capacity(topo.ranks_per_node);
        let mut mine = vec![usize::MAX; t_max];
        for relayed in &handle.relay {
            let src = relayed.src;
            // This rank's own row for each of `src`'s tokens, in `x`.
            let prefix = |s: usize| handle.rank_prefix_matrix[s * r_n + me] as usize;
            let first = if src == 0 { 0 } else { prefix(src - 1) };
            for i in first..prefix(src) {
                mine[handle.recv_src_idx[i] as usize] = i;
            }
            self.reclaim(Channel::Combine, src, until)?;
            let n = relayed.tokens.len();
            let sec = packet::combine(n, h, k);
            let base = map.net.staging(Channel::Combine, src);
            // Slot of (source node, local rank l) for token t.
            let slot =
                |l: usize, t: usize| (topo.node_of(src) * topo.ranks_per_node + l) * t_max + t;
            for (j, (&t, &mask)) in relayed.tokens.iter().zip(&relayed.masks).enumerate() {
                let t = t as usize;
                let ls = (0..topo.ranks_per_node).filter(|&l| mask >> l & 1 != 0);
                parts.clear();
                parts.extend(ls.clone().map(|l| {
                    let row = if l == topo.local {
                        &x_bits[mine[t] * h..(mine[t] + 1) * h]
                    } else {
                        &rows[slot(l, t) * h..(slot(l, t) + 1) * h]
                    };
                    (row, 1.0)
                }));
                reduce_rows(&parts, false, &mut out);
                local.write(base + sec.at[0] + j * h * 2, bytemuck::cast_slice(&out))?;
                if let Some(own_w) = topk_weights {
                    w_out.fill(0.0);
                    for l in ls {
                        let w = if l == topo.local {
                            &own_w[mine[t] * k..(mine[t] + 1) * k]
                        } else {
                            &wrows[slot(l, t) * k..(slot(l, t) + 1) * k]
                        };
                        for (a, &b) in w_out.iter_mut().zip(w) {
                            *a += b;
                        }
                    }
                    local.write(base + sec.at[1] + j * k * 4, bytemuck::cast_slice(&w_out))?;
                }
            }
            self.send_staged(Channel::Combine, src, sec.len)?;
        }
        Ok(())
    }
}
