//! The layout of every rank's symmetric region, as typed areas.
//!
//! The region is the same on every rank (the Buffer checks that the ranks agree), so an
//! [`Area`] names the same field in every rank's memory, and a peer on the node writes
//! a row straight into its place in this rank's region. In order:
//!
//! | block | what | sized by |
//! |---|---|---|
//! | [`ControlAreas`] | pid, abort word and messages, barrier, per-source epochs | ranks |
//! | [`NormalAreas`] | notify slots, received rows (a page-aligned *bank*), combine rows, relay rows | normal shape |
//! | [`LlAreas`] ×3 | received rows and scales (a bank), count signals, combine rows | low-latency shape |
//! | [`NetAreas`] | tails, barrier and fence counters, staging and landing per channel and peer | both, several nodes only |
//!
//! A *bank* is a page-aligned block of output rows that can be mapped again on its own
//! and handed out as a tensor without copying (see `symm::Bank`).

use crate::area::{Area, Layout, ALIGN};
use crate::config::{BufferConfig, Shape};
use crate::packet::{
    Channel, CombinePacket, DispatchPacket, LlCombinePacket, LlDispatchPacket, NotifyHead,
    NotifyPacket, RowFormat, CHANNELS, LL_BUFFERS,
};
use crate::tokens::TokenFormat;

/// Room for the reason a failing rank leaves in its peers' regions.
pub const ABORT_MSG_BYTES: usize = 496;

/// Page size the banks are aligned to (the largest common one; a bank must start on a
/// page to be mapped on its own).
const BANK_ALIGN: usize = 64 * 1024;

/// Words every rank has, whatever the modes: liveness, failure and synchronisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlAreas {
    /// The owning process's id (peers on the node watch it while they wait).
    pub pid: Area<u64>,
    /// Word 0: the first rank that failed, + 1 (0: none). Padded to 16 bytes.
    pub abort: Area<u64>,
    /// `[src R]` messages of [`ABORT_MSG_BYTES`]: why each failing rank gave up (one
    /// slot a rank, so that several failing ranks do not mix words).
    pub abort_msg: Area<u8>,
    /// `[src R]` barrier sequence numbers.
    pub barrier: Area<u64>,
    /// On several nodes, the last barrier the node's leader finished with the others.
    pub barrier_release: Area<u64>,
    /// `[src R]` epoch: the source finished writing its dispatch rows here.
    pub dispatch_done: Area<u64>,
    /// `[src R]` epoch: the source finished writing its combine rows here.
    pub combine_done: Area<u64>,
    /// `[src R]` epoch: the source (a rank of this node) finished its relay rows here.
    pub relay_done: Area<u64>,
    /// The last low-latency step this rank entered (peers read it before reusing a buffer).
    pub ll_entered: Area<u64>,
    /// `[LL_BUFFERS][src R]` epoch: low-latency combine rows from the source have landed.
    pub ll_combine_done: Area<u64>,
    /// The last low-latency combine this rank entered (as `ll_entered`, for combine
    /// areas).
    pub ll_combine_entered: Area<u64>,
    /// `[LL_BUFFERS]`: the last combine of each area whose rows for this node this rank
    /// left in its combine buffer for the sources to read (zero copy; 0: it copied).
    pub ll_combine_zero_copy: Area<u64>,
    /// `[LL_BUFFERS]`: the last combine of each area this rank received (reduced):
    /// same-node peers rewrite a combine buffer it read from only after this says so.
    pub ll_combine_received: Area<u64>,
    /// `[2][src R][1 + 2W]` elastic mode's round messages from the ranks of this node,
    /// by round parity: a stamp, stored last, then the set and the view (`W = ceil(R /
    /// 64)` words each; see [`ControlAreas::agree_slot`] and `elastic`).
    pub agree: Area<u64>,
    /// `[src R][2 + W]` elastic mode's decided masks from the ranks of this node: the
    /// agreement's number, stored last, then the rounds and the set.
    pub decided: Area<u64>,
    /// `W`.
    pub mask_words: usize,
}

/// Fence keys of each kind of the network path: one per (LL buffer, local expert),
/// and, of the combine kind, one more for elastic mode's decided masks.
pub fn fence_keys(fence_experts: usize) -> usize {
    LL_BUFFERS * fence_experts + 1
}

/// Words of a rank mask: one bit a rank.
pub fn mask_words(num_ranks: usize) -> usize {
    num_ranks.div_ceil(64).max(1)
}

