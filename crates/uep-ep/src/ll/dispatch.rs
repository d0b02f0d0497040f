//! Low-latency dispatch: send (enter → cast → pack → signal), then receive
//! (wait → agree → unpack: pack to the front).

use std::time::Instant;

use half::bf16;

use super::{check_window, LlDispatchArgs, LlDispatchOutput, LlHandle, LlPending, LlState};
use crate::area::{Area, Mem, SliceRows};
use crate::config::Shape;
use crate::ctx::Ctx;
use crate::device::pack::{kernel_pushes_rows, DispatchRemote, LlLanded, LlSink, LlTokens, Sink};
use crate::device::{
    CastPhase, Device, LlPackPhase, LlPlacePhase, LlPlacement, LlUnpackPhase, Store, Until, Word,
};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::LlAreas;
use crate::packet::{Channel, LlDispatchPacket, LL_BUFFERS};
use crate::quant::Cast;
use crate::tokens::{RecvTokens, TokenFormat};
use crate::wait::{epoch_word, Seen};

/// The rows to send, cast once per token (not once per copy): bf16 as given, or codes
/// with their scale words (FP8, NVFP4).
struct Rows<'a> {
    x: &'a [bf16],
    hidden: usize,
    format: TokenFormat,
    /// Bytes of one sent row.
    row_bytes: usize,
    /// Cast: `[T, row_bytes]` codes and `[T, words]` scale words.
    cast: Option<(Vec<u8>, Vec<f32>)>,
}

impl<'a> Rows<'a> {
    /// The rows of `x`, cast by `device`'s cast phase.
    fn cast(
        device: &dyn Device,
        x: &'a [bf16],
        hidden: usize,
        cast: Option<Cast>,
    ) -> Result<Rows<'a>> {
        let format = cast.map_or(TokenFormat::Bf16, |c| c.format());
        let (row_bytes, words) = (format.row_bytes(hidden), format.scale_words(hidden));
        let tokens = x.len() / hidden.max(1);
        let cast = match cast {
            Some(cast) => {
                let (mut q, mut scales) =
                    (vec![0u8; tokens * row_bytes], vec![0f32; tokens * words]);
                let phase = CastPhase { x, hidden, cast };
                device.cast(&phase, &mut q, &mut scales)?;
                Some((q, scales))
            }
            None => None,
        };
        Ok(Rows {
            x,
            hidden,
            format,
            row_bytes,
            cast,
        })
    }

    /// The rows as the pack phase reads them.
    fn tokens(&self) -> LlTokens<'_> {
        match &self.cast {
            Some((q, scales)) => LlTokens {
                bytes: q,
                row_bytes: self.row_bytes,
                scales,
                scale_words: self.format.scale_words(self.hidden),
            },
            None => LlTokens::bf16(self.x, self.hidden),
        }
    }
}

impl Ctx {
    /// The low-latency areas of buffer `b`.
    pub(crate) fn ll_areas(&self, b: usize) -> Result<LlAreas> {
        self.map.ll.map(|ll| ll[b % LL_BUFFERS]).ok_or_else(|| {
            invalid!("this Buffer has no low-latency buffers (its config has no low-latency shape)")
        })
    }

    fn check_ll_dispatch(&self, s: Shape, args: &LlDispatchArgs<'_>) -> Result<()> {
        let (x, topk_idx) = (args.x, args.topk_idx);
        let (k, h, m) = (s.topk, s.hidden, s.max_tokens);
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
        if let Some(w) = args.topk_weights {
            if w.len() != topk_idx.len() {
                return Err(invalid!(
                    "topk_weights has {} values, expected [tokens = {t_n}, topk = {k}]",
                    w.len()
                ));
            }
        }
        if args.cast.is_some() && h % 128 != 0 {
            return Err(invalid!(
                "a low-latency cast needs hidden to be a multiple of 128, got {h}"
            ));
        }
        if topk_idx.len() != t_n * k {
            return Err(invalid!(
                "topk_idx has {} values, expected [tokens = {t_n}, topk = {k}]",
                topk_idx.len()
            ));
        }
        Ok(())
    }

