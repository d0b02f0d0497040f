// The LL combine's send as a kernel (uep-ep's device/host/pack.rs `ll_combine_pack` is
// the definition): a warp a local expert returns each of its output rows to the source
// that sent it, a same-node source's into its combine rows at [token, slot], another
// node's into that source's packet, whose fence groups' rows leave in chunks as they
// are stored (push.cuh). This rank's own rows stay where they are: the reduction reads
// them in place.
#include "api.cuh"
#include "copy.cuh"
#include "push.cuh"

UEP_KERNEL void uep_ll_combine_pack(uep::LlCombinePackArgs a) {
    using namespace uep;
    const uint64_t rows = uint64_t(a.ranks) * a.max_tokens, rb = uint64_t(a.hidden) * 2;
    for (uint32_t le = grid_warp(); le < a.experts; le += grid_warps()) {
        for (uint32_t src = 0; src < a.ranks; ++src) {
            const LlCombineSink &s = a.sinks[src];
            if (src == a.rank || s.kind == kLlSkip) continue;
            const uint64_t at_range = 2 * (uint64_t(le) * a.ranks + src);
            const uint32_t begin = uint32_t(a.layout_range[at_range]);
            const uint32_t n = uint32_t(a.layout_range[at_range + 1]);
            for (uint32_t j = 0; j < n; ++j) {
                const uint64_t row = le * rows + begin + j;
                const uint8_t *from = reinterpret_cast<const uint8_t *>(a.y + row * a.hidden);
                if (s.kind == kLlPeer) {
                    const uint64_t at = uint64_t(a.src_info[row]) * a.topk + uint64_t(a.src_slot[row]);
                    warp_copy(s.region + s.rows_off + at * rb, from, rb);
                } else {
                    const uint32_t at = s.first[le] + j;
                    warp_copy(s.region + s.rows_off + uint64_t(at) * rb, from, rb);
                    const ChunkedPush &p = s.pushes[s.group_of[le]];
                    if (p.chunk_done) row_stored(p, uint32_t((s.rows_off + uint64_t(at) * rb - p.src_off) / rb));
                }
            }
        }
    }
}
