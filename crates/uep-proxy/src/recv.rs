//! Receiver-side emulation: turns arrived immediates into counter updates in
//! the local region (docs/architecture.md, "uep-proxy").
//!
//! * [`WriteImm`]: per-stream (= per (source, channel)) reorder window; tail
//!   increments are applied strictly in sequence order. The window accepts
//!   an arrival less than [`REORDER_LIMIT`] (half the sequence modulus)
//!   ahead of the next expected number; the sender's send window (see
//!   `worker`) keeps every arrival inside it.
//! * [`LlImm`]: partial completion fence; a count signal is stored only once
//!   the arrivals it announces have been seen, early signals wait.
//! * [`AtomicImm`]: fetch_add. [`BarrierImm`]: raise the source's barrier
//!   counter to the unwrapped sequence number (a fetch_max).
//!
//! Every immediate is validated first; a malformed one is reported as an
//! `Err` (the caller counts and logs it) and changes nothing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use uep_shm::Region;
use uep_wire::{
    AtomicImm, BarrierImm, Imm, LlImm, LlSignal, WriteImm, BARRIER_SEQ_MODULUS, WRITE_SEQ_MODULUS,
};

use crate::layout::CounterLayout;
use crate::stats::{StatsRef, ThreadStats};

/// An arrival may be at most this far ahead of the next expected sequence
/// number; anything else is stale (already applied) or a duplicate. Half
/// the sequence space, so "ahead" and "behind" never alias.
pub(crate) const REORDER_LIMIT: u32 = WRITE_SEQ_MODULUS / 2;

#[derive(Debug, Default)]
struct Window {
    /// Next sequence number to apply (unwrapped).
    next: u64,
    /// `pending[d]` = tail increment of sequence `next + d`, once arrived.
    pending: VecDeque<Option<u16>>,
}

#[derive(Debug, Default)]
struct Fence {
    /// Data arrivals not yet consumed by an applied signal.
    arrivals: u64,
    /// Count signals applied so far (the `k` of the stored value).
    applied: u32,
    /// Signals that came before their data, in arrival order.
    pending: VecDeque<u16>,
}

/// One proxy thread's receive-side state.
pub(crate) struct Recv {
    counters: CounterLayout,
    region: Region,
    emulate: bool,
    windows: Vec<Window>,
    fences: Vec<Fence>,
    stats: StatsRef,
    pending_signals: u64,
    hwm: u64,
}

type Malformed = String;

/// The counter at `off` (a layout lookup), bounds-checked by the region.
fn counter(region: &Region, off: crate::Result<u64>) -> Result<&AtomicU64, Malformed> {
    let off = off.map_err(|e| e.to_string())?;
    let off = usize::try_from(off).map_err(|_| format!("counter offset {off} overflows"))?;
    region.atomic_u64(off).map_err(|e| e.to_string())
}

impl Recv {
    /// State for a validated `counters` over `region`.
    pub(crate) fn new(
        counters: CounterLayout,
        region: Region,
        emulate: bool,
        stats: StatsRef,
    ) -> Recv {
        let windows = (0..counters.num_ranks * counters.num_channels)
            .map(|_| Window::default())
            .collect();
        let fences = (0..2 * counters.num_local_experts * counters.num_ranks)
            .map(|_| Fence::default())
            .collect();
        Recv {
            counters,
            region,
            emulate,
            windows,
            fences,
            stats,
            pending_signals: 0,
            hwm: 0,
        }
    }

    /// Whether anything is waiting (an early signal or an out-of-order
    /// tail increment): the thread then must not park for long.
    pub(crate) fn has_pending(&self) -> bool {
        self.pending_signals > 0 || self.windows.iter().any(|w| !w.pending.is_empty())
    }