    /// The send half of one low-latency dispatch (see
    /// [`crate::Buffer::low_latency_dispatch_send`]), numbered in `st`.
    pub(crate) fn ll_send(&self, st: &mut LlState, args: LlDispatchArgs<'_>) -> Result<LlPending> {
        let shape = self.ll_areas(0)?.shape;
        self.check_ll_dispatch(shape, &args)?;
        // The routing's own checks are the placement's, before the call begins.
        let place = self.device.ll_place(&LlPlacePhase {
            topk_idx: args.topk_idx,
            topk: shape.topk,
            num_experts: shape.num_experts,
            num_ranks: self.topo.num_ranks,
            max_rows: shape.max_tokens,
            rank: self.topo.rank,
        })?;
        let seq = st.dispatch.wrapping_add(1);
        let b = seq as usize % LL_BUFFERS;
        check_window(&st.unreceived, seq, ("dispatch", "dispatches"))?;
        self.ll_call_begins();
        st.dispatch = seq;
        // The outputs of step seq - 2 that someone still holds leave that bank: peers
        // may write it once this rank entered seq.
        if let Some(banks) = &mut st.banks {
            banks[(seq as usize + 1) % LL_BUFFERS].reclaim()?;
        }
        let pending = self.ll_send_step(seq, args, &place)?;
        st.unreceived[b] = Some(seq);
        Ok(pending)
    }

    /// The send half of step `seq`, in phases: enter → cast, while the host opens the
    /// sinks → pack → signal.
    fn ll_send_step(
        &self,
        seq: u32,
        args: LlDispatchArgs<'_>,
        place: &LlPlacement,
    ) -> Result<LlPending> {
        let x = args.x;
        let b = seq as usize % LL_BUFFERS;
        let areas = self.ll_areas(b)?;
        let s = areas.shape;
        let t_n = x.len() / s.hidden;
        // Enter the step: same-node peers may now write its buffer (see the module docs).
        let me = self.topo.rank;
        self.signal(&[Store::at(me, self.map.control.ll_entered, 0, seq as u64)?])?;
        let format = args.cast.map_or(TokenFormat::Bf16, |c| c.format());
        let open_sinks = || self.ll_open_sinks(seq, &areas, place, format);
        let device = &*self.device;
        // The cast runs while the host waits for the buffer's release and stages the
        // packets, which it does not touch.
        let (rows, sinks) = match args.cast {
            Some(_) => {
                device.overlapped(|| Rows::cast(device, x, s.hidden, args.cast), open_sinks)?
            }
            None => (Rows::cast(device, x, s.hidden, None)?, open_sinks()?),
        };
        self.ll_pack(&sinks, &areas, &args, place, &rows)?;
        let packets = self.ll_signal(sinks, seq, &areas, place, rows.row_bytes)?;
        Ok(LlPending {
            buffer_id: self.id,
            seq,
            buffer: b,
            num_tokens: t_n,
            format: rows.format,
            weighted: args.topk_weights.is_some(),
            topk_hash: place.fingerprint,
            packets,
        })
    }

    /// Where every rank's copies go: a same-node peer's rows (once it released the
    /// buffer), or a packet staged for a peer on another node; `Skip` for a masked rank
    /// (elastic mode), which gets nothing.
    fn ll_open_sinks(
        &self,
        seq: u32,
        areas: &LlAreas,
        place: &LlPlacement,
        format: TokenFormat,
    ) -> Result<Vec<LlSink>> {
        let b = seq as usize % LL_BUFFERS;
        let r_n = self.topo.num_ranks;
        let s = areas.shape;
        let (row_bytes, words) = (format.row_bytes(s.hidden), format.scale_words(s.hidden));
        let (epr, k) = (s.experts_per_rank(r_n), s.topk);
        let ch = Channel::ll_dispatch(b);
        let at = (seq, ch, self.map.control.ll_entered);
        let area = format!("buffer {b}");
        self.ll_sinks(at, ("LL dispatch", &area), |r, wait| {
            let mut staged = self.net()?.stage(ch, r, wait)?;
            let (row_of, n) = (place.row_of(r).to_vec(), place.rows[r]);
            let p = LlDispatchPacket::layout(epr, n as usize, k, row_bytes, words)
                .at_base(staged.area.offset());
            staged.fit_fence(p.rows.len(), self.device.lanes())?;
            let local = self.symm.local();
            local.put(p.counts, place.counts_of(r, epr))?;
            local.put(p.tokens, &[n])?;
            Ok(Box::new(DispatchRemote {
                packet: p,
                row_of,
                staged,
            }))
        })
    }

