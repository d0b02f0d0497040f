// What the warp collectives, barriers and spins give on a target, written so that every
// build computes the same words (the host build's tests compare them with the values
// CUDA defines; a GPU gives the same), and the misuses the host build reports. Each
// thread writes kSelftestWords words at out[(block * threads + thread) * words].
#include "api.cuh"

namespace {

using uep::lanemask_t;

UEP_DEVICE void collectives(uint64_t *out) {
    using namespace uep;
    const unsigned lane = lane_id();
    out[0] = shfl(kFullMask, uint64_t(1000 + lane), (lane * 7) % 32);
    out[1] = shfl_xor(kFullMask, uint32_t(lane * 3), 5);
    out[2] = uint64_t(ballot(kFullMask, lane % 3 == 0));
    out[3] = uint64_t(match_any(kFullMask, lane % 5));
    // Two half-warps, each its own collective over its own mask.
    const lanemask_t half = lane < 16 ? lanemask_t(0xffff) : lanemask_t(0xffff0000u);
    out[4] = uint64_t(ballot(half, lane % 2 == 1));
    out[5] = shfl(half, uint64_t(lane), lane < 16 ? 15 : 16);
    // Lanes leave a loop at different rounds, then meet again.
    uint64_t sum = 0;
    for (unsigned i = 0; i < lane % 4; ++i) sum += i;
    sync_warp(kFullMask);
    out[6] = sum + uint64_t(popc(ballot(kFullMask, true)));
    out[7] = uint64_t(lowest_lane(ballot(kFullMask, lane >= 9)));
}

// Each thread stores its word, the block meets, then each reads the word of the thread
// a warp and one further on.
UEP_DEVICE void block_sync(uint64_t *out, uint64_t *block_words) {
    using namespace uep;
    const unsigned t = thread_idx();
    block_words[t] = 7 * t + block_idx();
    sync_block();
    const unsigned other = (t + 33) % block_dim();
    out[0] = block_words[other];
    sync_block();
}

// Block b stores its flag, then waits for block b + 1's: only a grid whose blocks all
// run at once gets through.
UEP_DEVICE void spin_ring(uint64_t *out, uint64_t *flags) {
    using namespace uep;
    const unsigned b = block_idx(), next = (b + 1) % grid_dim();
    if (thread_idx() == 0) st_release_sys(flags + b, 1);
    if (lane_id() == 0)
        while (ld_acquire_sys(flags + next) == 0) pause();
    sync_warp(kFullMask);
    out[0] = ld_acquire_sys(flags + next);
}

}  // namespace

UEP_KERNEL void uep_selftest(uep::SelftestArgs a) {
    using namespace uep;
    const uint64_t me = uint64_t(block_idx()) * block_dim() + thread_idx();
    uint64_t *out = a.out + me * kSelftestWords;
    switch (a.which) {
        case kSelftestCollectives: collectives(out); break;
        case kSelftestBlockSync:
            block_sync(out, a.flags + uint64_t(block_idx()) * block_dim());
            break;
        case kSelftestSpinRing: spin_ring(out, a.flags); break;
        case kSelftestExitedLane:
            if (lane_id() == 3) return;
            out[0] = ballot(kFullMask, true);
            break;
        case kSelftestMismatch:
            out[0] = lane_id() < 16 ? ballot(kFullMask, true) : match_any(kFullMask, 1);
            break;
        case kSelftestOutsideMask:
            if (lane_id() < 16) out[0] = shfl(lanemask_t(0xffff), uint64_t(1), 20);
            break;
        case kSelftestDeadlock:
            if (lane_id() < 16)
                out[0] = ballot(kFullMask, true);
            else
                sync_block();
            break;
        case kSelftestSpinForever:
            while (ld_acquire_sys(a.flags) == 0) pause();
            break;
    }
}
