// The index of uep's kernels: every entry point and the one argument it takes, as
// DeepEP's api.cuh lists its kernels. Each argument is a plain struct of addresses and
// sizes, passed by value; src/api.rs mirrors each one for the Rust side (the same
// struct for a GPU launch and for the host build's, which host/entry.cpp exports), and
// a test compares their sizes.
//
// Addresses are the device's: device or mapped memory on a GPU, host memory in the host
// build. Counts are 32-bit where a grid index covers them.
#pragma once
#include "fifo.cuh"
#include "port.cuh"

namespace uep {

// get_dispatch_layout (layout.cu): which ranks, nodes and experts each token goes to.
struct LayoutArgs {
    const int64_t *topk_idx;  // [tokens, topk] expert ids, -1 for an empty slot
    int32_t *per_rank;        // [ranks] tokens to each rank (zeroed by the caller)
    int32_t *per_node;        // [ranks / ranks_per_node]
    int32_t *per_expert;      // [experts]
    uint8_t *in_rank;         // [tokens, ranks] 0/1 (zeroed)
    uint64_t *first_bad;      // UINT64_MAX, lowered to the first entry out of range
    uint32_t tokens, topk, experts, ranks, ranks_per_node, pad;
};

// The low-latency dispatch's FP8 cast (cast.cu): per 128 channels an f32 scale.
struct Fp8CastArgs {
    const uint16_t *x;  // [groups * 128] bf16 bits, 16-byte aligned
    uint8_t *q;         // [groups * 128] e4m3 codes
    float *scales;      // [groups]
    uint64_t groups;
    uint32_t round_scale;  // UE8M0 scales (powers of two)
    uint32_t pad;
};

// The low-latency dispatch's NVFP4 cast (cast.cu): per 16 channels a scale byte.
struct Nvfp4CastArgs {
    const uint16_t *x;  // [groups * 128] bf16 bits, 8-byte aligned
    uint8_t *q;         // [groups * 64] two e2m1 codes a byte, the even channel low
    uint8_t *sf;        // [groups * 8] block scale bytes
    uint64_t groups;
    float global_scale;
    uint32_t ue8m0;  // UE8M0 block scales instead of e4m3
};

// One row a token's output sums (uep_ep::device::Part): row `row` of source `source`,
// times `weight` when weighted.
struct ReducePart {
    uint32_t source, row;
    float weight;
};

// Both combines' reduction (reduce.cu): token t's row is the f32 sum, in order, of its
// parts parts[starts[t]..starts[t + 1]], read where they are, rounded once to bf16.
struct ReduceArgs {
    const uint16_t *const *sources;  // [sources] first row of each (bf16 bits)
    const uint32_t *starts;          // [tokens + 1]
    const ReducePart *parts;
    uint16_t *out;  // [tokens, hidden]
    uint32_t tokens, hidden, weighted, pad;
};

// The FIFO figure (fifo_bench.cu).
struct FifoPushArgs {
    const Ring *rings;  // one a block
    uint64_t *ns;       // [blocks] each producer warp's push time
    uint64_t count;     // commands a ring
    uint32_t batch;     // 1 to the warp's width at a time
    uint32_t pad;
};

struct FifoPingArgs {
    const Ring *rings;  // rings[0]
    uint64_t *ns;       // [rounds] push -> pop round trips
    uint32_t rounds;
    uint32_t pad;
};

// The LL send to other nodes, token by token (ll_send.cu).
struct LlSendArgs {
    const uint16_t *x;        // [tokens, hidden] bf16 bits
    const int64_t *topk_idx;  // [tokens, topk]
    const Ring *rings;        // one a block
    uint64_t *ns;             // [blocks]
    uint8_t *staged;          // device address of the staged rows
    uint64_t staged_off;      // their byte offset in the sender's symmetric buffer
    uint64_t recv_off;        // the receive area's byte offset in every rank's buffer
    uint32_t src_rank, max_tokens;
    uint32_t tokens, topk, hidden, experts, ranks, round_scale;
};

// Where the LL dispatch's pack puts one rank's copies (ll_pack.cu).
enum LlSinkKind : uint32_t {
    kLlSkip = 0,    // nowhere: a masked rank
    kLlPeer = 1,    // a rank of this node: each copy at its row of that rank's areas
    kLlPacket = 2,  // a rank of another node: each token once into a staged packet
};

// Rows that the kernels storing them push themselves, in chunks: rows
// [c * chunk_rows, (c + 1) * chunk_rows) leave as one write (two, with their scale rows)
// once all are stored, whichever warps stored them (push.cuh).
struct ChunkedPush {
    uint64_t src_off;  // the first row, a byte offset in this rank's region
    uint64_t dst_off;  // where it lands at the peer
    uint64_t scales_src_off, scales_dst_off;  // the same of the scale rows (scale_bytes > 0)
    uint32_t rows;        // rows to push
    uint32_t chunk_rows;  // rows a write covers (its last may be shorter)
    uint32_t row_bytes, scale_bytes;  // bytes a row, and of its scales (0: none)
    uint32_t *chunk_done;  // [chunks] rows stored so far (zeroed); null: nothing pushed
    SharedRing ring;       // the FIFO, leased to the kernel
    uint64_t *writes;      // writes pushed (a fenced packet's count signal counts them)
    uint64_t *sent_bytes;  // bytes handed to the proxy (this rank's network path)
    uint64_t *kernel_cmds;  // commands kernels pushed (this rank's network path)
    uint32_t dst_rank;
    uint32_t ordered;    // 1: normal mode's ordered stream on channel `key`, else LL fenced
    uint32_t key_kind, key;
};

struct LlPackSink {
    uint32_t kind;         // an LlSinkKind
    uint32_t packet_rows;  // packet: rows in it
    uint8_t *region;       // peer: that rank's memory; packet: this rank's
    const uint32_t *row_of;  // packet: [tokens] each token's row in it, UINT32_MAX none
    // The packet's areas, byte offsets in `region`.
    uint64_t rows_off, scales_off, ids_off, slots_off, weights_off;
    ChunkedPush push;  // packet: its rows as they are stored
};

// The LL dispatch's pack (ll_pack.cu): every (token, slot) copy into its row at a
// same-node rank, every token once into the packet of each rank on another node it
// goes to, the packets' rows pushed as they are complete.
struct LlPackArgs {
    const uint8_t *x;         // [tokens, row_bytes] rows as sent
    const float *scales;      // [tokens, scale_words] (null for bf16)
    const int64_t *topk_idx;  // [tokens, topk]
    const float *weights;     // [tokens, topk] (null: none given)
    const uint32_t *pos;      // [tokens * topk] each copy's row in its expert's block
    const LlPackSink *sinks;  // [ranks]
    // The receive areas, byte offsets in every rank's region.
    uint64_t recv_x_off, recv_scales_off, recv_src_off, recv_weight_off;
    uint32_t tokens, row_bytes, scale_words, topk;
    uint32_t rank, ranks, experts_per_rank, max_tokens;
};

// A packet that landed from a source on another node, as the LL receive reads it.
struct LlLandedArgs {
    uint32_t present;  // 0: the source is on this node (its rows are in recv_x)
    uint32_t pad;
    uint64_t rows_off;       // the packet's rows, a byte offset in the region
    const uint32_t *starts;  // [experts + 1] each local expert's copies in rows/codes
    const uint32_t *rows;    // each copy's row in the packet
    const int32_t *codes;    // each copy's token * topk + slot
    const float *scales;     // [packet rows, scale_words]
    const float *weights;    // [packet rows, topk]
};

// The LL dispatch's receive (ll_unpack.cu): every local expert's rows packed to the
// front of its block, sources ascending, scales column-major, the handle's tables.
struct LlUnpackArgs {
    uint8_t *region;               // this rank's memory
    const uint32_t *counts;        // [experts, ranks] rows from each source
    const LlLandedArgs *landed;    // [ranks]
    uint64_t recv_x_off, out_scales_off, recv_scales_off, recv_src_off, recv_weight_off;
    int32_t *layout_range;  // [experts, ranks, 2] (begin, count)
    int32_t *recv_count;    // [experts]
    int32_t *src_info;      // [experts, ranks * max_tokens], -1 filled
    int32_t *src_slot;      // the same
    float *src_weight;      // the same, or null (an unweighted dispatch)
    uint32_t experts, ranks, max_tokens, row_bytes, scale_words, topk;
};

// The LL dispatch's placement (ll_place.cu): where every copy goes, from topk_idx
// alone, with the routing's checks and fingerprint.
struct LlPlaceArgs {
    const int64_t *topk_idx;  // [tokens, topk]
    uint32_t *per_expert;     // [experts] copies each expert gets
    uint32_t *pos;            // [tokens * topk] each copy's row among its expert's (UINT32_MAX filled)
    uint32_t *row_of;         // [ranks, tokens] each token's row among a rank's (UINT32_MAX filled)
    uint32_t *rows;           // [ranks] tokens going to each rank
    uint64_t *first_bad;      // UINT64_MAX, lowered to the first slot outside [-1, experts)
    uint64_t *fingerprint;    // the routing's FNV-1a
    uint32_t tokens, topk, experts, ranks;
};

// Where the LL combine's pack returns one source's rows (ll_combine_pack.cu).
struct LlCombineSink {
    uint32_t kind;    // an LlSinkKind
    uint32_t groups;  // packet: its fence groups
    uint8_t *region;  // peer: that rank's memory; packet: this rank's
    uint64_t rows_off;        // peer: its combine rows; packet: the packet's rows
    const uint32_t *first;     // packet: [experts] each expert's first row in it
    const uint32_t *group_of;  // packet: [experts] each expert's fence group
    const ChunkedPush *pushes;  // packet: [groups] each group's rows as they are stored
};

// The LL combine's send (ll_combine_pack.cu): every expert output row back to its
// source, same-node ones into their combine rows, the others into packets.
struct LlCombinePackArgs {
    const uint16_t *y;              // [experts * ranks * max_tokens, hidden] bf16 bits
    const int32_t *layout_range;    // [experts, ranks, 2] (begin, count)
    const int32_t *src_info;        // [experts, ranks * max_tokens]
    const int32_t *src_slot;        // the same
    const LlCombineSink *sinks;     // [ranks]
    uint32_t experts, ranks, max_tokens, hidden, topk, rank;
};

// Where the normal combine returns one source's rows (normal_combine_send.cu): nowhere
// (region null), or the slot at a rank of this node whose rows and weights are indexed
// by the source's token.
struct ReturnSinkArgs {
    uint8_t *region;      // that rank's memory, or null: the rows stay
    uint64_t x_off;       // the slot's [tokens, hidden] rows
    uint64_t weights_off;  // the slot's [tokens, topk] weights
};

// The normal combine's send (normal_combine_send.cu): every received row back to its
// source's token row in the slot its sink names, with its weights.
struct NormalCombineSendArgs {
    const uint16_t *x;        // [rows, hidden] bf16 bits
    const float *weights;     // [rows, topk], or null: the combine returns none
    const int32_t *src_rank;  // [rows]
    const int32_t *src_idx;   // [rows]
    const ReturnSinkArgs *sinks;  // [ranks]
    uint32_t rows, hidden, topk, pad;
};

// Where the normal dispatch's notify puts this rank's counts for one rank
// (normal_notify.cu).
enum NotifySinkKind : uint32_t {
    kNotifySkip = 0,    // nowhere
    kNotifySlot = 1,    // a same-node rank's slot, published by its epoch word
    kNotifyPacket = 2,  // the packet to a rank of another node, in this rank's memory
};

struct NotifySinkArgs {
    uint32_t kind;  // a NotifySinkKind
    uint32_t pad;
    uint8_t *region;  // slot: that rank's memory; packet: this rank's
    uint64_t head_off, counts_off;  // the head (tokens, flags) and the [ranks + experts] counts
    uint64_t epoch_off;             // slot: the epoch word, stored last with release
};

// The normal dispatch's notify (normal_notify.cu).
struct NormalNotifyArgs {
    const uint32_t *counts;       // [ranks + experts] tokens per rank, then per expert
    const NotifySinkArgs *sinks;  // [ranks]
    uint32_t ranks, counts_len;
    uint32_t tokens, flags;  // the head
    uint64_t seq;            // the epoch the slots are published with
};

// Where the normal dispatch's pack stores one destination's rows (normal_pack.cu): the
// output areas of a rank of this node (from this source's first row there), or the
// packet staged for another node, whose direct rows `push` sends to its relay's output.
struct NormalPackDest {
    uint8_t *region;   // the memory the rows go to (this rank's own for a packet)
    uint32_t rank;     // a rank of this node: which (its ids are made local to it)
    uint32_t node;     // a packet: the node it goes to; kNormalPackRank: a rank of this node
    // The areas, byte offsets in `region`: rows (a packet's: those not sent direct),
    // scales, ids, weights, source tokens, a packet's node-rank masks and direct rows.
    uint64_t x_off, scales_off, topk_off, weights_off, src_off, mask_off;
    uint64_t direct_x_off, direct_scales_off;
    ChunkedPush push;  // a packet: its direct rows, chunk_rows (whole quanta) a write
};

constexpr uint32_t kNormalPackRank = 0xffffffffu;

// The normal dispatch's pack: each token into each destination it goes to, a warp a
// block of tokens and a destination (DeepEP's channel and target rank).
struct NormalPackArgs {
    const uint8_t *x;         // [tokens, row_bytes]
    const float *scales;      // [tokens, groups] (null: bf16)
    const int64_t *topk_idx;  // [tokens, topk] (null: the rows carry none)
    const float *weights;     // [tokens, topk] (null: none given or carried)
    const uint8_t *hit;       // [tokens][dests] the token goes there
    const uint8_t *direct;    // [tokens][dests] the token goes straight to the relay
    const uint32_t *starts;   // [blocks + 1][dests][2] (rows, direct rows) before each block
    const uint8_t *in_rank;   // [tokens, ranks] the token goes to the rank
    const NormalPackDest *dests;
    uint32_t tokens, block_tokens, blocks, dests_n;
    uint32_t row_bytes, groups, topk, with_topk, with_weights, all_weights;
    uint32_t ranks, ranks_per_node, experts_per_rank, quantum;
};

// The normal dispatch's forward on the rank that relays a source of another node
// (relay.cu): each token of the landed packet into the output rows of the node's ranks.
struct RelayArgs {
    uint8_t *local;           // this rank's memory: the landed packet, its own output rows
    const uint64_t *regions;  // [ranks per node] each node rank's memory
    uint64_t packet_x_off, packet_scales_off;  // the packet's rows and scales
    // The output bank and source indices, at the same offsets in every rank's memory.
    uint64_t recv_x_off, recv_scales_off, recv_topk_idx_off, recv_topk_weights_off, recv_src_off;
    const int64_t *idx;       // [n, topk] global expert ids (null: none carried)
    const float *weights;     // [n, topk] (null: none carried)
    const int32_t *tokens;    // [n] source token index
    const uint32_t *from;     // [n] the packet's row of each token's x, UINT32_MAX: own row
    const uint32_t *rows;     // [n, ranks per node] output rows, UINT32_MAX: not sent
    uint32_t n, ranks_per_node, local_rank, node;
    uint32_t row_bytes, groups, topk, experts_per_rank;
    uint32_t all_weights;     // every slot's weight goes (else the local slots' only)
    uint32_t pad;
};

// The host build's own check (selftest.cu): what the warp collectives, barriers and
// spins give, and the errors the host build reports.
struct SelftestArgs {
    uint64_t *out;    // [blocks * threads * kSelftestWords]
    uint64_t *flags;  // [blocks] words the spin cases store and wait on
    uint32_t which;   // a SelftestCase
    uint32_t pad;
};

constexpr unsigned kSelftestWords = 8;

enum SelftestCase : uint32_t {
    kSelftestCollectives = 0,  // shfl, shfl_xor, ballot, match_any, half-warp masks
    kSelftestBlockSync = 1,    // sync_block orders stores across the block's warps
    kSelftestSpinRing = 2,     // each block waits for the next block's flag
    kSelftestExitedLane = 3,   // error: a lane left before a full-mask ballot
    kSelftestMismatch = 4,     // error: lanes met at different collectives
    kSelftestOutsideMask = 5,  // error: a shuffle reads a lane outside its mask
    kSelftestDeadlock = 6,     // error: half the warp at sync_block, half at a ballot
    kSelftestSpinForever = 7,  // error: a spin past the deadline
};

}  // namespace uep