    /// The pack phase on this Buffer's device (its descriptor: [`LlPackPhase`]).
    fn ll_pack(
        &self,
        sinks: &[LlSink],
        areas: &LlAreas,
        args: &LlDispatchArgs<'_>,
        place: &LlPlacement,
        rows: &Rows<'_>,
    ) -> Result<()> {
        let phase = LlPackPhase {
            tokens: rows.tokens(),
            topk_idx: args.topk_idx,
            topk_weights: args.topk_weights,
            pos: &place.pos,
            areas,
            rank: self.topo.rank,
            num_ranks: self.topo.num_ranks,
            sinks,
            memory: &self.symm,
        };
        let started = Instant::now();
        self.device.ll_pack(&phase)?;
        if let Some(net) = &self.net {
            net.time_kernel(started.elapsed());
        }
        Ok(())
    }

    /// After every row (the launch joined every kernel thread): one count per (expert,
    /// receiver) into a same-node peer, or the packet to a peer on another node.
    /// Returns each packet's number among the fenced sends of its buffer to that peer
    /// (0 where none was sent).
    fn ll_signal(
        &self,
        sinks: Vec<LlSink>,
        seq: u32,
        areas: &LlAreas,
        place: &LlPlacement,
        row_bytes: usize,
    ) -> Result<Vec<u64>> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let epr = areas.shape.experts_per_rank(r_n);
        let mut packets = vec![0; r_n];
        for (r, sink) in sinks.into_iter().enumerate() {
            match sink {
                Sink::Skip => {}
                Sink::Peer(r) => {
                    let counts = place.counts_of(r, epr).iter().enumerate();
                    let stores = counts
                        .map(|(le, &c)| {
                            Store::at(r, areas.count_of(le, me, r_n)?, 0, epoch_word(seq, c))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    self.signal(&stores)?;
                }
                Sink::Packet(remote) => {
                    let DispatchRemote {
                        packet: p, staged, ..
                    } = *remote;
                    // One fence key per (buffer, source): the packet carries each token
                    // once for all its experts here, and is unpacked whole. The kernel
                    // pushed the rows; the rest (counts, ids, slots, scales) goes with
                    // the signal, which counts the rows' writes.
                    let head = match kernel_pushes_rows(row_bytes) {
                        true => p.rows.offset() - staged.area.offset(),
                        false => p.len,
                    };
                    let rest = staged.write_of(staged.area.prefix(head)?)?;
                    packets[r] = self.net()?.send_fenced(staged, &[vec![rest]])?;
                }
            }
        }
        Ok(packets)
    }

    /// The receive half of a low-latency dispatch (see
    /// [`crate::Buffer::low_latency_dispatch_recv`]).
    pub(crate) fn ll_recv(&self, st: &mut LlState, pending: &LlPending) -> Result<Received> {
        if pending.buffer_id != self.id {
            return Err(invalid!(
                "the low-latency dispatch to receive was sent by another Buffer"
            ));
        }
        if st.unreceived[pending.buffer] != Some(pending.seq) {
            return Err(invalid!(
                "low-latency dispatch {} was received already",
                pending.seq
            ));
        }
        let out = self.ll_recv_step(pending)?;
        st.unreceived[pending.buffer] = None;
        Ok(out)
    }

    /// The receive half of a step, in phases: wait for every source's counts → agree on
    /// the mask (elastic mode) → unpack every expert's rows to the front
    /// ([`LlUnpackPhase`]).
    fn ll_recv_step(&self, pending: &LlPending) -> Result<Received> {
        let (seq, b) = (pending.seq, pending.buffer);
        let areas = self.ll_areas(b)?;
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m) = (areas.shape.experts_per_rank(r_n), areas.shape.max_tokens);
        let Arrivals {
            mut counts,
            landed,
            wait_ns,
            seen,
        } = self.ll_wait_counts(pending, &areas)?;
        // Every survivor uses the same mask: what arrived from a source masked anywhere
        // is dropped.
        let masked = match &self.elastic {
            Some(_) => self.agree(&format!("LL dispatch {seq}"), false)?,
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
        let h = areas.shape.hidden;
        let packed = self.device.ll_unpack(&LlUnpackPhase {
            areas: &areas,
            num_ranks: r_n,
            counts: &counts,
            landed: &landed,
            row_bytes: pending.format.row_bytes(h),
            scale_words: pending.format.scale_words(h),
            weighted: pending.weighted,
            memory: &self.symm,
        })?;
        Ok((
            LlHandle {
                buffer_id: self.id,
                seq,
                buffer: b,
                num_tokens: pending.num_tokens,
                src_info: packed.src_info,
                src_slot: packed.src_slot,
                src_weight: packed.src_weight,
                layout_range: packed.layout_range,
                recv_count: packed.recv_count,
                format: pending.format,
                topk_hash: pending.topk_hash,
                masked,
            },
            wait_ns,
            seen,
        ))
    }

    /// What arrived from every source not masked (see [`Arrivals`]).
    fn ll_wait_counts(&self, pending: &LlPending, areas: &LlAreas) -> Result<Arrivals> {
        let (seq, b) = (pending.seq, pending.buffer);
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let epr = areas.shape.experts_per_rank(r_n);
        let wait = self.call_wait();
        let ch = Channel::ll_dispatch(b);
        let mut counts = vec![0u32; epr * r_n];
        let mut landed: Vec<Option<LlLanded>> = (0..r_n).map(|_| None).collect();
        let mut wait_ns = vec![0u64; r_n];
        let mut seen = None;
        for src in (0..r_n).filter(|&s| !self.masked(s)) {
            let start = Instant::now();
            if self.topo.is_local(src) {
                let words = (0..epr)
                    .map(|le| Word::at(me, areas.count_of(le, src, r_n)?, 0, Until::Epoch(seq)))
                    .collect::<Result<Vec<_>>>()?;
                let got = self.await_words(&words, src, &wait, &|le| {
                    format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s count for local expert {le} (ll_count[{b}][{le}][{src}])")
                });
                for (le, c) in self
                    .unless_lost(src, got)?
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    counts[le * r_n + src] = seen.insert(c).value() as u32;
                }
            } else {
                // Its packet of this step is numbered as ours to it; none if it was
                // masked when we sent.
                let n = pending.packets[src];
                if n == 0 {
                    continue;
                }
                let net = self.net()?;
                let landing = net
                    .wait_fenced(ch, src, 0, n, &wait, &|| {
                        format!("rank {me}: LL dispatch {seq}: waiting for rank {src}'s rows (fence of buffer {b})")
                    })
                    .and_then(|()| net.areas().landing(ch, src));
                let Some(landing) = self.unless_lost(src, landing)? else {
                    continue;
                };
                let l = self.ll_read_packet(src, landing.offset(), areas.shape, pending.format)?;
                for (le, copies) in l.by_expert.iter().enumerate() {
                    counts[le * r_n + src] = copies.len() as u32;
                }
                landed[src] = Some(l);
            }
            wait_ns[src] = start.elapsed().as_nanos() as u64;
        }
        // This rank's own counts were waited for (it is never masked, and has experts).
        let seen = seen.ok_or_else(|| {
            EpError::internal(format!("rank {me}: LL dispatch {seq} waited for no count"))
        })?;
        Ok(Arrivals {
            counts,
            landed,
            wait_ns,
            seen,
        })
    }

