// The normal dispatch's notify as a kernel (uep-ep's device/host/normal.rs
// `normal_notify` is the definition): a warp a rank stores this rank's counts and head
// into that rank's slot, then publishes the slot with its epoch word (release, system
// scope: a peer that acquires the epoch sees the counts), or into the packet for a rank
// of another node, which the host sends after.
#include "api.cuh"

UEP_KERNEL void uep_normal_notify(uep::NormalNotifyArgs a) {
    using namespace uep;
    for (uint32_t r = grid_warp(); r < a.ranks; r += grid_warps()) {
        const NotifySinkArgs &s = a.sinks[r];
        if (s.kind == kNotifySkip) continue;
        uint32_t *counts = reinterpret_cast<uint32_t *>(s.region + s.counts_off);
        for (uint32_t i = lane_id(); i < a.counts_len; i += kWarp) counts[i] = a.counts[i];
        if (lane_id() == 0) {
            uint32_t *head = reinterpret_cast<uint32_t *>(s.region + s.head_off);
            head[0] = a.tokens;
            head[1] = a.flags;
        }
        if (s.kind != kNotifySlot) continue;
        // Every lane's counts before the epoch.
        sync_warp(kFullMask);
        fence_sys();
        if (lane_id() == 0) st_release_sys(reinterpret_cast<uint64_t *>(s.region + s.epoch_off), a.seq);
    }
}
