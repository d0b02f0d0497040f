// The LL dispatch's placement as a kernel (uep-ep's device/place.rs is the definition):
// from topk_idx alone, where every copy goes, so that the call never needs topk_idx on
// the host. Tasks a warp each: one an expert (its copies numbered in (token, slot)
// order: the warp walks the slots a warp's width at a time, a ballot says which are
// its, their popcounts number them), one a rank (the tokens going to it numbered in
// token order, a lane a token), and one for the checks and the fingerprint (FNV-1a,
// sequential: the definition is a fold).
#include "api.cuh"

namespace {

using namespace uep;

UEP_DEVICE void place_expert(const LlPlaceArgs &a, uint32_t e) {
    const uint64_t slots = uint64_t(a.tokens) * a.topk;
    uint32_t count = 0;
    for (uint64_t base = 0; base < slots; base += kWarp) {
        const uint64_t i = base + lane_id();
        const bool mine = i < slots && a.topk_idx[i] == int64_t(e);
        const lanemask_t hits = ballot(kFullMask, mine);
        if (mine) a.pos[i] = count + uint32_t(popc(hits & lanes_below()));
        count += uint32_t(popc(hits));
    }
    if (lane_id() == 0) a.per_expert[e] = count;
}

UEP_DEVICE void place_rank(const LlPlaceArgs &a, uint32_t r) {
    const uint32_t epr = a.experts / a.ranks;
    uint32_t count = 0;
    for (uint32_t base = 0; base < a.tokens; base += kWarp) {
        const uint32_t t = base + lane_id();
        bool goes = false;
        for (uint32_t j = 0; t < a.tokens && j < a.topk; ++j) {
            const int64_t e = a.topk_idx[uint64_t(t) * a.topk + j];
            goes = goes || (e >= 0 && e < int64_t(a.experts) && uint64_t(e) / epr == r);
        }
        const lanemask_t hits = ballot(kFullMask, goes);
        if (goes) a.row_of[uint64_t(r) * a.tokens + t] = count + uint32_t(popc(hits & lanes_below()));
        count += uint32_t(popc(hits));
    }
    if (lane_id() == 0) a.rows[r] = count;
}

UEP_DEVICE void check_and_fingerprint(const LlPlaceArgs &a) {
    if (lane_id() != 0) return;
    const uint64_t slots = uint64_t(a.tokens) * a.topk;
    uint64_t h = 0xcbf29ce484222325ull, bad = ~0ull;
    for (uint64_t i = 0; i < slots; ++i) {
        const int64_t e = a.topk_idx[i];
        if (bad == ~0ull && (e < -1 || e >= int64_t(a.experts))) bad = i;
        h = (h ^ uint64_t(e)) * 0x100000001b3ull;
    }
    *a.first_bad = bad;
    *a.fingerprint = h;
}

}  // namespace

UEP_KERNEL void uep_ll_place(LlPlaceArgs a) {
    const uint32_t tasks = a.experts + a.ranks + 1;
    for (uint32_t task = grid_warp(); task < tasks; task += grid_warps()) {
        if (task < a.experts)
            place_expert(a, task);
        else if (task < a.experts + a.ranks)
            place_rank(a, task - a.experts);
        else
            check_and_fingerprint(a);
    }
}