impl ControlAreas {
    fn new(l: &mut Layout, r: usize) -> ControlAreas {
        ControlAreas {
            pid: l.take(1),
            abort: l.take(2),
            abort_msg: l.take(r * ABORT_MSG_BYTES),
            barrier: l.take(r),
            barrier_release: l.take(1),
            dispatch_done: l.take(r),
            combine_done: l.take(r),
            relay_done: l.take(r),
            ll_entered: l.take(1),
            ll_combine_done: l.take(LL_BUFFERS * r),
            ll_combine_entered: l.take(1),
            ll_combine_zero_copy: l.take(LL_BUFFERS),
            ll_combine_received: l.take(LL_BUFFERS),
            agree: l.take(2 * r * (1 + 2 * mask_words(r))),
            decided: l.take(r * (2 + mask_words(r))),
            mask_words: mask_words(r),
        }
    }

    /// Rank `src`'s round message of round parity `parity`: `(stamp word, the rest)`.
    pub fn agree_slot(&self, parity: usize, src: usize) -> crate::Result<(Area<u64>, Area<u64>)> {
        let w = 1 + 2 * self.mask_words;
        let r = self.agree.len() / (2 * w);
        let slot = self.agree.row((parity % 2) * r + src, w)?;
        Ok((slot.prefix(1)?, slot.slice(1..w)?))
    }

    /// Rank `src`'s decided mask: `(agreement number word, the rest)`.
    pub fn decided_slot(&self, src: usize) -> crate::Result<(Area<u64>, Area<u64>)> {
        let w = 2 + self.mask_words;
        let slot = self.decided.row(src, w)?;
        Ok((slot.prefix(1)?, slot.slice(1..w)?))
    }

    /// Rank `src`'s abort message slot (16-byte aligned: the proxy copies it to ranks on
    /// other nodes).
    pub fn abort_msg_of(&self, src: usize) -> crate::Result<Area<u8>> {
        self.abort_msg.row(src, ABORT_MSG_BYTES)
    }
}

/// One rank's notify slot from one source: an epoch word, then the source's
/// [`NotifyPacket`] (head and counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotifySlot {
    /// The call's epoch, stored last (release).
    pub epoch: Area<u64>,
    /// The source's tokens.
    pub head: Area<NotifyHead>,
    /// `[R + E]` the source's counts.
    pub counts: Area<u32>,
}

/// A page-aligned block of output rows (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BankArea {
    /// The bytes of the block.
    pub bytes: Area<u8>,
}

/// One bank of normal-mode output rows: two alternate, dispatch `n` uses bank `n % 2`,
/// so that the outputs of the last dispatch stay valid while the next one runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalBank {
    /// The bytes of the bank (page-aligned).
    pub area: BankArea,
    /// `[R * T]` rows of x (sized for bf16; FP8 rows are packed at H bytes a row).
    pub recv_x: Area<u8>,
    /// `[R * T, H/128]` scales.
    pub recv_scales: Area<f32>,
    /// `[R * T, K]` local expert ids.
    pub recv_topk_idx: Area<i64>,
    /// `[R * T, K]` weights.
    pub recv_topk_weights: Area<f32>,
}

impl NormalBank {
    fn new(l: &mut Layout, s: Shape, rows: usize) -> NormalBank {
        l.align_to(BANK_ALIGN);
        let start = l.len();
        let recv_x = l.take(rows * s.hidden * 2);
        let recv_scales = l.take(rows * s.groups());
        let recv_topk_idx = l.take(rows * s.topk);
        let recv_topk_weights = l.take(rows * s.topk);
        l.align_to(BANK_ALIGN);
        NormalBank {
            area: BankArea {
                bytes: Area::new(start, l.len() - start),
            },
            recv_x,
            recv_scales,
            recv_topk_idx,
            recv_topk_weights,
        }
    }
}

/// Normal-mode areas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormalAreas {
    /// The shape they are sized for.
    pub shape: Shape,
    /// `[2 parities][src R]` notify slots of `slot_bytes`.
    notify: Area<u8>,
    slot_bytes: usize,
    /// The received rows, in two banks.
    pub banks: [NormalBank; 2],
    /// `[R * T]` source token index.
    pub recv_src_idx: Area<i32>,
    /// `[sending rank R][token T, H]` combine rows, by (sending rank, my token).
    pub combine_x: Area<u16>,
    /// `[R][T, K]` weights beside them.
    pub combine_weights: Area<f32>,
    /// Several nodes, on the relaying rank: `[source node][local rank][token T, H]` the
    /// node's expert outputs for that source's tokens, reduced here before one row
    /// crosses the network. Empty on one node.
    pub relay_x: Area<u16>,
    /// `[source node][local rank][T, K]` weights beside them.
    pub relay_weights: Area<f32>,
}

