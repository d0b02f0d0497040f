// The LL dispatch's send as a kernel (uep-ep's device/host/pack.rs is the definition of
// where every row goes): a warp a token. Each copy of a token for an expert of a rank
// of this node is stored straight into that rank's receive areas; each token goes once
// into the packet of each rank of another node that one of its slots names. A packet's
// rows leave in chunks: the warp that stores a chunk's last row pushes the chunk's write
// (under the packet's fence key) into the FIFO, so the rows leave while later tokens
// are packed and the writes a count signal counts do not grow with the warps.
#include "api.cuh"
#include "copy.cuh"
#include "push.cuh"

namespace {

using namespace uep;

UEP_DEVICE bool on_rank(int64_t e, uint32_t r, uint32_t epr) {
    return e >= 0 && uint64_t(e) / epr == r;
}

// A copy of token `t`, slot `j` (expert `e`), into rank `r`'s receive areas.
UEP_DEVICE void to_peer(const LlPackArgs &a, const LlPackSink &s, uint32_t t, uint32_t j,
                        int64_t e) {
    const uint32_t k = a.topk, le = uint32_t(uint64_t(e) % a.experts_per_rank);
    const uint64_t row = (uint64_t(le) * a.ranks + a.rank) * a.max_tokens + a.pos[uint64_t(t) * k + j];
    warp_copy(s.region + a.recv_x_off + row * a.row_bytes, a.x + uint64_t(t) * a.row_bytes,
              a.row_bytes);
    if (a.scales)
        warp_copy(s.region + a.recv_scales_off + row * a.scale_words * 4,
                  reinterpret_cast<const uint8_t *>(a.scales + uint64_t(t) * a.scale_words),
                  uint64_t(a.scale_words) * 4);
    if (lane_id() == 0) {
        reinterpret_cast<int32_t *>(s.region + a.recv_src_off)[row] = int32_t(t * k + j);
        if (a.weights)
            reinterpret_cast<float *>(s.region + a.recv_weight_off)[row] = a.weights[uint64_t(t) * k + j];
    }
}

// Token `t` into packet `s` for rank `r`: its row, scales, index, slots and weights.
UEP_DEVICE void to_packet(const LlPackArgs &a, const LlPackSink &s, uint32_t t, uint32_t r,
                          const int64_t *chosen) {
    const uint32_t k = a.topk, i = s.row_of[t];
    warp_copy(s.region + s.rows_off + uint64_t(i) * a.row_bytes, a.x + uint64_t(t) * a.row_bytes,
              a.row_bytes);
    if (a.scales)
        warp_copy(s.region + s.scales_off + uint64_t(i) * a.scale_words * 4,
                  reinterpret_cast<const uint8_t *>(a.scales + uint64_t(t) * a.scale_words),
                  uint64_t(a.scale_words) * 4);
    const unsigned lane = lane_id();
    if (lane == 0) reinterpret_cast<int32_t *>(s.region + s.ids_off)[i] = int32_t(t);
    if (lane < k) {
        const int64_t e = chosen[lane];
        const int32_t local = on_rank(e, r, a.experts_per_rank) ? int32_t(uint64_t(e) % a.experts_per_rank) : -1;
        reinterpret_cast<int32_t *>(s.region + s.slots_off)[uint64_t(i) * k + lane] = local;
        reinterpret_cast<float *>(s.region + s.weights_off)[uint64_t(i) * k + lane] =
            a.weights ? a.weights[uint64_t(t) * k + lane] : 0.0f;
    }
    if (s.push.chunk_done) row_stored(s.push, i);
}

}  // namespace

UEP_KERNEL void uep_ll_pack(LlPackArgs a) {
    for (uint32_t t = grid_warp(); t < a.tokens; t += grid_warps()) {
        const int64_t *chosen = a.topk_idx + uint64_t(t) * a.topk;
        // Slot by slot, the whole warp on each: the branches below are the warp's.
        for (uint32_t j = 0; j < a.topk; ++j) {
            const int64_t e = chosen[j];
            if (e < 0) continue;
            const uint32_t r = uint32_t(uint64_t(e) / a.experts_per_rank);
            const LlPackSink &s = a.sinks[r];
            if (s.kind == kLlPeer) {
                to_peer(a, s, t, j, e);
            } else if (s.kind == kLlPacket) {
                // The first slot naming the rank carries the token there.
                bool first = true;
                for (uint32_t f = 0; f < j; ++f) first = first && !on_rank(chosen[f], r, a.experts_per_rank);
                if (first) to_packet(a, s, t, r, chosen);
            }
        }
    }
}
