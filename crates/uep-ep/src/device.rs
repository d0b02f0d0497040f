//! The host device: "kernels" are CPU threads, and waits are bounded spins on counters.
//!
//! A GPU kernel spins on a flag in registered memory; on a host shared by several
//! ranks a pure spin would steal the cores the other ranks need, so every wait here
//! spins briefly, then yields, then sleeps, and always gives up at a deadline with a
//! message that names who waited for what.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::error::{EpError, Result};

/// Spin iterations before the first yield; short, because a peer on the same core
/// cannot make progress while we spin.
const SPIN_LIMIT: u32 = 64;
/// Yields before falling back to short sleeps.
const YIELD_LIMIT: u32 = 256;
/// Sleep once a wait has gone on for a while: cheap on the cores, and still far
/// below the deadlines a user sets.
const SLEEP: Duration = Duration::from_micros(20);

/// Busy-wait without ever yielding or sleeping: how a GPU kernel waits. For comparing
/// the backoff against in benchmarks (`uep bench --spin-waits`); on a shared host it
/// steals the cores the other ranks need.
static SPIN_ONLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Make every wait of this process a pure spin (`true`) or the default backoff.
pub fn set_spin_only(spin: bool) {
    SPIN_ONLY.store(spin, std::sync::atomic::Ordering::Relaxed);
}

/// Spin, then yield, then sleep: one step of a bounded wait.
#[derive(Debug, Default)]
pub struct Backoff {
    step: u32,
}

impl Backoff {
    /// A fresh backoff, starting with spins.
    pub fn new() -> Self {
        Self { step: 0 }
    }

    /// Wait a little, longer each time.
    pub fn snooze(&mut self) {
        if SPIN_ONLY.load(std::sync::atomic::Ordering::Relaxed) {
            std::hint::spin_loop();
            // Keep counting, so the periodic liveness check still runs.
            self.step = self.step.wrapping_add(1);
            return;
        }
        if self.step < SPIN_LIMIT {
            for _ in 0..(1 << (self.step / 16).min(4)) {
                std::hint::spin_loop();
            }
        } else if self.step < SPIN_LIMIT + YIELD_LIMIT {
            std::thread::yield_now();
        } else {
            std::thread::sleep(SLEEP);
        }
        self.step = self.step.saturating_add(1);
    }
}

/// Where a wait gives up: a deadline, and an abort word a failing peer sets
/// (non-zero = that rank + 1 gave up), so that nobody waits for a rank that is gone.
#[derive(Clone, Copy, Debug)]
pub struct Until<'a> {
    /// When to give up.
    pub deadline: Instant,
    /// Set by a peer that failed.
    pub abort: Option<&'a AtomicU64>,
    /// The peer waited on, and its process id when it shares this machine: a dead
    /// process will never store, so the wait fails at once instead of at the deadline.
    pub peer: Option<(usize, u32)>,
}

/// Whether process `pid` is gone (exited, or a zombie waiting to be reaped).
pub fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may contain spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

impl<'a> Until<'a> {
    /// Only a deadline.
    pub fn deadline(deadline: Instant) -> Self {
        Until {
            deadline,
            abort: None,
            peer: None,
        }
    }

    /// The same deadline and abort word, watching `peer` (rank, pid).
    pub fn watching(self, rank: usize, pid: Option<u32>) -> Self {
        Until {
            peer: pid.map(|p| (rank, p)),
            ..self
        }
    }

    fn check(&self, what: &dyn Fn() -> String, step: u32) -> Result<()> {
        // Reading /proc costs microseconds: look once the wait has gone on a while.
        if step % 256 == 255 {
            if let Some((rank, pid)) = self.peer {
                if process_gone(pid) {
                    return Err(EpError::Peer(format!(
                        "{}: rank {rank} (pid {pid}) has died",
                        what()
                    )));
                }
            }
        }
        if let Some(a) = self.abort {
            let v = a.load(Ordering::Acquire);
            if v != 0 {
                return Err(EpError::Peer(format!("{}: rank {} aborted", what(), v - 1)));
            }
        }
        Ok(())
    }
}

/// Wait until `done(counter)` (acquire loads), or fail at the deadline, on abort, or when
/// the watched peer dies; `what()` and `seen(value)` make the message.
fn wait_for(
    counter: &AtomicU64,
    until: Until<'_>,
    what: impl Fn() -> String,
    done: impl Fn(u64) -> bool,
    expected: impl Fn(u64) -> String,
) -> Result<u64> {
    let mut backoff = Backoff::new();
    loop {
        let seen = counter.load(Ordering::Acquire);
        if done(seen) {
            return Ok(seen);
        }
        until.check(&what, backoff.step)?;
        if Instant::now() >= until.deadline {
            return Err(EpError::Timeout(format!("{}: {}", what(), expected(seen))));
        }
        backoff.snooze();
    }
}

/// Wait until `counter >= target`; returns the value seen.
pub fn wait_at_least(
    counter: &AtomicU64,
    target: u64,
    until: Until<'_>,
    what: impl Fn() -> String,
) -> Result<u64> {
    wait_for(
        counter,
        until,
        what,
        |v| v >= target,
        |seen| format!("expected >= {target}, saw {seen}"),
    )
}

