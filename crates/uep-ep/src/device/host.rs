//! The host device: "kernels" are CPU threads over contiguous chunks of the work, and
//! the proxy's FIFOs live in mappings of their own that those threads store into.

use std::ops::Range;

use uep_fifo::{Fifo, FifoAlloc, FifoError, FifoMemory};
use uep_shm::Region;

use super::Device;
use crate::error::{EpError, Result};

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

    fn fifo_alloc(&self) -> &dyn FifoAlloc {
        &HostFifos
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

    /// How `n` items are cut into chunks, one a thread: `(chunks, items per chunk)`.
    pub fn chunks(&self, n: usize) -> (usize, usize) {
        let chunks = self.threads.min(n.max(1));
        (chunks, n.div_ceil(chunks).max(1))
    }

    /// Run `kernel` on contiguous chunks of `0..n`, one per thread (in the caller's
    /// thread when one suffices; chunk `c` is `c * per..`, see [`HostDevice::chunks`]),
    /// and return the first error.
    pub fn launch<F>(&self, n: usize, kernel: F) -> Result<()>
    where
        F: Fn(Range<usize>) -> Result<()> + Sync,
    {
        let (chunks, per) = self.chunks(n);
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
        let n = out.len().checked_div(row_len).unwrap_or(0);
        let (chunks, per) = self.chunks(n);
        if chunks <= 1 {
            return kernel(0, out);
        }
        std::thread::scope(|s| {
            let mut blocks = out.chunks_mut(per * row_len).enumerate();
            let Some((_, first)) = blocks.next() else {
                return Ok(());
            };
            let handles: Vec<_> = blocks
                .map(|(c, block)| {
                    let kernel = &kernel;
                    s.spawn(move || kernel(c * per, block))
                })
                .collect();
            let mut result = kernel(0, first);
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
