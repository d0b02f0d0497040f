// The LL dispatch's receive as a kernel (uep-ep's device/host/unpack.rs is the
// definition): a warp a local expert packs its rows to the front of its block, sources
// ascending, each row moved by the whole warp: a same-node source's rows down in place
// (a row's destination is never above it), a packet's out of the landing area. Scale
// words go column-major; the handle's tables (where each row came from) are written as
// the rows move.
#include "api.cuh"
#include "copy.cuh"

namespace {

using namespace uep;

// Where a row came from: its token * topk + slot, and the slot's weight.
struct Row {
    int32_t code;
    float weight;
};

// Row `at` of the handle's tables, and the row's scale words as row `j_in_expert` of
// expert `le`'s column-major scales.
UEP_DEVICE void put_row(const LlUnpackArgs &a, uint32_t le, uint64_t at, uint32_t j_in_expert,
                        const float *scales, Row r) {
    const uint64_t rows = uint64_t(a.ranks) * a.max_tokens;
    float *out = reinterpret_cast<float *>(a.region + a.out_scales_off);
    for (uint32_t w = lane_id(); w < a.scale_words; w += kWarp)
        out[(uint64_t(le) * a.scale_words + w) * rows + j_in_expert] = scales[w];
    if (lane_id() == 0) {
        a.src_info[at] = r.code / int32_t(a.topk);
        a.src_slot[at] = r.code % int32_t(a.topk);
        if (a.src_weight) a.src_weight[at] = r.weight;
    }
}

// Source `src`'s `n` rows of expert `le` to rows `base..` of the expert.
UEP_DEVICE void unpack_block(const LlUnpackArgs &a, uint32_t le, uint32_t src, uint32_t n,
                             uint32_t base) {
    const uint64_t rows = uint64_t(a.ranks) * a.max_tokens, rb = a.row_bytes;
    const uint64_t to = le * rows + base, from = le * rows + uint64_t(src) * a.max_tokens;
    uint8_t *recv_x = a.region + a.recv_x_off;
    const LlLandedArgs &l = a.landed[src];
    for (uint32_t j = 0; j < n; ++j) {
        if (l.present) {
            const uint32_t c = l.starts[le] + j, i = l.rows[c];
            const int32_t code = l.codes[c];
            warp_copy(recv_x + (to + j) * rb, a.region + l.rows_off + uint64_t(i) * rb, rb);
            const float w = a.src_weight ? l.weights[uint64_t(i) * a.topk + uint32_t(code) % a.topk] : 0.0f;
            put_row(a, le, to + j, base + j, l.scales + uint64_t(i) * a.scale_words, Row{code, w});
        } else {
            if (from != to) warp_copy(recv_x + (to + j) * rb, recv_x + (from + j) * rb, rb);
            const float *scales = reinterpret_cast<const float *>(a.region + a.recv_scales_off) +
                                  (from + j) * a.scale_words;
            const int32_t code = reinterpret_cast<const int32_t *>(a.region + a.recv_src_off)[from + j];
            const float w = a.src_weight ? reinterpret_cast<const float *>(a.region + a.recv_weight_off)[from + j] : 0.0f;
            put_row(a, le, to + j, base + j, scales, Row{code, w});
        }
    }
}

}  // namespace

UEP_KERNEL void uep_ll_unpack(LlUnpackArgs a) {
    for (uint32_t le = grid_warp(); le < a.experts; le += grid_warps()) {
        uint32_t base = 0;
        for (uint32_t src = 0; src < a.ranks; ++src) {
            const uint32_t n = a.counts[le * a.ranks + src];
            unpack_block(a, le, src, n, base);
            if (lane_id() == 0) {
                a.layout_range[2 * (uint64_t(le) * a.ranks + src)] = int32_t(base);
                a.layout_range[2 * (uint64_t(le) * a.ranks + src) + 1] = int32_t(n);
            }
            base += n;
        }
        if (lane_id() == 0) a.recv_count[le] = int32_t(base);
    }
}