    /// Source `src` starts again (a new process took its rank): its streams and
    /// fences expect their first arrival, and its tail and count-signal counters read
    /// zero. The barrier counter stays: a replacement goes on with the job's barrier
    /// numbers. The caller makes sure nothing from the old process is still arriving.
    pub(crate) fn forget_source(&mut self, src: usize) -> Result<(), Malformed> {
        let (nc, ne, nr) = (
            self.counters.num_channels,
            self.counters.num_local_experts,
            self.counters.num_ranks,
        );
        let region = self.region.clone();
        for ch in 0..nc {
            self.windows[src * nc + ch] = Window::default();
            counter(&region, self.counters.tail(src, ch))?.store(0, Ordering::Release);
        }
        for buffer in 0..2 {
            for expert in 0..ne {
                let fence = std::mem::take(&mut self.fences[(buffer * ne + expert) * nr + src]);
                self.pending_signals -= fence.pending.len() as u64;
                counter(&region, self.counters.ll_signal(buffer, expert, src))?
                    .store(0, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Validates and applies one immediate.
    pub(crate) fn apply(&mut self, imm: u32) -> Result<(), Malformed> {
        ThreadStats::bump(&self.stats.imms_received, 1);
        let decoded = Imm::decode(imm).map_err(|e| format!("undecodable: {e}"))?;
        match decoded {
            Imm::Write(w) => self.write(w),
            Imm::Ll(l) => self.ll(l),
            Imm::Atomic(a) => self.atomic(a),
            Imm::Barrier(b) => self.barrier(b),
        }
    }

    fn write(&mut self, w: WriteImm) -> Result<(), Malformed> {
        let nc = self.counters.num_channels;
        let stream = usize::from(w.stream);
        if stream >= self.counters.num_ranks * nc {
            return Err(format!(
                "WriteImm stream {stream} names no (source, channel): {} ranks x {nc} channels \
                 = {} streams",
                self.counters.num_ranks,
                self.counters.num_ranks * nc
            ));
        }
        let (src, channel) = (stream / nc, stream % nc);
        let region = self.region.clone();
        let ctr = counter(&region, self.counters.tail(src, channel))?;
        if !self.emulate {
            // Tests only: apply on arrival, whatever the order.
            ctr.fetch_add(w.count.into(), Ordering::Release);
            ThreadStats::bump(&self.stats.tails_applied, 1);
            return Ok(());
        }
        let win = &mut self.windows[stream];
        let d = u32::from(w.seq).wrapping_sub(win.next as u32) % WRITE_SEQ_MODULUS;
        if d >= REORDER_LIMIT {
            return Err(format!(
                "WriteImm from rank {src} channel {channel} has seq {} but {} is next: stale, \
                 duplicate or more than {REORDER_LIMIT} ahead",
                w.seq,
                WriteImm::wrap_seq(win.next)
            ));
        }
        let d = d as usize;
        if win.pending.len() <= d {
            win.pending.resize(d + 1, None);
        }
        if win.pending[d].is_some() {
            return Err(format!(
                "WriteImm from rank {src} channel {channel} seq {} arrived twice",
                w.seq
            ));
        }
        win.pending[d] = Some(w.count);
        let depth = win.pending.len() as u64;
        let mut applied = 0;
        while let Some(Some(count)) = win.pending.front().copied() {
            if count > 0 {
                // Release: the data of this write and of every earlier one in
                // the sequence landed before their arrivals were observed.
                ctr.fetch_add(count.into(), Ordering::Release);
            }
            win.pending.pop_front();
            win.next += 1;
            applied += 1;
        }
        ThreadStats::bump(&self.stats.tails_applied, applied);
        if depth > self.hwm {
            self.hwm = depth;
            ThreadStats::set(&self.stats.reorder_window_hwm, depth);
        }
        Ok(())
    }

    fn ll(&mut self, l: LlImm) -> Result<(), Malformed> {
        let (buffer, expert, src) = (
            usize::from(l.buffer),
            usize::from(l.expert),
            usize::from(l.src_rank),
        );
        let region = self.region.clone();
        let ctr = counter(&region, self.counters.ll_signal(buffer, expert, src))?;
        let idx =
            (buffer * self.counters.num_local_experts + expert) * self.counters.num_ranks + src;
        let fence = &mut self.fences[idx];
        match l.signal {
            LlSignal::Arrival if !self.emulate => {}
            LlSignal::Arrival => fence.arrivals += 1,
            LlSignal::Count(n) if !self.emulate => {
                // Tests only: store on arrival, whatever has landed.
                fence.applied = fence.applied.wrapping_add(1);
                ctr.store(
                    u64::from(fence.applied) << 32 | u64::from(n),
                    Ordering::Release,
                );
                ThreadStats::bump(&self.stats.ll_signals_applied, 1);
                return Ok(());
            }
            LlSignal::Count(n) => {
                fence.pending.push_back(n);
                self.pending_signals += 1;
            }
        }
        let mut applied = 0;
        while let Some(&n) = fence.pending.front() {
            if fence.arrivals < u64::from(n) {
                break;
            }
            fence.arrivals -= u64::from(n);
            fence.applied = fence.applied.wrapping_add(1);
            // Release: the counted writes' data is visible to whoever
            // Acquire-loads the counter.
            ctr.store(
                u64::from(fence.applied) << 32 | u64::from(n),
                Ordering::Release,
            );
            fence.pending.pop_front();
            applied += 1;
        }
        self.pending_signals -= applied;
        ThreadStats::bump(&self.stats.ll_signals_applied, applied);
        ThreadStats::set(&self.stats.pending_signals, self.pending_signals);
        Ok(())
    }

    fn atomic(&mut self, a: AtomicImm) -> Result<(), Malformed> {
        let region = self.region.clone();
        let ctr = counter(&region, self.counters.atomic(a.slot.into()))?;
        // Sign-extend: a negative addend wraps the u64 like a subtraction.
        ctr.fetch_add(i64::from(a.value) as u64, Ordering::AcqRel);
        ThreadStats::bump(&self.stats.atomics_applied, 1);
        Ok(())
    }

    fn barrier(&mut self, b: BarrierImm) -> Result<(), Malformed> {
        let region = self.region.clone();
        let ctr = counter(&region, self.counters.barrier(b.src_rank.into()))?;
        let m = BARRIER_SEQ_MODULUS;
        let mut cur = ctr.load(Ordering::Acquire);
        loop {
            // Unwrap against the counter itself, so every thread that may
            // raise it agrees: the seq is the nearest value ahead of it.
            let diff = b.seq.wrapping_sub(cur as u32) % m;
            if diff == 0 || diff >= m / 2 {
                // Already passed (e.g. raised by another thread): no-op.
                return Ok(());
            }
            match ctr.compare_exchange_weak(
                cur,
                cur + u64::from(diff),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        ThreadStats::bump(&self.stats.barrier_updates, 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use uep_shm::Segment;
    use uep_wire::BarrierScope;

    const NC: usize = 2;
    const NE: usize = 3;
    const NR: usize = 2;

    fn layout() -> CounterLayout {
        CounterLayout {
            num_ranks: NR,
            tail_base: 0,
            num_channels: NC,
            ll_base: 64,
            num_local_experts: NE,
            barrier_base: 256,
            atomic_base: 512,
            num_atomic_slots: 4,
        }
    }

    fn segment() -> Segment {
        segment_of(1024)
    }

    fn segment_of(len: usize) -> Segment {
        static N: AtomicUsize = AtomicUsize::new(0);
        let job = format!("recvunit{}", N.fetch_add(1, Ordering::Relaxed));
        let mut s =
            Segment::create(&uep_shm::segment_name(&job, 0, std::process::id()), len).unwrap();
        s.unlink().unwrap();
        s
    }

    fn recv(seg: &Segment, emulate: bool) -> Recv {
        let l = layout();
        l.validate(seg.len()).unwrap();
        Recv::new(l, seg.region().clone(), emulate, Arc::default())
    }

    fn load(seg: &Segment, off: u64) -> u64 {
        seg.region()
            .atomic_u64(off as usize)
            .unwrap()
            .load(Ordering::Acquire)
    }

    fn wimm(src: usize, ch: usize, seq: u64, count: u16) -> u32 {
        WriteImm {
            stream: (src * NC + ch) as u16,
            seq: WriteImm::wrap_seq(seq),
            count,
        }
        .encode()
        .unwrap()
    }

    fn limm(buffer: u8, expert: u16, src: u16, signal: LlSignal) -> u32 {
        LlImm {
            buffer,
            expert,
            src_rank: src,
            signal,
        }
        .encode()
        .unwrap()
    }

    #[test]
    fn a_forgotten_source_starts_from_zero() {
        // Source 1 leaves a write and a count signal waiting; a new process takes its
        // rank: nothing of the old one waits, its counters read zero, and the new one's
        // first write (seq 0) and first signal apply as firsts.
        let seg = segment();
        let mut r = recv(&seg, true);
        let l = layout();
        let (tail, ll) = (l.tail(1, 0).unwrap(), l.ll_signal(0, 1, 1).unwrap());
        r.apply(wimm(1, 0, 0, 3)).unwrap();
        r.apply(wimm(1, 0, 2, 1)).unwrap();
        r.apply(limm(0, 1, 1, LlSignal::Count(1))).unwrap();
        assert!(r.has_pending());
        assert_eq!(load(&seg, tail), 3);
        r.forget_source(1).unwrap();
        assert!(!r.has_pending());
        assert_eq!((load(&seg, tail), load(&seg, ll)), (0, 0));
        r.apply(wimm(1, 0, 0, 2)).unwrap();
        assert_eq!(load(&seg, tail), 2);
        r.apply(limm(0, 1, 1, LlSignal::Arrival)).unwrap();
        r.apply(limm(0, 1, 1, LlSignal::Count(1))).unwrap();
        assert_eq!(load(&seg, ll), 1 << 32 | 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Any delivery order inside the window: the tail only ever equals
        /// the sum of a contiguous prefix, and ends at the total.
        #[test]
        fn tails_apply_in_sequence(counts in proptest::collection::vec(0u16..5, 1..300),
                                   seed: u64, window in 1usize..40, start in 0u64..8192) {
            let seg = segment();
            let mut r = recv(&seg, true);
            // Start the sequence anywhere (wrap-around included).
            r.windows[NC + 1].next = start;
            let prefix: Vec<u64> = counts.iter().scan(0u64, |s, &c| { *s += u64::from(c); Some(*s) }).collect();
            // Shuffle within blocks of `window` so no arrival is further ahead than that.
            let mut order: Vec<usize> = (0..counts.len()).collect();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            for block in order.chunks_mut(window) { block.shuffle(&mut rng); }
            let off = layout().tail(1, 1).unwrap();
            let mut seen = std::collections::BTreeSet::new();
            for &i in &order {
                r.apply(wimm(1, 1, start + i as u64, counts[i])).unwrap();
                seen.insert(i);
                let contiguous = (0..counts.len()).take_while(|j| seen.contains(j)).count();
                let expect = if contiguous == 0 { 0 } else { prefix[contiguous - 1] };
                prop_assert_eq!(load(&seg, off), expect);
            }
            prop_assert_eq!(load(&seg, off), *prefix.last().unwrap());
            prop_assert!(!r.has_pending());
            prop_assert!(r.hwm as usize <= window);
            // A replay of anything already applied is stale.
            prop_assert!(r.apply(wimm(1, 1, start + order[0] as u64, 1)).is_err());
            // Other counters untouched.
            prop_assert_eq!(load(&seg, layout().tail(0, 1).unwrap()), 0);
        }

        /// Signals and arrivals in any order: the counter shows (k, N) only
        /// once N arrivals of that round were seen.
        #[test]
        fn ll_fence_any_order(rounds in proptest::collection::vec(0u16..6, 1..6), seed: u64) {
            let seg = segment();
            let mut r = recv(&seg, true);
            let off = layout().ll_signal(1, 2, 1).unwrap();
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            for (k, &n) in rounds.iter().enumerate() {
                let mut evs: Vec<Option<u16>> = (0..n).map(|_| None).collect();
                evs.push(Some(n));
                evs.shuffle(&mut rng);
                let mut arrived = 0;
                let mut signalled = false;
                for e in evs {
                    match e {
                        None => { r.apply(limm(1, 2, 1, LlSignal::Arrival)).unwrap(); arrived += 1; }
                        Some(n) => { r.apply(limm(1, 2, 1, LlSignal::Count(n))).unwrap(); signalled = true; }
                    }
                    let v = load(&seg, off);
                    if signalled && arrived == n {
                        prop_assert_eq!(v, ((k as u64 + 1) << 32) | u64::from(n));
                    } else {
                        // Still the previous round's value.
                        let prev = if k == 0 { 0 } else { ((k as u64) << 32) | u64::from(rounds[k - 1]) };
                        prop_assert_eq!(v, prev);
                    }
                }
                prop_assert!(!r.has_pending());
            }
        }
    }

    #[test]
    fn malformed_immediates_change_nothing() {
        let seg = segment();
        let mut r = recv(&seg, true);
        let before: Vec<u64> = (0..128).map(|i| load(&seg, i * 8)).collect();
        let bad = [
            // Stream 4 = src 2 of 2 ranks.
            WriteImm {
                stream: 4,
                seq: 0,
                count: 1,
            }
            .encode()
            .unwrap(),
            // Far ahead of the window.
            wimm(0, 0, u64::from(REORDER_LIMIT), 1),
            limm(0, NE as u16, 0, LlSignal::Arrival),
            limm(0, 0, NR as u16, LlSignal::Count(1)),
            AtomicImm { slot: 4, value: 1 }.encode().unwrap(),
            BarrierImm {
                scope: BarrierScope::AllPeers,
                src_rank: 2,
                seq: 1,
            }
            .encode()
            .unwrap(),
            // Scope 3 and an arrival with count bits do not decode.
            3 << 30 | 3 << 28,
            1 << 30 | 5,
        ];
        for imm in bad {
            assert!(r.apply(imm).is_err(), "{imm:#x} should be malformed");
        }
        let after: Vec<u64> = (0..128).map(|i| load(&seg, i * 8)).collect();
        assert_eq!(before, after);
        // A duplicate of a pending (not yet applied) seq is caught too.
        r.apply(wimm(0, 0, 2, 1)).unwrap();
        assert!(r.apply(wimm(0, 0, 2, 1)).unwrap_err().contains("twice"));
        assert!(r.has_pending());
    }

    #[test]
    fn atomics_and_barriers() {
        let seg = segment();
        let mut r = recv(&seg, true);
        r.apply(AtomicImm { slot: 3, value: 5 }.encode().unwrap())
            .unwrap();
        r.apply(AtomicImm { slot: 3, value: -2 }.encode().unwrap())
            .unwrap();
        assert_eq!(load(&seg, layout().atomic(3).unwrap()), 3);
        let b = |seq| {
            BarrierImm {
                scope: BarrierScope::AllPeers,
                src_rank: 1,
                seq: BarrierImm::wrap_seq(seq),
            }
            .encode()
            .unwrap()
        };
        let off = layout().barrier(1).unwrap();
        r.apply(b(2)).unwrap();
        assert_eq!(load(&seg, off), 2);
        r.apply(b(1)).unwrap();
        assert_eq!(
            load(&seg, off),
            2,
            "an older barrier never lowers the counter"
        );
        // Across the 20-bit wrap.
        seg.region()
            .atomic_u64(off as usize)
            .unwrap()
            .store(u64::from(BARRIER_SEQ_MODULUS) - 1, Ordering::Release);
        r.apply(b(u64::from(BARRIER_SEQ_MODULUS) + 1)).unwrap();
        assert_eq!(load(&seg, off), u64::from(BARRIER_SEQ_MODULUS) + 1);
    }

    #[test]
    fn without_emulation_signals_apply_at_once() {
        let seg = segment();
        let mut r = recv(&seg, false);
        r.apply(wimm(0, 1, 5, 3)).unwrap();
        assert_eq!(load(&seg, layout().tail(0, 1).unwrap()), 3);
        r.apply(limm(0, 1, 0, LlSignal::Count(4))).unwrap();
        assert_eq!(
            load(&seg, layout().ll_signal(0, 1, 0).unwrap()),
            1 << 32 | 4
        );
    }

    /// Streams past the old 6-bit limit (64) land on their own (source,
    /// channel) tail, in order, and leave every other counter alone.
    #[test]
    fn streams_above_64_reach_their_tail() {
        let l = CounterLayout {
            num_ranks: 100,
            tail_base: 0,
            num_channels: 2,
            barrier_base: 1600,
            ..CounterLayout::default()
        };
        let seg = segment_of(4096);
        l.validate(seg.len()).unwrap();
        let mut r = Recv::new(l.clone(), seg.region().clone(), true, Arc::default());
        let imm = |stream: u16, seq: u64, count: u16| {
            WriteImm {
                stream,
                seq: WriteImm::wrap_seq(seq),
                count,
            }
            .encode()
            .unwrap()
        };
        // Rank 70 channel 1 = stream 141; rank 99 channel 0 = stream 198.
        r.apply(imm(141, 1, 5)).unwrap();
        assert_eq!(
            load(&seg, l.tail(70, 1).unwrap()),
            0,
            "seq 1 waits for seq 0"
        );
        r.apply(imm(198, 0, 7)).unwrap();
        r.apply(imm(141, 0, 2)).unwrap();
        assert_eq!(load(&seg, l.tail(70, 1).unwrap()), 7);
        assert_eq!(load(&seg, l.tail(99, 0).unwrap()), 7);
        let touched = [l.tail(70, 1).unwrap(), l.tail(99, 0).unwrap()];
        for src in 0..100 {
            for ch in 0..2 {
                let off = l.tail(src, ch).unwrap();
                if !touched.contains(&off) {
                    assert_eq!(load(&seg, off), 0, "tail ({src}, {ch})");
                }
            }
        }
        // Stream 200 = source 100 of 100 ranks: names nothing.
        let err = r.apply(imm(200, 0, 1)).unwrap_err();
        assert!(
            err.contains("stream 200") && err.contains("200 streams"),
            "{err}"
        );
        assert!(!r.has_pending());
    }
}
