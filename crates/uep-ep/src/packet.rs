//! Packets: what one operation sends to one peer on another node.
//!
//! A packet is laid out from offset 0 in named, 16-byte aligned sections (one-sided
//! writes want aligned ends); the sender stages it, the receiver finds it at the same
//! section offsets in its landing area. Both sides compute the layout from counts they
//! both know (or that the packet's header carries). Headers are `Pod` structs, read
//! and written whole.

use bytemuck::{Pod, Zeroable};

use crate::area::{Area, Layout};

/// Alignment of packet sections: one-sided writes move 16-byte aligned spans.
pub const SECTION_ALIGN: usize = 16;

/// What a packet is for. Each (channel, peer) has its own staging and landing area.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Channel {
    /// Normal dispatch: the sender's token counts.
    Notify,
    /// Normal dispatch rows, to the rank that relays them inside its node.
    Dispatch,
    /// Normal combine: a node's partial sums.
    Combine,
    /// Low-latency dispatch into buffer `b` (`0..LL_BUFFERS`).
    LlDispatch(u8),
    /// Low-latency combine of buffer `b`.
    LlCombine(u8),
    /// Elastic mode's agreement on the masked ranks, by round parity (`0..2`).
    Agree(u8),
    /// Elastic mode's decided masks (fenced, so that a rank reads a peer's decision
    /// only when it needs it: see `agree`).
    Decided,
}

/// Low-latency buffers: step `s` uses buffer `s % LL_BUFFERS`. Three, so that the
/// outputs of the last step stay valid while the next runs, even though peers on other
/// nodes may write a step's rows as soon as this rank entered the step before it.
pub const LL_BUFFERS: usize = 3;

/// Agreement rounds alternate between two channels (round parity).
const AGREE_PARITIES: usize = 2;

// The first index of each kind of channel: each kind follows the one before, as many
// as it has (one; one per LL buffer; one per parity; one).
const NOTIFY: usize = 0;
const DISPATCH: usize = NOTIFY + 1;
const COMBINE: usize = DISPATCH + 1;
const LL_DISPATCH: usize = COMBINE + 1;
const LL_COMBINE: usize = LL_DISPATCH + LL_BUFFERS;
const AGREE: usize = LL_COMBINE + LL_BUFFERS;
const DECIDED: usize = AGREE + AGREE_PARITIES;

/// Number of [`Channel`]s: one past the last kind's last index.
pub const CHANNELS: usize = DECIDED + 1;

impl Channel {
    /// Whether the channel's packets go through the proxy's partial-completion fence
    /// (low-latency calls, which may be received after later calls: a deferred hook, or
    /// a combine between two dispatches and their receives; decided masks, read only
    /// when needed) rather than the peer's one ordered stream (normal mode and the
    /// agreement's rounds, received in the calls that send them, so the k-th packet of
    /// the stream is the one the k-th receive expects).
    pub fn is_fenced(self) -> bool {
        matches!(
            self,
            Channel::LlDispatch(_) | Channel::LlCombine(_) | Channel::Decided
        )
    }

    /// The channel's index, `0..CHANNELS`.
    pub fn index(self) -> usize {
        match self {
            Channel::Notify => NOTIFY,
            Channel::Dispatch => DISPATCH,
            Channel::Combine => COMBINE,
            Channel::LlDispatch(b) => LL_DISPATCH + b as usize % LL_BUFFERS,
            Channel::LlCombine(b) => LL_COMBINE + b as usize % LL_BUFFERS,
            Channel::Agree(p) => AGREE + p as usize % AGREE_PARITIES,
            Channel::Decided => DECIDED,
        }
    }

    /// The agreement channel of round parity `parity`.
    pub fn agree(parity: usize) -> Channel {
        Channel::Agree((parity % AGREE_PARITIES) as u8)
    }

