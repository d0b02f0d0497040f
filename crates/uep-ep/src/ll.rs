//! Low-latency (LL) dispatch and combine: decode-sized batches, fixed layouts.
//!
//! Dispatch sends each (token, slot) to its expert's rank, no dedup, optionally cast
//! to FP8 on the way (one f32 scale per 128 channels). The receiver's layout is fixed
//! and pre-sized, `[E/R, R * M, H]`: source `s` owns rows `s*M..(s+1)*M` of every
//! local expert, so senders need no offsets from anyone and no count exchange comes
//! before the data. After the rows, a sender publishes one *count signal* per
//! (expert, receiver): the epoch and how many rows it wrote. Once every source's
//! signal is in, the receiver packs each expert's rows to the front (sources ascending,
//! `(token, slot)` order inside a source), so `recv_x[e][..recv_count[e]]` is dense.
//!
//! Two buffers alternate between steps: step `n` uses buffer `n % 2`, so step `n+1`
//! may start while step `n`'s views are read. Before writing buffer `b` of a peer, a
//! sender checks that the peer has entered step `n-1`, i.e. is done with step `n-2`,
//! the last user of `b`.
//!
//! Combine returns each expert output row to its source's `[token, slot]` row; the
//! source computes `sum_k w_k * y_k` in f32, in slot order, and rounds once.

use std::sync::atomic::Ordering;

use half::bf16;

use crate::buffer::{Buffer, RecvTokens};
use crate::device::{epoch_word, wait_at_least, wait_epoch};
use crate::error::Result;
use crate::invalid;
use crate::quant::{quantize_token, reduce_rows};
use crate::symm::{packet, Channel};

/// Where one kernel stores the copies bound for one rank: a same-node peer's slots
/// (`first` = None), or a staging packet whose expert `le` starts at row `first[le]`.
struct LlSink {
    region: uep_shm::Region,
    x: usize,
    scales: usize,
    src: usize,
    first: Option<Vec<usize>>,
}

/// Where every packed LL row came from; [`Buffer::low_latency_combine`] needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlHandle {
    pub(crate) buffer_id: u64,
    pub(crate) seq: u32,
    /// Which of the two buffers this step used.
    pub buffer: usize,
    /// Tokens this rank dispatched.
    pub num_tokens: usize,
    /// `[E/R, R*M]`: source token of each packed row (`-1` past the count).
    pub src_info: Vec<i32>,
    /// `[E/R, R*M]`: top-k slot that produced each packed row (`-1` past the count).
    pub src_slot: Vec<i32>,
    /// `[E/R, R]`: (begin, count) of each source's block among an expert's rows.
    pub layout_range: Vec<(i32, i32)>,
    /// `[E/R]`: rows received per local expert.
    pub recv_count: Vec<i32>,
    /// Fingerprint of the `topk_idx` dispatched, so combine can check it gets the same.
    pub(crate) topk_hash: u64,
}

/// What [`Buffer::low_latency_dispatch`] returns; slices live until the Buffer's next call.
#[derive(Debug)]
pub struct LlDispatchOutput<'b> {
    /// `[E/R, R*M, H]`: rows `..recv_count[e]` of expert `e` are valid.
    pub recv_x: RecvTokens<'b>,
    /// `[E/R]` valid rows per local expert.
    pub recv_count: Vec<i32>,
    /// For combine.
    pub handle: LlHandle,
}

