//! Symmetric memory: one registered region per rank, the same layout on every rank.
//!
//! Commands and kernels address it by *offset*, never by pointer, so the same offset
//! names the same field in every rank's region. [`RegionMap`] computes that layout
//! from a [`BufferConfig`]; [`Symmetric`] holds this rank's region and the mapped
//! regions of the ranks on its node.

use std::time::Duration;

use uep_shm::{Region, Segment};

use crate::buffer::BufferConfig;
use crate::error::Result;

/// Alignment of every area: a cache line, so counters of different writers never
/// share one and rows start where wide loads like them.
const ALIGN: usize = 128;

/// Bytes reserved for the proxy's LL-signal, barrier and atomic counters.
pub const PROXY_COUNTER_BYTES: usize = 64 * 1024;

/// Room for the reason a failing rank leaves in its peers' regions.
pub const ABORT_MSG_BYTES: usize = 496;

fn align_up(x: usize) -> usize {
    x.div_ceil(ALIGN) * ALIGN
}

/// Offsets of every area of a rank's region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionMap {
    /// Number of ranks.
    pub num_ranks: usize,
    /// Number of experts (all ranks).
    pub num_experts: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Top-k slots.
    pub topk: usize,
    /// Normal mode: most tokens a rank may dispatch in one call.
    pub max_tokens: usize,
    /// Low-latency mode: most tokens a rank may dispatch in one call (0 = no LL areas).
    pub ll_max_tokens: usize,

    /// Notify slots `[2 parities][src R]`, each `notify_slot_bytes`: an epoch word, then
    /// the source's `tokens_per_rank [R]` and `tokens_per_expert [E]` (u32).
    pub notify: usize,
    /// Bytes of one notify slot.
    pub notify_slot_bytes: usize,
    /// u64: the owning process's id (peers watch it while they wait).
    pub pid: usize,
    /// u64 abort word (first failed rank + 1), padded to 16 bytes, then `[src R]`
    /// messages of up to `ABORT_MSG_BYTES` (one slot per rank, so several failing ranks
    /// don't mix words; see [`RegionMap::abort_msg`]).
    pub abort: usize,
    /// `[src R]` u64 epoch: the source finished writing its dispatch rows here.
    pub dispatch_done: usize,
    /// `[src R]` u64 epoch: the source finished writing its combine rows here.
    pub combine_done: usize,
    /// `[src R]` u64: barrier sequence numbers.
    pub barrier: usize,
    /// u64: on several nodes, the last barrier the node's leader finished with the
    /// other nodes' leaders.
    pub barrier_release: usize,
    /// u64: the last low-latency step this rank entered (peers read it before reusing a buffer).
    pub ll_entered: usize,
    /// `[2 buffers][local expert][src R]` u64 epoch|count: LL count signals.
    pub ll_count: usize,
    /// `[2 buffers][src R]` u64 epoch: LL combine rows from the source have landed.
    pub ll_combine_done: usize,

    /// Normal dispatch receive area: `[R * max_tokens]` rows of x (bf16-sized).
    pub recv_x: usize,
    /// `[R * max_tokens, H/128]` f32 scales (FP8 input).
    pub recv_scales: usize,
    /// `[R * max_tokens, K]` i64 local expert ids.
    pub recv_topk_idx: usize,
    /// `[R * max_tokens, K]` f32 weights.
    pub recv_topk_weights: usize,
    /// `[R * max_tokens]` i32 source token index.
    pub recv_src_idx: usize,
    /// Normal combine receive area: `[R][max_tokens]` bf16 rows, by (sending rank, my token).
    pub combine_x: usize,
    /// `[R][max_tokens, K]` f32 weights.
    pub combine_weights: usize,
    /// Multi-node combine, on the rank that relays a remote source's tokens inside this
    /// node: `[source node][local rank][max_tokens]` bf16 rows, the node's expert
    /// outputs for that source's tokens, reduced here before one row crosses the network.
    pub relay_x: usize,
    /// `[source node][local rank][max_tokens, K]` f32 weights beside `relay_x`.
    pub relay_weights: usize,
    /// `[src R]` u64 epoch: the source (a rank of this node) finished writing its relay rows here.
    pub relay_done: usize,

    /// Low-latency areas, one per buffer index.
    pub ll: [LlAreas; 2],
    /// Areas for peers on other nodes (reached through the proxy); empty on one node.
    pub net: NetAreas,
    /// Total bytes.
    pub total: usize,
}

