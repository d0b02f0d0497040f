//! The host device: "kernels" are CPU threads over contiguous chunks of the work, and
//! the proxy's FIFOs live in mappings of their own that those threads store into.

use std::ops::Range;

use uep_fifo::{Fifo, FifoAlloc, FifoError, FifoMemory};
use uep_shm::Region;

mod normal;
mod pack;
mod phases;
mod signal;
mod unpack;

#[cfg(test)]
pub(crate) use normal::DirectRun;
pub(crate) use normal::{normal_combine_send, normal_notify, normal_pack, relay};
pub(crate) use pack::{ll_combine_pack, ll_pack};
pub(crate) use signal::{signal, wait};
pub(crate) use unpack::ll_unpack;

use half::bf16;

use super::{CastPhase, Device, LayoutPhase, ReducePhase};
use crate::error::{EpError, Result};
use crate::layout::DispatchLayout;

/// The host device: runs a kernel over `n` items on `threads` CPU threads.
#[derive(Clone, Copy, Debug)]
pub struct HostDevice {
    threads: usize,
}

/// The message of a panicked kernel thread.
fn panicked(payload: Box<dyn std::any::Any + Send>) -> EpError {
    let msg = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    EpError::Panicked(msg)
}

impl Device for HostDevice {
    fn name(&self) -> &str {
        "host"
    }

    fn lanes(&self) -> usize {
        self.threads
    }

    fn launch(&self, n: usize, kernel: &(dyn Fn(Range<usize>) -> Result<()> + Sync)) -> Result<()> {
        HostDevice::launch(self, n, kernel)
    }

    /// With one lane the calling thread is that lane (a launch runs there), so the
    /// kernels run first and the host's work after, as by default: a thread of their
    /// own would take the core the host's work runs on (LL FP8 dispatch, 2 ranks on 2
    /// cores: 8% slower, docs/performance.md).
    fn overlap(
        &self,
        kernels: &mut (dyn FnMut() -> Result<()> + Send),
        host: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        if self.threads == 1 {
            kernels()?;
            return host();
        }
        std::thread::scope(|s| {
            let kernels = s.spawn(kernels);
            let host = host();
            let kernels = kernels.join().unwrap_or_else(|p| Err(panicked(p)));
            kernels.and(host)
        })
    }

    fn fifo_alloc(&self) -> &dyn FifoAlloc {
        &HostFifos
    }

    fn layout(&self, phase: &LayoutPhase<'_>) -> Result<DispatchLayout> {
        self.layout_phase(phase)
    }

    fn cast(&self, phase: &CastPhase<'_>, q: &mut [u8], scales: &mut [f32]) -> Result<()> {
        self.cast_phase(phase, q, scales)
    }

    fn reduce(&self, phase: &ReducePhase<'_>, out: &mut [bf16]) -> Result<()> {
        self.reduce_phase(phase, out)
    }
}

/// The host device's FIFOs: each in a page-aligned mapping of its own, apart from the
/// registered region, stored into by the kernel threads and read by the proxy.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostFifos;

/// A mapping that holds one FIFO.
struct FifoMapping(Region);

// SAFETY: `Region` keeps its mapping alive while it lives (page-aligned, so
// `REGION_ALIGN`-aligned), and this one is made for a single FIFO and reached only
// through it (the mapping is anonymous and never handed out).
#[allow(unsafe_code)]
unsafe impl FifoMemory for FifoMapping {
    fn base(&self) -> *mut u8 {
        self.0.as_ptr()
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

impl FifoAlloc for HostFifos {
    fn alloc_fifo(&self, capacity: usize) -> std::result::Result<Fifo, FifoError> {
        let bytes = uep_fifo::region_bytes(capacity);
        let region = Region::anonymous(bytes).map_err(|_| FifoError::AllocFailed { bytes })?;
        Fifo::in_memory(std::sync::Arc::new(FifoMapping(region)), capacity)
    }
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
    /// thread when one suffices; chunk `c` is `c * per..`, see [`Device::split`]),
    /// and return the first error.
    pub fn launch<F>(&self, n: usize, kernel: F) -> Result<()>
    where
        F: Fn(Range<usize>) -> Result<()> + Sync,
    {
        let (chunks, per) = self.split(n);
        if chunks <= 1 {
            return kernel(0..n);
        }
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
                let r = h.join().unwrap_or_else(|p| Err(panicked(p)));
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })
    }

    /// Run `kernel(first_row, rows)` over contiguous blocks of `out`, which holds rows of
    /// `row_len` values; each thread owns its block, so no two write the same row.
    pub fn launch_rows<T, F>(&self, out: &mut [T], row_len: usize, kernel: F) -> Result<()>
    where
        T: Send,
        F: Fn(usize, &mut [T]) -> Result<()> + Sync,
    {
        let mut none: [u8; 0] = [];
        self.launch_row_pairs((out, row_len), (&mut none, 0), |first, rows, _| {
            kernel(first, rows)
        })
    }