    /// The low-latency dispatch channel of buffer `b`.
    pub fn ll_dispatch(b: usize) -> Channel {
        Channel::LlDispatch((b % LL_BUFFERS) as u8)
    }

    /// The low-latency combine channel of buffer `b`.
    pub fn ll_combine(b: usize) -> Channel {
        Channel::LlCombine((b % LL_BUFFERS) as u8)
    }

    /// Every channel, in index order.
    #[cfg(test)]
    pub fn all() -> impl Iterator<Item = Channel> {
        [Channel::Notify, Channel::Dispatch, Channel::Combine]
            .into_iter()
            .chain((0..LL_BUFFERS).map(Channel::ll_dispatch))
            .chain((0..LL_BUFFERS).map(Channel::ll_combine))
            .chain((0..AGREE_PARITIES).map(Channel::agree))
            .chain([Channel::Decided])
    }
}

fn sections() -> Layout {
    Layout::new(SECTION_ALIGN)
}

/// What a rank tells every rank before a normal dispatch, ahead of its counts.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct NotifyHead {
    /// Tokens the rank dispatches (every rank checks them against the Buffer's room).
    pub tokens: u32,
    /// Reserved; 0.
    pub flags: u32,
}

/// A normal dispatch's notify: the head, then `tokens_per_rank [R]` and
/// `tokens_per_expert [E]` (u32). The same bytes go into a same-node peer's notify slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotifyPacket {
    /// The head.
    pub head: Area<NotifyHead>,
    /// `[R + E]` counts.
    pub counts: Area<u32>,
    /// Bytes to send.
    pub len: usize,
}

impl NotifyPacket {
    /// The layout for `num_ranks` ranks and `num_experts` experts.
    pub fn layout(num_ranks: usize, num_experts: usize) -> NotifyPacket {
        let mut l = sections();
        let head = l.take(1);
        let counts = l.take(num_ranks + num_experts);
        NotifyPacket {
            head,
            counts,
            len: l.len(),
        }
    }

    /// The same sections at byte `base` (where the packet is staged or landed).
    pub fn at_base(self, base: usize) -> NotifyPacket {
        NotifyPacket {
            head: self.head.at_base(base),
            counts: self.counts.at_base(base),
            len: self.len,
        }
    }
}

/// The first 16 bytes of a dispatch packet: what the relaying rank needs to read it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct DispatchHeader {
    /// Tokens in the packet.
    pub tokens: u32,
    /// Of them, those the relay itself receives, whose rows were written straight into
    /// its output rows (valid with [`DispatchHeader::DIRECT`]).
    pub direct: u32,
    /// [`DispatchHeader::FP8`] | [`DispatchHeader::TOPK`] | ...
    pub flags: u32,
    /// Reserved; 0.
    pub reserved: u32,
}

impl DispatchHeader {
    /// Rows carry FP8 scales.
    pub const FP8: u32 = 1;
    /// Rows carry top-k ids.
    pub const TOPK: u32 = 2;
    /// Rows carry top-k weights.
    pub const WEIGHTS: u32 = 4;
    /// The relay's own rows went straight to it (else they are in the packet too: their
    /// place there would not be 16-byte aligned).
    pub const DIRECT: u32 = 8;
    /// The weights keep every lane at the receivers ([`crate::WeightLanes::All`]).
    pub const ALL_LANES: u32 = 16;

    /// Whether `flag` is set.
    pub fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }

    /// Tokens whose rows went straight to the relay (0 without [`Self::DIRECT`]).
    pub fn direct_tokens(&self) -> usize {
        if self.has(Self::DIRECT) {
            self.direct as usize
        } else {
            0
        }
    }
}

/// What a dispatch row carries besides its x bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowFormat {
    /// Bytes of x a row (2H for bf16, H for FP8).
    pub row_bytes: usize,
    /// f32 scales a row (0 for bf16).
    pub groups: usize,
    /// Top-k ids a row (0 without top-k).
    pub topk: usize,
    /// Top-k weights a row (0 without weights).
    pub weights: usize,
}

