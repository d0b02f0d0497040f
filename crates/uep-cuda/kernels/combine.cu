// The combine's reduction on the GPU (uep-ep's quant.rs `reduce_rows` is the
// definition): out[t] = bf16(0 + w[t,0]*y[src[t,0]] + w[t,1]*y[src[t,1]] + ...), in f32,
// slot order, skipping -1 slots, each product and sum rounded on its own (no fused
// multiply-add), rounded to bf16 once. A block a token, a thread two columns a step.
#include "fp8.cuh"

__device__ __forceinline__ uint16_t bf16_from_f32(float x) {
    const uint32_t b = uep::f32_bits(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);
    return uint16_t((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

extern "C" __global__ void uep_combine_reduce(const uint16_t *y, const int32_t *src,
                                              const float *w, uint32_t tokens, uint32_t topk,
                                              uint32_t hidden, uint32_t weighted,
                                              uint16_t *out) {
    for (uint32_t t = blockIdx.x; t < tokens; t += gridDim.x) {
        for (uint32_t c = 2 * threadIdx.x; c < hidden; c += 2 * blockDim.x) {
            float a0 = 0.0f, a1 = 0.0f;
            for (uint32_t k = 0; k < topk; ++k) {
                const int32_t row = src[uint64_t(t) * topk + k];
                if (row < 0) continue;
                const uint32_t pair =
                    *reinterpret_cast<const uint32_t *>(y + uint64_t(row) * hidden + c);
                float v0 = uep::bf16_to_f32(uint16_t(pair)), v1 = uep::bf16_to_f32(uint16_t(pair >> 16));
                if (weighted) {
                    const float wk = w[uint64_t(t) * topk + k];
                    v0 = uep::fmul_rn(wk, v0);
                    v1 = uep::fmul_rn(wk, v1);
                }
                a0 = uep::fadd_rn(a0, v0);
                a1 = uep::fadd_rn(a1, v1);
            }
            *reinterpret_cast<uint32_t *>(out + uint64_t(t) * hidden + c) =
                uint32_t(bf16_from_f32(a0)) | (uint32_t(bf16_from_f32(a1)) << 16);
        }
    }
}