impl NormalAreas {
    fn new(l: &mut Layout, s: Shape, r: usize, multi_node: bool) -> NormalAreas {
        let (e, h, k, t) = (s.num_experts, s.hidden, s.topk, s.max_tokens);
        let slot_bytes = (8 + NotifyPacket::layout(r, e).len).div_ceil(ALIGN) * ALIGN;
        let notify = l.take(2 * r * slot_bytes);
        let rows = r * t;
        let banks = [NormalBank::new(l, s, rows), NormalBank::new(l, s, rows)];
        let relay_rows = if multi_node { rows } else { 0 };
        NormalAreas {
            shape: s,
            notify,
            slot_bytes,
            banks,
            recv_src_idx: l.take(rows),
            combine_x: l.take(rows * h),
            combine_weights: l.take(rows * k),
            relay_x: l.take(relay_rows * h),
            relay_weights: l.take(relay_rows * k),
        }
    }

    /// The bank dispatch number `seq` uses.
    pub fn bank(&self, seq: u32) -> &NormalBank {
        &self.banks[(seq % 2) as usize]
    }

    /// Notify slot (`parity`, `src`).
    pub fn notify_slot(
        &self,
        parity: usize,
        src: usize,
        num_ranks: usize,
    ) -> crate::Result<NotifySlot> {
        let base = self
            .notify
            .row(parity * num_ranks + src, self.slot_bytes)?
            .offset();
        let p = NotifyPacket::layout(num_ranks, self.shape.num_experts);
        Ok(NotifySlot {
            epoch: Area::new(base, 1),
            head: p.head.at_base(base + 8),
            counts: p.counts.at_base(base + 8),
        })
    }
}

/// One of the low-latency buffers (two, used in turn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlAreas {
    /// The shape they are sized for.
    pub shape: Shape,
    /// `recv_x` and `out_scales`, as one bank.
    pub bank: BankArea,
    /// `[E/R, R*M]` rows of x (sized for bf16; FP8 rows are packed at H bytes a row).
    pub recv_x: Area<u8>,
    /// `[E/R, words, R*M]` scale words of the packed rows, column-major as DeepEP
    /// returns them.
    pub out_scales: Area<f32>,
    /// `[E/R, R*M, words]` scale words as senders write them (row-major, by source
    /// block).
    pub recv_scales: Area<f32>,
    /// `[E/R, R*M]` token * K + slot of each row, as senders write them.
    pub recv_src: Area<i32>,
    /// `[E/R, R*M]` the gate weight of each row's (token, slot), as senders write them.
    pub recv_weight: Area<f32>,
    /// `[E/R][src R]` epoch|count signals.
    pub count: Area<u64>,
    /// `[M, K]` bf16 rows: expert outputs for my (token, slot) pairs.
    pub combine_x: Area<u16>,
    /// `[E/R, R*M, H]` bf16 expert outputs, written by the caller before a zero-copy
    /// combine (DeepEP's next combine buffer) and sent from here, with no staging copy.
    /// Only this rank writes it; the proxy and the node's ranks read it.
    pub combine_send: Area<u16>,
    /// `[E/R][src R]`: where each source's block starts among an expert's rows of the
    /// combine buffer (the handle's `layout_range`), for a same-node source that reads
    /// its rows from there.
    pub combine_begin: Area<u32>,
}

impl LlAreas {
    fn new(l: &mut Layout, s: Shape, r: usize) -> LlAreas {
        let (epr, h, m) = (s.experts_per_rank(r), s.hidden, s.max_tokens);
        let rows = epr * r * m;
        l.align_to(BANK_ALIGN);
        let start = l.len();
        let recv_x = l.take(rows * h * 2);
        // Scale words for the format that has the most (NVFP4's four block scales a word).
        let words = TokenFormat::max_scale_words(h);
        let out_scales = l.take(rows * words);
        l.align_to(BANK_ALIGN);
        LlAreas {
            shape: s,
            bank: BankArea {
                bytes: Area::new(start, l.len() - start),
            },
            recv_x,
            out_scales,
            recv_scales: l.take(rows * words),
            recv_src: l.take(rows),
            recv_weight: l.take(rows),
            count: l.take(epr * r),
            combine_x: l.take(m * s.topk * h),
            combine_send: l.take(rows * h),
            combine_begin: l.take(epr * r),
        }
    }

