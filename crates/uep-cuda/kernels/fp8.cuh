// FP8 e4m3fn per-128-channel quantisation, the same function as uep-ep's quant.rs
// (which is the definition: its docs give the exact sequence of f32 operations).
// Host and device: the host build of this file is compared with quant.rs on every
// bf16 input (tests/numerics.rs), the device build on the GPU (uep gpu quant).
// Every f32 operation is spelled with its rounding (`__fdiv_rn`, `__fmul_rn`,
// `__fadd_rn` on the device) so no flag or contraction can change a bit.
#pragma once
#include <stdint.h>
#include <string.h>

#include "cmd.cuh"

namespace uep {

constexpr int kFp8Group = 128;

__host__ __device__ __forceinline__ uint32_t f32_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
#endif
}

__host__ __device__ __forceinline__ float f32_from_bits(uint32_t b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float x;
    memcpy(&x, &b, 4);
    return x;
#endif
}

__host__ __device__ __forceinline__ float fdiv_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

__host__ __device__ __forceinline__ float fmul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

__host__ __device__ __forceinline__ float fadd_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

// bf16 bits widened to f32 (exact).
__host__ __device__ __forceinline__ float bf16_to_f32(uint16_t b) {
    return f32_from_bits(uint32_t(b) << 16);
}

// Encode as e4m3fn: round to nearest even; beyond +-448 (infinities too) saturates to
// 0x7e/0xfe; NaN is 0x7f; -0.0 is 0x80. quant.rs `e4m3_from_f32`, operation by operation.
__host__ __device__ __forceinline__ uint8_t e4m3_from_f32(float x) {
    const uint32_t bits = f32_bits(x);
    const uint32_t sign = (bits >> 24) & 0x80;
    const uint32_t abs = bits & 0x7fffffffu;
    const uint32_t rebias = (127u - 7u) << 23;
    const uint32_t normal = (abs - rebias + (0x7ffffu + ((abs >> 20) & 1))) >> 20;
    const float mag = f32_from_bits(abs);
    const float magic = 16384.0f;
    const uint32_t subnormal = f32_bits(fadd_rn(mag, magic)) - f32_bits(magic);
    uint32_t code = mag < f32_from_bits(0x3c800000u) ? subnormal : normal;
    code = mag >= 448.0f ? 0x7eu : code;
    code |= sign;
    code = (mag != mag) ? 0x7fu : code;
    return uint8_t(code);
}

// The scale of a group whose largest magnitude is `amax` (quant.rs `fp8_scale`).
__host__ __device__ __forceinline__ float fp8_scale(float amax, bool round_scale) {
    // fmaxf(NaN, c) is c, as Rust's f32::max.
    const float clamped = amax > 1e-4f ? amax : 1e-4f;
    const float scale = fdiv_rn(clamped, 448.0f);
    const uint32_t bits = f32_bits(scale);
    const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
    if (!round_scale || !finite) return scale;
    return (bits & 0x7fffffu) == 0 ? scale : f32_from_bits(((bits >> 23) + 1) << 23);
}

}  // namespace uep