/// A normal dispatch of `n` tokens to another node, sent once to the rank there that
/// relays them inside its node: the header, x and scales of the `n - n_direct` tokens the
/// relay does not itself receive, then top-k ids (global), weights, source token index
/// and the mask of the node's local ranks that need each token, for all `n`. Behind the
/// packet, in the staging area only, the x rows and scales of the `n_direct` tokens the
/// relay receives: written straight into its output rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DispatchPacket {
    /// The header.
    pub header: Area<DispatchHeader>,
    /// `[n - n_direct]` x rows.
    pub x: Area<u8>,
    /// `[n - n_direct, groups]` scales.
    pub scales: Area<f32>,
    /// `[n, topk]` global expert ids.
    pub topk_idx: Area<i64>,
    /// `[n, weights]` weights.
    pub weights: Area<f32>,
    /// `[n]` source token index.
    pub src: Area<i32>,
    /// `[n]` bit `l`: local rank `l` of the node needs the token.
    pub mask: Area<u64>,
    /// Bytes to send (the packet proper).
    pub len: usize,
    /// `[n_direct]` x rows staged for the direct write.
    pub direct_x: Area<u8>,
    /// `[n_direct, groups]` scales staged for the direct write.
    pub direct_scales: Area<f32>,
    /// Bytes of staging used, direct rows included.
    pub staged_len: usize,
}

impl DispatchPacket {
    /// The layout of `n` tokens of which `n_direct` go straight to the relay.
    pub fn layout(n: usize, n_direct: usize, f: RowFormat) -> DispatchPacket {
        let rest = n - n_direct.min(n);
        let mut l = sections();
        let header = l.take(1);
        let x = l.take(rest * f.row_bytes);
        let scales = l.take(rest * f.groups);
        let topk_idx = l.take(n * f.topk);
        let weights = l.take(n * f.weights);
        let src = l.take(n);
        let mask = l.take(n);
        let len = l.len();
        let direct_x = l.take(n_direct * f.row_bytes);
        let direct_scales = l.take(n_direct * f.groups);
        DispatchPacket {
            header,
            x,
            scales,
            topk_idx,
            weights,
            src,
            mask,
            len,
            direct_x,
            direct_scales,
            staged_len: l.len(),
        }
    }

    /// The same sections at byte `base` (where the packet is staged or landed).
    pub fn at_base(self, base: usize) -> DispatchPacket {
        DispatchPacket {
            header: self.header.at_base(base),
            x: self.x.at_base(base),
            scales: self.scales.at_base(base),
            topk_idx: self.topk_idx.at_base(base),
            weights: self.weights.at_base(base),
            src: self.src.at_base(base),
            mask: self.mask.at_base(base),
            direct_x: self.direct_x.at_base(base),
            direct_scales: self.direct_scales.at_base(base),
            ..self
        }
    }
}

/// A normal combine's partial sums from one node: `[n, H]` bf16 rows, `[n, K]` weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombinePacket {
    /// Rows.
    pub x: Area<u16>,
    /// Weights.
    pub weights: Area<f32>,
    /// Bytes to send.
    pub len: usize,
}

impl CombinePacket {
    /// The layout of `n` rows of `hidden` channels with `topk` weights.
    pub fn layout(n: usize, hidden: usize, topk: usize) -> CombinePacket {
        let mut l = sections();
        let x = l.take(n * hidden);
        let weights = l.take(n * topk);
        CombinePacket {
            x,
            weights,
            len: l.len(),
        }
    }

    /// The same sections at byte `base`.
    pub fn at_base(self, base: usize) -> CombinePacket {
        CombinePacket {
            x: self.x.at_base(base),
            weights: self.weights.at_base(base),
            ..self
        }
    }
}

