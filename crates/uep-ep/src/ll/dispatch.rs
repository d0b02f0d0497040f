//! Low-latency dispatch: send (enter → quantise → pack → signal), then receive
//! (wait → pack to the front).

#![allow(unsafe_code)]

use std::sync::atomic::Ordering;
use std::time::Instant;

use half::bf16;
use uep_shm::Region;

use super::{fingerprint, LlDispatchOutput, LlHandle, LlPending};
use crate::area::{Area, Mem};
use crate::buffer::Buffer;
use crate::config::Shape;
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::LlAreas;
use crate::net::packet::{Channel, LlDispatchPacket, LL_BUFFERS};
use crate::net::{Staged, Write};
use crate::quant::quantize_token;
use crate::tokens::RecvTokens;
use crate::wait::epoch_word;

/// Where one rank's copies go: a same-node peer's rows for this source (`first` None),
/// or this rank's staged packet, expert `le` starting at row `first[le]`.
struct LlSink<'a> {
    region: &'a Region,
    x: Area<u8>,
    scales: Area<f32>,
    codes: Area<i32>,
    first: Option<Vec<usize>>,
    staged: Option<Staged>,
}

/// Where every packed row came from (the handle's tables).
struct Packed {
    layout_range: Vec<(i32, i32)>,
    recv_count: Vec<i32>,
    src_info: Vec<i32>,
    src_slot: Vec<i32>,
}

/// Where each copy goes inside its (expert, source) block: copies numbered per expert in
/// (token, slot) order.
struct Placement {
    /// `[E]` copies per expert.
    per_expert: Vec<u32>,
    /// `[T * K]` each copy's row in its expert's block (`u32::MAX` for a `-1` slot).
    pos: Vec<u32>,
}

impl Placement {
    fn of(topk_idx: &[i64], num_experts: usize) -> Placement {
        let mut per_expert = vec![0u32; num_experts];
        let mut pos = vec![u32::MAX; topk_idx.len()];
        for (p, &e) in pos.iter_mut().zip(topk_idx) {
            if e >= 0 {
                *p = per_expert[e as usize];
                per_expert[e as usize] += 1;
            }
        }
        Placement { per_expert, pos }
    }

    /// The counts of rank `r`'s `epr` experts.
    fn counts_of(&self, r: usize, epr: usize) -> &[u32] {
        &self.per_expert[r * epr..(r + 1) * epr]
    }
}

/// The rows to send, cast once per token (not once per copy): bf16 as given, or FP8
/// with a scale per 128 channels.
struct Rows<'a> {
    x: &'a [bf16],
    hidden: usize,
    /// Bytes of one sent row.
    row_bytes: usize,
    /// FP8: `[T, H]` codes and `[T, H/128]` scales.
    fp8: Option<(Vec<u8>, Vec<f32>)>,
}

impl<'a> Rows<'a> {
    fn quantise(x: &'a [bf16], hidden: usize, use_fp8: bool, round_scale: bool) -> Rows<'a> {
        let t_n = x.len() / hidden;
        let groups = hidden / 128;
        let fp8 = use_fp8.then(|| {
            let (mut q, mut scales) = (vec![0u8; t_n * hidden], vec![0f32; t_n * groups]);
            for t in 0..t_n {
                quantize_token(
                    &x[t * hidden..(t + 1) * hidden],
                    round_scale,
                    &mut q[t * hidden..(t + 1) * hidden],
                    &mut scales[t * groups..(t + 1) * groups],
                );
            }
            (q, scales)
        });
        Rows {
            x,
            hidden,
            row_bytes: if use_fp8 { hidden } else { 2 * hidden },
            fp8,
        }
    }

    /// Token `t`'s bytes as sent.
    fn row(&self, t: usize) -> &[u8] {
        let h = self.hidden;
        match &self.fp8 {
            Some((q, _)) => &q[t * h..(t + 1) * h],
            None => bytemuck::cast_slice(&self.x[t * h..(t + 1) * h]),
        }
    }

    /// Token `t`'s scales (FP8 only).
    fn scales(&self, t: usize) -> Option<&[f32]> {
        let g = self.hidden / 128;
        self.fp8.as_ref().map(|(_, s)| &s[t * g..(t + 1) * g])
    }
}

impl Buffer {
    /// The low-latency areas of buffer `b`.
    pub(crate) fn ll_areas(&self, b: usize) -> Result<LlAreas> {
        self.map.ll.map(|ll| ll[b % LL_BUFFERS]).ok_or_else(|| {
            invalid!("this Buffer has no low-latency buffers (its config has no low-latency shape)")
        })
    }

