// The host build's grid: fibers for lanes, an OS thread a warp (runtime.h says what it
// guarantees). The fibers are ucontext's; a lane switches to its warp's scheduler only
// at a collective, a barrier, a pause or its end.
#include "runtime.h"

#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define UEP_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define UEP_TSAN 1
#endif

namespace uep::host {
namespace {

constexpr unsigned kLanes = 32;
#if defined(UEP_ASAN) || defined(UEP_TSAN)
constexpr size_t kStackBytes = 1 << 20;
#else
constexpr size_t kStackBytes = 128 << 10;
#endif
constexpr size_t kGuardBytes = 4096;

// What a waiting lane waits at.
enum class Op : uint8_t { SyncWarp, Ballot, MatchAny, Shfl, ShflXor, Block };

const char *op_name(Op op) {
    switch (op) {
        case Op::SyncWarp: return "sync_warp";
        case Op::Ballot: return "ballot";
        case Op::MatchAny: return "match_any";
        case Op::Shfl: return "shfl";
        case Op::ShflXor: return "shfl_xor";
        case Op::Block: return "sync_block";
    }
    return "?";
}

std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

uint64_t now_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// One launch: the body, the grid and the first error.
struct Launch {
    uep_host_grid grid;
    void (*body)(void *);
    void *ctx;
    uint64_t deadline;  // clock_ns(); 0: none
    std::atomic<bool> failed{false};
    std::mutex mu;
    std::string error;

    void fail(const std::string &why) {
        std::lock_guard<std::mutex> g(mu);
        if (error.empty()) error = why;
        failed.store(true, std::memory_order_release);
    }
};

// A block's barrier among its warps; a warp whose lanes all ended no longer counts.
struct Block {
    std::mutex mu;
    std::condition_variable cv;
    unsigned live = 0;  // warps with a lane that has not ended
    unsigned arrived = 0;
    uint64_t generation = 0;

    void release_if_all_arrived() {
        if (live > 0 && arrived == live) {
            arrived = 0;
            ++generation;
            cv.notify_all();
        }
    }

    // Waits until every live warp arrived; false if the launch failed meanwhile.
    bool arrive_and_wait(Launch &launch) {
        std::unique_lock<std::mutex> g(mu);
        const uint64_t gen = generation;
        ++arrived;
        release_if_all_arrived();
        while (generation == gen) {
            if (launch.failed.load(std::memory_order_acquire)) return false;
            cv.wait_for(g, std::chrono::milliseconds(1));
        }
        return true;
    }

    void warp_ended() {
        std::lock_guard<std::mutex> g(mu);
        --live;
        release_if_all_arrived();
    }
};

enum class State : uint8_t { Runnable, Waiting, Ended };

struct Lane {
    ucontext_t ctx;
    unsigned id = 0;
    State state = State::Runnable;
    // The collective it waits at (or last took part in), and what it brought.
    Op op = Op::SyncWarp;
    uint32_t mask = 0;
    uint64_t value = 0;
    unsigned param = 0;
    uint64_t result = 0;
    unsigned pauses = 0;
    char *stack = nullptr;
#if defined(UEP_ASAN)
    void *fake_stack = nullptr;
#endif
#if defined(UEP_TSAN)
    void *fiber = nullptr;
#endif
};

struct Warp {
    Launch *launch = nullptr;
    Block *block = nullptr;
    unsigned block_idx = 0;
    unsigned first_thread = 0;  // threadIdx of lane 0
    unsigned width = 0;         // lanes the warp has (the block's last may have fewer)
    uint32_t ended = 0;         // lanes that returned
    Lane lanes[kLanes];
    ucontext_t sched;
#if defined(UEP_TSAN)
    void *sched_fiber = nullptr;
#endif
#if defined(UEP_ASAN)
    const void *sched_bottom = nullptr;
    size_t sched_size = 0;
#endif
    char *stacks = nullptr;

    uint32_t lanes_mask() const { return width == 32 ? ~0u : (1u << width) - 1; }