    /// Reads and checks the packet from `src` that landed at byte `base`.
    fn ll_read_packet(
        &self,
        src: usize,
        base: usize,
        s: Shape,
        format: TokenFormat,
    ) -> Result<LlLanded> {
        let (r_n, me) = (self.topo.num_ranks, self.topo.rank);
        let (epr, m, k, h) = (s.experts_per_rank(r_n), s.max_tokens, s.topk, s.hidden);
        let (groups, row_bytes) = (format.scale_words(h), format.row_bytes(h));
        let local = self.symm.local();
        let bad = |what: String| crate::protocol!("rank {src}'s LL packet for rank {me}: {what}");
        let head = LlDispatchPacket::layout(epr, 0, 0, 0, 0).at_base(base);
        let header = local.get_vec(head.counts)?;
        let n = local.get_vec(head.tokens)?[0] as usize;
        if n > m {
            return Err(bad(format!(
                "{n} tokens, more than the {m} a rank may send"
            )));
        }
        let p = LlDispatchPacket::layout(epr, n, k, row_bytes, groups).at_base(base);
        let (ids, slots) = (local.get_vec(p.ids)?, local.get_vec(p.slots)?);
        let by_expert = copies_by_expert(&header, &ids, &slots, m).map_err(bad)?;
        let (scales, weights) = (local.get_vec(p.scales)?, local.get_vec(p.weights)?);
        Ok(LlLanded {
            packet: p,
            by_expert,
            scales,
            weights,
        })
    }

