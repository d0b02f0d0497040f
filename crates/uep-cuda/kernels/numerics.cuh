// The numerics every device must match bit for bit: bf16 widening and rounding, FP8
// e4m3fn per-128-channel scales, NVFP4 (e2m1 codes, e4m3 or UE8M0 block scales). uep-ep's
// quant.rs and quant/nvfp4.rs are the definitions (their docs give the exact sequence
// of f32 operations); tests/host_check.rs compares this header's host build with them on
// every bf16 input. Every f32 operation is spelled with its rounding (port.cuh's
// fdiv_rn, fmul_rn, fadd_rn) so no flag or contraction can change a bit.
#pragma once
#include "port.cuh"

namespace uep {

constexpr int kFp8Group = 128;
constexpr int kNvfp4Block = 16;

// bf16 bits widened to f32 (exact).
UEP_HOST_DEVICE float bf16_to_f32(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }

// f32 rounded to bf16 bits: nearest even; a NaN stays a NaN, made quiet (quant.rs
// `bf16_bits_from_f32`).
UEP_HOST_DEVICE uint16_t bf16_from_f32(float x) {
    const uint32_t b = f32_bits(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x40);
    return uint16_t((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

// Encode as e4m3fn: round to nearest even; beyond +-448 (infinities too) saturates to
// 0x7e/0xfe; NaN is 0x7f; -0.0 is 0x80. quant.rs `e4m3_from_f32`, operation by operation.
UEP_HOST_DEVICE uint8_t e4m3_from_f32(float x) {
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

// Decode an e4m3fn byte (exact; 0x7f and 0xff are NaN). quant.rs `e4m3_to_f32`.
UEP_HOST_DEVICE float e4m3_to_f32(uint8_t byte) {
    const uint32_t b = byte;
    const uint32_t sign = (b & 0x80) << 24;
    const uint32_t exp = (b >> 3) & 0xf, mant = b & 0x7;
    uint32_t magnitude;
    if (exp == 0xf && mant == 0x7) {
        magnitude = 0x7fc00000u;
    } else if (exp == 0) {
        magnitude = f32_bits(fmul_rn(float(mant), 1.0f / 512.0f));
    } else {
        magnitude = ((exp << 23) + ((127u - 7u) << 23)) | (mant << 20);
    }
    return f32_from_bits(sign | magnitude);
}

// The scale of a group whose largest magnitude is `amax` (quant.rs `fp8_scale`).
UEP_HOST_DEVICE float fp8_scale(float amax, bool round_scale) {
    // fmaxf(NaN, c) is c, as Rust's f32::max.
    const float clamped = amax > 1e-4f ? amax : 1e-4f;
    const float scale = fdiv_rn(clamped, 448.0f);
    const uint32_t bits = f32_bits(scale);
    const bool finite = (bits & 0x7f800000u) != 0x7f800000u;
    if (!round_scale || !finite) return scale;
    return (bits & 0x7fffffu) == 0 ? scale : f32_from_bits(((bits >> 23) + 1) << 23);
}

// Encode as e2m1 (nvfp4.rs `e2m1_from_f32`): nearest, ties to even; beyond +-6, an
// infinity or a NaN saturates to +-6 by its sign bit; the sign of a zero is kept.
UEP_HOST_DEVICE uint8_t e2m1_from_f32(float x) {
    const uint32_t bits = f32_bits(x);
    float m = f32_from_bits(bits & 0x7fffffffu);
    m = (m != m || m > 3.40282347e38f) ? 3.40282347e38f : m;
    const uint32_t code = uint32_t(m > 0.25f) + uint32_t(m >= 0.75f) + uint32_t(m > 1.25f) +
                          uint32_t(m >= 1.75f) + uint32_t(m > 2.5f) + uint32_t(m >= 3.5f) +
                          uint32_t(m > 5.0f);
    return uint8_t(code | ((bits >> 28) & 0x8));
}

// The UE8M0 byte of the least power of two >= x, saturated to [2^-127, 2^127]; NaN is
// 255 (nvfp4.rs `ue8m0_round_up`).
UEP_HOST_DEVICE uint8_t ue8m0_round_up(float x) {
    if (x != x) return 255;
    if (x <= 0.0f) return 0;
    const uint32_t bits = f32_bits(x);
    const uint32_t exp = (bits >> 23) & 0xff, mantissa = bits & 0x7fffffu;
    uint32_t byte;
    if (exp == 0) {
        byte = mantissa > (1u << 22) ? 1 : 0;
    } else if (exp == 255) {
        byte = 254;
    } else {
        byte = exp + (mantissa != 0 ? 1 : 0);
    }
    return uint8_t(byte < 254 ? byte : 254);
}

// The value of a UE8M0 byte, 2^(byte - 127) (255 is NaN).
UEP_HOST_DEVICE float ue8m0_to_f32(uint8_t byte) {
    if (byte == 255) return f32_from_bits(0x7fc00000u);
    if (byte == 0) return f32_from_bits(1u << 22);
    return f32_from_bits(uint32_t(byte) << 23);
}

// An NVFP4 block's scale byte and the factor its channels are multiplied by before
// encoding, from the block's largest magnitude (NaNs left out) and the global scale
// (nvfp4.rs `nvfp4_quantize_token`).
struct Nvfp4Scale {
    uint8_t byte;
    float out;
};

UEP_HOST_DEVICE Nvfp4Scale nvfp4_scale(float amax, float global_scale, bool ue8m0) {
    const float recip6 = 1.0f / 6.0f;
    const float s = fmul_rn(global_scale, fmul_rn(amax, recip6));
    Nvfp4Scale r;
    r.byte = ue8m0 ? ue8m0_round_up(s) : e4m3_from_f32(s);
    const float decoded = ue8m0 ? ue8m0_to_f32(r.byte) : e4m3_to_f32(r.byte);
    r.out = (amax == 0.0f || decoded == 0.0f) ? 0.0f : fdiv_rn(global_scale, decoded);
    return r;
}

}  // namespace uep
