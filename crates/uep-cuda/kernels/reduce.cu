// Both combines' reduction (uep-ep's quant.rs `reduce_rows` is the definition), reading
// every row where it is (a caller's tensor, this rank's or a same-node peer's memory):
// token t's output is bf16(0 + w0*r0 + w1*r1 + ...) over its parts in order, in f32,
// each product and sum rounded on its own (no fused multiply-add), rounded to bf16
// once. A block a token, a thread two channels a step (one where rows are not 4-byte
// aligned or hidden is odd).
#include "api.cuh"
#include "numerics.cuh"

namespace {

UEP_DEVICE float term(const uep::ReduceArgs &a, const uep::ReducePart &p, float v) {
    return a.weighted ? uep::fmul_rn(p.weight, v) : v;
}

}  // namespace

UEP_KERNEL void uep_reduce(uep::ReduceArgs a) {
    using namespace uep;
    // Pairs when every source's rows and the output are 4-byte aligned (a block-uniform
    // choice: the same for every thread).
    const bool pairs = a.hidden % 2 == 0 && (reinterpret_cast<uintptr_t>(a.out) & 3) == 0;
    for (uint32_t t = block_idx(); t < a.tokens; t += grid_dim()) {
        const uint32_t begin = a.starts[t], end = a.starts[t + 1];
        bool aligned = pairs;
        for (uint32_t i = begin; i < end && aligned; ++i)
            aligned = (reinterpret_cast<uintptr_t>(a.sources[a.parts[i].source]) & 3) == 0;
        uint16_t *out = a.out + uint64_t(t) * a.hidden;
        const uint32_t width = aligned ? 2 : 1;
        for (uint32_t c = width * thread_idx(); c < a.hidden; c += width * block_dim()) {
            float a0 = 0.0f, a1 = 0.0f;
            for (uint32_t i = begin; i < end; ++i) {
                const ReducePart p = a.parts[i];
                const uint16_t *row = a.sources[p.source] + uint64_t(p.row) * a.hidden + c;
                if (aligned) {
                    const uint32_t pair = *reinterpret_cast<const uint32_t *>(row);
                    a0 = fadd_rn(a0, term(a, p, bf16_to_f32(uint16_t(pair))));
                    a1 = fadd_rn(a1, term(a, p, bf16_to_f32(uint16_t(pair >> 16))));
                } else {
                    a0 = fadd_rn(a0, term(a, p, bf16_to_f32(row[0])));
                }
            }
            if (aligned) {
                *reinterpret_cast<uint32_t *>(out + c) =
                    uint32_t(bf16_from_f32(a0)) | (uint32_t(bf16_from_f32(a1)) << 16);
            } else {
                out[c] = bf16_from_f32(a0);
            }
        }
    }
}