    std::string where() const {
        return fmt("block %u warp %u", block_idx, first_thread / kLanes);
    }
};

thread_local Warp *tls_warp = nullptr;
thread_local Lane *tls_lane = nullptr;

// Switches from the running lane to its warp's scheduler (for good once it ended).
void to_scheduler(Warp &w, Lane &me) {
#if defined(UEP_ASAN)
    __sanitizer_start_switch_fiber(me.state == State::Ended ? nullptr : &me.fake_stack,
                                   w.sched_bottom, w.sched_size);
#endif
#if defined(UEP_TSAN)
    __tsan_switch_to_fiber(w.sched_fiber, 0);
#endif
    swapcontext(&me.ctx, &w.sched);
#if defined(UEP_ASAN)
    __sanitizer_finish_switch_fiber(me.fake_stack, &w.sched_bottom, &w.sched_size);
#endif
}

// The running lane stops for good: the launch failed.
[[noreturn]] void abandon(Warp &w, Lane &me) {
    me.state = State::Ended;
    to_scheduler(w, me);
    __builtin_unreachable();
}

// Records the running lane's error. The caller abandons the lane in its next statement,
// once the message's temporaries are gone (an abandoned fiber's frames never unwind).
void fail_here(Warp &w, Lane &me, const std::string &why) {
    w.launch->fail(fmt("%s lane %u: %s", w.where().c_str(), me.id, why.c_str()));
}

std::string lanes_of(uint32_t mask) {
    std::string s;
    for (unsigned l = 0; l < kLanes; ++l)
        if (mask >> l & 1) s += (s.empty() ? "" : ",") + std::to_string(l);
    return s.empty() ? "none" : s;
}

// Every lane of `mask` arrived at the same collective: each gets its result and runs on.
void complete(Warp &w, uint32_t mask) {
    Lane &first = w.lanes[__builtin_ctz(mask)];
    const Op op = first.op;
    uint32_t votes = 0;
    for (unsigned l = 0; l < kLanes; ++l)
        if ((mask >> l & 1) && w.lanes[l].value) votes |= 1u << l;
    for (unsigned l = 0; l < kLanes; ++l) {
        if (!(mask >> l & 1)) continue;
        Lane &me = w.lanes[l];
        switch (op) {
            case Op::SyncWarp:
            case Op::Block: break;
            case Op::Ballot: me.result = votes; break;
            case Op::MatchAny: {
                uint32_t same = 0;
                for (unsigned o = 0; o < kLanes; ++o)
                    if ((mask >> o & 1) && w.lanes[o].value == me.value) same |= 1u << o;
                me.result = same;
                break;
            }
            case Op::Shfl:
            case Op::ShflXor: {
                const unsigned src = op == Op::Shfl ? me.param % kLanes : (l ^ me.param);
                if (src >= kLanes) {
                    me.result = me.value;  // CUDA: outside the warp, the lane's own value
                } else if (!(mask >> src & 1)) {
                    w.launch->fail(fmt("%s lane %u: %s reads lane %u, outside the mask {%s}",
                                       w.where().c_str(), l, op_name(op), src,
                                       lanes_of(mask).c_str()));
                } else {
                    me.result = w.lanes[src].value;
                }
                break;
            }
        }
        me.state = State::Runnable;
    }
}

// The running lane arrives at a collective over `mask`; returns its result once every
// lane of the mask arrived.
uint64_t collective(Op op, uint32_t mask, uint64_t value, unsigned param) {
    Warp &w = *tls_warp;
    Lane &me = *tls_lane;
    if (w.launch->failed.load(std::memory_order_acquire)) abandon(w, me);
    if (!(mask >> me.id & 1)) {
        fail_here(w, me, fmt("%s with mask {%s}, which leaves the lane itself out",
                             op_name(op), lanes_of(mask).c_str()));
        abandon(w, me);
    }
    if (mask & ~w.lanes_mask()) {
        fail_here(w, me, fmt("%s over lanes {%s}, but the warp has only %u (a block of %u threads)",
                             op_name(op), lanes_of(mask & ~w.lanes_mask()).c_str(), w.width,
                             w.launch->grid.threads));
        abandon(w, me);
    }
    if (mask & w.ended) {
        fail_here(w, me, fmt("%s over {%s}, but lane(s) %s already exited", op_name(op),
                             lanes_of(mask).c_str(), lanes_of(mask & w.ended).c_str()));
        abandon(w, me);
    }
    // Lanes of the mask waiting at another collective may still get there once theirs
    // completes; if none can, the scheduler reports the deadlock.
    uint32_t arrived = 1u << me.id;
    for (unsigned l = 0; l < kLanes; ++l) {
        const Lane &o = w.lanes[l];
        if ((mask >> l & 1) && o.state == State::Waiting && o.op == op && o.mask == mask)
            arrived |= 1u << l;
    }
    me.op = op;
    me.mask = mask;
    me.value = value;
    me.param = param;
    me.state = State::Waiting;
    if (arrived == mask) {
        complete(w, mask);
    } else {
        to_scheduler(w, me);
    }
    if (w.launch->failed.load(std::memory_order_acquire)) abandon(w, me);
    return me.result;
}

void lane_main() {
    Warp &w = *tls_warp;
    Lane &me = *tls_lane;
#if defined(UEP_ASAN)
    __sanitizer_finish_switch_fiber(nullptr, &w.sched_bottom, &w.sched_size);
#endif
    w.launch->body(w.launch->ctx);
    me.state = State::Ended;
    w.ended |= 1u << me.id;
    // Lanes waiting for this one at a collective would wait for ever.
    for (unsigned l = 0; l < w.width; ++l) {
        const Lane &o = w.lanes[l];
        if (o.state == State::Waiting && o.op != Op::Block && (o.mask >> me.id & 1)) {
            w.launch->fail(fmt("%s lane %u: exited before the %s over {%s} that lane %u waits at",
                               w.where().c_str(), me.id, op_name(o.op), lanes_of(o.mask).c_str(),
                               l));
            break;
        }
    }
    to_scheduler(w, me);
}

// Why no lane of `w` can run: two lanes whose collectives name each other but differ,
// or else what every waiting lane waits at.
std::string deadlock(const Warp &w) {
    for (unsigned l = 0; l < w.width; ++l) {
        const Lane &a = w.lanes[l];
        if (a.state != State::Waiting) continue;
        for (unsigned k = 0; k < w.width; ++k) {
            const Lane &b = w.lanes[k];
            if (k == l || !(a.mask >> k & 1) || b.state != State::Waiting) continue;
            if (a.op != b.op || a.mask != b.mask)
                return fmt("lane %u waits at %s over {%s}, but lane %u waits at %s over {%s}", l,
                           op_name(a.op), lanes_of(a.mask).c_str(), k, op_name(b.op),
                           lanes_of(b.mask).c_str());
        }
    }
    std::string s;
    for (unsigned l = 0; l < w.width; ++l) {
        const Lane &o = w.lanes[l];
        if (o.state == State::Waiting)
            s += fmt("%slane %u at %s over {%s}", s.empty() ? "" : "; ", l, op_name(o.op),
                     lanes_of(o.mask).c_str());
    }
    return s;
}

bool make_lanes(Warp &w) {
    const size_t per = kStackBytes + kGuardBytes;
    void *mem = mmap(nullptr, per * w.width, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED) return false;
    w.stacks = static_cast<char *>(mem);
    for (unsigned l = 0; l < w.width; ++l) {
        Lane &lane = w.lanes[l];
        lane.id = l;
        lane.stack = w.stacks + l * per + kGuardBytes;
        mprotect(w.stacks + l * per, kGuardBytes, PROT_NONE);
        getcontext(&lane.ctx);
        lane.ctx.uc_stack.ss_sp = lane.stack;
        lane.ctx.uc_stack.ss_size = kStackBytes;
        lane.ctx.uc_link = &w.sched;
        makecontext(&lane.ctx, lane_main, 0);
#if defined(UEP_TSAN)
        lane.fiber = __tsan_create_fiber(0);
#endif
    }
    return true;
}

void free_lanes(Warp &w) {
#if defined(UEP_TSAN)
    for (unsigned l = 0; l < w.width; ++l) __tsan_destroy_fiber(w.lanes[l].fiber);
#endif
    if (w.stacks) munmap(w.stacks, (kStackBytes + kGuardBytes) * w.width);
}

void resume(Warp &w, Lane &lane) {
    tls_lane = &lane;
#if defined(UEP_ASAN)
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, lane.stack, kStackBytes);
#endif
#if defined(UEP_TSAN)
    __tsan_switch_to_fiber(lane.fiber, 0);
#endif
    swapcontext(&w.sched, &lane.ctx);
#if defined(UEP_ASAN)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// A warp's OS thread: runs its lanes in turn until all ended or the launch failed.
void run_warp(Warp &w) {
    tls_warp = &w;
#if defined(UEP_TSAN)
    w.sched_fiber = __tsan_get_current_fiber();
#endif
    if (!make_lanes(w)) {
        w.launch->fail(w.where() + ": no memory for the lanes' stacks");
        w.block->warp_ended();
        return;
    }
    unsigned next = 0;
    for (;;) {
        if (w.launch->failed.load(std::memory_order_acquire)) break;
        Lane *run = nullptr;
        for (unsigned i = 0; i < w.width && !run; ++i) {
            Lane &l = w.lanes[(next + i) % w.width];
            if (l.state == State::Runnable) run = &l;
        }
        if (run) {
            next = run->id + 1;
            resume(w, *run);
            continue;
        }
        const uint32_t live = w.lanes_mask() & ~w.ended;
        if (live == 0) break;
        // Every live lane waits: at the block's barrier, or on each other for good.
        bool at_block = true;
        for (unsigned l = 0; l < w.width; ++l)
            if ((live >> l & 1) && w.lanes[l].op != Op::Block) at_block = false;
        if (!at_block) {
            w.launch->fail(fmt("%s: deadlock: %s, and no lane can run", w.where().c_str(),
                               deadlock(w).c_str()));
            break;
        }
        if (!w.block->arrive_and_wait(*w.launch)) break;
        for (unsigned l = 0; l < w.width; ++l)
            if (live >> l & 1) w.lanes[l].state = State::Runnable;
    }
    w.block->warp_ended();
    free_lanes(w);
    tls_warp = nullptr;
    tls_lane = nullptr;
}

void put_error(uep_host_error *err, const std::string &msg) {
    if (!err || !err->msg || err->len == 0) return;
    snprintf(err->msg, err->len, "%s", msg.c_str());
}

}  // namespace

unsigned thread_idx() { return tls_warp->first_thread + tls_lane->id; }
unsigned block_idx() { return tls_warp->block_idx; }
unsigned block_dim() { return tls_warp->launch->grid.threads; }
unsigned grid_dim() { return tls_warp->launch->grid.blocks; }

void sync_block() {
    // A barrier of the whole warp first; the warp's scheduler then meets the block's
    // other warps once every live lane waits there.
    Warp &w = *tls_warp;
    Lane &me = *tls_lane;
    if (w.launch->failed.load(std::memory_order_acquire)) abandon(w, me);
    me.op = Op::Block;
    me.mask = w.lanes_mask();
    me.state = State::Waiting;
    to_scheduler(w, me);
    if (w.launch->failed.load(std::memory_order_acquire)) abandon(w, me);
}

void sync_warp(uint32_t mask) { collective(Op::SyncWarp, mask, 0, 0); }

uint32_t ballot(uint32_t mask, bool p) { return uint32_t(collective(Op::Ballot, mask, p, 0)); }

uint32_t match_any(uint32_t mask, uint32_t v) {
    return uint32_t(collective(Op::MatchAny, mask, v, 0));
}

uint64_t shfl_bits(uint32_t mask, uint64_t bits, unsigned src) {
    return collective(Op::Shfl, mask, bits, src);
}

uint64_t shfl_xor_bits(uint32_t mask, uint64_t bits, unsigned lanes) {
    return collective(Op::ShflXor, mask, bits, lanes);
}

uint64_t clock_ns() { return now_ns(); }

void pause() {
    Warp &w = *tls_warp;
    Lane &me = *tls_lane;
    Launch &launch = *w.launch;
    if (launch.failed.load(std::memory_order_acquire)) abandon(w, me);
    ++me.pauses;
    if (launch.deadline && (me.pauses & 63) == 0 && now_ns() > launch.deadline) {
        fail_here(w, me, fmt("spun past the launch's deadline (%.3f s)",
                             double(launch.grid.timeout_ns) * 1e-9));
        abandon(w, me);
    }
    // The warp's other lanes first (the word may be theirs to store), then the machine.
    for (unsigned l = 0; l < w.width; ++l) {
        if (l != me.id && w.lanes[l].state == State::Runnable) {
            to_scheduler(w, me);
            if (launch.failed.load(std::memory_order_acquire)) abandon(w, me);
            return;
        }
    }
    if ((me.pauses & 255) == 0) {
        const timespec nap{0, 20000};
        nanosleep(&nap, nullptr);
    } else {
        sched_yield();
    }
}

}  // namespace uep::host