    /// The output areas of the LL dispatch `handle` describes: all rows, and the
    /// column-major scales (empty for bf16).
    pub(crate) fn ll_output_areas(&self, handle: &LlHandle) -> Result<(Area<u8>, Area<f32>)> {
        let areas = self.ll_areas(handle.buffer)?;
        let s = areas.shape;
        let rows = s.experts_per_rank(self.topo.num_ranks) * self.topo.num_ranks * s.max_tokens;
        let (rb, groups) = (
            handle.format.row_bytes(s.hidden),
            handle.format.scale_words(s.hidden),
        );
        Ok((
            areas.recv_x.prefix(rows * rb)?,
            areas.out_scales.prefix(rows * groups)?,
        ))
    }

    /// The outputs of a received dispatch, borrowing the Buffer.
    pub(crate) fn ll_output<'a>(
        &'a self,
        st: &'a mut LlState,
        (handle, wait_ns, seen): Received,
    ) -> Result<LlDispatchOutput<'a>> {
        let (x, scales) = self.ll_output_areas(&handle)?;
        // Every source signalled its counts for this step, so its rows are written; peers
        // write this buffer again only for step seq + LL_BUFFERS, which needs this rank to
        // enter a later step first (the Buffer held mutably).
        let published = self.symm.published(&seen);
        let (x, scales) = (published.view(x)?, published.view(scales)?);
        let recv_x = RecvTokens::from_bytes(handle.format, x, scales);
        // The next combine's buffer, once its last combine is done with it.
        let combine_buffer = match self.ll_next_combine_area(st)? {
            Some(area) => Some(bytemuck::cast_slice_mut(
                self.symm.exclusive(area, &mut st.key)?,
            )),
            None => None,
        };
        Ok(LlDispatchOutput {
            recv_x,
            recv_count: handle.recv_count.clone(),
            handle,
            wait_ns,
            combine_buffer,
        })
    }
}

/// A received dispatch: its handle, how long each source was waited for, and what the
/// waits acquired (to read the outputs with).
pub(crate) type Received = (LlHandle, Vec<u64>, Seen);

/// What an LL receive's first phase found.
struct Arrivals {
    /// `[E/R, R]` rows from each source (zero from one found gone here).
    counts: Vec<u32>,
    /// `[R]` the packet of each source on another node.
    landed: Vec<Option<LlLanded>>,
    /// `[R]` how long the wait for each source took.
    wait_ns: Vec<u64>,
    /// What the waits acquired: every source published its rows.
    seen: Seen,
}

