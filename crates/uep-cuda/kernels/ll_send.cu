// The low-latency dispatch's send to ranks on other nodes, token by token, as
// UCCL-EP's kernels do it: a warp casts its token to FP8 once (per-128 scales, UE8M0
// optional), stores the row into the staging area in pinned host memory, and pushes
// one 16-byte Write per distinct destination rank of the token into its FIFO; the
// proxy then posts the row. Each block's one warp owns one FIFO.
#include "cmd.cuh"
#include "fifo.cuh"
#include "fp8.cuh"

struct SendArea {
    uint8_t *staged;      // device address of the staged rows (pinned host memory)
    uint64_t staged_off;  // their byte offset in the sender's symmetric buffer
    uint64_t recv_off;    // the receive area's byte offset in every rank's buffer
    uint32_t src_rank;    // this rank: its block of the receive area
    uint32_t max_tokens;  // rows a block of the receive area holds
};

// Cast token `t` into `row`: q [hidden] bytes, then [hidden / 128] f32 scales.
__device__ void cast_row(const uint16_t *x, uint32_t hidden, bool round_scale, uint8_t *row) {
    const unsigned lane = threadIdx.x & 31;
    for (uint32_t g = 0; g < hidden / uep::kFp8Group; ++g) {
        const uint2 raw = reinterpret_cast<const uint2 *>(x + g * uep::kFp8Group)[lane];
        const uint16_t v[4] = {uint16_t(raw.x), uint16_t(raw.x >> 16), uint16_t(raw.y),
                               uint16_t(raw.y >> 16)};
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) amax = max(amax, uint32_t(v[i] & 0x7fff));
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
        const float s = uep::fp8_scale(uep::bf16_to_f32(uint16_t(amax)), round_scale);
        const float inv = uep::fdiv_rn(1.0f, s);
        uint32_t packed = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            packed |= uint32_t(uep::e4m3_from_f32(uep::fmul_rn(uep::bf16_to_f32(v[i]), inv)))
                      << (8 * i);
        reinterpret_cast<uint32_t *>(row + g * uep::kFp8Group)[lane] = packed;
        if (lane == 0) reinterpret_cast<float *>(row + hidden)[g] = s;
    }
}

extern "C" __global__ void uep_ll_send(const uint16_t *x, const int64_t *topk_idx,
                                       uint32_t tokens, uint32_t topk, uint32_t hidden,
                                       uint32_t experts, uint32_t ranks, uint32_t round_scale,
                                       SendArea area, const uep::Ring *rings, uint64_t *ns) {
    if (threadIdx.x >= 32) return;
    const unsigned lane = threadIdx.x;
    uep::Producer p = uep::Producer::open(rings[blockIdx.x]);
    uint64_t t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const uint32_t row_bytes = hidden + hidden / 32;
    const uint32_t epr = experts / ranks;
    for (uint32_t t = blockIdx.x; t < tokens; t += gridDim.x) {
        uint8_t *row = area.staged + uint64_t(t) * row_bytes;
        cast_row(x + uint64_t(t) * hidden, hidden, round_scale != 0, row);
        // The whole warp's row stores before any lane's command: the proxy reads the
        // row once it pops the command.
        __syncwarp();
        __threadfence_system();
        const int64_t id = lane < topk ? topk_idx[uint64_t(t) * topk + lane] : -1;
        const bool valid = id >= 0 && id < int64_t(experts);
        const uint32_t r = valid ? uint32_t(id) / epr : 0xffffffffu;
        const uint32_t same = __match_any_sync(0xffffffffu, r);
        const bool leader = valid && (__ffs(same) - 1) == int(lane);
        const uint64_t src = area.staged_off + uint64_t(t) * row_bytes;
        const uint64_t dst =
            area.recv_off + (uint64_t(area.src_rank) * area.max_tokens + t) * row_bytes;
        const uep::Cmd c = uep::write_cmd(r, src, dst, row_bytes, 0);
        p.push_lanes(leader, c.word0, c.word1);
    }
    p.close();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (lane == 0) ns[blockIdx.x] = t1 - t0;
}
