// The LL dispatch's FP8 cast (per 128 channels, optional UE8M0 scale): one warp a
// group, four channels a lane; the same bits as uep-ep's quant.rs (uep gpu quant).
#include "fp8.cuh"

extern "C" __global__ void uep_fp8_quantize(const uint16_t *x, uint64_t groups,
                                            uint32_t round_scale, uint8_t *q, float *scales) {
    const unsigned lane = threadIdx.x & 31;
    const uint64_t warps = uint64_t(gridDim.x) * (blockDim.x / 32);
    for (uint64_t g = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; g < groups;
         g += warps) {
        // 8 bytes a lane: the warp reads the group's 256 bytes in one coalesced pass.
        const uint2 raw = reinterpret_cast<const uint2 *>(x + g * uep::kFp8Group)[lane];
        const uint16_t v[4] = {uint16_t(raw.x), uint16_t(raw.x >> 16), uint16_t(raw.y),
                               uint16_t(raw.y >> 16)};
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = max(amax, uint32_t(v[i] & 0x7fff));
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
        const float s = uep::fp8_scale(uep::bf16_to_f32(uint16_t(amax)), round_scale != 0);
        const float inv = uep::fdiv_rn(1.0f, s);
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            packed |= uint32_t(uep::e4m3_from_f32(uep::fmul_rn(uep::bf16_to_f32(v[i]), inv)))
                      << (8 * i);
        reinterpret_cast<uint32_t *>(q + g * uep::kFp8Group)[lane] = packed;
        if (lane == 0) scales[g] = s;
    }
}

// The same cast with 16-byte loads: eight channels a lane, half a warp a group, two
// groups a warp step (more bytes in flight per load than the 8-byte version above).
extern "C" __global__ void uep_fp8_quantize_x16(const uint16_t *x, uint64_t groups,
                                                uint32_t round_scale, uint8_t *q,
                                                float *scales) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned half = lane >> 4, sub = lane & 15;
    const uint64_t warps = uint64_t(gridDim.x) * (blockDim.x / 32);
    const uint64_t first = (uint64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    for (uint64_t pair = first; 2 * pair < groups; pair += warps) {
        const uint64_t g = 2 * pair + half;
        const bool live = g < groups;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (live) raw = reinterpret_cast<const uint4 *>(x + g * uep::kFp8Group)[sub];
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            amax = max(amax, max(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
        // Lanes 0-15 and 16-31 reduce apart: offsets below 16 stay in each half.
#pragma unroll
        for (int d = 8; d > 0; d >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
        const float s = uep::fp8_scale(uep::bf16_to_f32(uint16_t(amax)), round_scale != 0);
        const float inv = uep::fdiv_rn(1.0f, s);
        uint32_t out[2] = {0, 0};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint16_t v = uint16_t(w[i / 2] >> (16 * (i % 2)));
            out[i / 4] |= uint32_t(uep::e4m3_from_f32(uep::fmul_rn(uep::bf16_to_f32(v), inv)))
                          << (8 * (i % 4));
        }
        if (live) {
            reinterpret_cast<uint2 *>(q + g * uep::kFp8Group)[sub] = make_uint2(out[0], out[1]);
            if (sub == 0) scales[g] = s;
        }
    }
}
