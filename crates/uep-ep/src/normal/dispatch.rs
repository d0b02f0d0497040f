//! Normal dispatch: notify → plan → pack → publish → relay → finish.

use std::borrow::Cow;
use std::ops::Range;

use super::paths::CallMask;
use super::{
    column_sum, DispatchArgs, DispatchOutput, NormalHandle, NormalState, Relayed, WeightLanes,
};
use crate::area::{Area, Mem, SliceRows, STREAM_ABOVE};
use crate::config::Shape;
use crate::ctx::Ctx;
use crate::device::normal::{rows_aligned, Dest, NormalPlan, NotifySink, RowSink};
use crate::device::{LayoutPhase, NormalPackPhase, NotifyPhase, Store, Until, Word};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::layout::DispatchLayout;
use crate::map::NormalAreas;
use crate::net::Staged;
use crate::packet::{Channel, DispatchHeader, DispatchPacket, NotifyHead, NotifyPacket, RowFormat};
use crate::tokens::{RecvTokens, TokenFormat};
use crate::wait::{Seen, Wait};

/// The routing one dispatch works with, whichever way it was given.
struct Routing<'a> {
    in_rank: Cow<'a, [bool]>,
    per_rank: Cow<'a, [i32]>,
    per_expert: Cow<'a, [i32]>,
}

impl<'a> Routing<'a> {
    fn of_layout(layout: Cow<'a, DispatchLayout>) -> Self {
        match layout {
            Cow::Borrowed(l) => Routing {
                in_rank: l.is_token_in_rank.as_slice().into(),
                per_rank: l.num_tokens_per_rank.as_slice().into(),
                per_expert: l.num_tokens_per_expert.as_slice().into(),
            },
            Cow::Owned(l) => Routing {
                in_rank: l.is_token_in_rank.into(),
                per_rank: l.num_tokens_per_rank.into(),
                per_expert: l.num_tokens_per_expert.into(),
            },
        }
    }
}

impl Routing<'_> {
    /// The routing without the masked ranks: a token no longer goes to them, and
    /// counts nothing there (`epr` experts a rank).
    fn without(&self, mask: &CallMask, epr: usize) -> Routing<'_> {
        let r_n = self.per_rank.len();
        let mut r = Routing {
            in_rank: Cow::Borrowed(&self.in_rank),
            per_rank: Cow::Borrowed(&self.per_rank),
            per_expert: Cow::Borrowed(&self.per_expert),
        };
        for dead in (0..r_n).filter(|&d| mask.is(d)) {
            for row in r.in_rank.to_mut().chunks_exact_mut(r_n) {
                row[dead] = false;
            }
            r.per_rank.to_mut()[dead] = 0;
            r.per_expert.to_mut()[dead * epr..(dead + 1) * epr].fill(0);
        }
        r
    }
}

/// What a dispatch's finish needs besides the plan: every rank's counts, what this
/// rank relayed, and the mask.
struct Done<'m> {
    counts: Counts,
    relay: Vec<Relayed>,
    mask: &'m CallMask,
}

/// What the notify phase gathered: every rank's counts.
struct Counts {
    /// `[R, R]`: tokens rank `s` sends to rank `r`.
    matrix: Vec<u32>,
    /// `[E/R]`: (token, slot) pairs each local expert receives (from the senders' counts).
    recv_per_expert: Vec<usize>,
    /// `[R]`: tokens each rank dispatches.
    tokens: Vec<u32>,
}

impl Counts {
    /// Where rows from rank `upto` start among rank `r`'s received rows.
    fn column_sum(&self, upto: usize, r: usize) -> usize {
        column_sum(&self.matrix, self.tokens.len(), upto, r)
    }
}

impl NormalPlan {
    fn packet(&self, d: usize) -> DispatchPacket {
        let (n, n_direct) = self.totals[d];
        DispatchPacket::layout(n, n_direct, self.fmt)
    }

    /// The direct rows to node destination `d` that no kernel thread pushed: each block
    /// pushes whole quanta only, so the rows around each block boundary (and the tail)
    /// that share a quantum with the next block are left to the publish phase.
    fn unpushed_direct(&self, d: usize) -> Vec<Range<usize>> {
        let nd = self.dests.len();
        let starts = self.block_start.iter().skip(d).step_by(nd).map(|&(_, x)| x);
        unpushed(starts, self.totals[d].1, self.row_quantum())
    }
}

