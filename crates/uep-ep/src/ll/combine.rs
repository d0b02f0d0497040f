//! Low-latency combine: send (pack each expert output to its source → publish), then
//! receive (wait → weighted reduce).

use half::bf16;

use super::{check_window, LlCombineInput, LlCombinePending, LlHandle, LlState};
use crate::area::{Area, SliceRows};
use crate::ctx::Ctx;
use crate::device::fingerprint;
use crate::device::pack::{CombineRemote, LlCombineSink, Sink};
use crate::device::{LlCombinePackPhase, Part, ReducePhase, Rows, Store, Symmetric, Until, Word};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::LlAreas;
use crate::packet::{ll_combine_groups, Channel, LlCombinePacket, LL_BUFFERS};
use crate::symm::Exclusive;

/// This rank's own rows of a combine: (token * K + slot, expert row) of each, read
/// straight from the expert outputs by the reduction.
fn own_rows(handle: &LlHandle, me: usize, r_n: usize, areas: &LlAreas) -> Vec<(usize, usize)> {
    let (m, k) = (areas.shape.max_tokens, areas.shape.topk);
    let mut own = Vec::new();
    for le in 0..areas.shape.experts_per_rank(r_n) {
        let (begin, n) = handle.layout_range[le * r_n + me];
        for row in (begin..begin + n).map(|j| le * r_n * m + j as usize) {
            own.push((
                handle.src_info[row] as usize * k + handle.src_slot[row] as usize,
                row,
            ));
        }
    }
    own
}

/// The row sets a combine's reduction reads, and the (source, row) of each
/// (token, slot).
type Located<'a> = (Vec<Rows<'a>>, Vec<(u32, u32)>);

/// What a combine's receive waited for: each packet from another node (its landing
/// area), which same-node sources left our rows in their combine buffer, and what the
/// waits acquired.
struct CombineArrivals {
    landed: Vec<Option<Area<u8>>>,
    in_place: Vec<bool>,
    seen: crate::wait::Seen,
}

impl Ctx {
    /// The send half of one low-latency combine (see
    /// [`crate::Buffer::low_latency_combine_send`]), numbered in `st`.
    pub(crate) fn ll_combine_send_call(
        &self,
        st: &mut LlState,
        y: LlCombineInput<'_>,
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
    ) -> Result<LlCombinePending> {
        let seq = st.combine.wrapping_add(1);
        self.check_ll_combine(seq, y, topk_idx, topk_weights, handle)?;
        check_window(&st.combine_unreceived, seq, ("combine", "combines"))?;
        self.ll_call_begins();
        st.combine = seq;
        let pending = self.ll_combine_send(seq, y, topk_idx, topk_weights, handle, &mut st.key)?;
        st.combine_unreceived[seq as usize % LL_BUFFERS] = Some(seq);
        Ok(pending)
    }

    /// The receive half of a low-latency combine (see
    /// [`crate::Buffer::low_latency_combine_recv`]).
    pub(crate) fn ll_combine_recv_call(
        &self,
        st: &mut LlState,
        pending: &LlCombinePending,
        y: LlCombineInput<'_>,
        out: &mut [bf16],
    ) -> Result<()> {
        let c = pending.seq as usize % LL_BUFFERS;
        if st.combine_unreceived[c] != Some(pending.seq) {
            return Err(invalid!(
                "low-latency combine {} was received already",
                pending.seq
            ));
        }
        if pending.zero_copy != matches!(y, LlCombineInput::ZeroCopy) {
            return Err(invalid!(
                "low-latency combine receive: pass the send half's input (zero-copy or rows) again"
            ));
        }
        let y = self.ll_combine_rows(y, pending.seq, &mut st.key)?;
        self.ll_combine_recv(pending, y, out)?;
        st.combine_unreceived[c] = None;
        Ok(())
    }

