// The normal dispatch's pack as a kernel (uep-ep's device/host/normal.rs `normal_pack`
// is the definition): a warp a (block of tokens, destination) pair walks the block's
// tokens in order, as DeepEP's intranode dispatch gives each channel's senders one
// target rank, and stores each token that goes there into its next row: x and scales,
// its expert ids (made local for a rank of this node, global in a packet) and weights,
// a packet's mask of the node's ranks that need it, the source index. A token sent
// straight to another node's relay goes to the packet's direct rows, which the warp
// pushes as they fill whole quanta of at least a write.
#include "api.cuh"
#include "copy.cuh"
#include "push.cuh"

namespace {

using namespace uep;

// Token `t`'s routing into row `j` of `d`: ids and weights a lane a slot.
UEP_DEVICE void put_routing(const NormalPackArgs &a, const NormalPackDest &d, uint32_t t,
                            uint64_t j) {
    const unsigned lane = lane_id();
    if (lane >= a.topk) return;
    const uint64_t at = uint64_t(t) * a.topk + lane, row = j * a.topk + lane;
    const float w = a.weights ? a.weights[at] : 0.0f;
    if (d.node == kNormalPackRank) {
        if (!a.with_topk) return;
        const int64_t e = a.topk_idx[at];
        const bool mine = e >= 0 && uint64_t(e) / a.experts_per_rank == d.rank;
        reinterpret_cast<int64_t *>(d.region + d.topk_off)[row] =
            mine ? e - int64_t(d.rank) * a.experts_per_rank : -1;
        if (a.with_weights)
            reinterpret_cast<float *>(d.region + d.weights_off)[row] =
                (mine || a.all_weights) ? w : 0.0f;
    } else {
        // Global ids and every weight: the relaying rank makes them local.
        if (a.with_topk && a.topk_idx)
            reinterpret_cast<int64_t *>(d.region + d.topk_off)[row] = a.topk_idx[at];
        if (a.with_weights && a.weights)
            reinterpret_cast<float *>(d.region + d.weights_off)[row] = w;
    }
}

// Token `t`'s mask of node `m`'s ranks it goes to.
UEP_DEVICE uint64_t node_mask(const NormalPackArgs &a, uint32_t t, uint32_t m) {
    const uint8_t *in = a.in_rank + uint64_t(t) * a.ranks + uint64_t(m) * a.ranks_per_node;
    uint64_t mask = 0;
    for (uint32_t l = 0; l < a.ranks_per_node; ++l)
        if (in[l]) mask |= uint64_t(1) << l;
    return mask;
}

// The direct rows a warp pushes: from `next` (a multiple of the quantum), in runs of
// whole quanta, a run once it holds `chunk_rows` rows or the block is done.
struct DirectRun {
    uint32_t next;

    UEP_DEVICE void take(const ChunkedPush &p, uint32_t packed, uint32_t q, bool last) {
        const uint32_t end = packed / q * q;
        if (end <= next || (!last && end - next < p.chunk_rows)) return;
        // Every lane's stores of the rows before the write that carries them.
        sync_warp(kFullMask);
        fence_sys();
        if (lane_id() == 0) push_rows(p, next, end - next);
        next = end;
    }
};

// Block `b`'s tokens into destination `dn`.
UEP_DEVICE void pack(const NormalPackArgs &a, uint32_t b, uint32_t dn) {
    const NormalPackDest &d = a.dests[dn];
    const uint64_t rb = a.row_bytes, sb = uint64_t(a.groups) * 4, nd = a.dests_n;
    const bool packet = d.node != kNormalPackRank;
    const uint32_t *start = a.starts + (uint64_t(b) * nd + dn) * 2;
    uint32_t j = start[0], jd = start[1];
    DirectRun run{(jd + a.quantum - 1) / a.quantum * a.quantum};
    const uint32_t first = b * a.block_tokens;
    // A split may end in empty blocks (first past the tokens).
    const uint32_t end = first < a.tokens && a.tokens - first > a.block_tokens
                             ? first + a.block_tokens
                             : a.tokens;
    for (uint32_t t = first; t < end; ++t) {
        const uint64_t at = uint64_t(t) * nd + dn;
        if (!a.hit[at]) continue;
        const bool direct = a.direct[at];
        // The row's place: among the direct rows, among the rest of a packet, or its own
        // row in a same-node rank's output.
        const uint64_t row = direct ? jd : packet ? j - jd : j;
        uint8_t *x = d.region + (direct ? d.direct_x_off : d.x_off) + row * rb;
        warp_copy(x, a.x + uint64_t(t) * rb, rb);
        if (sb) {
            uint8_t *s = d.region + (direct ? d.direct_scales_off : d.scales_off) + row * sb;
            warp_copy(s, reinterpret_cast<const uint8_t *>(a.scales) + uint64_t(t) * sb, sb);
        }
        put_routing(a, d, t, j);
        if (lane_id() == 0) {
            if (packet)
                reinterpret_cast<uint64_t *>(d.region + d.mask_off)[j] = node_mask(a, t, d.node);
            reinterpret_cast<int32_t *>(d.region + d.src_off)[j] = int32_t(t);
        }
        ++j;
        if (direct && ++jd && d.push.rows) run.take(d.push, jd, a.quantum, false);
    }
    // A packet without a port (its node lost) pushes nothing; the host drops it.
    if (d.push.rows) run.take(d.push, jd, a.quantum, true);
}

}  // namespace

UEP_KERNEL void uep_normal_pack(NormalPackArgs a) {
    const uint32_t pairs = a.blocks * a.dests_n;
    for (uint32_t w = grid_warp(); w < pairs; w += grid_warps())
        pack(a, w / a.dests_n, w % a.dests_n);
}
