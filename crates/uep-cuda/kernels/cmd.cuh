// uep's 16-byte TransferCmd (crates/uep-wire/src/cmd.rs has the bit table), for the
// commands a kernel pushes. Host and device: a test compares it with the Rust encoder.
#pragma once
#include "port.cuh"

namespace uep {

// Byte offsets in a FIFO region (uep-fifo's HEAD_OFFSET, TAIL_OFFSET, HEADER_BYTES; a
// test compares them).
constexpr uint64_t kFifoHeadOff = 128;
constexpr uint64_t kFifoTailOff = 256;
constexpr uint64_t kFifoSlotsOff = 384;

constexpr uint64_t kKindWrite = 1;
constexpr uint64_t kPiggybackNone = 0xFFFF;
// word0: kind bits 0..3, combine bit 4, LL buffer bit 5, dst rank bits 6..15 (10 bits:
// up to 1024 ranks), piggyback slot 16..31, len 32..55.
constexpr uint64_t kFlagCombine = 1ull << 4;
constexpr uint64_t kFlagLlBuffer = 1ull << 5;
constexpr unsigned kRankShift = 6;
constexpr uint32_t kRankMask = 0x3ff;
// An LL write's piggyback slot: bit 15 the LL namespace, bit 10 a count signal (not set
// for a data arrival), bits 0..9 the fence key (uep-proxy's cmds.rs has the table).
constexpr uint64_t kLlSlot = 1ull << 15;
constexpr uint32_t kLlKeyMask = 0x3ff;

struct Cmd {
    uint64_t word0, word1;
};

// A Write of `len` bytes from `src_off` to `dst_off` on `dst_rank` (offsets 16-byte
// aligned, len < 2^24, dst_rank < 1024), no piggyback; `flags` holds kFlagCombine and
// kFlagLlBuffer.
UEP_HOST_DEVICE Cmd write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off, uint32_t len,
                              uint64_t flags) {
    Cmd c;
    c.word0 = kKindWrite | flags | (uint64_t(dst_rank & kRankMask) << kRankShift) |
              (kPiggybackNone << 16) | (uint64_t(len) << 32);
    c.word1 = (dst_off >> 4) | ((src_off >> 4) << 32);
    return c;
}

// A normal-mode write of `len` bytes to `dst_rank` on ordered channel `channel` with a
// tail increment of `tail_inc`: uep-proxy's `cmds::normal_write`.
UEP_HOST_DEVICE Cmd normal_write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off,
                                     uint32_t len, uint32_t channel, uint32_t tail_inc) {
    Cmd c;
    c.word0 = kKindWrite | (uint64_t(dst_rank & kRankMask) << kRankShift) |
              (uint64_t(channel & 0xff) << 16) | (uint64_t(len) << 32) |
              (uint64_t(tail_inc & 0xff) << 56);
    c.word1 = (dst_off >> 4) | ((src_off >> 4) << 32);
    return c;
}

// An LL data write of `len` bytes to `dst_rank` that the receiver counts as one
// arrival under the fence key (`kind`, `key`): uep-proxy's `cmds::ll_write`.
UEP_HOST_DEVICE Cmd ll_write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off,
                                 uint32_t len, uint32_t kind, uint32_t key) {
    Cmd c;
    c.word0 = kKindWrite | (kind ? kFlagLlBuffer : 0) |
              (uint64_t(dst_rank & kRankMask) << kRankShift) |
              ((kLlSlot | (key & kLlKeyMask)) << 16) | (uint64_t(len) << 32);
    c.word1 = (dst_off >> 4) | ((src_off >> 4) << 32);
    return c;
}

}  // namespace uep
