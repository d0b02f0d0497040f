// Pushing a packet's rows from the kernels that store them (api.cuh's ChunkedPush).
#pragma once
#include "api.cuh"

namespace uep {

// One write of the push: `len` bytes from `src` to `dst`, counted as the push says.
UEP_DEVICE void push_write(const ChunkedPush &p, uint64_t src, uint64_t dst, uint64_t len) {
    const Cmd cmd = p.ordered ? normal_write_cmd(p.dst_rank, src, dst, uint32_t(len), p.key, 0)
                              : ll_write_cmd(p.dst_rank, src, dst, uint32_t(len), p.key_kind, p.key);
    p.ring.publish(p.ring.claim(1), cmd);
    atomic_add(p.writes, uint64_t(1));
    atomic_add(p.sent_bytes, len);
    atomic_add(p.kernel_cmds, uint64_t(1));
}

// Rows [first, first + rows) of the push, stored and fenced already, leave as one write
// (two, with their scale rows); one lane pushes them.
UEP_DEVICE void push_rows(const ChunkedPush &p, uint32_t first, uint32_t rows) {
    const uint64_t at = uint64_t(first) * p.row_bytes, len = uint64_t(rows) * p.row_bytes;
    push_write(p, p.src_off + at, p.dst_off + at, len);
    if (p.scale_bytes) {
        const uint64_t s = uint64_t(first) * p.scale_bytes;
        push_write(p, p.scales_src_off + s, p.scales_dst_off + s, uint64_t(rows) * p.scale_bytes);
    }
}

// Row `i` (of the push's rows) is stored by the calling warp: the warp that stores a
// chunk's last row pushes the chunk's write (and its scales'), so the writes follow the
// rows' size, not the number of warps.
UEP_DEVICE void row_stored(const ChunkedPush &p, uint32_t i) {
    // Every lane's stores of the row before its count; the pusher's after the count.
    sync_warp(kFullMask);
    fence_sys();
    const uint32_t c = i / p.chunk_rows, first = c * p.chunk_rows;
    const uint32_t rows = p.rows - first < p.chunk_rows ? p.rows - first : p.chunk_rows;
    uint32_t last = 0;
    if (lane_id() == 0) last = atomic_add(p.chunk_done + c, 1u) + 1 == rows;
    if (!shfl(kFullMask, last, 0)) return;
    fence_sys();
    if (lane_id() == 0) push_rows(p, first, rows);
}

}  // namespace uep