extern "C" int uep_host_launch(const uep_host_grid *grid, void (*body)(void *), void *ctx,
                               uep_host_error *err) {
    using namespace uep::host;
    if (grid->blocks == 0 || grid->threads == 0 || grid->threads > 1024) {
        put_error(err, fmt("a grid of %u blocks of %u threads (1 to 1024 a block, at least one block)",
                           grid->blocks, grid->threads));
        return 1;
    }
    Launch launch;
    launch.grid = *grid;
    launch.body = body;
    launch.ctx = ctx;
    launch.deadline = grid->timeout_ns ? now_ns() + grid->timeout_ns : 0;
    const unsigned warps = (grid->threads + kLanes - 1) / kLanes;
    std::vector<std::unique_ptr<Block>> blocks;
    std::vector<std::unique_ptr<Warp>> all;
    for (unsigned b = 0; b < grid->blocks; ++b) {
        blocks.push_back(std::make_unique<Block>());
        blocks.back()->live = warps;
        for (unsigned k = 0; k < warps; ++k) {
            auto w = std::make_unique<Warp>();
            w->launch = &launch;
            w->block = blocks.back().get();
            w->block_idx = b;
            w->first_thread = k * kLanes;
            w->width = std::min(kLanes, grid->threads - k * kLanes);
            all.push_back(std::move(w));
        }
    }
    std::vector<std::thread> threads;
    threads.reserve(all.size());
    try {
        for (auto &w : all) threads.emplace_back(run_warp, std::ref(*w));
    } catch (const std::exception &e) {
        launch.fail(std::string("starting a warp's thread: ") + e.what());
    }
    for (auto &t : threads) t.join();
    if (launch.failed.load(std::memory_order_acquire)) {
        put_error(err, launch.error);
        return 1;
    }
    return 0;
}