    /// Where the count signal of (`local_expert`, `src`) lives.
    pub fn count_of(
        &self,
        local_expert: usize,
        src: usize,
        num_ranks: usize,
    ) -> crate::Result<Area<u64>> {
        self.count
            .slice(local_expert * num_ranks + src..local_expert * num_ranks + src + 1)
    }
}

/// Areas for peers on other nodes, reached through the proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct NetAreas {
    /// `[src R]` packets announced per peer in its ordered stream, applied in order by
    /// the proxy.
    pub tails: Area<u64>,
    /// `[src R]` the proxy's `NodeLeader` barrier counters.
    pub barriers: Area<u64>,
    /// `[kind 2][LL buffer][local expert][src R]` the proxy's partial-completion fence
    /// counters (`(signals applied << 32) | writes counted`), kind 0 LL dispatch, 1 LL
    /// combine; empty without low-latency mode.
    pub fences: Area<u64>,
    /// Local experts per rank in the fence (0 without low-latency mode).
    pub fence_experts: usize,
    /// The abort word this rank writes into the regions of ranks on other nodes when
    /// it fails (a one-sided write needs its source in registered memory).
    pub abort_src: Area<u64>,
    /// `[channel][dst R]` packets being sent, `staging_cap` bytes each.
    staging: [Area<u8>; CHANNELS],
    /// `[channel][src R]` packets received, `landing_cap` bytes each.
    landing: [Area<u8>; CHANNELS],
    staging_cap: [usize; CHANNELS],
    landing_cap: [usize; CHANNELS],
}

impl NetAreas {
    fn new(l: &mut Layout, normal: Option<Shape>, ll: Option<Shape>, r: usize) -> NetAreas {
        let mut staging_cap = [0usize; CHANNELS];
        let mut landing_cap = [0usize; CHANNELS];
        let round = |n: usize| n.div_ceil(ALIGN) * ALIGN;
        if let Some(s) = normal {
            let (h, k, t) = (s.hidden, s.topk, s.max_tokens);
            let f = RowFormat {
                row_bytes: 2 * h,
                groups: s.groups(),
                topk: k,
                weights: k,
            };
            let notify = round(NotifyPacket::layout(r, s.num_experts).len);
            // Every row in the packet, or staged for the direct write: the same room,
            // plus the alignment of the direct sections.
            let dispatch = round(DispatchPacket::layout(t, 0, f).staged_len + 32);
            let combine = round(CombinePacket::layout(t, h, k).len);
            for (ch, cap) in [
                (Channel::Notify, notify),
                (Channel::Dispatch, dispatch),
                (Channel::Combine, combine),
            ] {
                staging_cap[ch.index()] = cap;
                landing_cap[ch.index()] = cap;
            }
        }
        if let Some(s) = ll {
            let (epr, h, m) = (s.experts_per_rank(r), s.hidden, s.max_tokens);
            // A peer gets each of at most M tokens once, and back at most M copies per
            // expert and K per token.
            // bf16 rows are the largest (NVFP4's scale words do not make up for a 4x
            // smaller row).
            let d = round(LlDispatchPacket::layout(epr, m, s.topk, 2 * h, s.groups()).len);
            let rows = (m * s.topk).min(epr * m);
            let c = round(LlCombinePacket::layout(rows, h).len);
            for b in 0..LL_BUFFERS {
                staging_cap[Channel::ll_dispatch(b).index()] = d;
                landing_cap[Channel::ll_dispatch(b).index()] = d;
                staging_cap[Channel::ll_combine(b).index()] = c;
                landing_cap[Channel::ll_combine(b).index()] = c;
            }
        }
        // Elastic mode's agreement: a stamp, the set and the view; decided masks: the
        // agreement's number, the rounds, the set.
        for parity in 0..2 {
            let agree = round(8 * (1 + 2 * mask_words(r)));
            staging_cap[Channel::agree(parity).index()] = agree;
            landing_cap[Channel::agree(parity).index()] = agree;
        }
        let decided = round(8 * (2 + mask_words(r)));
        staging_cap[Channel::Decided.index()] = decided;
        landing_cap[Channel::Decided.index()] = decided;
        let tails = l.take(r);
        let barriers = l.take(r);
        let fence_experts = ll.map_or(0, |s| s.experts_per_rank(r));
        // Two kinds (LL dispatch, LL combine) of keys; the last combine key counts
        // decided masks.
        let fences = l.take(2 * fence_keys(fence_experts) * r);
        let abort_src = l.take(1);
        let mut staging = [Area::default(); CHANNELS];
        let mut landing = [Area::default(); CHANNELS];
        for ch in 0..CHANNELS {
            staging[ch] = l.take(r * staging_cap[ch]);
            landing[ch] = l.take(r * landing_cap[ch]);
        }
        NetAreas {
            tails,
            barriers,
            fences,
            fence_experts,
            abort_src,
            staging,
            landing,
            staging_cap,
            landing_cap,
        }
    }

