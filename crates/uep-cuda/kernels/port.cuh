// The one place that knows the target. Every kernel is written over this header and
// built three ways from the same source:
//   * nvcc (CUDA, sm_90 and sm_80): PTX for the scoped loads and stores, CUDA's warp
//     intrinsics;
//   * hipcc (HIP on AMD, gfx90a and gfx940): wavefronts of 64, HIP's builtins;
//   * the host build (the system C++ compiler): every CUDA thread a fiber, each warp's
//     lanes on one OS thread and every warp of the grid on its own, all at once
//     (host/runtime.h), so that a kernel spinning on a word another block or another
//     process stores makes progress, and warp collectives honour their masks.
// No kernel uses inline PTX, an intrinsic or a builtin variable (threadIdx, warpSize)
// except through this header.
#pragma once
#include <stdint.h>
#include <string.h>

#if defined(__HIP__) || defined(__HIPCC__)
#define UEP_TARGET_HIP 1
#include <hip/hip_runtime.h>
#elif defined(__CUDACC__)
#define UEP_TARGET_CUDA 1
#else
#define UEP_TARGET_HOST 1
#include "host/runtime.h"
#endif

#if defined(UEP_TARGET_HOST)
#define UEP_DEVICE inline
#define UEP_HOST_DEVICE inline
#define UEP_KERNEL extern "C"
#else
#define UEP_DEVICE __device__ __forceinline__
#define UEP_HOST_DEVICE __host__ __device__ __forceinline__
#define UEP_KERNEL extern "C" __global__
#endif