    /// Low-latency dispatch of `x` (`[T, H]` bf16) by `topk_idx` (`[T, K]`), optionally
    /// cast to FP8 (`round_scale`: power-of-two scales). Collective: the send half and
    /// the receive half together.
    pub fn low_latency_dispatch(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
        round_scale: bool,
    ) -> Result<LlDispatchOutput<'_>> {
        let pending = self.low_latency_dispatch_send(x, topk_idx, use_fp8, round_scale)?;
        self.low_latency_dispatch_recv(pending)
    }

    /// The send half of [`Buffer::low_latency_dispatch`]: returns once this rank's
    /// copies are on their way. Receive them with
    /// [`Buffer::low_latency_dispatch_recv`]; at most two dispatches may wait for it.
    pub fn low_latency_dispatch_send(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
        round_scale: bool,
    ) -> Result<LlPending> {
        self.collective(|b| b.ll_send(x, topk_idx, use_fp8, round_scale))
    }

    /// The receive half of a low-latency dispatch: waits for every source's copies and
    /// packs them. Collective (every rank receives the same step).
    pub fn low_latency_dispatch_recv(
        &mut self,
        pending: LlPending,
    ) -> Result<LlDispatchOutput<'_>> {
        let (handle, wait_ns) = self.collective(|b| b.ll_recv(&pending))?;
        self.ll_output(handle, wait_ns)
    }

    fn check_ll_dispatch(
        &self,
        s: Shape,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
    ) -> Result<()> {
        let (e_n, k, h, m) = (s.num_experts, s.topk, s.hidden, s.max_tokens);
        if x.len() % h != 0 {
            return Err(invalid!(
                "x has {} values, not a multiple of hidden = {h}",
                x.len()
            ));
        }
        let t_n = x.len() / h;
        if t_n > m {
            return Err(invalid!(
                "rank {} dispatches {t_n} tokens, more than num_max_dispatch_tokens_per_rank = {m} (low-latency)",
                self.topo.rank
            ));
        }
        if use_fp8 && h % 128 != 0 {
            return Err(invalid!(
                "FP8 needs hidden to be a multiple of 128, got {h}"
            ));
        }
        if topk_idx.len() != t_n * k {
            return Err(invalid!(
                "topk_idx has {} values, expected [tokens = {t_n}, topk = {k}]",
                topk_idx.len()
            ));
        }
        let mut per_expert = vec![0usize; e_n];
        for (i, &e) in topk_idx.iter().enumerate() {
            if e < -1 || e >= e_n as i64 {
                return Err(invalid!(
                    "topk_idx[{}][{}] = {e} is outside [-1, {e_n})",
                    i / k,
                    i % k
                ));
            }
            if e >= 0 {
                per_expert[e as usize] += 1;
                // Only a token naming one expert in several slots can get here.
                if per_expert[e as usize] > m {
                    return Err(invalid!(
                        "expert {e} gets more than {m} rows from rank {} (a token names it in several slots); \
                         low-latency mode has {m} rows per (expert, source)",
                        self.topo.rank
                    ));
                }
            }
        }
        Ok(())
    }

    fn ll_send(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
        round_scale: bool,
    ) -> Result<LlPending> {
        let shape = self.ll_areas(0)?.shape;
        self.check_ll_dispatch(shape, x, topk_idx, use_fp8)?;
        let seq = self.seq.ll.wrapping_add(1);
        let b = seq as usize % LL_BUFFERS;
        // Peers may write step seq + 1 once this rank entered seq, into the buffer of
        // step seq - 2: that step must have been received.
        let older = (seq as usize + 1) % LL_BUFFERS;
        if let Some(p) = self.seq.ll_unreceived[older].or(self.seq.ll_unreceived[b]) {
            return Err(invalid!(
                "low-latency dispatch {p} was never received: at most two low-latency dispatches may wait for their receive (call the hook of the older one first)"
            ));
        }
        self.seq.ll = seq;
        // ... and the outputs of step seq - 2 that someone still holds leave that bank.
        if let Some(banks) = &mut self.banks.ll {
            banks[older].reclaim()?;
        }
        let pending = self.ll_send_step(seq, x, topk_idx, use_fp8, round_scale)?;
        self.seq.ll_unreceived[b] = Some(seq);
        Ok(pending)
    }

    /// The send half of step `seq`, in phases: enter → quantise → open sinks → pack →
    /// signal.
    fn ll_send_step(
        &self,
        seq: u32,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
        round_scale: bool,
    ) -> Result<LlPending> {
        let b = seq as usize % LL_BUFFERS;
        let areas = self.ll_areas(b)?;
        let s = areas.shape;
        let t_n = x.len() / s.hidden;
        // Enter the step: same-node peers may now write its buffer (see the module docs).
        self.symm
            .local()
            .word(self.map.control.ll_entered, 0)?
            .store(seq as u64, Ordering::Release);
        let rows = Rows::quantise(x, s.hidden, use_fp8, round_scale);
        let place = Placement::of(topk_idx, s.num_experts);
        let sinks = self.ll_open_sinks(seq, &areas, &place, rows.row_bytes)?;
        self.ll_pack(&sinks, &areas, topk_idx, &place, &rows)?;
        self.ll_signal(sinks, seq, &areas, &place, rows.row_bytes)?;
        Ok(LlPending {
            buffer_id: self.id,
            seq,
            buffer: b,
            num_tokens: t_n,
            fp8: use_fp8,
            topk_hash: fingerprint(topk_idx),
        })
    }

    /// Where every rank's copies go: a same-node peer's rows (once it released the
    /// buffer), or a packet staged for a peer on another node; `None` for a masked rank
    /// (elastic mode), which gets nothing.
    fn ll_open_sinks(
        &self,
        seq: u32,
        areas: &LlAreas,
        place: &Placement,
        row_bytes: usize,
    ) -> Result<Vec<Option<LlSink<'_>>>> {
        let b = seq as usize % LL_BUFFERS;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let epr = areas.shape.experts_per_rank(r_n);
        let groups = areas.shape.hidden / 128;
        let wait = self.ll_wait();
        let ch = Channel::ll_dispatch(b);
        let mut sinks = Vec::with_capacity(r_n);
        for r in 0..r_n {
            if self.masked(r) {
                sinks.push(None);
            } else if self.topo.is_local(r) {
                let region = self.peer_region(r)?;
                // Buffer b of rank r was last used by step seq - 3; r moves past it when
                // it enters seq - 1.
                let word = region.word(self.map.control.ll_entered, 0)?;
                let released = wait.at_least(word, seq as u64 - 1, Some(self.peer(r)), &|| {
                    format!(
                        "rank {me}: LL dispatch {seq}: waiting for rank {r} to release buffer {b}"
                    )
                });
                if self.unless_lost(r, released)?.is_none() {
                    sinks.push(None);
                    continue;
                }
                // This source's block of every expert: rows `me*M..` of each.
                sinks.push(Some(LlSink {
                    region,
                    x: areas.recv_x,
                    scales: areas.recv_scales,
                    codes: areas.recv_src,
                    first: None,
                    staged: None,
                }));
            } else {
                let staged = self.net()?.stage(ch, r, &wait)?;
                let counts = place.counts_of(r, epr);
                let n = counts.iter().sum::<u32>() as usize;
                let p = LlDispatchPacket::layout(epr, n, row_bytes, groups)
                    .at_base(staged.area.offset());
                self.symm.local().put(p.counts, counts)?;
                let first = counts
                    .iter()
                    .scan(0usize, |acc, &c| {
                        let f = *acc;
                        *acc += c as usize;
                        Some(f)
                    })
                    .collect();
                sinks.push(Some(LlSink {
                    region: self.symm.local(),
                    x: p.rows,
                    scales: p.scales,
                    codes: p.codes,
                    first: Some(first),
                    staged: Some(staged),
                }));
            }
        }
        Ok(sinks)
    }

    /// The kernel: every (token, slot) copy into its place, in parallel over tokens.
    fn ll_pack(
        &self,
        sinks: &[Option<LlSink<'_>>],
        areas: &LlAreas,
        topk_idx: &[i64],
        place: &Placement,
        rows: &Rows<'_>,
    ) -> Result<()> {
        let s = areas.shape;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m, k, h) = (s.experts_per_rank(r_n), s.max_tokens, s.topk, s.hidden);
        let (groups, row_bytes) = (h / 128, rows.row_bytes);
        let t_n = topk_idx.len() / k.max(1);
        self.device.launch(t_n, |range| {
            for t in range {
                for slot in 0..k {
                    let e = topk_idx[t * k + slot];
                    if e < 0 {
                        continue;
                    }
                    let (r, le) = (e as usize / epr, e as usize % epr);
                    let Some(sink) = &sinks[r] else { continue };
                    let p = place.pos[t * k + slot] as usize;
                    let row = match &sink.first {
                        None => le * r_n * m + me * m + p,
                        Some(first) => first[le] + p,
                    };
                    sink.region.put(sink.x.row(row, row_bytes)?, rows.row(t))?;
                    if let Some(scales) = rows.scales(t) {
                        sink.region.put(sink.scales.row(row, groups)?, scales)?;
                    }
                    sink.region
                        .put(sink.codes.row(row, 1)?, &[(t * k + slot) as i32])?;
                }
            }
            Ok(())
        })
    }

    /// After every row (the launch joined every kernel thread): one count per (expert,
    /// receiver) into a same-node peer, or the packet to a peer on another node, each
    /// expert's rows written straight into their block there (one write per expert:
    /// the per-expert batching of the reference).
    fn ll_signal(
        &self,
        sinks: Vec<Option<LlSink<'_>>>,
        seq: u32,
        areas: &LlAreas,
        place: &Placement,
        row_bytes: usize,
    ) -> Result<()> {
        let s = areas.shape;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m) = (s.experts_per_rank(r_n), s.max_tokens);
        let groups = s.hidden / 128;
        let total = self.symm.local().len();
        for (r, sink) in sinks.into_iter().enumerate() {
            let Some(sink) = sink else { continue };
            let counts = place.counts_of(r, epr);
            match (sink.first, sink.staged) {
                (None, _) => {
                    for (le, &c) in counts.iter().enumerate() {
                        sink.region
                            .word(areas.count_of(le, me, r_n)?, 0)?
                            .store(epoch_word(seq, c), Ordering::Release);
                    }
                }
                (Some(first), Some(staged)) => {
                    let n = counts.iter().sum::<u32>() as usize;
                    let p = LlDispatchPacket::layout(epr, n, row_bytes, groups);
                    let mut direct = Vec::with_capacity(epr);
                    for (le, &c) in counts.iter().enumerate().filter(|(_, &c)| c > 0) {
                        let c = c as usize;
                        let block = le * r_n * m + me * m;
                        direct.push(Write::new(
                            sink.x.rows(first[le]..first[le] + c, row_bytes)?,
                            areas.recv_x.rows(block..block + c, row_bytes)?,
                            total,
                        )?);
                    }
                    self.net()?.send(staged, p.len, &direct)?;
                }
                (Some(_), None) => {
                    return Err(EpError::internal("an LL packet was not staged".into()))
                }
            }
        }
        Ok(())
    }

    fn ll_recv(&mut self, pending: &LlPending) -> Result<(LlHandle, Vec<u64>)> {
        if pending.buffer_id != self.id {
            return Err(invalid!(
                "the low-latency dispatch to receive was sent by another Buffer"
            ));
        }
        if self.seq.ll_unreceived[pending.buffer] != Some(pending.seq) {
            return Err(invalid!(
                "low-latency dispatch {} was received already",
                pending.seq
            ));
        }
        let out = self.ll_recv_step(pending)?;
        self.seq.ll_unreceived[pending.buffer] = None;
        Ok(out)
    }

    /// The receive half of a step, in phases: wait for every source's counts → agree on
    /// the mask (elastic mode) → pack each expert's rows to the front.
    fn ll_recv_step(&self, pending: &LlPending) -> Result<(LlHandle, Vec<u64>)> {
        let (seq, b) = (pending.seq, pending.buffer);
        let areas = self.ll_areas(b)?;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m) = (areas.shape.experts_per_rank(r_n), areas.shape.max_tokens);
        let (mut counts, wait_ns) = self.ll_wait_counts(pending, &areas)?;
        // Every survivor uses the same mask: what arrived from a source masked anywhere
        // is dropped.
        let masked = match &self.elastic {
            Some(_) => self.agree(&format!("LL dispatch {seq}"))?,
            None => vec![false; r_n],
        };
        for (i, c) in counts.iter_mut().enumerate() {
            if masked[i % r_n] {
                *c = 0;
            }
            if *c as usize > m {
                return Err(invalid!(
                    "rank {} sent {c} rows to expert {} of rank {me}, more than the {m} it may send",
                    i % r_n,
                    me * epr + i / r_n
                ));
            }
        }
        let packed = self.ll_pack_front(&areas, &counts, pending.fp8)?;
        Ok((
            LlHandle {
                buffer_id: self.id,
                seq,
                buffer: b,
                num_tokens: pending.num_tokens,
                src_info: packed.src_info,
                src_slot: packed.src_slot,
                layout_range: packed.layout_range,
                recv_count: packed.recv_count,
                fp8: pending.fp8,
                topk_hash: pending.topk_hash,
                masked,
            },
            wait_ns,
        ))
    }

    /// `[E/R, R]` counts from every source not masked (zero from one found gone here),
    /// and how long each wait took. A source on another node announced a packet: its
    /// rows went straight into their blocks, and its scales and codes join them here.
    fn ll_wait_counts(&self, pending: &LlPending, areas: &LlAreas) -> Result<(Vec<u32>, Vec<u64>)> {
        let (seq, b, use_fp8) = (pending.seq, pending.buffer, pending.fp8);
        let s = areas.shape;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m, k, h) = (s.experts_per_rank(r_n), s.max_tokens, s.topk, s.hidden);
        let (groups, row_bytes) = (h / 128, if use_fp8 { h } else { 2 * h });
        let local = self.symm.local();
        let wait = self.ll_wait();
        let ch = Channel::ll_dispatch(b);
        let mut counts = vec![0u32; epr * r_n];
        let mut wait_ns = vec![0u64; r_n];
        for src in (0..r_n).filter(|&s| !self.masked(s)) {
            let start = Instant::now();
            if self.topo.is_local(src) {
                for le in 0..epr {
                    let word = local.word(areas.count_of(le, src, r_n)?, 0)?;
                    let count = wait.epoch(word, seq, Some(self.peer(src)), &|| {
                        format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s count for local expert {le} (ll_count[{b}][{le}][{src}])")
                    });
                    match self.unless_lost(src, count)? {
                        Some(c) => counts[le * r_n + src] = c,
                        None => break,
                    }
                }
            } else {
                let landing = self.net()?.recv(ch, src, &wait, &|| {
                    format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s rows")
                });
                let Some(landing) = self.unless_lost(src, landing)? else {
                    continue;
                };
                let mut header = vec![0u32; epr];
                local.get(
                    LlDispatchPacket::layout(epr, 0, 0, 0)
                        .counts
                        .at_base(landing.offset()),
                    &mut header,
                )?;
                let total: usize = header.iter().map(|&c| c as usize).sum();
                if header.iter().any(|&c| c as usize > m) || total > m * k.min(epr) {
                    return Err(invalid!(
                        "rank {src} announced {header:?} rows for rank {me}'s experts; at most {m} each"
                    ));
                }
                let p = LlDispatchPacket::layout(epr, total, row_bytes, groups)
                    .at_base(landing.offset());
                let mut first = 0;
                for (le, &c) in header.iter().enumerate() {
                    let (n, block) = (c as usize, le * r_n * m + src * m);
                    if use_fp8 {
                        local.copy(
                            areas.recv_scales.rows(block..block + n, groups)?,
                            local,
                            p.scales.rows(first..first + n, groups)?,
                        )?;
                    }
                    local.copy(
                        areas.recv_src.slice(block..block + n)?,
                        local,
                        p.codes.slice(first..first + n)?,
                    )?;
                    counts[le * r_n + src] = c;
                    first += n;
                }
            }
            wait_ns[src] = start.elapsed().as_nanos() as u64;
        }
        Ok((counts, wait_ns))
    }

    /// Packs each expert's blocks to the front, sources ascending (moves only go
    /// down), the scales into their column-major place, and records where every row
    /// came from.
    fn ll_pack_front(&self, areas: &LlAreas, counts: &[u32], use_fp8: bool) -> Result<Packed> {
        let s = areas.shape;
        let r_n = self.topo.num_ranks;
        let (epr, m, k, h) = (s.experts_per_rank(r_n), s.max_tokens, s.topk, s.hidden);
        let (groups, row_bytes) = (h / 128, if use_fp8 { h } else { 2 * h });
        let local = self.symm.local();
        let rows_per_expert = r_n * m;
        let mut out = Packed {
            layout_range: vec![(0i32, 0i32); epr * r_n],
            recv_count: vec![0i32; epr],
            src_info: vec![-1i32; epr * rows_per_expert],
            src_slot: vec![-1i32; epr * rows_per_expert],
        };
        let mut block_scales = Vec::new();
        let mut column = Vec::new();
        for le in 0..epr {
            let mut base = 0usize;
            for src in 0..r_n {
                let n = counts[le * r_n + src] as usize;
                let (from, to) = (le * rows_per_expert + src * m, le * rows_per_expert + base);
                if n > 0 && from != to {
                    local.copy(
                        areas.recv_x.rows(to..to + n, row_bytes)?,
                        local,
                        areas.recv_x.rows(from..from + n, row_bytes)?,
                    )?;
                }
                if use_fp8 && n > 0 {
                    block_scales.resize(n * groups, 0f32);
                    local.get(
                        areas.recv_scales.rows(from..from + n, groups)?,
                        &mut block_scales,
                    )?;
                    for g in 0..groups {
                        column.clear();
                        column.extend((0..n).map(|i| block_scales[i * groups + g]));
                        let at = (le * groups + g) * rows_per_expert + base;
                        local.put(areas.out_scales.slice(at..at + n)?, &column)?;
                    }
                }
                let codes = local.get_vec(areas.recv_src.slice(from..from + n)?)?;
                for (i, &code) in codes.iter().enumerate() {
                    out.src_info[to + i] = code / k as i32;
                    out.src_slot[to + i] = code % k as i32;
                }
                out.layout_range[le * r_n + src] = (base as i32, n as i32);
                base += n;
            }
            out.recv_count[le] = base as i32;
        }
        Ok(out)
    }

    /// The output areas of the LL dispatch `handle` describes: all rows, and the
    /// column-major scales (empty for bf16).
    pub(crate) fn ll_output_areas(&self, handle: &LlHandle) -> Result<(Area<u8>, Area<f32>)> {
        let areas = self.ll_areas(handle.buffer)?;
        let s = areas.shape;
        let rows = s.experts_per_rank(self.topo.num_ranks) * self.topo.num_ranks * s.max_tokens;
        let rb = if handle.fp8 { s.hidden } else { 2 * s.hidden };
        let groups = if handle.fp8 { s.hidden / 128 } else { 0 };
        Ok((
            areas.recv_x.prefix(rows * rb)?,
            areas.out_scales.prefix(rows * groups)?,
        ))
    }

    fn ll_output(&self, handle: LlHandle, wait_ns: Vec<u64>) -> Result<LlDispatchOutput<'_>> {
        let (x, scales) = self.ll_output_areas(&handle)?;
        // SAFETY: every source signalled its counts for this step, so its rows are
        // written; peers write this buffer again only for step seq + LL_BUFFERS, which
        // needs this rank to enter a later step first (`&mut self`).
        let (x, scales) = unsafe { (self.symm.view(x)?, self.symm.view(scales)?) };
        let recv_x = RecvTokens::from_bytes(handle.fp8, x, scales);
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: handle.recv_count.clone(),
            handle,
            wait_ns,
        })
    }
}