/// The rows of `0..total` in no whole quantum (`q` rows) between two adjacent block
/// starts of `starts` (ascending, the last one `total`): those that the kernel's
/// `DirectRun`s leave.
fn unpushed(starts: impl Iterator<Item = usize>, total: usize, q: usize) -> Vec<Range<usize>> {
    let mut gaps: Vec<Range<usize>> = starts
        .map(|x| x / q * q..x.div_ceil(q).saturating_mul(q).min(total))
        .filter(|r| !r.is_empty())
        .collect();
    gaps.dedup();
    gaps
}

/// DeepEP's `rank_prefix_matrix` of the `[R, R]` count matrix: entry `[s][r]` is the
/// tokens ranks `0..=s` send to rank `r`.
fn rank_prefix_matrix(matrix: &[u32], r_n: usize) -> Vec<i32> {
    let mut prefix = vec![0i32; r_n * r_n];
    for s in 0..r_n {
        for r in 0..r_n {
            let above = if s > 0 { prefix[(s - 1) * r_n + r] } else { 0 };
            prefix[s * r_n + r] = matrix[s * r_n + r] as i32 + above;
        }
    }
    prefix
}

/// For tokens split into `chunks` blocks of `per` (as the device's launch splits them),
/// with `hit` and `direct` (`[T][dest]`) saying where each goes: `[block + 1][dest]` the
/// running (rows, direct rows) totals at each block's start (its kernel thread's first
/// rows) and after the last, and `[dest]` the totals.
#[allow(clippy::type_complexity)]
fn block_starts(
    hit: &[bool],
    direct: &[bool],
    nd: usize,
    (chunks, per): (usize, usize),
) -> (Vec<(usize, usize)>, Vec<(usize, usize)>) {
    let t_n = hit.len() / nd.max(1);
    let mut block_start = Vec::with_capacity((chunks + 1) * nd);
    let mut totals = vec![(0usize, 0usize); nd];
    for c in 0..chunks {
        block_start.extend_from_slice(&totals);
        for t in (c * per).min(t_n)..((c + 1) * per).min(t_n) {
            for (d, (n, n_direct)) in totals.iter_mut().enumerate() {
                *n += hit[t * nd + d] as usize;
                *n_direct += direct[t * nd + d] as usize;
            }
        }
    }
    block_start.extend_from_slice(&totals);
    (block_start, totals)
}

impl Ctx {
    /// The normal-mode shape, if this Buffer has one.
    pub(crate) fn normal_areas(&self) -> Result<NormalAreas> {
        self.map.normal.ok_or_else(|| {
            invalid!("this Buffer has no normal-mode buffers (its config has no normal shape)")
        })
    }

    /// Compute the dispatch layout of `topk_idx` (`[T, K]`) for this Buffer's ranks and
    /// normal-mode experts.
    pub(crate) fn get_dispatch_layout(&self, topk_idx: &[i64]) -> Result<DispatchLayout> {
        let s = self.normal_areas()?.shape;
        self.device.layout(&LayoutPhase {
            topk_idx,
            topk: s.topk,
            num_experts: s.num_experts,
            num_ranks: self.topo.num_ranks,
            ranks_per_node: self.topo.ranks_per_node,
        })
    }

    /// One normal dispatch (see [`crate::Buffer::dispatch`]), numbered in `st`. In
    /// elastic mode the survivors then agree on the mask; if it grew (a rank was lost
    /// during the call), they run the dispatch again without the lost ranks, in the
    /// same bank (`elastic`).
    pub(crate) fn dispatch_call(
        &self,
        st: &mut NormalState,
        args: &DispatchArgs<'_>,
    ) -> Result<(NormalHandle, Seen)> {
        let areas = self.normal_areas()?;
        let routing = self.check_dispatch(args, areas.shape)?;
        let t_n = args.x.num_tokens(areas.shape.hidden)?;
        st.dispatch = st.dispatch.wrapping_add(1);
        // Peers write this call's bank once they have its notify: outputs of the call
        // before the last that someone still holds must leave it first.
        if let Some(banks) = &mut st.banks {
            banks[(st.dispatch % 2) as usize].reclaim()?;
        }
        let mut mask = self.normal_mask()?;
        loop {
            self.refuse_stale_handle(args.handle, &mask)?;
            let seq = st.dispatch;
            let routing = routing.without(&mask, areas.shape.experts_per_rank(self.topo.num_ranks));
            let out = self.dispatch_attempt(seq, &areas, &routing, args, t_n, &mask)?;
            match self.normal_agree(&format!("dispatch {seq}"), &mask, false)? {
                None => return Ok(out),
                Some(grown) => mask = grown,
            }
            // Two ahead: the same bank and notify slots, which every survivor is done
            // with (it finished the call before the agreement heard from it).
            st.dispatch = st.dispatch.wrapping_add(2);
        }
    }