    /// The area this rank stages its packet for `dst` on `ch` in.
    pub fn staging(&self, ch: Channel, dst: usize) -> crate::Result<Area<u8>> {
        let c = ch.index();
        self.staging[c].row(dst, self.staging_cap[c])
    }

    /// The area the packet from `src` on `ch` lands in.
    pub fn landing(&self, ch: Channel, src: usize) -> crate::Result<Area<u8>> {
        let c = ch.index();
        self.landing[c].row(src, self.landing_cap[c])
    }
}

/// Every area of a rank's region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionMap {
    /// Number of ranks.
    pub num_ranks: usize,
    /// Liveness, failure and synchronisation words.
    pub control: ControlAreas,
    /// Normal mode, if configured.
    pub normal: Option<NormalAreas>,
    /// Low-latency mode's buffers, if configured.
    pub ll: Option<[LlAreas; LL_BUFFERS]>,
    /// The network path's areas (several nodes only).
    pub net: Option<NetAreas>,
    /// Total bytes.
    pub total: usize,
}

impl RegionMap {
    /// The layout for `cfg` on `num_ranks` ranks; `multi_node` adds the network areas.
    pub fn new(cfg: &BufferConfig, num_ranks: usize, multi_node: bool) -> RegionMap {
        let r = num_ranks.max(1);
        let mut l = Layout::new(ALIGN);
        let control = ControlAreas::new(&mut l, r);
        let normal = cfg
            .normal
            .map(|s| NormalAreas::new(&mut l, s, r, multi_node));
        let ll = cfg
            .ll
            .map(|s| std::array::from_fn(|_| LlAreas::new(&mut l, s, r)));
        let net = multi_node.then(|| NetAreas::new(&mut l, cfg.normal, cfg.ll, r));
        l.align_to(BANK_ALIGN);
        RegionMap {
            num_ranks: r,
            control,
            normal,
            ll,
            net,
            total: l.len(),
        }
    }
}

