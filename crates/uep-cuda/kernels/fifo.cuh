// The device's side of uep's command FIFO (crates/uep-fifo, "Memory layout" and
// "Protocol"): a kernel is the ring's exclusive producer (the host holds a
// `DeviceLease` for it) and publishes each 16-byte command in host memory that is
// pinned and mapped into the device.
//
// PTX relied on (PTX ISA memory consistency model, scope .sys because the consumer
// is a CPU thread):
//   st.relaxed.sys.global.u64   word1 of the slot;
//   st.release.sys.global.u64   word0 of the slot: a release orders the thread's
//                               earlier word1 store before it, so a CPU that sees a
//                               non-zero word0 (Acquire) sees that word1. This pair is
//                               the design's "one 16-byte store": a v2.u64 vector store
//                               is two accesses in the model, in no defined order, so
//                               it could expose word0 before word1.
//   ld.acquire.sys.global.u64   tail (and head at start): the consumer zeroes a slot
//                               before its Release of tail, so a slot seen free is.
// A warp publishes up to 32 commands at once, one a lane, each with its own release
// (one instruction for the warp), so the system fence is paid once per 32 commands.
#pragma once
#include <stdint.h>

#include "cmd.cuh"

namespace uep {

// One FIFO as the kernel sees it: the device address of its region and its capacity.
struct Ring {
    uint64_t *base;
    uint64_t capacity;  // a power of two
};

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_relaxed_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// The producer's state, kept in registers by every lane of the owning warp.
struct Producer {
    Ring ring;
    uint64_t head;
    uint64_t cached_tail;

    __device__ __forceinline__ uint64_t *word(uint64_t index, int w) const {
        return ring.base + kFifoSlotsOff / 8 + 2 * (index & (ring.capacity - 1)) + w;
    }

    __device__ __forceinline__ uint64_t *tail_word() const { return ring.base + kFifoTailOff / 8; }

    // Continue from the head the previous producer stored back.
    __device__ static Producer open(Ring ring) {
        Producer p{ring, 0, 0};
        p.head = ld_acquire_sys(ring.base + kFifoHeadOff / 8);
        p.cached_tail = ld_acquire_sys(p.tail_word());
        return p;
    }

    // Wait (lane 0 polls, the warp follows) until `n` more slots are free.
    __device__ void reserve(uint32_t n) {
        const unsigned lane = threadIdx.x & 31;
        if (head + n - cached_tail <= ring.capacity) return;
        uint64_t tail = cached_tail;
        if (lane == 0) {
            do {
                tail = ld_acquire_sys(tail_word());
            } while (head + n - tail > ring.capacity);
        }
        cached_tail = __shfl_sync(0xffffffffu, tail, 0);
    }

    // Every lane of the warp calls this; lanes below `n` publish their command in
    // slots head + lane. Returns the first slot's index.
    __device__ uint64_t push_warp(uint64_t w0, uint64_t w1, uint32_t n) {
        reserve(n);
        const unsigned lane = threadIdx.x & 31;
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
    __device__ uint32_t push_lanes(bool has, uint64_t w0, uint64_t w1) {
        const unsigned lane = threadIdx.x & 31;
        const uint32_t mask = __ballot_sync(0xffffffffu, has);
        const uint32_t n = __popc(mask);
        if (n == 0) return 0;
        reserve(n);
        if (has) {
            const uint64_t slot = head + __popc(mask & ((1u << lane) - 1));
            st_relaxed_sys(word(slot, 1), w1);
            st_release_sys(word(slot, 0), w0);
        }
        head += n;
        return n;
    }

    // Only for observers of head (a later producer, `Fifo::len`): the consumer gates
    // on word0.
    __device__ void close() const {
        if ((threadIdx.x & 31) == 0) st_release_sys(ring.base + kFifoHeadOff / 8, head);
    }

    __device__ bool consumed(uint64_t slot) const { return ld_acquire_sys(tail_word()) > slot; }
};

}  // namespace uep
