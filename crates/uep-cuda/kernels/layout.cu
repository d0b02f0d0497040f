// get_dispatch_layout (uep-ep's layout.rs is the definition): one warp a token, a lane
// a top-k slot (top-k at most 32, the narrowest warp); lanes naming the same rank
// (node) elect one of them with match_any, so a token counts once per rank and node.
// Integer atomics only, so the counts are exact whatever the order.
#include "api.cuh"

UEP_KERNEL void uep_dispatch_layout(uep::LayoutArgs a) {
    using namespace uep;
    const unsigned lane = lane_id();
    const uint32_t epr = a.experts / a.ranks;
    for (uint32_t t = grid_warp(); t < a.tokens; t += grid_warps()) {
        const int64_t id = lane < a.topk ? a.topk_idx[uint64_t(t) * a.topk + lane] : -1;
        const bool valid = id >= 0 && id < int64_t(a.experts);
        if (lane < a.topk && !valid && id != -1)
            atomic_min(a.first_bad, uint64_t(t) * a.topk + lane);
        // Invalid and empty slots match each other under a rank no slot has.
        const uint32_t r = valid ? uint32_t(id) / epr : 0xffffffffu;
        const uint32_t node = valid ? r / a.ranks_per_node : 0xffffffffu;
        const lanemask_t same_rank = match_any(kFullMask, r);
        const lanemask_t same_node = match_any(kFullMask, node);
        if (valid) {
            atomic_add(a.per_expert + id, 1);
            if (lowest_lane(same_rank) == int(lane)) {
                atomic_add(a.per_rank + r, 1);
                a.in_rank[uint64_t(t) * a.ranks + r] = 1;
            }
            if (lowest_lane(same_node) == int(lane)) atomic_add(a.per_node + node, 1);
        }
    }
}