/// What travels to a peer on another node: one *packet* per (operation, peer), written
/// into the peer's landing area for this rank of that channel by one or more writes, then
/// announced by a zero-length write. The proxy applies announcements in order per peer,
/// so a counter that says "k packets" means k packets' bytes are here. Every rank runs
/// the same sequence of collective calls and each call sends exactly one packet to each
/// peer on another node, so the k-th packet from a peer is the one the k-th wait expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Channel {
    /// Normal dispatch: the sender's token counts.
    Notify = 0,
    /// Normal dispatch rows.
    Dispatch = 1,
    /// Normal combine rows.
    Combine = 2,
    /// Low-latency dispatch rows, buffer 0.
    LlDispatch0 = 3,
    /// Low-latency dispatch rows, buffer 1.
    LlDispatch1 = 4,
    /// Low-latency combine rows, buffer 0.
    LlCombine0 = 5,
    /// Low-latency combine rows, buffer 1.
    LlCombine1 = 6,
}

/// Number of [`Channel`]s.
pub const CHANNELS: usize = 7;

impl Channel {
    /// The low-latency dispatch channel of buffer `b`.
    pub fn ll_dispatch(b: usize) -> Channel {
        if b == 0 {
            Channel::LlDispatch0
        } else {
            Channel::LlDispatch1
        }
    }

    /// The low-latency combine channel of buffer `b`.
    pub fn ll_combine(b: usize) -> Channel {
        if b == 0 {
            Channel::LlCombine0
        } else {
            Channel::LlCombine1
        }
    }
}

/// Offsets of the sections of one packet; every section starts 16-byte aligned, as
/// one-sided writes want.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sections {
    /// Start of each section.
    pub at: Vec<usize>,
    /// Total bytes.
    pub len: usize,
}

impl Sections {
    /// Lay out sections of the given byte lengths.
    pub fn new(lens: &[usize]) -> Sections {
        let mut at = Vec::with_capacity(lens.len());
        let mut off = 0;
        for &l in lens {
            at.push(off);
            off += l.div_ceil(16) * 16;
        }
        Sections { at, len: off }
    }
}

/// Packet layouts shared by sender and receiver (both compute them from counts they know).
pub mod packet {
    use super::Sections;

    /// Normal dispatch of `n` tokens to a node, sent once to the rank that relays them
    /// inside it: a [`DispatchHeader`], then x and scales (`groups` a row, 0 for bf16)
    /// of the `n_rest` tokens the relay itself does not receive, global top-k ids
    /// (`k_idx` a row, 0 without top-k), weights (`k_w` a row), source index, and the
    /// mask of the node's local ranks that need each of the `n` tokens. The rows the
    /// relay receives are written straight into its output rows ([`dispatch_direct`]).
    pub fn dispatch(
        n: usize,
        n_rest: usize,
        row_bytes: usize,
        groups: usize,
        k_idx: usize,
        k_w: usize,
    ) -> Sections {
        Sections::new(&[
            DispatchHeader::BYTES,
            n_rest * row_bytes,
            n_rest * groups * 4,
            n * k_idx * 8,
            n * k_w * 4,
            n * 4,
            n * 8,
        ])
    }

    /// Where the sender stages the x rows and the scales of the `n_direct` tokens the
    /// relay itself receives: after the packet `sec` (the staging area has room).
    pub fn dispatch_direct(sec: &Sections, n_direct: usize, row_bytes: usize) -> [usize; 2] {
        [sec.len, sec.len + (n_direct * row_bytes).div_ceil(16) * 16]
    }