    /// The next combine's buffer (see [`crate::Buffer::low_latency_combine_buffer`]),
    /// once the combine that last used it is done with it. Only for a caller that holds
    /// the Buffer mutably, for as long as the slice lives.
    pub(crate) fn next_combine_buffer<'a>(&'a self, st: &'a mut LlState) -> Result<&'a mut [bf16]> {
        let area = self.ll_next_combine_area(st)?.ok_or_else(|| {
            invalid!(
                "the next low-latency combine buffer is still read by a combine that was never received (call its hook first)"
            )
        })?;
        // The proxy and the node's ranks read the buffer only for a combine sent from it,
        // and that one is done with it (waited above).
        let rows: &mut [u16] = self.symm.exclusive(area, &mut st.key)?;
        Ok(bytemuck::cast_slice_mut(rows))
    }

    /// The area of the next combine's buffer once it may be written again (its last
    /// combine's writes have left, and every live rank of the node received that
    /// combine), or `None` while that combine waits for this rank's own receive (which
    /// reads this rank's own rows from it).
    pub(crate) fn ll_next_combine_area(&self, st: &LlState) -> Result<Option<Area<u16>>> {
        let c = st.combine.wrapping_add(1) as usize % LL_BUFFERS;
        if st.combine_unreceived[c].is_some() {
            return Ok(None);
        }
        let areas = self.ll_areas(c)?;
        let wait = self.call_wait();
        // Nothing is read for a masked rank any more (its writes may never finish).
        let live = (0..self.topo.num_ranks).filter(|&r| r != self.topo.rank && !self.masked(r));
        // The combine that last used the buffer.
        let last = u64::from(st.combine.wrapping_add(1)).saturating_sub(LL_BUFFERS as u64);
        for r in live {
            if self.topo.is_local(r) {
                // A same-node source may be reading its rows from the buffer still.
                let received = self.map.control.ll_combine_received;
                let word = Word::at(r, received, c, Until::AtLeast(last))?;
                let what = || {
                    format!(
                        "rank {}: waiting for rank {r} to receive LL combine {last} before reusing combine buffer {c}",
                        self.topo.rank
                    )
                };
                let received = self.await_word(word, r, &wait, &what);
                self.unless_lost(r, received)?;
            } else if let Some(net) = &self.net {
                net.wait_sent(Channel::ll_combine(c), r, &wait)?;
            }
        }
        Ok(Some(areas.combine_send))
    }

