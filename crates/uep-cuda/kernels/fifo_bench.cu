// The FIFO figure: kernels push Write commands to CPU proxies (uep gpu fifo).
#include "cmd.cuh"
#include "fifo.cuh"

using uep::Producer;
using uep::Ring;

// The `i`th command a ring carries: a 4 KiB Write whose offsets count `i`, so the
// consumer can check that every command arrived once and in order.
__device__ __forceinline__ uep::Cmd bench_cmd(uint32_t ring, uint64_t i) {
    const uint64_t off = (i & ((1ull << 26) - 1)) << 4;
    return uep::write_cmd(ring & 0xff, off, off, 4096, 0);
}

// Block b's first warp is ring b's producer and pushes `count` commands, `batch` (1 to
// 32) at a time: batch 1 is one thread's push, 32 a whole warp's. `ns[b]` gets the
// warp's push time in global-timer nanoseconds.
extern "C" __global__ void uep_fifo_push(const Ring *rings, uint64_t count, uint32_t batch,
                                         uint64_t *ns) {
    if (threadIdx.x >= 32) return;
    Producer p = Producer::open(rings[blockIdx.x]);
    uint64_t t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    const unsigned lane = threadIdx.x;
    for (uint64_t i = 0; i < count; i += batch) {
        const uint32_t n = uint32_t(count - i < batch ? count - i : batch);
        const uep::Cmd c = bench_cmd(blockIdx.x, i + lane);
        p.push_warp(c.word0, c.word1, n);
    }
    p.close();
    uint64_t t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (lane == 0) ns[blockIdx.x] = t1 - t0;
}

// Push -> pop latency: one thread pushes a command, waits until the proxy has popped
// it (tail passes the slot), and records the round trip in global-timer nanoseconds.
extern "C" __global__ void uep_fifo_ping(const Ring *rings, uint32_t rounds, uint64_t *ns) {
    if (threadIdx.x >= 32) return;
    Producer p = Producer::open(rings[0]);
    for (uint32_t k = 0; k < rounds; ++k) {
        uint64_t t0, t1;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        const uep::Cmd c = bench_cmd(0, p.head);
        const uint64_t slot = p.push_warp(c.word0, c.word1, 1);
        if (threadIdx.x == 0)
            while (!p.consumed(slot)) {
            }
        __syncwarp();
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
        if (threadIdx.x == 0) ns[k] = t1 - t0;
    }
    p.close();
}