    /// The first 16 bytes of a dispatch packet: what the relaying rank needs to read it.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct DispatchHeader {
        /// Tokens in the packet.
        pub tokens: u32,
        /// Of them, those the relay receives, whose rows went straight to it; `None`
        /// when they are in the packet too (their rows there would not be aligned).
        pub direct: Option<u32>,
        /// Rows carry FP8 scales.
        pub fp8: bool,
        /// Rows carry top-k ids.
        pub topk: bool,
        /// Rows carry top-k weights.
        pub weights: bool,
    }

    impl DispatchHeader {
        /// Encoded size.
        pub const BYTES: usize = 16;

        /// Encode.
        pub fn to_bytes(self) -> [u8; 16] {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&self.tokens.to_le_bytes());
            b[4] = self.fp8 as u8
                | (self.topk as u8) << 1
                | (self.weights as u8) << 2
                | (self.direct.is_some() as u8) << 3;
            b[8..12].copy_from_slice(&self.direct.unwrap_or(0).to_le_bytes());
            b
        }

        /// Decode.
        pub fn from_bytes(b: [u8; 16]) -> DispatchHeader {
            DispatchHeader {
                tokens: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                direct: (b[4] & 8 != 0).then(|| u32::from_le_bytes([b[8], b[9], b[10], b[11]])),
                fp8: b[4] & 1 != 0,
                topk: b[4] & 2 != 0,
                weights: b[4] & 4 != 0,
            }
        }
    }

    /// Normal combine of `n` rows: bf16 rows, weights.
    pub fn combine(n: usize, hidden: usize, k: usize) -> Sections {
        Sections::new(&[n * hidden * 2, n * k * 4])
    }

    /// Low-latency dispatch of `n` copies to `experts` local experts: per-expert counts,
    /// scales, (token * K + slot) codes, then the rows. The packet sent is what precedes
    /// the rows (`at[3]`): the rows are staged last, expert by expert, and each expert's
    /// block is written straight into its place in the receiver's rows.
    pub fn ll_dispatch(experts: usize, n: usize, row_bytes: usize, groups: usize) -> Sections {
        Sections::new(&[experts * 4, n * groups * 4, n * 4, n * row_bytes])
    }

    /// Low-latency combine of `n` rows.
    pub fn ll_combine(n: usize, hidden: usize) -> Sections {
        Sections::new(&[n * hidden * 2])
    }
}

/// Offsets of the network areas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetAreas {
    /// `[src R]` u64: packets announced per peer, applied in order by the proxy.
    pub tails: usize,
    /// Small counter areas the proxy's other emulations may use.
    pub proxy_counters: usize,
    /// u64: the abort word this rank writes into the regions of ranks on other nodes
    /// when it fails (a one-sided write needs its source in registered memory).
    pub abort_src: usize,
    /// Capacity of one packet of each channel.
    pub cap: [usize; CHANNELS],
    /// `[channel][dst R]` packets being sent.
    pub staging: [usize; CHANNELS],
    /// `[channel][src R]` packets received.
    pub landing: [usize; CHANNELS],
}

impl NetAreas {
    /// Offset of the announcement counter of `src`.
    pub fn tail(&self, src: usize) -> usize {
        self.tails + 8 * src
    }

    /// Offset of the packet this rank sends to `dst` on `ch`.
    pub fn staging(&self, ch: Channel, dst: usize) -> usize {
        self.staging[ch as usize] + dst * self.cap[ch as usize]
    }

    /// Offset of the packet from `src` on `ch`.
    pub fn landing(&self, ch: Channel, src: usize) -> usize {
        self.landing[ch as usize] + src * self.cap[ch as usize]
    }
}