/// Wait until the high 32 bits of `counter` (an epoch) equal `epoch`; returns the low 32
/// bits (the value published with it).
pub fn wait_epoch(
    counter: &AtomicU64,
    epoch: u32,
    until: Until<'_>,
    what: impl Fn() -> String,
) -> Result<u32> {
    let word = wait_for(
        counter,
        until,
        what,
        |v| (v >> 32) as u32 == epoch,
        |seen| {
            format!(
                "expected epoch {epoch}, saw epoch {} (value {})",
                seen >> 32,
                seen as u32
            )
        },
    )?;
    Ok(word as u32)
}

/// Pack an epoch and a 32-bit value into one counter word.
pub fn epoch_word(epoch: u32, value: u32) -> u64 {
    ((epoch as u64) << 32) | value as u64
}

/// The host device: runs a kernel over `n` items on `threads` CPU threads.
#[derive(Clone, Copy, Debug)]
pub struct HostDevice {
    threads: usize,
}

impl HostDevice {
    /// A device with `threads` kernel threads (at least one).
    pub fn new(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
        }
    }

    /// Number of kernel threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `kernel` on contiguous chunks of `0..n`, one per thread (in the caller's
    /// thread when one suffices), and return the first error.
    pub fn launch<F>(&self, n: usize, kernel: F) -> Result<()>
    where
        F: Fn(Range<usize>) -> Result<()> + Sync,
    {
        let chunks = self.threads.min(n.max(1));
        if chunks <= 1 {
            return kernel(0..n);
        }
        let per = n.div_ceil(chunks);
        std::thread::scope(|s| {
            let handles: Vec<_> = (1..chunks)
                .map(|c| {
                    let kernel = &kernel;
                    let range = (c * per).min(n)..((c + 1) * per).min(n);
                    s.spawn(move || kernel(range))
                })
                .collect();
            let mut result = kernel(0..per.min(n));
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(EpError::InvalidArgument("a device thread panicked".into()))
                });
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })
    }
}

impl HostDevice {
    /// Run `kernel(first_row, rows)` over contiguous blocks of `out`, which holds rows of
    /// `row_len` values; each thread owns its block, so no two write the same row.
    pub fn launch_rows<T, F>(&self, out: &mut [T], row_len: usize, kernel: F) -> Result<()>
    where
        T: Send,
        F: Fn(usize, &mut [T]) -> Result<()> + Sync,
    {
        let n = out.len().checked_div(row_len).unwrap_or(0);
        let chunks = self.threads.min(n.max(1));
        if chunks <= 1 {
            return kernel(0, out);
        }
        let per = n.div_ceil(chunks);
        std::thread::scope(|s| {
            let mut blocks = out.chunks_mut(per * row_len).enumerate();
            let (_, first) = blocks.next().expect("at least one block");
            let handles: Vec<_> = blocks
                .map(|(c, block)| {
                    let kernel = &kernel;
                    s.spawn(move || kernel(c * per, block))
                })
                .collect();
            let mut result = kernel(0, first);
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(EpError::InvalidArgument("a device thread panicked".into()))
                });
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;

    #[test]
    fn launch_covers_every_item_once() {
        for threads in [1, 2, 3, 8] {
            for n in [0, 1, 5, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                HostDevice::new(threads)
                    .launch(n, |r| {
                        for i in r {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    })
                    .unwrap();
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn launch_rows_gives_each_row_to_one_thread() {
        for threads in [1, 2, 3, 8] {
            for n in [0usize, 1, 5, 100] {
                let mut out = vec![0usize; n * 3];
                HostDevice::new(threads)
                    .launch_rows(&mut out, 3, |first, rows| {
                        for (i, row) in rows.chunks_exact_mut(3).enumerate() {
                            row.fill(first + i + 1);
                        }
                        Ok(())
                    })
                    .unwrap();
                let want: Vec<usize> = (0..n).flat_map(|i| [i + 1; 3]).collect();
                assert_eq!(out, want);
            }
        }
    }

    #[test]
    fn waits_time_out_with_a_message() {
        let c = AtomicU64::new(3);
        let err = wait_at_least(
            &c,
            4,
            Until::deadline(Instant::now() + Duration::from_millis(5)),
            || "rank 1 waiting for rank 2's counter".into(),
        )
        .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rank 2") && msg.contains(">= 4") && msg.contains("saw 3"),
            "{msg}"
        );
        let err = wait_epoch(&c, 9, Until::deadline(Instant::now()), || "x".into()).unwrap_err();
        assert!(err.to_string().contains("expected epoch 9"));
        let abort = AtomicU64::new(3);
        let until = Until {
            deadline: Instant::now() + Duration::from_secs(60),
            abort: Some(&abort),
            peer: None,
        };
        let err = wait_at_least(&c, 4, until, || "rank 0 waiting".into()).unwrap_err();
        assert!(err.to_string().contains("rank 2 aborted"), "{err}");
    }

    #[test]
    fn a_dead_peer_ends_the_wait_long_before_the_deadline() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(process_gone(pid));
        assert!(!process_gone(std::process::id()));
        let c = AtomicU64::new(0);
        let start = Instant::now();
        let until = Until::deadline(start + Duration::from_secs(60)).watching(3, Some(pid));
        let err = wait_at_least(&c, 1, until, || "rank 0 waiting for rank 3".into()).unwrap_err();
        assert!(err.to_string().contains("rank 3 (pid"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn waits_see_a_later_store() {
        let c = Arc::new(AtomicU64::new(0));
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            c2.store(epoch_word(5, 42), Ordering::Release);
        });
        let v = wait_epoch(
            &c,
            5,
            Until::deadline(Instant::now() + Duration::from_secs(5)),
            || "x".into(),
        )
        .unwrap();
        assert_eq!(v, 42);
        t.join().unwrap();
    }
}