fn fingerprint(topk_idx: &[i64]) -> u64 {
    // FNV-1a: cheap, and only guards against passing another step's routing.
    topk_idx.iter().fold(0xcbf2_9ce4_8422_2325, |h, &v| {
        (h ^ v as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Buffer {
    /// Low-latency dispatch of `x` (`[T, H]` bf16) by `topk_idx` (`[T, K]`), optionally
    /// cast to FP8 (`round_scale`: power-of-two scales). Collective.
    pub fn low_latency_dispatch(
        &mut self,
        x: &[bf16],
        topk_idx: &[i64],
        use_fp8: bool,
        round_scale: bool,
    ) -> Result<LlDispatchOutput<'_>> {
        self.ensure_usable()?;
        if let Err(e) = self.check_ll_dispatch(x, topk_idx, use_fp8) {
            return self.fail(e);
        }
        let (r_n, me, e_n, k, h) = (
            self.num_ranks,
            self.rank,
            self.cfg.num_experts,
            self.cfg.topk,
            self.cfg.hidden,
        );
        let (epr, m) = (e_n / r_n, self.cfg.num_max_ll_tokens_per_rank);
        let t_n = x.len() / h;
        self.ll_seq = self.ll_seq.wrapping_add(1);
        let seq = self.ll_seq;
        let b = (seq % 2) as usize;
        let map = self.map.clone();
        let areas = map.ll[b];
        let until = self.until()?;
        self.symm
            .local()
            .atomic_u64(map.ll_entered)?
            .store(seq as u64, Ordering::Release);

        // Row of each (token, slot) inside its (expert, me) block, in (token, slot) order.
        let mut per_expert = vec![0u32; e_n];
        let mut pos = vec![u32::MAX; t_n * k];
        for (p, &e) in pos.iter_mut().zip(topk_idx) {
            if e >= 0 {
                *p = per_expert[e as usize];
                per_expert[e as usize] += 1;
            }
        }
        // Cast once per token, not once per copy.
        let groups = h / 128;
        let (row_bytes, mut q, mut scales) = if use_fp8 {
            (h, vec![0u8; t_n * h], vec![0f32; t_n * groups])
        } else {
            (h * 2, Vec::new(), Vec::new())
        };
        if use_fp8 {
            for t in 0..t_n {
                quantize_token(
                    &x[t * h..(t + 1) * h],
                    round_scale,
                    &mut q[t * h..(t + 1) * h],
                    &mut scales[t * groups..(t + 1) * groups],
                );
            }
        }
        let ch = Channel::ll_dispatch(b);
        // Where copies for each rank go: the same-node peer's slots for this source, or
        // this rank's staging packet for a peer on another node (experts ascending).
        let mut sinks = Vec::with_capacity(r_n);
        for r in 0..r_n {
            if self.is_local(r) {
                let region = self.peer_region(r)?;
                // Buffer b of rank r was last used by step seq-2; r must have moved past it.
                wait_at_least(region.atomic_u64(map.ll_entered)?, seq as u64 - 1, until.watching(r, self.peer_pid(r)), || {
                    format!("rank {me}: LL dispatch {seq}: waiting for rank {r} to release buffer {b}")
                })
                .map_err(|e| self.explain_abort(e))
                .or_else(|e| self.fail(e))?;
                sinks.push(LlSink {
                    region,
                    x: areas.recv_x,
                    scales: areas.recv_scales,
                    src: areas.recv_src,
                    first: None,
                });
            } else {
                self.reclaim(ch, r, until)?;
                let counts = &per_expert[r * epr..(r + 1) * epr];
                let sec = packet::ll_dispatch(
                    epr,
                    counts.iter().sum::<u32>() as usize,
                    row_bytes,
                    groups,
                );
                let base = map.net.staging(ch, r);
                self.symm
                    .local()
                    .write(base + sec.at[0], bytemuck::cast_slice(counts))?;
                let first = counts.iter().scan(0usize, |acc, &c| {
                    let f = *acc;
                    *acc += c as usize;
                    Some(f)
                });
                sinks.push(LlSink {
                    region: *self.symm.local(),
                    x: base + sec.at[3],
                    scales: base + sec.at[1],
                    src: base + sec.at[2],
                    first: Some(first.collect()),
                });
            }
        }
        self.device.launch(t_n, |range| {
            for t in range {
                for s in 0..k {
                    let e = topk_idx[t * k + s];
                    if e < 0 {
                        continue;
                    }
                    let (r, le) = (e as usize / epr, e as usize % epr);
                    let sink = &sinks[r];
                    let pos = pos[t * k + s] as usize;
                    let row = match &sink.first {
                        None => le * r_n * m + me * m + pos,
                        Some(first) => first[le] + pos,
                    };
                    if use_fp8 {
                        sink.region
                            .write(sink.x + row * row_bytes, &q[t * h..(t + 1) * h])?;
                        sink.region.write(
                            sink.scales + row * groups * 4,
                            bytemuck::cast_slice(&scales[t * groups..(t + 1) * groups]),
                        )?;
                    } else {
                        sink.region.write(
                            sink.x + row * row_bytes,
                            bytemuck::cast_slice(&x[t * h..(t + 1) * h]),
                        )?;
                    }
                    sink.region
                        .write(sink.src + row * 4, &((t * k + s) as i32).to_le_bytes())?;
                }
            }
            Ok(())
        })?;
        // Count signals, after all rows (the launch joined every kernel thread).
        for (r, sink) in sinks.iter().enumerate() {
            if sink.first.is_none() {
                for le in 0..epr {
                    let word = epoch_word(seq, per_expert[r * epr + le]);
                    sink.region
                        .atomic_u64(map.ll_count_at(b, le, me))?
                        .store(word, Ordering::Release);
                }
            } else if let Some(first) = &sink.first {
                // Each expert's rows straight into their block at the receiver (one write
                // per expert: the per-expert batching of the reference), then the packet.
                let counts = &per_expert[r * epr..(r + 1) * epr];
                let direct: Vec<(usize, usize, usize)> = (0..epr)
                    .filter(|&le| counts[le] > 0)
                    .map(|le| {
                        (
                            sink.x + first[le] * row_bytes,
                            areas.recv_x + (le * r_n * m + me * m) * row_bytes,
                            counts[le] as usize * row_bytes,
                        )
                    })
                    .collect();
                let n = counts.iter().sum::<u32>() as usize;
                let sec = packet::ll_dispatch(epr, n, row_bytes, groups);
                self.send_staged_with(ch, r, sec.at[3], &direct)?;
            }
        }
        let mut counts = vec![0u32; epr * r_n];
        for src in 0..r_n {
            if self.is_local(src) {
                for le in 0..epr {
                    let at = map.ll_count_at(b, le, src);
                    counts[le * r_n + src] =
                        wait_epoch(self.symm.local().atomic_u64(at)?, seq, until.watching(src, self.peer_pid(src)), || {
                            format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s count for local expert {le} (ll_count[{b}][{le}][{src}])")
                        })
                        .map_err(|e| self.explain_abort(e))
                        .or_else(|e| self.fail(e))?;
                }
            } else {
                self.wait_packet(src, until, || {
                    format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s rows")
                })?;
                let base = map.net.landing(ch, src);
                let local = *self.symm.local();
                let mut header = vec![0u32; epr];
                local.read(base, bytemuck::cast_slice_mut(&mut header))?;
                let total: usize = header.iter().map(|&c| c as usize).sum();
                if header.iter().any(|&c| c as usize > m) || total > m * k.min(epr) {
                    return self.fail(invalid!("rank {src} announced {header:?} rows for rank {me}'s experts; at most {m} each"));
                }
                let sec = packet::ll_dispatch(epr, total, row_bytes, groups);
                let mut first = 0;
                // The rows themselves went straight into their blocks.
                for (le, &c) in header.iter().enumerate() {
                    let (n, row) = (c as usize, le * r_n * m + src * m);
                    if use_fp8 {
                        local.copy_from(
                            areas.recv_scales + row * groups * 4,
                            &local,
                            base + sec.at[1] + first * groups * 4,
                            n * groups * 4,
                        )?;
                    }
                    local.copy_from(
                        areas.recv_src + row * 4,
                        &local,
                        base + sec.at[2] + first * 4,
                        n * 4,
                    )?;
                    counts[le * r_n + src] = c;
                    first += n;
                }
            }
            for le in 0..epr {
                if counts[le * r_n + src] as usize > m {
                    return self.fail(invalid!(
                        "rank {src} sent {} rows to expert {} of rank {me}, more than the {m} it may send",
                        counts[le * r_n + src],
                        me * epr + le
                    ));
                }
            }
        }

        // Pack each expert's blocks to the front, sources ascending (moves only go down).
        let local = self.symm.local();
        let mut layout_range = vec![(0i32, 0i32); epr * r_n];
        let mut recv_count = vec![0i32; epr];
        let rows_per_expert = r_n * m;
        let mut src_info = vec![-1i32; epr * rows_per_expert];
        let mut src_slot = vec![-1i32; epr * rows_per_expert];
        for le in 0..epr {
            let mut base = 0usize;
            for src in 0..r_n {
                let n = counts[le * r_n + src] as usize;
                let (from, to) = (le * rows_per_expert + src * m, le * rows_per_expert + base);
                if n > 0 && from != to {
                    local.copy_from(
                        areas.recv_x + to * row_bytes,
                        local,
                        areas.recv_x + from * row_bytes,
                        n * row_bytes,
                    )?;
                    if use_fp8 {
                        local.copy_from(
                            areas.recv_scales + to * groups * 4,
                            local,
                            areas.recv_scales + from * groups * 4,
                            n * groups * 4,
                        )?;
                    }
                }
                let codes: &[i32] = self.symm.view(areas.recv_src + from * 4, n)?;
                for (i, &code) in codes.iter().enumerate() {
                    src_info[to + i] = code / k as i32;
                    src_slot[to + i] = code % k as i32;
                }
                layout_range[le * r_n + src] = (base as i32, n as i32);
                base += n;
            }
            recv_count[le] = base as i32;
        }
        let rows = epr * rows_per_expert;
        let recv_x = self.recv_tokens(areas.recv_x, areas.recv_scales, rows, use_fp8)?;
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: recv_count.clone(),
            handle: LlHandle {
                buffer_id: self.id,
                seq,
                buffer: b,
                num_tokens: t_n,
                src_info,
                src_slot,
                layout_range,
                recv_count,
                topk_hash: fingerprint(topk_idx),
            },
        })
    }

    fn check_ll_dispatch(&self, x: &[bf16], topk_idx: &[i64], use_fp8: bool) -> Result<()> {
        let (e_n, k, h) = (self.cfg.num_experts, self.cfg.topk, self.cfg.hidden);
        let m = self.cfg.num_max_ll_tokens_per_rank;
        if m == 0 {
            return Err(invalid!(
                "this Buffer has no low-latency buffers (num_max_ll_tokens_per_rank = 0)"
            ));
        }
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
                self.rank
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
                        self.rank
                    ));
                }
            }
        }
        Ok(())
    }

    /// Low-latency combine: expert outputs `y` (`[E/R, R*M, H]` bf16, laid out like the
    /// dispatch's `recv_x`) back to their tokens, weighted by `topk_weights` (`[T, K]`),
    /// with the same `topk_idx` as the dispatch of `handle`. Returns `[T, H]`. Collective.
    pub fn low_latency_combine(
        &mut self,
        y: &[bf16],
        topk_idx: &[i64],
        topk_weights: &[f32],
        handle: &LlHandle,
    ) -> Result<Vec<bf16>> {
        self.ensure_usable()?;
        let (r_n, me, e_n, k, h) = (
            self.num_ranks,
            self.rank,
            self.cfg.num_experts,
            self.cfg.topk,
            self.cfg.hidden,
        );
        let (epr, m) = (e_n / r_n, self.cfg.num_max_ll_tokens_per_rank);
        let t_n = handle.num_tokens;
        let check = || -> Result<()> {
            if handle.buffer_id != self.id {
                return Err(invalid!(
                    "the handle was made by another Buffer (or another rank)"
                ));
            }
            if y.len() != epr * r_n * m * h {
                return Err(invalid!(
                    "combine input has {} values, expected [E/R = {epr}, R*M = {}, hidden = {h}]",
                    y.len(),
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
        };
        if let Err(e) = check() {
            return self.fail(e);
        }
        let map = self.map.clone();
        let areas = map.ll[handle.buffer];
        let seq = handle.seq;
        let until = self.until()?;
        let ch = Channel::ll_combine(handle.buffer);
        // Rows for a same-node source go to its [token, slot] rows; for a source on another
        // node, into a staging packet in (expert, row) order, which the source can replay.
        let mut sinks = Vec::with_capacity(r_n);
        for src in 0..r_n {
            if self.is_local(src) {
                sinks.push((self.peer_region(src)?, None));
            } else {
                self.reclaim(ch, src, until)?;
                let mut first = Vec::with_capacity(epr);
                let mut n = 0;
                for le in 0..epr {
                    first.push(n);
                    n += handle.layout_range[le * r_n + src].1 as usize;
                }
                sinks.push((
                    *self.symm.local(),
                    Some((map.net.staging(ch, src), first, n)),
                ));
            }
        }
        self.device.launch(epr, |experts| {
            for le in experts {
                for (src, (region, staged)) in sinks.iter().enumerate() {
                    if src == me {
                        // Read straight from `y` by the reduction.
                        continue;
                    }
                    let (begin, n) = handle.layout_range[le * r_n + src];
                    for j in begin as usize..(begin + n) as usize {
                        let row = le * r_n * m + j;
                        let (t, s) = (handle.src_info[row] as usize, handle.src_slot[row] as usize);
                        let at = match staged {
                            None => areas.combine_x + (t * k + s) * h * 2,
                            Some((base, first, _)) => {
                                base + (first[le] + j - begin as usize) * h * 2
                            }
                        };
                        region.write(at, bytemuck::cast_slice(&y[row * h..(row + 1) * h]))?;
                    }
                }
            }
            Ok(())
        })?;
        for (src, (region, staged)) in sinks.iter().enumerate() {
            match staged {
                None => region
                    .atomic_u64(map.ll_combine_done + 8 * (handle.buffer * r_n + me))?
                    .store(seq as u64, Ordering::Release),
                Some((_, _, n)) => self.send_staged(ch, src, packet::ll_combine(*n, h).len)?,
            }
        }
        for src in 0..r_n {
            let what = || {
                format!("rank {me}: LL combine {seq}: waiting for rank {src}'s expert outputs (ll_combine_done[{}][{src}])", handle.buffer)
            };
            if self.is_local(src) {
                self.wait_local(
                    map.ll_combine_done + 8 * (handle.buffer * r_n + src),
                    seq as u64,
                    src,
                    until,
                    what,
                )?;
                continue;
            }
            self.wait_packet(src, until, what)?;
        }
        // Where each (token, slot)'s expert output is: this rank's own in `y`, a
        // same-node peer's in the combine rows, another node's where its packet landed
        // (expert by expert, this rank's (token, slot) copies in order).
        let rows: &[u16] = self.symm.view(areas.combine_x, t_n * k * h)?;
        let y_bits: &[u16] = bytemuck::cast_slice(y);
        let mut from: Vec<&[u16]> = (0..t_n * k).map(|i| &rows[i * h..(i + 1) * h]).collect();
        for le in 0..epr {
            let (begin, n) = handle.layout_range[le * r_n + me];
            for row in (begin..begin + n).map(|j| le * r_n * m + j as usize) {
                let i = handle.src_info[row] as usize * k + handle.src_slot[row] as usize;
                from[i] = &y_bits[row * h..(row + 1) * h];
            }
        }
        for src in (0..r_n).filter(|&s| !self.is_local(s)) {
            let experts = (src * epr) as i64..((src + 1) * epr) as i64;
            let n = topk_idx.iter().filter(|e| experts.contains(e)).count();
            let landed: &[u16] = self.symm.view(
                map.net.landing(ch, src) + packet::ll_combine(n, h).at[0],
                n * h,
            )?;
            let mut j = 0;
            for e in experts {
                for (i, _) in topk_idx.iter().enumerate().filter(|(_, &v)| v == e) {
                    from[i] = &landed[j * h..(j + 1) * h];
                    j += 1;
                }
            }
        }
        let mut out = vec![bf16::ZERO; t_n * h];
        self.device.launch_rows(&mut out, h, |first, out| {
            let mut parts = Vec::with_capacity(k);
            for (t, out_row) in (first..).zip(out.chunks_exact_mut(h)) {
                parts.clear();
                for s in (0..k).filter(|&s| topk_idx[t * k + s] >= 0) {
                    parts.push((from[t * k + s], topk_weights[t * k + s]));
                }
                reduce_rows(&parts, true, out_row);
            }
            Ok(())
        })?;
        Ok(out)
    }
}