/// Offsets of one low-latency buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LlAreas {
    /// `[E/R, R*M]` rows of x (bf16-sized; FP8 uses the first H bytes of a row's span).
    pub recv_x: usize,
    /// `[E/R, R*M, H/128]` f32 scales.
    pub recv_scales: usize,
    /// `[E/R, R*M]` i32: source token * K + top-k slot.
    pub recv_src: usize,
    /// `[M, K]` bf16 rows: expert outputs for my (token, slot) pairs.
    pub combine_x: usize,
}

impl RegionMap {
    /// The layout for `cfg` on `num_ranks` ranks.
    pub fn new(cfg: &BufferConfig, num_ranks: usize, multi_node: bool) -> RegionMap {
        let (r, e, h, k) = (num_ranks, cfg.num_experts, cfg.hidden, cfg.topk);
        let t = cfg.num_max_dispatch_tokens_per_rank;
        let m = cfg.num_max_ll_tokens_per_rank;
        let groups = h.div_ceil(128);
        let epr = e.checked_div(r).unwrap_or(0);
        let mut at = 0usize;
        let mut take = |bytes: usize| {
            let off = at;
            at = align_up(at + bytes);
            off
        };
        let notify_slot_bytes = align_up(16 + 4 * (r + e));
        let notify = take(2 * r * notify_slot_bytes);
        let pid = take(8);
        let abort = take(16 + r * ABORT_MSG_BYTES);
        let dispatch_done = take(8 * r);
        let combine_done = take(8 * r);
        let barrier = take(8 * r);
        let barrier_release = take(8);
        let ll_entered = take(8);
        let ll_count = take(8 * 2 * epr * r);
        let ll_combine_done = take(8 * 2 * r);
        let rows = r * t;
        let recv_x = take(rows * h * 2);
        let recv_scales = take(rows * groups * 4);
        let recv_topk_idx = take(rows * k * 8);
        let recv_topk_weights = take(rows * k * 4);
        let recv_src_idx = take(rows * 4);
        let combine_x = take(rows * h * 2);
        let combine_weights = take(rows * k * 4);
        // Indexed by (source node, local rank), that is R slots of `t` tokens.
        let relay_rows = if multi_node { rows } else { 0 };
        let relay_x = take(relay_rows * h * 2);
        let relay_weights = take(relay_rows * k * 4);
        let relay_done = take(8 * r);
        let mut ll = [LlAreas::default(); 2];
        if m > 0 {
            for areas in &mut ll {
                let ll_rows = epr * r * m;
                *areas = LlAreas {
                    recv_x: take(ll_rows * h * 2),
                    recv_scales: take(ll_rows * groups * 4),
                    recv_src: take(ll_rows * 4),
                    combine_x: take(m * k * h * 2),
                };
            }
        }
        let mut net = NetAreas::default();
        if multi_node {
            let row = h * 2;
            let ll_rows = (m * k).min(epr * m);
            net.cap = [
                align_up(4 * (r + e)),
                // Room for every row, in the packet or staged direct, plus alignment.
                align_up(packet::dispatch(t, t, row, groups, k, k).len + 32),
                align_up(packet::combine(t, h, k).len),
                align_up(packet::ll_dispatch(epr, ll_rows, row, groups).len),
                align_up(packet::ll_dispatch(epr, ll_rows, row, groups).len),
                align_up(packet::ll_combine(ll_rows, h).len),
                align_up(packet::ll_combine(ll_rows, h).len),
            ];
            net.tails = take(8 * r);
            net.proxy_counters = take(PROXY_COUNTER_BYTES);
            net.abort_src = take(8);
            for ch in 0..CHANNELS {
                net.staging[ch] = take(r * net.cap[ch]);
                net.landing[ch] = take(r * net.cap[ch]);
            }
        }
        RegionMap {
            num_ranks: r,
            num_experts: e,
            hidden: h,
            topk: k,
            max_tokens: t,
            ll_max_tokens: m,
            notify,
            notify_slot_bytes,
            pid,
            abort,
            dispatch_done,
            combine_done,
            barrier,
            barrier_release,
            ll_entered,
            ll_count,
            ll_combine_done,
            recv_x,
            recv_scales,
            recv_topk_idx,
            recv_topk_weights,
            recv_src_idx,
            combine_x,
            combine_weights,
            relay_x,
            relay_weights,
            relay_done,
            ll,
            net,
            total: at,
        }
    }

