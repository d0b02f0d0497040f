// The host build's GPU: how a grid runs on CPU threads (port.cuh's third target).
//
// Every CUDA thread is a fiber. A warp's 32 lanes are fibers of one OS thread, which
// runs them in turn: a lane runs until it reaches a warp collective, a block barrier, a
// pause in a spin loop, or its end. Every warp of every block is an OS thread of its
// own and all of them start at once, so a kernel that spins (through `pause`) on a word
// that another block, another launch or another process stores makes progress, as on a
// GPU whose grid is resident.
//
// Collectives are checked as CUDA defines them: every lane a mask names must reach the
// same collective with the same mask. A lane that exited, a mask naming a lane that
// left or went to another collective, a lane outside its own mask, lanes the warp does
// not have, and a warp whose lanes all wait on collectives that can never complete end
// the launch with an error that names them; so does a spin past the launch's deadline.
// Once a launch fails, every lane stops at its next collective or pause.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace uep::host {

// One-dimensional identity of the calling lane.
unsigned thread_idx();
unsigned block_idx();
unsigned block_dim();
unsigned grid_dim();

// Block and warp barriers.
void sync_block();
void sync_warp(uint32_t mask);

// Warp collectives over up to 64-bit values (shuffles move the bits).
uint32_t ballot(uint32_t mask, bool p);
uint32_t match_any(uint32_t mask, uint32_t v);
uint64_t shfl_bits(uint32_t mask, uint64_t bits, unsigned src);
uint64_t shfl_xor_bits(uint32_t mask, uint64_t bits, unsigned lanes);

// `v` moved as the 8 bytes `move` shuffles.
template <class T, class Move>
inline T shuffled(T v, Move move) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = move(bits);
    memcpy(&v, &bits, sizeof(T));
    return v;
}

template <class T>
inline T shfl(uint32_t mask, T v, unsigned src) {
    return shuffled(v, [&](uint64_t bits) { return shfl_bits(mask, bits, src); });
}

template <class T>
inline T shfl_xor(uint32_t mask, T v, unsigned lanes) {
    return shuffled(v, [&](uint64_t bits) { return shfl_xor_bits(mask, bits, lanes); });
}

// Nanoseconds of a monotonic clock.
uint64_t clock_ns();
// A spin loop's pause: the warp's other lanes run, then other threads and processes.
void pause();

}  // namespace uep::host

// The launcher, as C for the Rust side (src/emu/ffi.rs).
extern "C" {

// A one-dimensional grid: `blocks` blocks of `threads` threads; a spin (pause) past
// `timeout_ns` after the launch ends it with an error (0: no deadline).
struct uep_host_grid {
    uint32_t blocks;
    uint32_t threads;
    uint64_t timeout_ns;
};

// Where a failed launch says why (NUL-terminated, cut to `len`).
struct uep_host_error {
    char *msg;
    size_t len;
};

// Runs `body(ctx)` on every thread of `grid`, all at once; returns once all ended: 0,
// or 1 with the first error in `err`.
int uep_host_launch(const uep_host_grid *grid, void (*body)(void *), void *ctx,
                    uep_host_error *err);

}  // extern "C"

namespace uep::host {

// `uep_host_launch` of a callable.
template <class F>
inline int launch(const uep_host_grid &grid, F &&f, uep_host_error *err) {
    using G = std::remove_reference_t<F>;
    return uep_host_launch(&grid, [](void *c) { (*static_cast<G *>(c))(); }, &f, err);
}

}  // namespace uep::host
