//! Counters the proxy threads keep, and their aggregate [`ProxyStats`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_utils::CachePadded;

/// A thread's counters, on their own cache lines.
pub(crate) type StatsRef = Arc<CachePadded<ThreadStats>>;

/// A snapshot of what a [`crate::Proxy`]'s threads have done, summed over
/// threads (`reorder_window_hwm` is the maximum).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    /// Commands popped from the FIFOs (every kind).
    pub commands: u64,
    /// Write commands posted (data writes and zero-length signals).
    pub writes_posted: u64,
    /// Bytes of data posted by Write commands.
    pub bytes_posted: u64,
    /// Atomic commands posted.
    pub atomics_posted: u64,
    /// Quiet commands completed.
    pub quiets: u64,
    /// Barrier commands completed.
    pub barriers: u64,
    /// Zero-length barrier messages sent to peers.
    pub barrier_imms_posted: u64,
    /// Send completions retired.
    pub completions: u64,
    /// Posts answered with back-pressure (retried later).
    pub would_block: u64,
    /// Immediates received.
    pub imms_received: u64,
    /// Tail increments applied (normal mode).
    pub tails_applied: u64,
    /// LL count signals applied (counter stored).
    pub ll_signals_applied: u64,
    /// LL count signals that arrived before their data and are still waiting.
    pub pending_signals: u64,
    /// Emulated atomic adds applied.
    pub atomics_applied: u64,
    /// Barrier counters raised.
    pub barrier_updates: u64,
    /// Largest reorder window seen: 1 + how far ahead of the next expected
    /// sequence number an arrival was (1 = everything in order).
    pub reorder_window_hwm: u64,
    /// Immediates that failed validation (counted and logged, never applied).
    pub malformed_imms: u64,
    /// Commands rejected (undecodable or invalid); each is a fatal error.
    pub rejected_commands: u64,
    /// Times a thread parked (slept) while idle.
    pub idle_parks: u64,
    /// Operations in flight to a lost peer, given up on.
    pub abandoned: u64,
    /// Commands to a lost peer, dropped without posting.
    pub dropped_to_lost: u64,
}

macro_rules! thread_stats {
    ($($field:ident),* $(,)?) => {
        /// One thread's counters; written only by that thread (Relaxed).
        #[derive(Debug, Default)]
        pub(crate) struct ThreadStats {
            $(pub(crate) $field: AtomicU64,)*
        }

        impl ThreadStats {
            /// Adds this thread's counters into `s` (hwm: max).
            pub(crate) fn add_to(&self, s: &mut ProxyStats) {
                $(
                    let v = self.$field.load(Relaxed);
                    if stringify!($field) == "reorder_window_hwm" {
                        s.$field = s.$field.max(v);
                    } else {
                        s.$field += v;
                    }
                )*
            }
        }
    };
}

thread_stats!(
    commands,
    writes_posted,
    bytes_posted,
    atomics_posted,
    quiets,
    barriers,
    barrier_imms_posted,
    completions,
    would_block,
    imms_received,
    tails_applied,
    ll_signals_applied,
    pending_signals,
    atomics_applied,
    barrier_updates,
    reorder_window_hwm,
    malformed_imms,
    rejected_commands,
    idle_parks,
    abandoned,
    dropped_to_lost,
);

impl ThreadStats {
    /// Adds `n` to a counter. Only the owning thread writes, so a plain
    /// load + store is enough (no read-modify-write on the hot path).
    pub(crate) fn bump(c: &AtomicU64, n: u64) {
        c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
    }

    /// Sets a gauge / high-water mark.
    pub(crate) fn set(c: &AtomicU64, v: u64) {
        c.store(v, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregate_sums_and_maxes() {
        let a = ThreadStats::default();
        let b = ThreadStats::default();
        ThreadStats::bump(&a.commands, 3);
        ThreadStats::bump(&b.commands, 4);
        ThreadStats::set(&a.reorder_window_hwm, 5);
        ThreadStats::set(&b.reorder_window_hwm, 2);
        let mut s = ProxyStats::default();
        a.add_to(&mut s);
        b.add_to(&mut s);
        assert_eq!((s.commands, s.reorder_window_hwm), (7, 5));
    }
}
