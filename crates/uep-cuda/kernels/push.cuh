// Pushing a packet's rows from the kernels that store them (api.cuh's ChunkedPush).
#pragma once
#include "api.cuh"

namespace uep {

// Row `i` (of the push's rows) is stored by the calling warp: the warp that stores a
// chunk's last row pushes the chunk's write, so the writes a count signal counts follow
// the packet's size, not the number of warps.
UEP_DEVICE void row_stored(const ChunkedPush &p, uint32_t i, uint32_t row_bytes) {
    // Every lane's stores of the row before its count; the pusher's after the count.
    sync_warp(kFullMask);
    fence_sys();
    const uint32_t c = i / p.chunk_rows, first = c * p.chunk_rows;
    const uint32_t rows = p.rows - first < p.chunk_rows ? p.rows - first : p.chunk_rows;
    uint32_t last = 0;
    if (lane_id() == 0) last = atomic_add(p.chunk_done + c, 1u) + 1 == rows;
    if (!shfl(kFullMask, last, 0)) return;
    fence_sys();
    if (lane_id() == 0) {
        const uint64_t src = p.rows_off + uint64_t(first) * row_bytes;
        const uint64_t len = uint64_t(rows) * row_bytes;
        const Cmd cmd = ll_write_cmd(p.dst_rank, src, p.dst_base + (src - p.src_base), uint32_t(len),
                                     p.key_kind, p.key);
        p.ring.publish(p.ring.claim(1), cmd);
        atomic_add(p.writes, uint64_t(1));
        atomic_add(p.sent_bytes, len);
        atomic_add(p.kernel_cmds, uint64_t(1));
    }
}

}  // namespace uep
