//! A kernel's FIFOs: rings in pinned host memory, each leased to one producer warp of
//! the GPU, with the table of device addresses the kernel reads.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use uep_fifo::{DeviceLease, Fifo, FifoAlloc};

use crate::gpu::driver;
use crate::pinned::device_addr;
use crate::{CudaError, CudaFifos, Gpu};

/// `n` FIFOs leased to a kernel (block `b`'s warp produces into ring `b`) and their
/// table in device memory (`uep::Ring[n]`: address, capacity).
pub(crate) struct DeviceRings {
    fifos: Vec<Arc<Fifo>>,
    // Held for their drop: host pushes stay out while the kernels own the rings.
    _leases: Vec<DeviceLease<Arc<Fifo>>>,
    table: CudaSlice<u64>,
}

impl DeviceRings {
    /// `n` empty FIFOs of `capacity` slots, named `what` and their index.
    pub(crate) fn new(gpu: &Gpu, n: usize, capacity: usize, what: &str) -> Result<Self, CudaError> {
        let fifo_err = |e: uep_fifo::FifoError| CudaError::Fifo(e.to_string());
        let alloc = CudaFifos::new(gpu);
        let fifos = (0..n)
            .map(|r| {
                Ok(Arc::new(
                    alloc
                        .alloc_fifo(capacity)
                        .map_err(fifo_err)?
                        .with_label(format!("{what} {r}")),
                ))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let leases = fifos
            .iter()
            .map(|f| DeviceLease::claim(f.clone()).map_err(fifo_err))
            .collect::<Result<Vec<_>, _>>()?;
        let mut words = Vec::with_capacity(2 * n);
        for lease in &leases {
            words.push(device_addr(lease.region_addr())?);
            words.push(capacity as u64);
        }
        let table = gpu
            .stream()
            .clone_htod(&words)
            .map_err(driver("copying the ring table"))?;
        Ok(DeviceRings {
            fifos,
            _leases: leases,
            table,
        })
    }

    /// Consumer `c` of `of`'s rings: every `of`th ring from `c`, with its index.
    pub(crate) fn share(&self, c: usize, of: usize) -> Vec<(usize, &Fifo)> {
        self.fifos
            .iter()
            .map(|f| &**f)
            .enumerate()
            .skip(c)
            .step_by(of)
            .collect()
    }

    /// The `uep::Ring` table the kernel takes.
    pub(crate) fn table(&self) -> &CudaSlice<u64> {
        &self.table
    }

    /// Runs `launch` while `consumers` CPU threads drain the rings, thread `c` calling
    /// `drain` on its share (every `consumers`th ring from `c`) and a flag raised if the
    /// launch failed. Returns what each thread returned and the time from the launch to
    /// the last thread's return (the clock starts once the threads run).
    pub(crate) fn drained_while<T: Send>(
        &self,
        consumers: usize,
        drain: impl Fn(&[(usize, &Fifo)], &AtomicBool) -> Result<T, CudaError> + Sync,
        launch: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(Vec<T>, Duration), CudaError> {
        let failed = AtomicBool::new(false);
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..consumers)
                .map(|c| {
                    let (mine, failed, drain) = (self.share(c, consumers), &failed, &drain);
                    s.spawn(move || drain(&mine, failed))
                })
                .collect();
            let start = Instant::now();
            let launched = launch();
            if launched.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            let mut results = Vec::with_capacity(consumers);
            for w in workers {
                let r = w
                    .join()
                    .map_err(|_| CudaError::Fifo("a consumer thread panicked".into()))?;
                results.push(r);
            }
            let wall = start.elapsed();
            launched?;
            Ok((results.into_iter().collect::<Result<_, _>>()?, wall))
        })
    }
}