    /// One attempt of dispatch `seq` under `mask`.
    fn dispatch_attempt(
        &self,
        seq: u32,
        areas: &NormalAreas,
        routing: &Routing<'_>,
        args: &DispatchArgs<'_>,
        t_n: usize,
        mask: &CallMask,
    ) -> Result<(NormalHandle, Seen)> {
        let wait = self.call_wait();
        let counts = self.notify(seq, areas, routing, t_n, mask, &wait)?;
        self.check_room(&counts, areas, args)?;
        let mut plan = self.plan(seq, areas, &counts, routing, args, t_n, mask, &wait)?;
        let _landing = self.net.as_ref().map(|n| n.watch_arrivals());
        self.pack(&plan, areas, args, routing)?;
        self.publish(seq, &mut plan)?;
        let relay = self.relay_dispatch(seq, areas, &counts.matrix, mask, &wait)?;
        let done = Done {
            counts,
            relay,
            mask,
        };
        self.finish(seq, areas, done, routing, &plan, args, t_n, &wait)
    }

    /// Validate a dispatch before anything is sent.
    /// The routing of a cached dispatch: its handle's, once it is this Buffer's and
    /// for as many tokens.
    fn cached_routing<'a>(
        &self,
        args: &DispatchArgs<'a>,
        handle: &'a NormalHandle,
        t_n: usize,
    ) -> Result<Routing<'a>> {
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
        Ok(Routing {
            in_rank: handle.is_token_in_rank.as_slice().into(),
            per_rank: handle.num_tokens_per_rank.as_slice().into(),
            per_expert: handle.num_tokens_per_expert.as_slice().into(),
        })
    }

    fn check_dispatch<'a>(&self, args: &DispatchArgs<'a>, shape: Shape) -> Result<Routing<'a>> {
        let (r_n, k, h) = (self.topo.num_ranks, shape.topk, shape.hidden);
        let t_n = args.x.num_tokens(h)?;
        if args.num_worst_tokens > r_n * shape.max_tokens {
            return Err(invalid!(
                "num_worst_tokens = {} exceeds the Buffer's receive rows (ranks * num_max_dispatch_tokens_per_rank = {})",
                args.num_worst_tokens,
                r_n * shape.max_tokens
            ));
        }
        if args.expert_alignment == 0 {
            return Err(invalid!("expert_alignment must be at least 1"));
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
            return self.cached_routing(args, handle, t_n);
        }
        if let Some(idx) = args.topk_idx {
            if idx.len() != t_n * k {
                return Err(invalid!(
                    "topk_idx has {} values, expected [tokens = {t_n}, topk = {k}]",
                    idx.len()
                ));
            }
        }
        let layout = match (args.layout, args.topk_idx) {
            (Some(layout), idx) => {
                if layout.num_tokens != t_n
                    || layout.num_ranks != r_n
                    || layout.num_experts != shape.num_experts
                {
                    return Err(invalid!(
                        "the layout is for {} tokens, {} ranks, {} experts; this call has {t_n}, {r_n}, {}",
                        layout.num_tokens,
                        layout.num_ranks,
                        layout.num_experts,
                        shape.num_experts
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
                Cow::Borrowed(layout)
            }
            (None, Some(idx)) => Cow::Owned(self.get_dispatch_layout(idx)?),
            (None, None) => {
                return Err(invalid!(
                    "dispatch needs topk_idx, a layout, or a cached handle"
                ))
            }
        };
        Ok(Routing::of_layout(layout))
    }

    /// Phase 1, notify: this rank's counts into every same-node peer's slot and a packet
    /// to every other node; then every rank's counts.
    fn notify(
        &self,
        seq: u32,
        areas: &NormalAreas,
        routing: &Routing<'_>,
        t_n: usize,
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<Counts> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (e_n, epr) = (areas.shape.num_experts, areas.shape.experts_per_rank(r_n));
        let parity = (seq % 2) as usize;
        let mut mine: Vec<u32> = Vec::with_capacity(r_n + e_n);
        mine.extend(routing.per_rank.iter().map(|&c| c as u32));
        mine.extend(routing.per_expert.iter().map(|&c| c as u32));
        let head = NotifyHead {
            tokens: t_n as u32,
            flags: 0,
        };
        self.send_counts(seq, areas, (head, &mine), mask, wait)?;
        let local = self.symm.local();
        let mut counts = Counts {
            matrix: vec![0u32; r_n * r_n],
            recv_per_expert: vec![0usize; epr],
            tokens: vec![0u32; r_n],
        };
        let p = NotifyPacket::layout(r_n, e_n);
        // A masked source counts nothing; one lost now too (the call runs again).
        for src in (0..r_n).filter(|&s| !mask.is(s)) {
            let what = || {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s token counts (notify[{parity}][{src}])")
            };
            let read = if self.topo.is_local(src) {
                let slot = areas.notify_slot(parity, src, r_n)?;
                let word = Word::at(me, slot.epoch, 0, Until::AtLeast(seq as u64))?;
                let seen = self.await_word(word, src, wait, &what);
                match self.unless_lost(src, seen)? {
                    Some(seen) => Some((
                        self.read_published(me, slot.head, &seen)?[0],
                        self.read_published(me, slot.counts, &seen)?,
                    )),
                    None => None,
                }
            } else {
                // The packet landed in this rank's staging memory, the host's.
                let landing = self.net()?.recv(Channel::Notify, src, wait, &what);
                match self.unless_lost(src, landing)? {
                    Some(l) => Some((
                        local.get_vec(p.head.at_base(l.offset()))?[0],
                        local.get_vec(p.counts.at_base(l.offset()))?,
                    )),
                    None => None,
                }
            };
            let Some((head, row)) = read else {
                continue;
            };
            counts.tokens[src] = head.tokens;
            counts.matrix.row_mut(src, r_n).copy_from_slice(&row[..r_n]);
            for (le, n) in counts.recv_per_expert.iter_mut().enumerate() {
                *n += row[r_n + me * epr + le] as usize;
            }
        }
        Ok(counts)
    }

    /// Notify's send: the device's notify phase stores `mine` into the packets staged
    /// for the other nodes, which the host sends, then into every live same-node
    /// rank's slot.
    fn send_counts(
        &self,
        seq: u32,
        areas: &NormalAreas,
        (head, mine): (NotifyHead, &[u32]),
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<()> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let parity = (seq % 2) as usize;
        let p = NotifyPacket::layout(r_n, areas.shape.num_experts);
        // The other nodes' packets first (they take longest to arrive), then this
        // node's slots: a same-node peer that has its counts early would only wait.
        let (mut remote, mut local) = (vec![NotifySink::Skip; r_n], vec![NotifySink::Skip; r_n]);
        let mut staged = Vec::new();
        for peer in (0..r_n).filter(|&p| !mask.is(p)) {
            if self.topo.is_local(peer) {
                let slot = areas.notify_slot(parity, me, r_n)?;
                local[peer] = NotifySink::Slot { rank: peer, slot };
            } else if let Some(s) = self.stage_unless_lost(Channel::Notify, peer, wait)? {
                remote[peer] = NotifySink::Packet(p.at_base(s.area.offset()));
                staged.push((peer, s));
            }
        }
        let phase = |sinks| NotifyPhase {
            seq,
            head,
            counts: mine,
            sinks,
            memory: &self.symm,
        };
        self.device.normal_notify(&phase(&remote))?;
        for (peer, s) in staged {
            self.unless_lost(peer, self.net()?.send(s, p.len, &[]))?;
        }
        self.device.normal_notify(&phase(&local))
    }

    /// After notify, every rank knows every rank's tokens: if one dispatches more than
    /// the Buffer holds, all stop here together, before any row moves.
    fn check_room(
        &self,
        counts: &Counts,
        areas: &NormalAreas,
        args: &DispatchArgs<'_>,
    ) -> Result<()> {
        let max = areas.shape.max_tokens;
        if let Some((src, &n)) = counts
            .tokens
            .iter()
            .enumerate()
            .max_by_key(|(_, &n)| n)
            .filter(|(_, &n)| n as usize > max)
        {
            return Err(EpError::Capacity {
                what: format!(
                    "rank {src} dispatches {n} tokens, more than num_max_dispatch_tokens_per_rank = {max} (seen by rank {}); make a Buffer with room for {n}",
                    self.topo.rank
                ),
                tokens: n as usize,
            });
        }
        let num_recv = counts.column_sum(self.topo.num_ranks, self.topo.rank);
        if args.num_worst_tokens > 0 && args.num_worst_tokens < num_recv {
            return Err(invalid!(
                "rank {} receives {num_recv} tokens, more than num_worst_tokens = {}",
                self.topo.rank,
                args.num_worst_tokens
            ));
        }
        Ok(())
    }

    /// Phase 2, plan: destinations, which tokens go where, where each kernel thread's
    /// rows start, and the areas they land in (staging the other nodes' packets).
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        seq: u32,
        areas: &NormalAreas,
        counts: &Counts,
        routing: &Routing<'_>,
        args: &DispatchArgs<'_>,
        t_n: usize,
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<NormalPlan> {
        let (r_n, me, topo) = (self.topo.num_ranks, self.topo.rank, self.topo);
        let (h, k) = (areas.shape.hidden, areas.shape.topk);
        let fp8 = args.x.is_fp8();
        let with_topk = args.handle.is_none() && args.topk_idx.is_some();
        let with_weights = with_topk && args.topk_weights.is_some();
        let groups = h / 128;
        let fmt = RowFormat {
            row_bytes: args.x.row_bytes(h),
            groups: if fp8 { groups } else { 0 },
            topk: if with_topk { k } else { 0 },
            weights: if with_weights { k } else { 0 },
        };
        let out_base: Vec<usize> = (0..r_n).map(|r| counts.column_sum(me, r)).collect();
        let in_rank = &routing.in_rank;
        let (nodes, staged) = self.stage_nodes(mask, wait)?;
        let dests: Vec<Dest> = (0..r_n)
            .filter(|&r| topo.is_local(r) && !mask.is(r))
            .map(Dest::Rank)
            .chain(nodes)
            .collect();
        let nd = dests.len();
        let hit: Vec<bool> = (0..t_n)
            .flat_map(|t| {
                let row = in_rank.row(t, r_n);
                dests.iter().map(move |d| match *d {
                    Dest::Rank(r) => row[r],
                    Dest::Node(m, _) => row[topo.node_ranks(m)].contains(&true),
                })
            })
            .collect();
        // A token that another node's relay itself receives goes straight into the
        // relay's output rows (its rows from this rank are contiguous there), so the
        // relay unpacks only the rows of the node's other ranks; where those rows do not
        // start 16-byte aligned, as one-sided writes need, they travel in the packet.
        let direct_ok = |r: usize| rows_aligned(out_base[r], fmt);
        let direct: Vec<bool> = (0..t_n)
            .flat_map(|t| {
                dests.iter().map(move |d| match *d {
                    Dest::Rank(_) => false,
                    Dest::Node(_, relay) => in_rank[t * r_n + relay] && direct_ok(relay),
                })
            })
            .collect();
        let (block_start, totals) = block_starts(&hit, &direct, nd, self.device.split(t_n));
        let (sinks, staged) =
            self.open_row_sinks(seq, areas, &dests, &totals, &out_base, fmt, staged)?;
        let node_rows: usize = (dests.iter().zip(&totals))
            .filter(|(d, _)| matches!(d, Dest::Rank(r) if *r != me))
            .map(|(_, &(n, _))| n)
            .sum();
        Ok(NormalPlan {
            dests,
            hit,
            direct,
            block_start,
            totals,
            sinks,
            staged,
            out_base,
            fmt,
            fp8,
            with_topk,
            with_weights,
            weight_lanes: args.weight_lanes,
            streaming: node_rows * fmt.row_bytes > STREAM_ABOVE,
        })
    }

    /// The other nodes a dispatch sends to, and the packet staged for each, in the
    /// same order. A node is left out where it has no relay (every rank there is
    /// masked) or its relay was lost.
    fn stage_nodes(&self, mask: &CallMask, wait: &Wait<'_>) -> Result<(Vec<Dest>, Vec<Staged>)> {
        let (mut nodes, mut staged) = (Vec::new(), Vec::new());
        for m in self.topo.remote_nodes() {
            let Some(relay) = mask.relays.of(self.topo.rank, m) else {
                continue;
            };
            if let Some(s) = self.stage_unless_lost(Channel::Dispatch, relay.rank, wait)? {
                nodes.push(Dest::Node(m, relay.rank));
                staged.push(s);
            }
        }
        Ok((nodes, staged))
    }

    /// Where each destination's rows go: a same-node rank's output rows from this
    /// rank's first row there, or the packet staged for another node's relay.
    #[allow(clippy::too_many_arguments)]
    fn open_row_sinks(
        &self,
        seq: u32,
        areas: &NormalAreas,
        dests: &[Dest],
        totals: &[(usize, usize)],
        out_base: &[usize],
        fmt: RowFormat,
        node_staged: Vec<Staged>,
    ) -> Result<(Vec<RowSink>, Vec<Option<Staged>>)> {
        let r_n = self.topo.num_ranks;
        let mut node_staged = node_staged.into_iter();
        let (h, k) = (areas.shape.hidden, areas.shape.topk);
        let groups = h / 128;
        let bank = areas.bank(seq);
        let mut sinks = Vec::with_capacity(dests.len());
        let mut staged = Vec::with_capacity(dests.len());
        for (d, dest) in dests.iter().enumerate() {
            match *dest {
                Dest::Rank(r) => {
                    let j = out_base[r];
                    let rows = r_n * areas.shape.max_tokens;
                    sinks.push(RowSink {
                        rank: r,
                        x: bank.recv_x.slice(j * fmt.row_bytes..rows * fmt.row_bytes)?,
                        scales: bank.recv_scales.slice(j * groups..rows * groups)?,
                        topk: bank.recv_topk_idx.slice(j * k..rows * k)?,
                        weights: bank.recv_topk_weights.slice(j * k..rows * k)?,
                        src: areas.recv_src_idx.slice(j..rows)?,
                        mask: Area::default(),
                        direct_x: Area::default(),
                        direct_scales: Area::default(),
                        relay_x: Area::default(),
                        relay_scales: Area::default(),
                    });
                    staged.push(None);
                }
                Dest::Node(_, relay) => {
                    let s = node_staged
                        .next()
                        .ok_or_else(|| EpError::internal("a node packet was not staged".into()))?;
                    let (n, n_direct) = totals[d];
                    let p = DispatchPacket::layout(n, n_direct, fmt).at_base(s.area.offset());
                    if p.staged_len > s.area.len() {
                        return Err(EpError::internal(format!(
                            "a dispatch packet of {} bytes does not fit its {}-byte staging area",
                            p.staged_len,
                            s.area.len()
                        )));
                    }
                    // Direct rows exist only where the relay's rows start aligned.
                    let (j, rows) = (out_base[relay], r_n * areas.shape.max_tokens);
                    sinks.push(RowSink {
                        rank: self.topo.rank,
                        x: p.x,
                        scales: p.scales,
                        topk: p.topk_idx,
                        weights: p.weights,
                        src: p.src,
                        mask: p.mask,
                        direct_x: p.direct_x,
                        direct_scales: p.direct_scales,
                        relay_x: bank.recv_x.slice(j * fmt.row_bytes..rows * fmt.row_bytes)?,
                        relay_scales: bank.recv_scales.slice(j * groups..rows * groups)?,
                    });
                    staged.push(Some(s));
                }
            }
        }
        Ok((sinks, staged))
    }

    /// Phase 3, pack: the kernel threads store each token once into each destination,
    /// and push the writes of the rows that go straight to another node's relay as they
    /// go (runs of about a write's size), so those are on the wire while later tokens
    /// pack.
    fn pack(
        &self,
        plan: &NormalPlan,
        areas: &NormalAreas,
        args: &DispatchArgs<'_>,
        routing: &Routing<'_>,
    ) -> Result<()> {
        let phase = NormalPackPhase {
            plan,
            x: args.x,
            topk_idx: args.topk_idx,
            topk_weights: args.topk_weights,
            in_rank: &routing.in_rank,
            topo: self.topo,
            shape: areas.shape,
            memory: &self.symm,
        };
        let started = std::time::Instant::now();
        self.device.normal_pack(&phase)?;
        if let Some(net) = &self.net {
            net.time_kernel(started.elapsed());
        }
        Ok(())
    }

    /// Phase 4, publish: a release store of the epoch into each same-node rank; the
    /// packet to each other node, after the direct rows no kernel thread pushed,
    /// announcing it and every direct row.
    fn publish(&self, seq: u32, plan: &mut NormalPlan) -> Result<()> {
        let me = self.topo.rank;
        let total = self.symm.local().len();
        for (d, dest) in plan.dests.iter().enumerate() {
            match *dest {
                Dest::Rank(r) => {
                    let done = self.map.control.dispatch_done;
                    self.signal(&[Store::at(r, done, me, seq as u64)?])?
                }
                Dest::Node(_, relay) => {
                    let (n, n_direct) = plan.totals[d];
                    let staged = plan.staged[d]
                        .take()
                        .ok_or_else(|| EpError::internal("a node packet was not staged".into()))?;
                    let p = plan.packet(d).at_base(staged.area.offset());
                    let aligned = rows_aligned(plan.out_base[relay], plan.fmt);
                    let header = DispatchHeader {
                        tokens: n as u32,
                        direct: n_direct as u32,
                        flags: (plan.fp8 as u32 * DispatchHeader::FP8)
                            | (plan.with_topk as u32 * DispatchHeader::TOPK)
                            | (plan.with_weights as u32 * DispatchHeader::WEIGHTS)
                            | ((plan.weight_lanes == WeightLanes::All) as u32
                                * DispatchHeader::ALL_LANES)
                            | (aligned as u32 * DispatchHeader::DIRECT),
                        reserved: 0,
                    };
                    self.symm.local().put(p.header, &[header])?;
                    let mut direct = Vec::new();
                    for rows in plan.unpushed_direct(d) {
                        direct.extend(plan.sinks[d].direct_writes(rows, plan.fmt, total)?);
                    }
                    let sent = self.net()?.send(staged, p.len, &direct);
                    self.unless_lost(relay, sent)?;
                }
            }
        }
        Ok(())
    }

    /// Waits until every source published its rows of dispatch `seq` (a same-node
    /// source publishes itself, one on another node is published by the rank of this
    /// node that relays it): what the waits acquired.
    fn wait_sources(&self, seq: u32, done: &Done<'_>, wait: &Wait<'_>) -> Result<Seen> {
        let (r_n, me, topo) = (self.topo.num_ranks, self.topo.rank, self.topo);
        let mut seen = None;
        for src in (0..r_n).filter(|&s| !done.mask.is(s)) {
            let n = done.counts.matrix[src * r_n + me] as usize;
            let publisher = match topo.is_local(src) {
                true => Some(src),
                false => done.mask.relays.of(src, topo.node).map(|r| r.rank),
            };
            let Some(publisher) = publisher else {
                continue;
            };
            let what = || {
                format!("rank {me}: dispatch {seq}: waiting for rank {src}'s {n} rows (dispatch_done[{src}], published by rank {publisher})")
            };
            let done = self.map.control.dispatch_done;
            let word = Word::at(me, done, src, Until::AtLeast(seq as u64))?;
            let got = self.await_word(word, publisher, wait, &what);
            seen = self.unless_lost(publisher, got)?.or(seen);
        }
        // Every source (this rank among them) published its rows.
        seen.ok_or_else(|| {
            EpError::internal(format!("rank {me}: dispatch {seq} waited for no source"))
        })
    }

    /// Phase 6, finish: wait for every source (a same-node source publishes itself, one
    /// on another node is published by the rank of this node that relays it), pad the
    /// outputs, and build the handle.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        seq: u32,
        areas: &NormalAreas,
        done: Done<'_>,
        routing: &Routing<'_>,
        plan: &NormalPlan,
        args: &DispatchArgs<'_>,
        t_n: usize,
        wait: &Wait<'_>,
    ) -> Result<(NormalHandle, Seen)> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let k = areas.shape.topk;
        let bank = areas.bank(seq);
        let seen = self.wait_sources(seq, &done, wait)?;
        let Done {
            counts,
            relay,
            mask,
        } = done;
        let num_recv = counts.column_sum(r_n, me);
        let rows = if args.num_worst_tokens > 0 {
            args.num_worst_tokens
        } else {
            num_recv
        };
        if rows > num_recv && plan.with_topk {
            // Padding rows (num_worst_tokens) route nowhere.
            let pad = (rows - num_recv) * k;
            let (ids, weights) = (bank.recv_topk_idx, bank.recv_topk_weights);
            self.write_area(me, ids.rows(num_recv..rows, k)?, &vec![-1i64; pad])?;
            if plan.with_weights {
                self.write_area(me, weights.rows(num_recv..rows, k)?, &vec![0f32; pad])?;
            }
        }
        let align = args.expert_alignment.max(1);
        let prefix = rank_prefix_matrix(&counts.matrix, r_n);
        Ok((
            NormalHandle {
                buffer_id: self.id,
                rank_prefix_matrix: prefix,
                is_token_in_rank: routing.in_rank.to_vec(),
                num_tokens_per_rank: routing.per_rank.to_vec(),
                num_tokens_per_expert: routing.per_expert.to_vec(),
                recv_src_idx: self.read_published(
                    me,
                    areas.recv_src_idx.prefix(num_recv)?,
                    &seen,
                )?,
                num_recv_tokens_per_expert: counts
                    .recv_per_expert
                    .iter()
                    .map(|n| n.div_ceil(align) * align)
                    .collect(),
                num_tokens: t_n,
                num_recv_tokens: num_recv,
                num_rows: rows,
                topk: k,
                bank: (seq % 2) as usize,
                fp8: plan.fp8,
                with_topk: plan.with_topk,
                with_weights: plan.with_weights,
                relay,
                masked: mask.masked.clone(),
            },
            seen,
        ))
    }

    /// The output areas of the dispatch `handle` describes: x, scales, top-k ids and
    /// weights (empty where the dispatch carried none).
    pub(crate) fn dispatch_areas(&self, handle: &NormalHandle) -> Result<[Area<u8>; 4]> {
        let a = self.normal_areas()?;
        let bank = &a.banks[handle.bank];
        let (h, k, rows) = (a.shape.hidden, a.shape.topk, handle.num_rows);
        let format = rows_of(handle);
        let (rb, groups) = (format.row_bytes(h), format.scale_words(h));
        Ok([
            bank.recv_x.prefix(rows * rb)?,
            bank.recv_scales.prefix(rows * groups)?.cast(),
            bank.recv_topk_idx
                .prefix(if handle.with_topk { rows * k } else { 0 })?
                .cast(),
            bank.recv_topk_weights
                .prefix(if handle.with_weights { rows * k } else { 0 })?
                .cast(),
        ])
    }

    /// The outputs of a dispatch whose waits acquired `seen`, borrowing the Buffer.
    pub(crate) fn dispatch_output(
        &self,
        (handle, seen): (NormalHandle, Seen),
    ) -> Result<DispatchOutput<'_>> {
        let [x, scales, idx, w] = self.dispatch_areas(&handle)?;
        // Every source published (dispatch_done = this call's epoch) that its rows are
        // written; peers write these areas again only after this rank's next notify,
        // which needs the Buffer mutably, while the output borrows it.
        let published = self.symm.published(&seen);
        let (x, scales, idx, w) = (
            published.view(x)?,
            published.view::<f32>(scales.cast())?,
            published.view::<i64>(idx.cast())?,
            published.view::<f32>(w.cast())?,
        );
        let recv_x = RecvTokens::from_bytes(rows_of(&handle), x, scales);
        Ok(DispatchOutput {
            recv_x,
            recv_topk_idx: handle.with_topk.then_some(idx),
            recv_topk_weights: handle.with_weights.then_some(w),
            num_recv_tokens_per_expert: handle.num_recv_tokens_per_expert.clone(),
            handle,
        })
    }
}