impl BufferConfig {
    /// Bytes of registered memory each rank needs for this config on `num_ranks` ranks
    /// spread over `num_nodes` nodes (most of it is touched only when used).
    pub fn bytes_needed(&self, num_ranks: usize, num_nodes: usize) -> usize {
        RegionMap::new(self, num_ranks, num_nodes > 1).total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(e: usize, h: usize, k: usize, t: usize) -> Shape {
        Shape {
            num_experts: e,
            hidden: h,
            topk: k,
            max_tokens: t,
        }
    }

    /// Every byte range of the map, named.
    fn ranges(map: &RegionMap) -> Vec<(String, std::ops::Range<usize>)> {
        let mut v = Vec::new();
        let c = &map.control;
        let mut add = |name: &str, r: std::ops::Range<usize>| v.push((name.to_string(), r));
        add("pid", c.pid.byte_range());
        add("abort", c.abort.byte_range());
        add("abort_msg", c.abort_msg.byte_range());
        add("barrier", c.barrier.byte_range());
        add("barrier_release", c.barrier_release.byte_range());
        add("dispatch_done", c.dispatch_done.byte_range());
        add("combine_done", c.combine_done.byte_range());
        add("relay_done", c.relay_done.byte_range());
        add("ll_entered", c.ll_entered.byte_range());
        add("ll_combine_done", c.ll_combine_done.byte_range());
        add("ll_combine_entered", c.ll_combine_entered.byte_range());
        add("ll_combine_zero_copy", c.ll_combine_zero_copy.byte_range());
        add("ll_combine_received", c.ll_combine_received.byte_range());
        add("agree", c.agree.byte_range());
        if let Some(n) = &map.normal {
            add("notify", n.notify.byte_range());
            for (i, b) in n.banks.iter().enumerate() {
                add(&format!("bank{i}.recv_x"), b.recv_x.byte_range());
                add(&format!("bank{i}.recv_scales"), b.recv_scales.byte_range());
                add(
                    &format!("bank{i}.recv_topk_idx"),
                    b.recv_topk_idx.byte_range(),
                );
                add(
                    &format!("bank{i}.recv_topk_weights"),
                    b.recv_topk_weights.byte_range(),
                );
            }
            add("recv_src_idx", n.recv_src_idx.byte_range());
            add("combine_x", n.combine_x.byte_range());
            add("combine_weights", n.combine_weights.byte_range());
            add("relay_x", n.relay_x.byte_range());
            add("relay_weights", n.relay_weights.byte_range());
        }
        for (b, a) in map.ll.iter().flatten().enumerate() {
            add(&format!("ll{b}.recv_x"), a.recv_x.byte_range());
            add(&format!("ll{b}.out_scales"), a.out_scales.byte_range());
            add(&format!("ll{b}.recv_scales"), a.recv_scales.byte_range());
            add(&format!("ll{b}.recv_src"), a.recv_src.byte_range());
            add(&format!("ll{b}.recv_weight"), a.recv_weight.byte_range());
            add(&format!("ll{b}.count"), a.count.byte_range());
            add(&format!("ll{b}.combine_x"), a.combine_x.byte_range());
            add(&format!("ll{b}.combine_send"), a.combine_send.byte_range());
            add(
                &format!("ll{b}.combine_begin"),
                a.combine_begin.byte_range(),
            );
        }
        if let Some(n) = &map.net {
            add("tails", n.tails.byte_range());
            add("barriers", n.barriers.byte_range());
            add("fences", n.fences.byte_range());
            add("abort_src", n.abort_src.byte_range());
            for ch in 0..CHANNELS {
                add(&format!("staging{ch}"), n.staging[ch].byte_range());
                add(&format!("landing{ch}"), n.landing[ch].byte_range());
            }
        }
        v
    }

    proptest! {
        /// Areas are disjoint, aligned and inside the region for any shapes; banks are
        /// page-aligned and hold exactly their rows.
        #[test]
        fn areas_are_disjoint_aligned_and_in_bounds(
            r in 1usize..9,
            epr in 1usize..9,
            h in 1usize..40,
            k in 1usize..9,
            t in 0usize..70,
            m in 0usize..20,
            multi in any::<bool>(),
        ) {
            let e = r * epr;
            let k = k.min(e);
            let cfg = BufferConfig {
                normal: (t > 0).then(|| shape(e, h * 8, k, t)),
                ll: (m > 0).then(|| shape(e, h * 8, k, m)),
                ..BufferConfig::new(e, h * 8, k, 1, 0)
            };
            let map = RegionMap::new(&cfg, r, multi);
            let mut all = ranges(&map);
            for (name, range) in &all {
                prop_assert_eq!(range.start % ALIGN, 0, "{} misaligned", name);
                prop_assert!(range.end <= map.total, "{} past the end", name);
            }
            all.sort_by_key(|(_, r)| r.start);
            for w in all.windows(2) {
                prop_assert!(w[0].1.end <= w[1].1.start, "{} overlaps {}", w[0].0, w[1].0);
            }
            if let Some(n) = &map.normal {
                for bank in &n.banks {
                    let b = bank.area.bytes;
                    prop_assert_eq!(b.offset() % BANK_ALIGN, 0);
                    prop_assert_eq!(b.bytes() % BANK_ALIGN, 0);
                    prop_assert!(b.offset() <= bank.recv_x.offset() && bank.recv_topk_weights.end() <= b.end());
                }
                prop_assert!(n.recv_src_idx.offset() >= n.banks[1].area.bytes.end());
                for p in 0..2 {
                    for s in 0..r {
                        let slot = n.notify_slot(p, s, r).unwrap();
                        prop_assert!(slot.counts.end() <= n.notify.end());
                        prop_assert_eq!(slot.epoch.offset() % 8, 0);
                    }
                }
            }
            for a in map.ll.iter().flatten() {
                prop_assert_eq!(a.bank.bytes.offset() % BANK_ALIGN, 0);
                prop_assert!(a.out_scales.end() <= a.bank.bytes.end());
                prop_assert!(a.recv_scales.offset() >= a.bank.bytes.end());
            }
            if let Some(n) = &map.net {
                for ch in Channel::all() {
                    if n.staging_cap[ch.index()] > 0 {
                        prop_assert!(n.staging(ch, r - 1).unwrap().end() <= map.total);
                        prop_assert!(n.landing(ch, r - 1).unwrap().end() <= map.total);
                    }
                    prop_assert!(n.staging(ch, r).is_err() || n.staging_cap[ch.index()] == 0);
                }
            }
        }
    }
}
