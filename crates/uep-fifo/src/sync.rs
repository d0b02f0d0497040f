//! Atomics and waiting primitives: std normally, loom's under `cfg(loom)` so
//! the model checker sees (and permutes) every shared access and every wait.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

/// Busy-wait hint; under loom a yield, so spinning cannot livelock the model.
pub(crate) fn spin_loop() {
    #[cfg(loom)]
    loom::hint::spin_loop();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Gives up the rest of the time slice.
pub(crate) fn yield_now() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::thread::yield_now();
}
