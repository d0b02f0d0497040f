// get_dispatch_layout on the GPU (uep-ep's layout.rs is the definition): one warp a
// token, a lane a top-k slot; lanes naming the same rank (node) elect one of them with
// __match_any_sync, so a token counts once per rank and node. Integer atomics only, so
// the counts are exact whatever the order.
#include <stdint.h>

extern "C" __global__ void uep_dispatch_layout(const int64_t *topk_idx, uint32_t tokens,
                                               uint32_t topk, uint32_t experts, uint32_t ranks,
                                               uint32_t ranks_per_node, int32_t *per_rank,
                                               int32_t *per_node, int32_t *per_expert,
                                               uint8_t *in_rank, uint64_t *first_bad) {
    const unsigned lane = threadIdx.x & 31;
    const uint32_t warps = gridDim.x * (blockDim.x / 32);
    const uint32_t epr = experts / ranks;
    for (uint32_t t = (blockIdx.x * blockDim.x + threadIdx.x) / 32; t < tokens; t += warps) {
        const int64_t id = lane < topk ? topk_idx[uint64_t(t) * topk + lane] : -1;
        const bool valid = id >= 0 && id < int64_t(experts);
        if (lane < topk && !valid && id != -1)
            atomicMin(reinterpret_cast<unsigned long long *>(first_bad),
                      (unsigned long long)(uint64_t(t) * topk + lane));
        // Invalid and empty slots match each other under a rank no slot has.
        const uint32_t r = valid ? uint32_t(id) / epr : 0xffffffffu;
        const uint32_t node = valid ? r / ranks_per_node : 0xffffffffu;
        const uint32_t same_rank = __match_any_sync(0xffffffffu, r);
        const uint32_t same_node = __match_any_sync(0xffffffffu, node);
        if (valid) {
            atomicAdd(per_expert + id, 1);
            if ((__ffs(same_rank) - 1) == int(lane)) {
                atomicAdd(per_rank + r, 1);
                in_rank[uint64_t(t) * ranks + r] = 1;
            }
            if ((__ffs(same_node) - 1) == int(lane)) atomicAdd(per_node + node, 1);
        }
    }
}
