// The low-latency dispatch's casts (uep-ep's quant.rs and quant/nvfp4.rs are the
// definitions): FP8 e4m3 with an f32 scale per 128 channels, or NVFP4 with a scale byte
// per 16; a warp a group of 128 channels (half a warp with 16-byte loads), bit for bit
// the host device's.
#include "api.cuh"
#include "numerics.cuh"

namespace {

// A group of 128 channels read four a lane (a warp of 32; on 64-wide wavefronts the
// upper half reads the next group).
constexpr unsigned kLanesAGroup = uep::kFp8Group / 4;

// The group's four channels of this lane.
UEP_DEVICE void load4(const uint16_t *group, unsigned sub, uint16_t v[4]) {
    const uep::u32x2 raw = reinterpret_cast<const uep::u32x2 *>(group)[sub];
    v[0] = uint16_t(raw.x);
    v[1] = uint16_t(raw.x >> 16);
    v[2] = uint16_t(raw.y);
    v[3] = uint16_t(raw.y >> 16);
}

// Lanes `width` apart at most (a power of two below the group's lanes) reduce together.
UEP_DEVICE uint32_t max_over(uint32_t v, unsigned width) {
    for (unsigned d = width / 2; d > 0; d >>= 1) v = uep::max_u32(v, uep::shfl_xor(uep::kFullMask, v, d));
    return v;
}

}  // namespace

// One warp (32 lanes) a group, four channels a lane: the warp reads the group's 256
// bytes in one coalesced pass.
UEP_KERNEL void uep_fp8_quantize(uep::Fp8CastArgs a) {
    using namespace uep;
    const unsigned sub = lane_id() % kLanesAGroup;
    const unsigned groups_a_warp = kWarp / kLanesAGroup;
    const uint64_t own = uint64_t(grid_warp()) * groups_a_warp;
    const uint64_t step = uint64_t(grid_warps()) * groups_a_warp;
    // A warp's lanes share `base`, so all of them reach every shuffle.
    for (uint64_t base = own; base < a.groups; base += step) {
        const uint64_t g = base + lane_id() / kLanesAGroup;
        const bool live = g < a.groups;
        uint16_t v[4] = {0, 0, 0, 0};
        if (live) load4(a.x + g * kFp8Group, sub, v);
        uint32_t amax = 0;
        for (int i = 0; i < 4; ++i) amax = max_u32(amax, uint32_t(v[i] & 0x7fff));
        amax = max_over(amax, kLanesAGroup);
        const float s = fp8_scale(bf16_to_f32(uint16_t(amax)), a.round_scale != 0);
        const float inv = fdiv_rn(1.0f, s);
        uint32_t packed = 0;
        for (int i = 0; i < 4; ++i)
            packed |= uint32_t(e4m3_from_f32(fmul_rn(bf16_to_f32(v[i]), inv))) << (8 * i);
        if (live) {
            reinterpret_cast<uint32_t *>(a.q + g * kFp8Group)[sub] = packed;
            if (sub == 0) a.scales[g] = s;
        }
    }
}

// The same cast with 16-byte loads: eight channels a lane, sixteen lanes a group (more
// bytes in flight per load than the 8-byte version above).
UEP_KERNEL void uep_fp8_quantize_x16(uep::Fp8CastArgs a) {
    using namespace uep;
    constexpr unsigned kLanes16 = kFp8Group / 8;
    const unsigned sub = lane_id() % kLanes16;
    const unsigned groups_a_warp = kWarp / kLanes16;
    const uint64_t own = uint64_t(grid_warp()) * groups_a_warp;
    const uint64_t step = uint64_t(grid_warps()) * groups_a_warp;
    for (uint64_t base = own; base < a.groups; base += step) {
        const uint64_t g = base + lane_id() / kLanes16;
        const bool live = g < a.groups;
        u32x4 raw = {0, 0, 0, 0};
        if (live) raw = reinterpret_cast<const u32x4 *>(a.x + g * kFp8Group)[sub];
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        uint32_t amax = 0;
        for (int i = 0; i < 4; ++i) amax = max_u32(amax, max_u32(w[i] & 0x7fffu, (w[i] >> 16) & 0x7fffu));
        // Each group's lanes reduce apart: offsets below 16 stay inside a group.
        amax = max_over(amax, kLanes16);
        const float s = fp8_scale(bf16_to_f32(uint16_t(amax)), a.round_scale != 0);
        const float inv = fdiv_rn(1.0f, s);
        uint32_t out[2] = {0, 0};
        for (int i = 0; i < 8; ++i) {
            const uint16_t v = uint16_t(w[i / 2] >> (16 * (i % 2)));
            out[i / 4] |= uint32_t(e4m3_from_f32(fmul_rn(bf16_to_f32(v), inv))) << (8 * (i % 4));
        }
        if (live) {
            u32x2 packed;
            packed.x = out[0];
            packed.y = out[1];
            reinterpret_cast<u32x2 *>(a.q + g * kFp8Group)[sub] = packed;
            if (sub == 0) a.scales[g] = s;
        }
    }
}

// NVFP4: a warp a group of 128 channels, four channels a lane, four lanes a block of 16
// (one scale byte, written by the block's first lane); two codes a byte, the even
// channel in the low nibble.
UEP_KERNEL void uep_nvfp4_quantize(uep::Nvfp4CastArgs a) {
    using namespace uep;
    const unsigned sub = lane_id() % kLanesAGroup;
    const unsigned groups_a_warp = kWarp / kLanesAGroup;
    const uint64_t own = uint64_t(grid_warp()) * groups_a_warp;
    const uint64_t step = uint64_t(grid_warps()) * groups_a_warp;
    for (uint64_t base = own; base < a.groups; base += step) {
        const uint64_t g = base + lane_id() / kLanesAGroup;
        const bool live = g < a.groups;
        uint16_t v[4] = {0, 0, 0, 0};
        if (live) load4(a.x + g * kFp8Group, sub, v);
        // |bf16| orders like its low 15 bits; a NaN (above +inf's) does not count.
        uint32_t amax = 0;
        for (int i = 0; i < 4; ++i) {
            const uint32_t m = v[i] & 0x7fffu;
            amax = max_u32(amax, m <= 0x7f80u ? m : 0u);
        }
        amax = max_over(amax, kNvfp4Block / 4);
        const Nvfp4Scale s = nvfp4_scale(bf16_to_f32(uint16_t(amax)), a.global_scale, a.ue8m0 != 0);
        uint16_t codes = 0;
        for (int i = 0; i < 4; ++i)
            codes |= uint16_t(e2m1_from_f32(fmul_rn(bf16_to_f32(v[i]), s.out))) << (4 * i);
        if (live) {
            reinterpret_cast<uint16_t *>(a.q + g * (kFp8Group / 2))[sub] = codes;
            if (sub % (kNvfp4Block / 4) == 0) a.sf[g * (kFp8Group / kNvfp4Block) + sub / 4] = s.byte;
        }
    }
}
