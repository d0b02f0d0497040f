// The normal dispatch's forward as a kernel (uep-ep's device/host/normal.rs `relay` is
// the definition), on the rank that relays a source of another node: a warp a token of
// the landed packet stores it into the output row of each rank of this node its rows
// name: x and scales (read from the packet, or from this rank's own output row where the
// source sent it straight here), its expert ids made local to that rank, its weights,
// its source index.
#include "api.cuh"
#include "copy.cuh"

namespace {

using namespace uep;

constexpr uint32_t kNotSent = 0xffffffffu;

// Token `j`'s ids and weights as rank `r` gets them, into its output row `row`.
UEP_DEVICE void put_routing(const RelayArgs &a, uint8_t *region, uint32_t j, uint32_t r,
                            uint64_t row) {
    const unsigned lane = lane_id();
    if (!a.idx || lane >= a.topk) return;
    const int64_t e = a.idx[uint64_t(j) * a.topk + lane];
    const bool mine = e >= 0 && uint64_t(e) / a.experts_per_rank == r;
    reinterpret_cast<int64_t *>(region + a.recv_topk_idx_off)[row * a.topk + lane] =
        mine ? e - int64_t(r) * a.experts_per_rank : -1;
    if (a.weights)
        reinterpret_cast<float *>(region + a.recv_topk_weights_off)[row * a.topk + lane] =
            (mine || a.all_weights) ? a.weights[uint64_t(j) * a.topk + lane] : 0.0f;
}

}  // namespace

UEP_KERNEL void uep_relay(RelayArgs a) {
    const uint64_t rb = a.row_bytes, sb = uint64_t(a.groups) * 4;
    for (uint32_t j = grid_warp(); j < a.n; j += grid_warps()) {
        const uint32_t *at = a.rows + uint64_t(j) * a.ranks_per_node;
        const bool own = a.from[j] == kNotSent;
        const uint8_t *x = own ? a.local + a.recv_x_off + uint64_t(at[a.local_rank]) * rb
                               : a.local + a.packet_x_off + uint64_t(a.from[j]) * rb;
        const uint8_t *scales = own ? a.local + a.recv_scales_off + uint64_t(at[a.local_rank]) * sb
                                    : a.local + a.packet_scales_off + uint64_t(a.from[j]) * sb;
        for (uint32_t l = 0; l < a.ranks_per_node; ++l) {
            if (at[l] == kNotSent) continue;
            const uint64_t row = at[l];
            uint8_t *region = reinterpret_cast<uint8_t *>(a.regions[l]);
            // This rank's own row, sent straight here, is in place already.
            if (!(l == a.local_rank && own)) {
                warp_copy(region + a.recv_x_off + row * rb, x, rb);
                if (sb) warp_copy(region + a.recv_scales_off + row * sb, scales, sb);
            }
            put_routing(a, region, j, a.node * a.ranks_per_node + l, row);
            if (lane_id() == 0) reinterpret_cast<int32_t *>(region + a.recv_src_off)[row] = a.tokens[j];
        }
    }
}