/// Bytes a low-latency combine fences together for one peer: adjacent local experts'
/// blocks are grouped until a group holds this many (one count signal, and in a packet
/// staged whole, one write, per group).
pub const LL_COMBINE_GROUP_BYTES: usize = 1 << 20;

/// The groups of adjacent local experts a low-latency combine fences together for one
/// peer, from the rows each of its local experts returns to that peer (`rows[le]`),
/// `row_bytes` each. Both sides know these counts (the sender from its dispatch's
/// layout, the receiver from its own routing), so both cut the same groups. Never empty:
/// group 0 is in every combine, even one with no rows.
pub fn ll_combine_groups(rows: &[usize], row_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (le, &n) in rows.iter().enumerate() {
        bytes += n * row_bytes;
        if bytes >= LL_COMBINE_GROUP_BYTES {
            groups.push(start..le + 1);
            (start, bytes) = (le + 1, 0);
        }
    }
    if start < rows.len() || groups.is_empty() {
        match groups.last_mut() {
            // Trailing experts with no rows join the last group.
            Some(last) if bytes == 0 => last.end = rows.len(),
            _ => groups.push(start..rows.len()),
        }
    }
    groups
}

/// A low-latency dispatch to a peer on another node: each token once, however many of
/// the peer's experts it chose (DeepEP sends one row per (token, expert) copy; the
/// receiver expands them into its experts' blocks, where it moves rows anyway). The
/// header first, at fixed offsets: per-expert copy counts and the number of tokens; then
/// each token's source index, the local expert of each of its top-k slots (`-1` for a
/// slot not on the peer), its top-k weights, its scales and its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlDispatchPacket {
    /// `[experts]` copies per local expert.
    pub counts: Area<u32>,
    /// `[1]` tokens in the packet.
    pub tokens: Area<u32>,
    /// `[n]` each token's index at the source, ascending.
    pub ids: Area<i32>,
    /// `[n, K]` the peer's local expert of each slot of each token, or `-1`.
    pub slots: Area<i32>,
    /// `[n, K]` each token's gate weights (0 where the source gave none).
    pub weights: Area<f32>,
    /// `[n, groups]` scale words.
    pub scales: Area<f32>,
    /// `[n]` rows.
    pub rows: Area<u8>,
    /// Bytes to send.
    pub len: usize,
}

impl LlDispatchPacket {
    /// The layout of `n` tokens for `experts` experts, top-`k`, rows of `row_bytes`,
    /// `groups` scales. The header's place does not depend on `n`.
    pub fn layout(
        experts: usize,
        n: usize,
        k: usize,
        row_bytes: usize,
        groups: usize,
    ) -> LlDispatchPacket {
        let mut l = sections();
        let counts = l.take(experts);
        let tokens = l.take(1);
        let ids = l.take(n);
        let slots = l.take(n * k);
        let weights = l.take(n * k);
        let scales = l.take(n * groups);
        let rows = l.take(n * row_bytes);
        LlDispatchPacket {
            counts,
            tokens,
            ids,
            slots,
            weights,
            scales,
            rows,
            len: l.len(),
        }
    }

    /// The same sections at byte `base`.
    pub fn at_base(self, base: usize) -> LlDispatchPacket {
        LlDispatchPacket {
            counts: self.counts.at_base(base),
            tokens: self.tokens.at_base(base),
            ids: self.ids.at_base(base),
            slots: self.slots.at_base(base),
            weights: self.weights.at_base(base),
            scales: self.scales.at_base(base),
            rows: self.rows.at_base(base),
            ..self
        }
    }
}

/// A low-latency combine: `[n, H]` bf16 expert outputs, expert by expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlCombinePacket {
    /// Rows.
    pub rows: Area<u16>,
    /// Bytes to send.
    pub len: usize,
}

impl LlCombinePacket {
    /// The layout of `n` rows of `hidden` channels.
    pub fn layout(n: usize, hidden: usize) -> LlCombinePacket {
        let mut l = sections();
        let rows = l.take(n * hidden);
        LlCombinePacket { rows, len: l.len() }
    }