/// What the rows of a normal dispatch are made of (normal mode moves bf16 or FP8).
fn rows_of(handle: &NormalHandle) -> TokenFormat {
    if handle.fp8 {
        TokenFormat::Fp8
    } else {
        TokenFormat::Bf16
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::host::DirectRun;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the block boundaries, quantum and batch, the runs the kernel threads
        /// push and the rows the publish phase sends cover every direct row once, and
        /// every write starts on a quantum (so it is 16-byte aligned).
        #[test]
        fn pushed_and_published_rows_cover_each_direct_row_once(
            sizes in proptest::collection::vec(0usize..40, 1..6),
            q in 1usize..5,
            row_bytes in 1usize..64,
            write_bytes in 1usize..512,
        ) {
            let mut starts = vec![0];
            for n in &sizes {
                starts.push(starts.last().unwrap() + n);
            }
            let total = *starts.last().unwrap();
            let mut seen = vec![0u8; total];
            let mut cover = |rows: Range<usize>| {
                prop_assert_eq!(rows.start % q, 0, "{:?}", rows);
                for r in rows {
                    seen[r] += 1;
                }
                Ok(())
            };
            for b in starts.windows(2) {
                let mut run = DirectRun::new(b[0], q, row_bytes, write_bytes);
                for packed in b[0]..=b[1] {
                    if let Some(rows) = run.take(packed, q, false) {
                        cover(rows)?;
                    }
                }
                if let Some(rows) = run.take(b[1], q, true) {
                    cover(rows)?;
                }
            }
            for rows in unpushed(starts.iter().copied(), total, q) {
                cover(rows)?;
            }
            prop_assert!(seen.iter().all(|&n| n == 1), "{:?}", seen);
        }
    }
}
