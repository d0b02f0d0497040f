// Copies by a whole warp, as the data-moving kernels make them.
#pragma once
#include "port.cuh"

namespace uep {

// `n` bytes from `src` to `dst`, by the whole warp: 16 bytes a lane where both and `n`
// allow it, else 4, else 1. Lane l always moves the same pieces of a row (l, l + warp,
// ...), so a row moved down onto the previous one's place reads each piece before the
// same lane writes over it.
UEP_DEVICE void warp_copy(uint8_t *dst, const uint8_t *src, uint64_t n) {
    const uint64_t how = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n;
    if ((how & 15) == 0) {
        for (uint64_t i = lane_id(); i < n / 16; i += kWarp)
            reinterpret_cast<u32x4 *>(dst)[i] = reinterpret_cast<const u32x4 *>(src)[i];
    } else if ((how & 3) == 0) {
        for (uint64_t i = lane_id(); i < n / 4; i += kWarp)
            reinterpret_cast<uint32_t *>(dst)[i] = reinterpret_cast<const uint32_t *>(src)[i];
    } else {
        for (uint64_t i = lane_id(); i < n; i += kWarp) dst[i] = src[i];
    }
}

}  // namespace uep