    /// The same sections at byte `base`.
    pub fn at_base(self, base: usize) -> LlCombinePacket {
        LlCombinePacket {
            rows: self.rows.at_base(base),
            ..self
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ll_combine_groups_cover_every_expert_once() {
        let mb = LL_COMBINE_GROUP_BYTES;
        assert_eq!(ll_combine_groups(&[0, 0, 0], 1), vec![0..3]);
        assert_eq!(ll_combine_groups(&[1, 1, 0], mb), vec![0..1, 1..3]);
        assert_eq!(ll_combine_groups(&[1, 0, 1, 0], mb / 2), vec![0..4]);
        assert_eq!(ll_combine_groups(&[1, 0, 1, 1], mb / 2), vec![0..3, 3..4]);
        assert_eq!(ll_combine_groups(&[2, 3], 1), vec![0..2]);
        for rows in [vec![5usize; 64], vec![0; 64], (0..64).collect()] {
            let groups = ll_combine_groups(&rows, 14336);
            assert_eq!(groups[0].start, 0);
            assert_eq!(groups.last().unwrap().end, rows.len());
            assert!(groups
                .windows(2)
                .all(|g| g[0].end == g[1].start && !g[0].is_empty()));
        }
    }

    #[test]
    fn channels_have_distinct_indices() {
        let idx: Vec<usize> = Channel::all().map(Channel::index).collect();
        assert_eq!(idx, (0..CHANNELS).collect::<Vec<_>>());
    }

    #[test]
    fn headers_round_trip_as_bytes() {
        let h = DispatchHeader {
            tokens: 7,
            direct: 3,
            flags: DispatchHeader::FP8 | DispatchHeader::DIRECT,
            reserved: 0,
        };
        let bytes: [u8; 16] = bytemuck::cast(h);
        assert_eq!(&bytes[..4], &7u32.to_le_bytes());
        let back: DispatchHeader = bytemuck::cast(bytes);
        assert_eq!(back, h);
        assert!(back.has(DispatchHeader::FP8) && !back.has(DispatchHeader::TOPK));
        assert_eq!(back.direct_tokens(), 3);
        let plain = DispatchHeader { flags: 0, ..h };
        assert_eq!(plain.direct_tokens(), 0);
        assert_eq!(std::mem::size_of::<NotifyHead>(), 8);
    }

    #[test]
    fn sections_are_aligned_and_ordered() {
        let f = RowFormat {
            row_bytes: 100,
            groups: 3,
            topk: 5,
            weights: 5,
        };
        let p = DispatchPacket::layout(9, 4, f);
        let secs = [
            p.header.byte_range(),
            p.x.byte_range(),
            p.scales.byte_range(),
            p.topk_idx.byte_range(),
            p.weights.byte_range(),
            p.src.byte_range(),
            p.mask.byte_range(),
            p.direct_x.byte_range(),
            p.direct_scales.byte_range(),
        ];
        for w in secs.windows(2) {
            assert!(w[0].end <= w[1].start && w[1].start % SECTION_ALIGN == 0);
        }
        assert_eq!(p.x.len(), 5 * 100);
        assert_eq!(p.direct_x.len(), 4 * 100);
        assert!(p.len <= p.direct_x.offset() && p.staged_len >= p.direct_scales.end());
        let moved = p.at_base(4096);
        assert_eq!(moved.mask.offset(), p.mask.offset() + 4096);
        assert_eq!(moved.len, p.len);
        let ll = LlDispatchPacket::layout(4, 10, 8, 64, 2);
        assert_eq!(ll.len, ll.rows.end());
        let head = LlDispatchPacket::layout(4, 0, 0, 0, 0);
        assert_eq!((head.counts, head.tokens), (ll.counts, ll.tokens));
    }
}
