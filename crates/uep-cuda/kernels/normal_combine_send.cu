// The normal combine's send as a kernel (uep-ep's device/host/normal.rs
// `normal_combine_send` is the definition): a warp a received row stores it, and its
// weights, at its source token's row of the slot its source's sink names: the source's
// own combine rows at a rank of this node, or the relay slot of the rank that relays
// them to the source's node. Rows whose sink is none stay: this rank reduces them.
#include "api.cuh"
#include "copy.cuh"

UEP_KERNEL void uep_normal_combine_send(uep::NormalCombineSendArgs a) {
    using namespace uep;
    const uint64_t rb = uint64_t(a.hidden) * 2;
    for (uint32_t i = grid_warp(); i < a.rows; i += grid_warps()) {
        const ReturnSinkArgs &s = a.sinks[a.src_rank[i]];
        if (!s.region) continue;
        const uint64_t t = uint64_t(a.src_idx[i]);
        warp_copy(s.region + s.x_off + t * rb, reinterpret_cast<const uint8_t *>(a.x + uint64_t(i) * a.hidden), rb);
        if (a.weights && lane_id() < a.topk)
            reinterpret_cast<float *>(s.region + s.weights_off)[t * a.topk + lane_id()] =
                a.weights[uint64_t(i) * a.topk + lane_id()];
    }
}