    /// [`HostDevice::launch_rows`] over two outputs whose rows go together (`a.0` rows
    /// of `a.1` values and as many of `b.1`, as a row's codes and its scales):
    /// `kernel(first_row, a_rows, b_rows)`.
    pub fn launch_row_pairs<A, B, F>(
        &self,
        a: (&mut [A], usize),
        b: (&mut [B], usize),
        kernel: F,
    ) -> Result<()>
    where
        A: Send,
        B: Send,
        F: Fn(usize, &mut [A], &mut [B]) -> Result<()> + Sync,
    {
        let n = a.0.len().checked_div(a.1).unwrap_or(0);
        let (chunks, per) = self.split(n);
        if chunks <= 1 {
            return kernel(0, a.0, b.0);
        }
        // A chunk of `b` for each chunk of `a` (empty ones where `b` has no rows).
        let mut b_blocks: Vec<&mut [B]> = match b.1 {
            0 => (0..chunks).map(|_| <&mut [B]>::default()).collect(),
            len => b.0.chunks_mut(per * len).collect(),
        };
        b_blocks.resize_with(chunks, Default::default);
        std::thread::scope(|s| {
            let mut blocks = a.0.chunks_mut(per * a.1).zip(b_blocks).enumerate();
            let Some((_, (a0, b0))) = blocks.next() else {
                return Ok(());
            };
            let handles: Vec<_> = blocks
                .map(|(c, (ac, bc))| {
                    let kernel = &kernel;
                    s.spawn(move || kernel(c * per, ac, bc))
                })
                .collect();
            let mut result = kernel(0, a0, b0);
            for h in handles {
                let r = h.join().unwrap_or_else(|p| Err(panicked(p)));
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
    use std::sync::atomic::{AtomicUsize, Ordering};

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
    fn host_fifos_carry_commands() {
        let fifo = HostFifos.alloc_fifo(8).unwrap();
        let cmd = uep_fifo::TransferCmd { word0: 3, word1: 4 };
        let slot = fifo.try_push(cmd).unwrap();
        let mut c = fifo.consumer().unwrap();
        assert_eq!(c.poll(), Some((slot, cmd)));
    }

    #[test]
    fn an_overlap_runs_the_kernels_while_the_host_works() {
        use std::sync::atomic::AtomicBool;
        use std::time::{Duration, Instant};
        let device: &dyn Device = &HostDevice::new(2);
        // The kernels wait for the host: they finish only if both run at once.
        let host_ran = AtomicBool::new(false);
        let (waited, ()) = device
            .overlapped(
                || {
                    let start = Instant::now();
                    while !host_ran.load(Ordering::Acquire) {
                        if start.elapsed() > Duration::from_secs(20) {
                            return Err(EpError::internal("the host never ran".into()));
                        }
                        std::thread::yield_now();
                    }
                    Ok(start.elapsed())
                },
                || {
                    host_ran.store(true, Ordering::Release);
                    Ok(())
                },
            )
            .unwrap();
        assert!(waited < Duration::from_secs(20));
        // Both sides run to the end; the kernels' error comes first.
        let host_done = AtomicBool::new(false);
        let err = device
            .overlapped(
                || Err::<(), _>(EpError::internal("kernel".into())),
                || {
                    host_done.store(true, Ordering::Relaxed);
                    Err::<(), _>(EpError::internal("host".into()))
                },
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("kernel") && host_done.into_inner(),
            "{err}"
        );
        let err = device
            .overlapped(|| -> Result<()> { panic!("boom") }, || Ok(()))
            .unwrap_err();
        assert!(matches!(&err, EpError::Panicked(m) if m == "boom"), "{err}");
        // One lane: the kernels on the calling thread, then the host's work.
        let order = std::sync::Mutex::new(Vec::new());
        let one: &dyn Device = &HostDevice::new(1);
        let caller = std::thread::current().id();
        let on_caller = |side| {
            order.lock().unwrap().push(side);
            assert_eq!(std::thread::current().id(), caller);
            Ok(())
        };
        one.overlapped(|| on_caller("kernels"), || on_caller("host"))
            .unwrap();
        assert_eq!(order.into_inner().unwrap(), ["kernels", "host"]);
    }

    #[test]
    fn a_panicking_kernel_thread_is_an_error() {
        let err = HostDevice::new(2)
            .launch(10, |r| {
                if r.start > 0 {
                    panic!("boom at {}", r.start);
                }
                Ok(())
            })
            .unwrap_err();
        assert!(
            matches!(&err, EpError::Panicked(m) if m == "boom at 5"),
            "{err}"
        );
    }
}