// The entry points, as every build names them.
UEP_KERNEL void uep_dispatch_layout(uep::LayoutArgs a);
UEP_KERNEL void uep_fp8_quantize(uep::Fp8CastArgs a);
UEP_KERNEL void uep_fp8_quantize_x16(uep::Fp8CastArgs a);
UEP_KERNEL void uep_nvfp4_quantize(uep::Nvfp4CastArgs a);
UEP_KERNEL void uep_reduce(uep::ReduceArgs a);
UEP_KERNEL void uep_fifo_push(uep::FifoPushArgs a);
UEP_KERNEL void uep_fifo_ping(uep::FifoPingArgs a);
UEP_KERNEL void uep_ll_send(uep::LlSendArgs a);
UEP_KERNEL void uep_ll_place(uep::LlPlaceArgs a);
UEP_KERNEL void uep_ll_pack(uep::LlPackArgs a);
UEP_KERNEL void uep_normal_pack(uep::NormalPackArgs a);
UEP_KERNEL void uep_ll_unpack(uep::LlUnpackArgs a);
UEP_KERNEL void uep_ll_combine_pack(uep::LlCombinePackArgs a);
UEP_KERNEL void uep_normal_combine_send(uep::NormalCombineSendArgs a);
UEP_KERNEL void uep_normal_notify(uep::NormalNotifyArgs a);
UEP_KERNEL void uep_relay(uep::RelayArgs a);
UEP_KERNEL void uep_selftest(uep::SelftestArgs a);