    /// Offset of `rank`'s abort message slot (16-byte aligned: the proxy copies it to
    /// ranks on other nodes).
    pub fn abort_msg(&self, rank: usize) -> usize {
        self.abort + 16 + rank * ABORT_MSG_BYTES
    }

    /// Offset of notify slot (`parity`, `src`).
    pub fn notify_slot(&self, parity: usize, src: usize) -> usize {
        self.notify + (parity * self.num_ranks + src) * self.notify_slot_bytes
    }

    /// Offset of the LL count signal (`buffer`, `local_expert`, `src`).
    pub fn ll_count_at(&self, buffer: usize, local_expert: usize, src: usize) -> usize {
        let epr = self.num_experts / self.num_ranks;
        self.ll_count + 8 * ((buffer * epr + local_expert) * self.num_ranks + src)
    }
}

/// This rank's region and the regions of the ranks it shares memory with.
pub struct Symmetric {
    rank: usize,
    own: Segment,
    peers: Vec<Option<Segment>>,
}

impl std::fmt::Debug for Symmetric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symmetric")
            .field("rank", &self.rank)
            .field("own", &self.own)
            .finish()
    }
}

impl Symmetric {
    /// Map the peers in `local` (rank ids on this node, including `rank`).
    pub fn map_peers(
        rank: usize,
        own: Segment,
        names: &[String],
        local: &[usize],
        bytes: usize,
        timeout: Duration,
    ) -> Result<Symmetric> {
        let mut peers: Vec<Option<Segment>> = (0..names.len()).map(|_| None).collect();
        for &p in local {
            if p != rank {
                peers[p] = Some(Segment::open(&names[p], bytes, timeout)?);
            }
        }
        Ok(Symmetric { rank, own, peers })
    }

    /// Remove the names of this rank's segment: every peer has mapped it.
    pub fn unlink(&mut self) -> Result<()> {
        Ok(self.own.unlink()?)
    }

    /// This rank's region.
    pub fn local(&self) -> &Region {
        self.own.region()
    }

    /// The region of `peer`, if it shares memory with this rank.
    pub fn peer(&self, peer: usize) -> Option<&Region> {
        if peer == self.rank {
            Some(self.own.region())
        } else {
            self.peers
                .get(peer)
                .and_then(|p| p.as_ref())
                .map(Segment::region)
        }
    }

    /// Borrow `count` values of `T` at `offset` of this rank's region.
    ///
    /// Only for ranges that the protocol has finished writing: every area handed out
    /// this way (received rows and their metadata) is written by peers only during a
    /// collective call that this rank has entered, and the Buffer's calls take
    /// `&mut self`, so a view borrowed from `&self` ends before the next write can start.
    pub fn view<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<&[T]> {
        let region = self.own.region();
        // SAFETY: see above: no writer can touch the range while `&self` is borrowed;
        // bounds and alignment are checked by `slice`.
        Ok(unsafe { region.slice::<T>(offset, count)? })
    }

    /// Mutably borrow `count` values of `T` at `offset` of this rank's region, for
    /// in-place work on rows that have fully arrived (LL packing, padding).
    #[allow(clippy::mut_from_ref)]
    pub fn view_mut<T: bytemuck::Pod>(&mut self, offset: usize, count: usize) -> Result<&mut [T]> {
        let region = self.own.region();
        // SAFETY: `&mut self` excludes every other view, and no peer writes the range
        // until this rank enters its next collective call (see `view`).
        Ok(unsafe { region.slice_mut::<T>(offset, count)? })
    }
}