namespace uep {

// ---------------------------------------------------------------------------------
// Thread and block identity (one-dimensional grids and blocks only).

#if defined(UEP_TARGET_HOST)
using host::block_dim;
using host::block_idx;
using host::grid_dim;
using host::thread_idx;
// The host build's warps are CUDA's width, so that kernels run there as on a GPU.
constexpr unsigned kWarp = 32;
using lanemask_t = uint32_t;
#else
UEP_DEVICE unsigned thread_idx() { return threadIdx.x; }
UEP_DEVICE unsigned block_idx() { return blockIdx.x; }
UEP_DEVICE unsigned block_dim() { return blockDim.x; }
UEP_DEVICE unsigned grid_dim() { return gridDim.x; }
#if defined(UEP_TARGET_HIP)
constexpr unsigned kWarp = 64;
using lanemask_t = uint64_t;
#else
constexpr unsigned kWarp = 32;
using lanemask_t = uint32_t;
#endif
#endif

// Every lane of a warp.
constexpr lanemask_t kFullMask = ~lanemask_t(0);

UEP_DEVICE unsigned lane_id() { return thread_idx() % kWarp; }
UEP_DEVICE unsigned warp_id() { return thread_idx() / kWarp; }
// Warps of the whole grid, and this warp's index among them.
UEP_DEVICE unsigned grid_warps() { return grid_dim() * (block_dim() / kWarp); }
UEP_DEVICE unsigned grid_warp() { return (block_idx() * block_dim() + thread_idx()) / kWarp; }
// The lanes below this one.
UEP_DEVICE lanemask_t lanes_below() { return (lanemask_t(1) << lane_id()) - 1; }

// ---------------------------------------------------------------------------------
// Bit counts.

#if defined(UEP_TARGET_HOST)
UEP_DEVICE int popc(uint64_t x) { return __builtin_popcountll(x); }
// The lowest lane of a mask, -1 for none.
UEP_DEVICE int lowest_lane(uint64_t x) { return __builtin_ffsll(static_cast<long long>(x)) - 1; }
#else
UEP_DEVICE int popc(uint64_t x) { return __popcll(x); }
UEP_DEVICE int lowest_lane(uint64_t x) { return __ffsll(static_cast<long long>(x)) - 1; }
#endif

// ---------------------------------------------------------------------------------
// Barriers and warp collectives. `mask` names the lanes that take part; each of them
// must reach the same collective (the host build reports one that left or went
// elsewhere as an error).

#if defined(UEP_TARGET_CUDA)
UEP_DEVICE void sync_block() { __syncthreads(); }
UEP_DEVICE void sync_warp(lanemask_t mask) { __syncwarp(mask); }
UEP_DEVICE lanemask_t ballot(lanemask_t mask, bool p) { return __ballot_sync(mask, p); }
UEP_DEVICE lanemask_t match_any(lanemask_t mask, uint32_t v) { return __match_any_sync(mask, v); }
template <class T>
UEP_DEVICE T shfl(lanemask_t mask, T v, unsigned src) {
    return __shfl_sync(mask, v, src);
}
template <class T>
UEP_DEVICE T shfl_xor(lanemask_t mask, T v, unsigned lanes) {
    return __shfl_xor_sync(mask, v, lanes);
}
#elif defined(UEP_TARGET_HIP)
// HIP (ROCm 5.2) has no masked warp functions: a wavefront runs its active lanes in
// lockstep, and the kernels call these with every lane that the mask names active.
UEP_DEVICE void sync_block() { __syncthreads(); }
UEP_DEVICE void sync_warp(lanemask_t) { __builtin_amdgcn_wave_barrier(); }
UEP_DEVICE lanemask_t ballot(lanemask_t mask, bool p) { return __ballot(p) & mask; }
template <class T>
UEP_DEVICE T shfl(lanemask_t, T v, unsigned src) {
    return __shfl(v, int(src), int(kWarp));
}
template <class T>
UEP_DEVICE T shfl_xor(lanemask_t, T v, unsigned lanes) {
    return __shfl_xor(v, int(lanes), int(kWarp));
}
// No match instruction: each round the lowest lane left names a value and the lanes
// holding it leave.
UEP_DEVICE lanemask_t match_any(lanemask_t mask, uint32_t v) {
    lanemask_t left = mask, mine = 0;
    while (left) {
        const uint32_t named = __shfl(v, lowest_lane(left), int(kWarp));
        const lanemask_t same = ballot(mask, v == named) & left;
        if (v == named) mine = same;
        left &= ~same;
    }
    return mine;
}
#else
using host::ballot;
using host::match_any;
using host::shfl;
using host::shfl_xor;
using host::sync_block;
using host::sync_warp;
#endif

// ---------------------------------------------------------------------------------
// Memory: loads and stores with acquire/release at device (gpu) or system scope, and
// relaxed atomics. System scope is what a CPU thread (a proxy, the host) or a peer
// GPU observes; device scope what other blocks of this GPU observe.

#if defined(UEP_TARGET_CUDA)
UEP_DEVICE uint64_t ld_acquire_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
UEP_DEVICE uint64_t ld_acquire_gpu(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
UEP_DEVICE uint64_t ld_relaxed_sys(const uint64_t *p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
UEP_DEVICE void st_relaxed_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
UEP_DEVICE void st_release_sys(uint64_t *p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
UEP_DEVICE void st_release_gpu(uint64_t *p, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
UEP_DEVICE void fence_gpu() { __threadfence(); }
UEP_DEVICE void fence_sys() { __threadfence_system(); }
UEP_DEVICE int32_t atomic_add(int32_t *p, int32_t v) { return atomicAdd(p, v); }
UEP_DEVICE uint32_t atomic_add(uint32_t *p, uint32_t v) { return atomicAdd(p, v); }
UEP_DEVICE uint64_t atomic_add(uint64_t *p, uint64_t v) {
    return atomicAdd(reinterpret_cast<unsigned long long *>(p), static_cast<unsigned long long>(v));
}
UEP_DEVICE uint64_t atomic_min(uint64_t *p, uint64_t v) {
    return atomicMin(reinterpret_cast<unsigned long long *>(p), static_cast<unsigned long long>(v));
}
#elif defined(UEP_TARGET_HIP)
UEP_DEVICE uint64_t ld_acquire_sys(const uint64_t *p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
UEP_DEVICE uint64_t ld_acquire_gpu(const uint64_t *p) {
    return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
UEP_DEVICE uint64_t ld_relaxed_sys(const uint64_t *p) {
    return __hip_atomic_load(p, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
UEP_DEVICE void st_relaxed_sys(uint64_t *p, uint64_t v) {
    __hip_atomic_store(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
UEP_DEVICE void st_release_sys(uint64_t *p, uint64_t v) {
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
UEP_DEVICE void st_release_gpu(uint64_t *p, uint64_t v) {
    __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
UEP_DEVICE void fence_gpu() { __threadfence(); }
UEP_DEVICE void fence_sys() { __threadfence_system(); }
template <class T>
UEP_DEVICE T atomic_add(T *p, T v) {
    return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
UEP_DEVICE uint64_t atomic_min(uint64_t *p, uint64_t v) {
    return __hip_atomic_fetch_min(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
#else
// The host's memory model is at least as strong at every scope: both scopes are the
// same C++ atomic with the same order.
UEP_DEVICE uint64_t ld_acquire_sys(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
UEP_DEVICE uint64_t ld_acquire_gpu(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
UEP_DEVICE uint64_t ld_relaxed_sys(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
UEP_DEVICE void st_relaxed_sys(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
UEP_DEVICE void st_release_sys(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
UEP_DEVICE void st_release_gpu(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
UEP_DEVICE void fence_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
UEP_DEVICE void fence_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <class T>
UEP_DEVICE T atomic_add(T *p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
UEP_DEVICE uint64_t atomic_min(uint64_t *p, uint64_t v) {
    uint64_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
#endif

// ---------------------------------------------------------------------------------
// Time, and a pause for spin loops.

#if defined(UEP_TARGET_CUDA)
// Nanoseconds of the GPU's global timer.
UEP_DEVICE uint64_t clock_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
UEP_DEVICE void pause() { __nanosleep(32); }
#elif defined(UEP_TARGET_HIP)
// The constant-rate real-time counter (100 MHz on CDNA2/3) in nanoseconds.
UEP_DEVICE uint64_t clock_ns() { return __builtin_amdgcn_s_memrealtime() * 10; }
UEP_DEVICE void pause() { __builtin_amdgcn_s_sleep(1); }
#else
using host::clock_ns;
using host::pause;
#endif

// ---------------------------------------------------------------------------------
// Vectors for wide loads and stores, and f32 arithmetic with its rounding spelled out
// (no flag or contraction may change a bit: the host device is the definition).

#if defined(UEP_TARGET_HOST)
struct alignas(8) u32x2 {
    uint32_t x, y;
};
struct alignas(16) u32x4 {
    uint32_t x, y, z, w;
};
#else
using u32x2 = uint2;
using u32x4 = uint4;
#endif

// Bit casts (memcpy: a register move on every target).
UEP_HOST_DEVICE uint32_t f32_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}

UEP_HOST_DEVICE float f32_from_bits(uint32_t b) {
    float x;
    memcpy(&x, &b, 4);
    return x;
}

UEP_HOST_DEVICE float fdiv_rn(float a, float b) {
#if defined(UEP_TARGET_CUDA) && defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

UEP_HOST_DEVICE float fmul_rn(float a, float b) {
#if defined(UEP_TARGET_CUDA) && defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

UEP_HOST_DEVICE float fadd_rn(float a, float b) {
#if defined(UEP_TARGET_CUDA) && defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

UEP_HOST_DEVICE uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

}  // namespace uep