/// The receiver's reading of a packet's tokens: for each of `header.len()` local experts,
/// (row in the packet, token * K + slot) of each copy, in (token, slot) order, which is
/// the order the sender numbered them in. `ids` are the tokens' source indices
/// (ascending, below `m`), `slots` their `[n, K]` local experts. Checks everything a
/// peer wrote; the error says what is wrong.
fn copies_by_expert(
    header: &[u32],
    ids: &[i32],
    slots: &[i32],
    m: usize,
) -> std::result::Result<Vec<Vec<(u32, i32)>>, String> {
    let epr = header.len();
    let k = slots.len().checked_div(ids.len()).unwrap_or(0);
    if k * ids.len() != slots.len() {
        return Err(format!("{} slots for {} tokens", slots.len(), ids.len()));
    }
    let mut by_expert = vec![Vec::new(); epr];
    let mut last = -1i64;
    for (i, &t) in ids.iter().enumerate() {
        if i64::from(t) <= last || t as usize >= m {
            return Err(format!("token {t} after {last} (ascending, below {m})"));
        }
        last = t.into();
        for (slot, &le) in slots.row(i, k).iter().enumerate() {
            if le < -1 || le >= epr as i32 {
                return Err(format!("local expert {le} is outside [-1, {epr})"));
            }
            if le >= 0 {
                by_expert[le as usize].push((i as u32, (t as usize * k + slot) as i32));
            }
        }
    }
    let copies: Vec<u32> = by_expert.iter().map(|c| c.len() as u32).collect();
    if copies != header {
        return Err(format!(
            "its counts announced {header:?} copies per expert but it carries {copies:?}"
        ));
    }
    Ok(by_expert)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::pack::{on_rank, slots_on};
    use proptest::prelude::*;

    /// `[T, K]` routings over `ranks` ranks of `epr` experts, `-1` slots and repeats
    /// included.
    fn routing() -> impl Strategy<Value = (usize, usize, usize, Vec<i64>)> {
        (1usize..5, 1usize..4, 1usize..4).prop_flat_map(|(k, epr, ranks)| {
            let e = (epr * ranks) as i64;
            let idx = prop::collection::vec(-1..e, 0..12 * k).prop_map(move |mut v| {
                v.truncate(v.len() / k * k);
                v
            });
            (Just(k), Just(epr), Just(ranks), idx)
        })
    }

    proptest! {
        /// What a sender packs for a peer on another node reads back, expert by expert,
        /// as the copies in the order the sender numbered them ([`LlPlacement`]).
        #[test]
        fn a_packet_reads_back_in_placement_order((k, epr, ranks, topk_idx) in routing()) {
            let phase = LlPlacePhase {
                topk_idx: &topk_idx,
                topk: k,
                num_experts: epr * ranks,
                num_ranks: ranks,
                max_rows: usize::MAX,
                rank: 0,
            };
            let place = crate::device::HostDevice::new(1).ll_place(&phase).unwrap();
            for r in 0..ranks {
                let (mut ids, mut slots) = (Vec::new(), Vec::new());
                for (t, chosen) in topk_idx.chunks(k).enumerate() {
                    if chosen.iter().any(|&e| on_rank(e, r, epr)) {
                        let mut row = vec![0; k];
                        slots_on(chosen, r, epr, &mut row);
                        ids.push(t as i32);
                        slots.extend(row);
                    }
                }
                let got = copies_by_expert(place.counts_of(r, epr), &ids, &slots, 12).unwrap();
                for (le, copies) in got.iter().enumerate() {
                    for (p, &(i, code)) in copies.iter().enumerate() {
                        let code = code as usize;
                        prop_assert_eq!(topk_idx[code], (r * epr + le) as i64);
                        prop_assert_eq!(place.pos[code] as usize, p);
                        prop_assert_eq!(ids[i as usize] as usize, code / k);
                    }
                }
            }
        }

        /// Whatever a peer wrote, reading it fails with a reason or yields copies that
        /// name only its tokens' rows; it never panics.
        #[test]
        fn any_packet_is_read_or_refused(
            header in prop::collection::vec(0u32..6, 1..4),
            ids in prop::collection::vec(-2i32..20, 0..6),
            slots in prop::collection::vec(-3i32..5, 0..24),
        ) {
            if let Ok(got) = copies_by_expert(&header, &ids, &slots, 16) {
                for copies in &got {
                    for &(i, code) in copies {
                        prop_assert!((i as usize) < ids.len() && code >= 0);
                    }
                }
            }
        }
    }
}