    /// The expert outputs `input` names for combine `seq`: the caller's rows, or the
    /// combine buffer of `seq`'s area.
    /// The expert outputs a combine sends: the caller's rows, or (zero copy) the combine
    /// buffer, which this rank alone writes (`key`) and the proxy only reads.
    fn ll_combine_rows<'a>(
        &'a self,
        input: LlCombineInput<'a>,
        seq: u32,
        key: &'a mut Exclusive,
    ) -> Result<&'a [bf16]> {
        match input {
            LlCombineInput::Rows(y) => Ok(y),
            LlCombineInput::ZeroCopy => {
                let area = self.ll_areas(seq as usize % LL_BUFFERS)?.combine_send;
                let rows: &[u16] = self.symm.exclusive(area, key)?;
                Ok(bytemuck::cast_slice(rows))
            }
        }
    }

    fn check_ll_combine(
        &self,
        seq: u32,
        input: LlCombineInput<'_>,
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
    ) -> Result<()> {
        let s = self.ll_areas(handle.buffer)?.shape;
        let (r_n, k, h, m) = (self.topo.num_ranks, s.topk, s.hidden, s.max_tokens);
        let (epr, t_n) = (s.experts_per_rank(r_n), handle.num_tokens);
        if handle.buffer_id != self.id {
            return Err(invalid!(
                "the handle was made by another Buffer (or another rank)"
            ));
        }
        let y_len = match input {
            LlCombineInput::Rows(y) => y.len(),
            LlCombineInput::ZeroCopy => {
                self.ll_areas(seq as usize % LL_BUFFERS)?.combine_send.len()
            }
        };
        if y_len != epr * r_n * m * h {
            return Err(invalid!(
                "combine input has {} values, expected [E/R = {epr}, R*M = {}, hidden = {h}]",
                y_len,
                r_n * m
            ));
        }
        if topk_idx.len() != t_n * k || topk_weights.len() != t_n * k {
            return Err(invalid!(
                "topk_idx/topk_weights have {}/{} values, expected [tokens = {t_n}, topk = {k}]",
                topk_idx.len(),
                topk_weights.len()
            ));
        }
        if fingerprint(topk_idx) != handle.topk_hash {
            return Err(invalid!(
                "topk_idx differs from the one dispatched with this handle"
            ));
        }
        Ok(())
    }

    /// Send: each expert output row to its source's `[token, slot]` row on this node, or,
    /// for a source on another node, into a packet in (expert, row) order, which the
    /// source replays; then publish. Zero copy: no row moves here; the node's sources
    /// read theirs from the combine buffer (with each block's start, published before
    /// the epoch), and the packet's rows are written from it.
    fn ll_combine_send(
        &self,
        seq: u32,
        input: LlCombineInput<'_>,
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
        key: &mut Exclusive,
    ) -> Result<LlCombinePending> {
        let zero_copy = matches!(input, LlCombineInput::ZeroCopy);
        let y = self.ll_combine_rows(input, seq, key)?;
        let c = seq as usize % LL_BUFFERS;
        let areas = self.ll_areas(c)?;
        let ch = Channel::ll_combine(c);
        // Enter the combine: same-node peers may now write its area.
        let entered = self.map.control.ll_combine_entered;
        self.signal(&[Store::at(self.topo.rank, entered, 0, seq as u64)?])?;
        let at = (seq, ch, entered);
        let area = format!("combine area {c}");
        let sinks = self.ll_sinks(at, ("LL combine", &area), |src, wait| {
            self.ll_combine_remote(ch, src, handle, &areas, wait)
        })?;
        // A zero-copy combine moves no row here: the node's sources read theirs from the
        // combine buffer (told where each block starts), the other nodes' go from it.
        // The flag and the offsets are published with the combine's `done`.
        let me = self.topo.rank;
        let flag = |value| Store::at(me, self.map.control.ll_combine_zero_copy, c, value);
        if zero_copy {
            let begins: Vec<u32> = handle.layout_range.iter().map(|&(b, _)| b as u32).collect();
            self.write_area(me, areas.combine_begin, &begins)?;
            self.signal(&[flag(seq as u64)?])?;
        } else {
            self.signal(&[flag(0)?])?;
            self.ll_combine_pack(&sinks, handle, y, &areas)?;
        }
        let packets = self.ll_combine_publish(sinks, seq, handle, &areas, zero_copy)?;
        Ok(LlCombinePending {
            buffer_id: self.id,
            seq,
            num_tokens: handle.num_tokens,
            topk_idx: topk_idx.to_vec(),
            topk_weights: topk_weights.to_vec(),
            own: own_rows(handle, self.topo.rank, self.topo.num_ranks, &areas),
            y_len: y.len(),
            zero_copy,
            packets,
        })
    }

    /// The packet of a combine to `src` on another node: staged, its rows' area, and
    /// its fence groups of adjacent experts (each its own key and signal), under whose
    /// keys the kernel pushes each expert's block.
    fn ll_combine_remote(
        &self,
        ch: Channel,
        src: usize,
        handle: &LlHandle,
        areas: &LlAreas,
        wait: &crate::wait::Wait<'_>,
    ) -> Result<Box<CombineRemote>> {
        let (r_n, h) = (self.topo.num_ranks, areas.shape.hidden);
        let epr = areas.shape.experts_per_rank(r_n);
        let net = self.net()?;
        let mut staged = net.stage(ch, src, wait)?;
        let counts: Vec<usize> = (0..epr)
            .map(|le| handle.layout_range[le * r_n + src].1 as usize)
            .collect();
        let first: Vec<usize> = (counts.iter())
            .scan(0, |n, &c| Some(std::mem::replace(n, *n + c)))
            .collect();
        let groups = ll_combine_groups(&counts, 2 * h);
        let mut group_of = vec![0; epr];
        for (g, experts) in groups.iter().enumerate() {
            group_of[experts.clone()].fill(g);
        }
        net.fence_blocks(&mut staged, groups.len())?;
        let p = LlCombinePacket::layout(counts.iter().sum(), h).at_base(staged.area.offset());
        Ok(Box::new(CombineRemote {
            rows: p.rows,
            first,
            counts,
            groups,
            group_of,
            staged,
        }))
    }

    /// The pack phase on this Buffer's device (its descriptor: [`LlCombinePackPhase`]).
    fn ll_combine_pack(
        &self,
        sinks: &[LlCombineSink],
        handle: &LlHandle,
        y: &[bf16],
        areas: &LlAreas,
    ) -> Result<()> {
        let phase = LlCombinePackPhase {
            y,
            layout_range: &handle.layout_range,
            src_info: &handle.src_info,
            src_slot: &handle.src_slot,
            areas,
            rank: self.topo.rank,
            num_ranks: self.topo.num_ranks,
            sinks,
            memory: &self.symm,
        };
        let started = std::time::Instant::now();
        self.device.ll_combine_pack(&phase)?;
        if let Some(net) = &self.net {
            net.time_kernel(started.elapsed());
        }
        Ok(())
    }

    /// After the kernel: the epoch into each same-node source, and the signals of each
    /// other node's packet (with its blocks, from the combine buffer, in a zero-copy
    /// combine, where no kernel ran). Returns each packet's number among the fenced
    /// sends of its area to that peer (0 where none was sent).
    fn ll_combine_publish(
        &self,
        sinks: Vec<LlCombineSink>,
        seq: u32,
        handle: &LlHandle,
        areas: &LlAreas,
        zero_copy: bool,
    ) -> Result<Vec<u64>> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (m, h) = (areas.shape.max_tokens, areas.shape.hidden);
        let c = seq as usize % LL_BUFFERS;
        let mut packets = vec![0; r_n];
        for (r, sink) in sinks.into_iter().enumerate() {
            match sink {
                Sink::Skip => {}
                Sink::Peer(r) => {
                    let done = self.map.control.ll_combine_done;
                    self.signal(&[Store::at(r, done, c * r_n + me, seq as u64)?])?
                }
                Sink::Packet(remote) => {
                    let rows = remote.rows;
                    let mut blocks = vec![Vec::new(); remote.groups.len()];
                    for (g, experts) in remote.groups.iter().enumerate().filter(|_| zero_copy) {
                        for le in experts.clone().filter(|&le| remote.counts[le] > 0) {
                            let (first, n) = (remote.first[le], remote.counts[le]);
                            let row = le * r_n * m + handle.layout_range[le * r_n + r].0 as usize;
                            let from = areas.combine_send.rows(row..row + n, h)?;
                            let at = rows.rows(first..first + n, h)?;
                            blocks[g].push(remote.staged.write_from(from.cast(), at.cast())?);
                        }
                    }
                    packets[r] = self.net()?.send_fenced(remote.staged, &blocks)?;
                }
            }
        }
        Ok(packets)
    }

    /// Receive: wait for every source, then reduce each token's rows where they landed:
    /// this rank's own outputs in `y`, a same-node peer's in the combine rows, another
    /// node's where its packet landed (expert by expert, this rank's (token, slot)
    /// copies in order).
    fn ll_combine_recv(&self, p: &LlCombinePending, y: &[bf16], out: &mut [bf16]) -> Result<()> {
        let (seq, c) = (p.seq, p.seq as usize % LL_BUFFERS);
        let areas = self.ll_areas(c)?;
        let s = areas.shape;
        let r_n = self.topo.num_ranks;
        let (epr, k, h) = (s.experts_per_rank(r_n), s.topk, s.hidden);
        let t_n = p.num_tokens;
        if p.buffer_id != self.id || y.len() != p.y_len || out.len() != t_n * h {
            return Err(invalid!(
                "low-latency combine receive: pass the send half's Buffer and y ({} values), and an output of [tokens = {t_n}, hidden = {h}] (got y of {} and an output of {})",
                p.y_len,
                y.len(),
                out.len()
            ));
        }
        // `[E]`: this rank's copies routed to each expert.
        let mut per_expert = vec![0usize; r_n * epr];
        for &e in p.topk_idx.iter().filter(|&&e| e >= 0) {
            per_expert[e as usize] += 1;
        }
        let arrivals = self.ll_combine_arrivals(p, &areas, &per_expert)?;
        // Elastic mode: every survivor leaves out the same experts' outputs.
        let masked = match &self.elastic {
            Some(_) => {
                let m = self.agree(&format!("LL combine {seq}"), true)?;
                self.note_combine_mask(&m);
                m
            }
            None => vec![false; r_n],
        };
        let (sources, from) =
            self.ll_combine_sources(p, y, &areas, &arrivals, &masked, &per_expert)?;
        let (idx, w) = (&p.topk_idx, &p.topk_weights);
        let kept = |i: usize| idx[i] >= 0 && !masked[idx[i] as usize / epr];
        let mut starts = Vec::with_capacity(t_n + 1);
        let mut parts = Vec::with_capacity(t_n * k);
        for t in 0..t_n {
            starts.push(parts.len() as u32);
            parts.extend((t * k..(t + 1) * k).filter(|&i| kept(i)).map(|i| Part {
                source: from[i].0,
                row: from[i].1,
                weight: w[i],
            }));
        }
        starts.push(parts.len() as u32);
        let phase = ReducePhase {
            hidden: h,
            sources: &sources,
            starts: &starts,
            parts: &parts,
            weighted: true,
            memory: Symmetric::new(&self.symm, self.symm.published(&arrivals.seen)),
        };
        self.device.reduce(&phase, out)?;
        // Same-node sources may rewrite the combine buffers read above.
        let received = self.map.control.ll_combine_received;
        self.signal(&[Store::at(self.topo.rank, received, c, u64::from(seq))?])
    }

    /// Wait for every live source's expert outputs of combine `p`: a same-node source's
    /// epoch (and whether it left our rows in its combine buffer), the count signals of
    /// each fence group of a packet from another node.
    fn ll_combine_arrivals(
        &self,
        p: &LlCombinePending,
        areas: &LlAreas,
        per_expert: &[usize],
    ) -> Result<CombineArrivals> {
        let (seq, c) = (p.seq, p.seq as usize % LL_BUFFERS);
        let (r_n, me, h) = (self.topo.num_ranks, self.topo.rank, areas.shape.hidden);
        let epr = areas.shape.experts_per_rank(r_n);
        let wait = self.call_wait();
        let ch = Channel::ll_combine(c);
        let mut landed = vec![None; r_n];
        // `[src]`: a same-node source that left our rows in its combine buffer.
        let mut in_place = vec![false; r_n];
        // What the waits acquired (this rank's own publication at least: it is never
        // masked, and its own rows travel through its combine area too).
        let mut seen = None;
        for (src, landed) in landed.iter_mut().enumerate() {
            if self.masked(src) {
                continue;
            }
            let what = || {
                format!("rank {me}: LL combine {seq}: waiting for rank {src}'s expert outputs (ll_combine_done[{c}][{src}])")
            };
            if self.topo.is_local(src) {
                let done = self.map.control.ll_combine_done;
                let word = Word::at(me, done, c * r_n + src, Until::AtLeast(seq as u64))?;
                let done = self.await_word(word, src, &wait, &what);
                if let Some(done) = self.unless_lost(src, done)? {
                    if src != me {
                        let flag = self.map.control.ll_combine_zero_copy.slice(c..c + 1)?;
                        in_place[src] = self.read_published(src, flag, &done)?[0] == u64::from(seq);
                    }
                    seen.get_or_insert(done);
                }
            } else if p.packets[src] > 0 {
                // A group of the source's experts is usable once its own count signal
                // is in; the groups are cut from counts both sides know.
                let net = self.net()?;
                let groups = ll_combine_groups(per_expert.row(src, epr), 2 * h);
                let arrived = groups
                    .iter()
                    .enumerate()
                    .try_for_each(|(g, experts)| {
                        let what = || {
                            format!("rank {me}: LL combine {seq}: waiting for rank {src}'s outputs of its experts {experts:?} (fence key {g} of combine buffer {c})")
                        };
                        let n = net.next_fenced(ch, src, g)?;
                        net.wait_fenced(ch, src, g, n, &wait, &what)
                    })
                    .and_then(|()| net.areas().landing(ch, src));
                *landed = self.unless_lost(src, arrived)?;
            }
        }
        // Every source published its rows for this combine (its epoch, or the count
        // signals of its blocks); they write this combine area again only for combine
        // seq + LL_BUFFERS, which follows this rank's next combine.
        let seen = seen.ok_or_else(|| {
            EpError::internal(format!("rank {me}: LL combine {seq} waited for no source"))
        })?;
        Ok(CombineArrivals {
            landed,
            in_place,
            seen,
        })
    }

    /// Where each (token, slot)'s expert output is, as (source, row) of the returned
    /// sources: this rank's own rows in `y`, a same-node source's in its combine rows or
    /// (zero copy) its combine buffer, another node's in the landed packet; the masked
    /// sources' are left out by the reduction.
    fn ll_combine_sources<'a>(
        &'a self,
        p: &LlCombinePending,
        y: &'a [bf16],
        areas: &LlAreas,
        arrivals: &CombineArrivals,
        masked: &[bool],
        per_expert: &[usize],
    ) -> Result<Located<'a>> {
        let s = areas.shape;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, k, h, t_n) = (s.experts_per_rank(r_n), s.topk, s.hidden, p.num_tokens);
        let CombineArrivals {
            landed, in_place, ..
        } = arrivals;
        let area = areas.combine_x.rows(0..t_n * k, h)?;
        let mut sources = vec![Rows::Symmetric { rank: me, area }, Rows::Tensor(y)];
        let mut from: Vec<(u32, u32)> = (0..t_n * k).map(|i| (0, i as u32)).collect();
        for &(i, row) in &p.own {
            from[i] = (1, row as u32);
        }
        for (src, at) in landed.iter().enumerate() {
            let (Some(at), false) = (at, masked[src]) else {
                continue;
            };
            let n = per_expert.row(src, epr).iter().sum();
            // Every block of ours in the packet was signalled (waited for); the source
            // writes this landing area again only with its next combine packet of this
            // area, after this rank's next combines.
            let area = LlCombinePacket::layout(n, h).at_base(at.offset()).rows;
            let source = sources.len() as u32;
            sources.push(Rows::Symmetric { rank: me, area });
            let mut j = 0;
            for e in (src * epr) as i64..((src + 1) * epr) as i64 {
                for (i, _) in p.topk_idx.iter().enumerate().filter(|(_, &v)| v == e) {
                    from[i] = (source, j);
                    j += 1;
                }
            }
        }
        for src in (0..r_n).filter(|&r| in_place[r] && !masked[r]) {
            let begins = self.read_published(src, areas.combine_begin, &arrivals.seen)?;
            // The source published this combine (its epoch, acquired by the wait, after
            // its rows and block offsets); it writes its combine buffer again only once
            // this rank says it received this combine (`ll_combine_received`).
            let area = areas.combine_send;
            let source = sources.len() as u32;
            sources.push(Rows::Symmetric { rank: src, area });
            let block = self.topo.num_ranks * s.max_tokens;
            for le in 0..epr {
                // Our copies to expert `e` are its rows from `begin` on, in (token, slot)
                // order, as the dispatch packed them.
                let (e, begin) = ((src * epr + le) as i64, begins[le * r_n + me] as usize);
                let mine = p.topk_idx.iter().enumerate().filter(|(_, &v)| v == e);
                for (row, (i, _)) in (le * block + begin..).zip(mine) {
                    if (row + 1) * h > area.len() {
                        return Err(EpError::internal(format!(
                            "rank {src}'s combine buffer has no row {row} for rank {me}"
                        )));
                    }
                    from[i] = (source, row as u32);
                }
            }
        }
        Ok((sources, from))
    }
}
