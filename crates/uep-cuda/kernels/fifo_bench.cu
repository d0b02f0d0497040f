// The FIFO figure: kernels push Write commands to CPU proxies (uep gpu fifo).
#include "api.cuh"

namespace {

// The `i`th command a ring carries: a 4 KiB Write whose offsets count `i`, so the
// consumer can check that every command arrived once and in order.
UEP_DEVICE uep::Cmd bench_cmd(uint32_t ring, uint64_t i) {
    const uint64_t off = (i & ((1ull << 26) - 1)) << 4;
    return uep::write_cmd(ring & 0xff, off, off, 4096, 0);
}

}  // namespace

// Block b's first warp is ring b's producer and pushes `count` commands, `batch` (1 to
// the warp's width) at a time: 1 is one thread's push, the width a whole warp's.
// `ns[b]` gets the warp's push time in nanoseconds.
UEP_KERNEL void uep_fifo_push(uep::FifoPushArgs a) {
    using namespace uep;
    if (warp_id() != 0) return;
    Producer p = Producer::open(a.rings[block_idx()]);
    const uint64_t t0 = clock_ns();
    for (uint64_t i = 0; i < a.count; i += a.batch) {
        const uint32_t n = uint32_t(a.count - i < a.batch ? a.count - i : a.batch);
        const Cmd c = bench_cmd(block_idx(), i + lane_id());
        p.push_warp(c.word0, c.word1, n);
    }
    p.close();
    const uint64_t t1 = clock_ns();
    if (lane_id() == 0) a.ns[block_idx()] = t1 - t0;
}

// Push -> pop latency: one thread pushes a command, waits until the proxy has popped
// it (tail passes the slot), and records the round trip in nanoseconds.
UEP_KERNEL void uep_fifo_ping(uep::FifoPingArgs a) {
    using namespace uep;
    if (warp_id() != 0) return;
    Producer p = Producer::open(a.rings[0]);
    for (uint32_t k = 0; k < a.rounds; ++k) {
        const uint64_t t0 = clock_ns();
        const Cmd c = bench_cmd(0, p.head);
        const uint64_t slot = p.push_warp(c.word0, c.word1, 1);
        if (lane_id() == 0)
            while (!p.consumed(slot)) pause();
        sync_warp(kFullMask);
        const uint64_t t1 = clock_ns();
        if (lane_id() == 0) a.ns[k] = t1 - t0;
    }
    p.close();
}
