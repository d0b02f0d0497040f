//! The CUDA device on uep-ep's seam: [`CudaDevice`] implements
//! [`uep_ep::device::Device`], so `Buffer::with_device` runs the EP operations with
//! their compute phases on a GPU.
//!
//! What runs where, today:
//! * **layout, cast (FP8 and NVFP4), reduce** (the trait's phase methods): CUDA
//!   kernels, the same sources the emulated device runs in CI and `uep gpu` checks bit
//!   for bit against the host's definitions; a phase's inputs are copied to the device
//!   and its outputs back, since the EP layer's memory (the caller's tensors and the
//!   `/dev/shm` symmetric memory) is host memory;
//! * **FIFO memory**: pinned host memory mapped into the GPU ([`CudaFifos`]);
//! * **launch** (the data-moving kernels: pack, store into same-node peers, push
//!   commands): still host closures, run on CPU threads, because they read and write
//!   host-mapped symmetric memory; see `docs/cuda.md` for what moves them to the GPU.

use std::ops::Range;

use cudarc::driver::CudaFunction;
use half::bf16;
use uep_ep::device::{
    CastPhase, Device, HostDevice, KernelLog, KernelPhases, LayoutPhase, Phase, ReducePhase,
};
use uep_ep::Cast;
use uep_ep::{DispatchLayout, EpError};
use uep_fifo::FifoAlloc;

use crate::gpu::kernels;
use crate::layout;
use crate::quant::Loads;
use crate::{CudaError, CudaFifos, Gpu};

/// A GPU as the device of a `uep_ep::Buffer`.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::sync::Arc;
/// use uep_cuda::CudaDevice;
/// use uep_ep::device::Device;
/// let device = Arc::new(CudaDevice::open(0, 4)?);
/// assert_eq!(device.name(), "cuda");
/// // let buffer = uep_ep::Buffer::with_device(control_plane, config, device)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct CudaDevice {
    gpu: Gpu,
    fifos: CudaFifos,
    /// Runs the data-moving kernels (see the module docs).
    host: HostDevice,
    layout: CudaFunction,
    cast: CudaFunction,
    cast_nvfp4: CudaFunction,
    reduce: CudaFunction,
    /// The phases run as kernels since the last `take_kernel_phases`.
    ran: KernelLog,
}

/// A driver failure as the EP layer's error: a resource that failed.
fn ep(e: CudaError) -> EpError {
    EpError::Resource(format!("CUDA device: {e}"))
}

impl CudaDevice {
    /// Opens GPU `ordinal`; the data-moving kernels get `host_threads` CPU threads.
    pub fn open(ordinal: usize, host_threads: usize) -> Result<CudaDevice, CudaError> {
        let gpu = Gpu::open(ordinal)?;
        Ok(CudaDevice {
            fifos: CudaFifos::new(&gpu),
            host: HostDevice::new(host_threads),
            layout: gpu.function(kernels::LAYOUT, "uep_dispatch_layout")?,
            cast: gpu.function(kernels::CAST, Loads::X16.kernel())?,
            cast_nvfp4: gpu.function(kernels::CAST, "uep_nvfp4_quantize")?,
            reduce: gpu.function(kernels::REDUCE, "uep_reduce")?,
            ran: KernelLog::default(),
            gpu,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Device for CudaDevice {
    fn name(&self) -> &str {
        "cuda"
    }

    fn lanes(&self) -> usize {
        self.host.lanes()
    }

    fn take_kernel_phases(&self) -> KernelPhases {
        self.ran.take()
    }

    fn launch(
        &self,
        n: usize,
        kernel: &(dyn Fn(Range<usize>) -> uep_ep::Result<()> + Sync),
    ) -> uep_ep::Result<()> {
        self.host.launch(n, kernel)
    }

    fn fifo_alloc(&self) -> &dyn FifoAlloc {
        &self.fifos
    }

    fn layout(&self, p: &LayoutPhase<'_>) -> uep_ep::Result<DispatchLayout> {
        let run = |s| layout::compute(&self.gpu, &self.layout, p.topk_idx, s).map_err(ep);
        let (layout, ran) = layout::phase(p, &self.host, run)?;
        if ran {
            self.ran.ran(Phase::Layout);
        }
        Ok(layout)
    }

    fn cast(&self, p: &CastPhase<'_>, q: &mut [u8], scales: &mut [f32]) -> uep_ep::Result<()> {
        p.check(q.len(), scales.len())?;
        let x: &[u16] = bytemuck::cast_slice(p.x);
        if x.is_empty() {
            return Ok(());
        }
        match p.cast {
            Cast::Fp8 { round_scale } => {
                crate::quant::cast(&self.gpu, &self.cast, x, round_scale, q, scales)
            }
            Cast::Nvfp4(n) => crate::quant::cast_nvfp4(
                &self.gpu,
                &self.cast_nvfp4,
                x,
                n,
                q,
                bytemuck::cast_slice_mut(scales),
            ),
        }
        .map_err(ep)?;
        self.ran.ran(Phase::Cast);
        Ok(())
    }

    fn reduce(&self, p: &ReducePhase<'_>, out: &mut [bf16]) -> uep_ep::Result<()> {
        p.check(out.len())?;
        if p.tokens() == 0 || p.hidden == 0 {
            return self.host.reduce(p, out);
        }
        crate::reduce::reduce(&self.gpu, &self.reduce, p, out).map_err(ep)?;
        self.ran.ran(Phase::Reduce);
        Ok(())
    }
}
