// The device's side of uep's command FIFO (crates/uep-fifo, "Memory layout" and
// "Protocol"): a kernel is the ring's exclusive producer (the host holds a
// `DeviceLease` for it) and publishes each 16-byte command in host memory that is
// pinned and mapped into the device.
//
// Orders relied on (port.cuh's system-scope accesses, because the consumer is a CPU
// thread; docs/cuda.md has the PTX each is on a GPU):
//   st_relaxed_sys   word1 of the slot;
//   st_release_sys   word0 of the slot: a release orders the lane's earlier word1 store
//                    before it, so a CPU that sees a non-zero word0 (Acquire) sees that
//                    word1. This pair is the design's "one 16-byte store": a 16-byte
//                    vector store is two accesses in the PTX model, in no defined order,
//                    so it could expose word0 before word1.
//   ld_acquire_sys   tail (and head at start): the consumer zeroes a slot before its
//                    Release of tail, so a slot seen free is.
// A warp publishes up to a warp's width of commands at once, one a lane, each with its
// own release.
#pragma once
#include "cmd.cuh"
#include "port.cuh"

namespace uep {

// One FIFO as the kernel sees it: the device address of its region and its capacity.
struct Ring {
    uint64_t *base;
    uint64_t capacity;  // a power of two
};

// The producer's state, kept in registers by every lane of the owning warp.
struct Producer {
    Ring ring;
    uint64_t head;
    uint64_t cached_tail;

    UEP_DEVICE uint64_t *word(uint64_t index, int w) const {
        return ring.base + kFifoSlotsOff / 8 + 2 * (index & (ring.capacity - 1)) + w;
    }

    UEP_DEVICE uint64_t *tail_word() const { return ring.base + kFifoTailOff / 8; }

    // Continue from the head the previous producer stored back. Lane 0 reads head and
    // tail and the warp takes its values: the state must be the same in every lane, or
    // lanes that read a tail the consumer moved in between would part ways in reserve.
    UEP_DEVICE static Producer open(Ring ring) {
        Producer p{ring, 0, 0};
        if (lane_id() == 0) {
            p.head = ld_acquire_sys(ring.base + kFifoHeadOff / 8);
            p.cached_tail = ld_acquire_sys(p.tail_word());
        }
        p.head = shfl(kFullMask, p.head, 0);
        p.cached_tail = shfl(kFullMask, p.cached_tail, 0);
        return p;
    }

    // Wait (lane 0 polls, the warp follows) until `n` more slots are free.
    UEP_DEVICE void reserve(uint32_t n) {
        if (head + n - cached_tail <= ring.capacity) return;
        uint64_t tail = cached_tail;
        if (lane_id() == 0) {
            for (tail = ld_acquire_sys(tail_word()); head + n - tail > ring.capacity;
                 tail = ld_acquire_sys(tail_word()))
                pause();
        }
        cached_tail = shfl(kFullMask, tail, 0);
    }

    // Every lane of the warp calls this; lanes below `n` publish their command in
    // slots head + lane. Returns the first slot's index.
    UEP_DEVICE uint64_t push_warp(uint64_t w0, uint64_t w1, uint32_t n) {
        reserve(n);
        const unsigned lane = lane_id();
        const uint64_t first = head;
        if (lane < n) {
            st_relaxed_sys(word(first + lane, 1), w1);
            st_release_sys(word(first + lane, 0), w0);
        }
        head = first + n;
        return first;
    }

    // Every lane of the warp calls this; each lane with `has` publishes its command,
    // the lanes in lane order taking consecutive slots. Returns how many were pushed.
    UEP_DEVICE uint32_t push_lanes(bool has, uint64_t w0, uint64_t w1) {
        const lanemask_t mask = ballot(kFullMask, has);
        const uint32_t n = uint32_t(popc(mask));
        if (n == 0) return 0;
        reserve(n);
        if (has) {
            const uint64_t slot = head + uint64_t(popc(mask & lanes_below()));
            st_relaxed_sys(word(slot, 1), w1);
            st_release_sys(word(slot, 0), w0);
        }
        head += n;
        return n;
    }

    // Only for observers of head (a later producer, `Fifo::len`): the consumer gates
    // on word0.
    UEP_DEVICE void close() const {
        if (lane_id() == 0) st_release_sys(ring.base + kFifoHeadOff / 8, head);
    }

    UEP_DEVICE bool consumed(uint64_t slot) const { return ld_acquire_sys(tail_word()) > slot; }
};

// A ring many producers of one kernel push into at once, exclusive to the kernel for
// its launch (the host holds a `DeviceLease`): a producer claims slots by adding to
// `head` (the region's own word, as MSCCL++'s device FIFO claims its head with an
// atomic), waits until the consumer freed them, and publishes each as above. Slots
// leave in claim order: the consumer gates on each slot's word0 in turn.
struct SharedRing {
    uint64_t *base;
    uint64_t capacity;  // a power of two

    UEP_DEVICE uint64_t *word(uint64_t index, int w) const {
        return base + kFifoSlotsOff / 8 + 2 * (index & (capacity - 1)) + w;
    }

    // Claims `n` consecutive slots (n <= capacity) and waits until they are free;
    // returns the first. One thread's call.
    UEP_DEVICE uint64_t claim(uint32_t n) const {
        const uint64_t first = atomic_add(base + kFifoHeadOff / 8, uint64_t(n));
        while (first + n - ld_acquire_sys(base + kFifoTailOff / 8) > capacity) pause();
        return first;
    }

    // Publishes `c` in claimed slot `slot`.
    UEP_DEVICE void publish(uint64_t slot, Cmd c) const {
        st_relaxed_sys(word(slot, 1), c.word1);
        st_release_sys(word(slot, 0), c.word0);
    }
};

}  // namespace uep
