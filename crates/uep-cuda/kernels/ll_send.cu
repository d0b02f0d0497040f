// The low-latency dispatch's send to ranks on other nodes, token by token, as
// UCCL-EP's kernels do it: a warp casts its token to FP8 once (per-128 scales, UE8M0
// optional), stores the row into the staging area in pinned host memory, and pushes
// one 16-byte Write per distinct destination rank of the token into its FIFO; the
// proxy then posts the row. Each block's first warp owns one FIFO.
#include "api.cuh"
#include "numerics.cuh"

namespace {

// Cast a token into `row`: [hidden] codes, then [hidden / 128] f32 scales; a warp a
// token, 128 channels a step (four a lane over 32 lanes; wider warps leave the rest
// idle).
UEP_DEVICE void cast_row(const uint16_t *x, uint32_t hidden, bool round_scale, uint8_t *row) {
    using namespace uep;
    const unsigned lane = lane_id();
    const bool mine = lane < kFp8Group / 4;
    for (uint32_t g = 0; g < hidden / kFp8Group; ++g) {
        uint16_t v[4] = {0, 0, 0, 0};
        if (mine) {
            const u32x2 raw = reinterpret_cast<const u32x2 *>(x + g * kFp8Group)[lane];
            v[0] = uint16_t(raw.x);
            v[1] = uint16_t(raw.x >> 16);
            v[2] = uint16_t(raw.y);
            v[3] = uint16_t(raw.y >> 16);
        }
        uint32_t amax = 0;
        for (int i = 0; i < 4; ++i) amax = max_u32(amax, uint32_t(v[i] & 0x7fff));
        for (unsigned d = kFp8Group / 8; d > 0; d >>= 1) amax = max_u32(amax, shfl_xor(kFullMask, amax, d));
        const float s = fp8_scale(bf16_to_f32(uint16_t(amax)), round_scale);
        const float inv = fdiv_rn(1.0f, s);
        uint32_t packed = 0;
        for (int i = 0; i < 4; ++i)
            packed |= uint32_t(e4m3_from_f32(fmul_rn(bf16_to_f32(v[i]), inv))) << (8 * i);
        if (mine) reinterpret_cast<uint32_t *>(row + g * kFp8Group)[lane] = packed;
        if (lane == 0) reinterpret_cast<float *>(row + hidden)[g] = s;
    }
}

}  // namespace

UEP_KERNEL void uep_ll_send(uep::LlSendArgs a) {
    using namespace uep;
    if (warp_id() != 0) return;
    const unsigned lane = lane_id();
    Producer p = Producer::open(a.rings[block_idx()]);
    const uint64_t t0 = clock_ns();
    const uint32_t row_bytes = a.hidden + a.hidden / 32;
    const uint32_t epr = a.experts / a.ranks;
    for (uint32_t t = block_idx(); t < a.tokens; t += grid_dim()) {
        uint8_t *row = a.staged + uint64_t(t) * row_bytes;
        cast_row(a.x + uint64_t(t) * a.hidden, a.hidden, a.round_scale != 0, row);
        // The whole warp's row stores before any lane's command: the proxy reads the
        // row once it pops the command.
        sync_warp(kFullMask);
        fence_sys();
        const int64_t id = lane < a.topk ? a.topk_idx[uint64_t(t) * a.topk + lane] : -1;
        const bool valid = id >= 0 && id < int64_t(a.experts);
        const uint32_t r = valid ? uint32_t(id) / epr : 0xffffffffu;
        const lanemask_t same = match_any(kFullMask, r);
        const bool leader = valid && lowest_lane(same) == int(lane);
        const uint64_t src = a.staged_off + uint64_t(t) * row_bytes;
        const uint64_t dst = a.recv_off + (uint64_t(a.src_rank) * a.max_tokens + t) * row_bytes;
        const Cmd c = write_cmd(r, src, dst, row_bytes, 0);
        p.push_lanes(leader, c.word0, c.word1);
    }
    p.close();
    const uint64_t t1 = clock_ns();
    if (lane == 0) a.ns[block_idx()] = t1 - t0;
}
