//! The emulated GPU device (`--device emu`): uep's kernels, the same sources a GPU runs
//! (`kernels/*.cu`), built for the host and run on CPU threads as a grid whose blocks
//! all run at once (`kernels/host/runtime.h`). Built by default, with no CUDA compiler
//! or driver, so that CI runs every kernel on every commit, bit for bit against the
//! host device.
//!
//! The phases with a kernel run it ([`EmuDevice::KERNELS`]); the others run the host
//! device's definition on CPU threads, and [`Device::take_kernel_phases`] says which
//! ran as kernels. A small grid by default (two blocks of two warps): it runs on the
//! machine's cores beside every other rank's.

use std::ops::Range;
use std::time::Duration;

use half::bf16;
use uep_ep::device::{
    CastPhase, Device, HostDevice, HostFifos, KernelLog, KernelPhases, LayoutPhase,
    LlCombinePackPhase, LlPackPhase, LlPlacePhase, LlPlacement, LlUnpackPhase, LlUnpacked,
    NormalCombineSendPhase, NormalPackPhase, NotifyPhase, Phase, ReducePhase, RelayPhase,
};
use uep_ep::{Cast, DispatchLayout, EpError};
use uep_fifo::FifoAlloc;

mod combine;
mod ffi;
pub(crate) mod kernels;
mod normal;
mod normal_pack;
mod pack;
mod place;
mod push;
mod unpack;

pub use ffi::Grid;

#[cfg(test)]
mod tests;

use crate::quant::Loads;

/// The emulated GPU; see the module docs.
///
/// ```
/// use uep_cuda::EmuDevice;
/// use uep_ep::device::{Device, LayoutPhase, Phase};
/// let device = EmuDevice::new(2);
/// let topk_idx = [0i64, 5, 3, -1];
/// let phase = LayoutPhase { topk_idx: &topk_idx, topk: 2, num_experts: 8, num_ranks: 2, ranks_per_node: 2 };
/// let layout = device.layout(&phase).unwrap();
/// assert_eq!(layout.num_tokens_per_rank, [2, 1]);
/// assert!(device.take_kernel_phases().contains(Phase::Layout));
/// ```
#[derive(Debug)]
pub struct EmuDevice {
    /// Runs the phases that have no kernel yet.
    host: HostDevice,
    grid: Grid,
    /// The phases run as kernels since the last `take_kernel_phases`.
    ran: KernelLog,
}

/// An error of the host build's launch, which is uep's own fault.
fn launch_failed(e: String) -> EpError {
    EpError::Internal(format!("emulated device: {e}"))
}

impl EmuDevice {
    /// The phases that run as kernels on this device.
    pub const KERNELS: [Phase; 11] = [
        Phase::Layout,
        Phase::Cast,
        Phase::Reduce,
        Phase::LlPlace,
        Phase::LlPack,
        Phase::LlUnpack,
        Phase::LlCombinePack,
        Phase::NormalNotify,
        Phase::NormalPack,
        Phase::Relay,
        Phase::NormalCombineSend,
    ];

    /// The default grid: two blocks of two warps, spins bounded by uep's default wait.
    pub const GRID: Grid = Grid {
        blocks: 2,
        threads: 64,
        timeout_ns: 100_000_000_000,
    };

    /// An emulated GPU with the default grid; the phases without a kernel run on
    /// `threads` CPU threads.
    pub fn new(threads: usize) -> EmuDevice {
        EmuDevice::with_grid(threads, EmuDevice::GRID)
    }

    /// An emulated GPU whose kernels run on `grid`.
    pub fn with_grid(threads: usize, grid: Grid) -> EmuDevice {
        EmuDevice {
            host: HostDevice::new(threads),
            grid,
            ran: KernelLog::default(),
        }
    }

    /// The grid every kernel runs on.
    pub fn grid(&self) -> Grid {
        self.grid
    }

    /// How long a kernel's spin may last.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.grid.timeout_ns)
    }
}

impl Device for EmuDevice {
    fn name(&self) -> &str {
        "emu"
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
        &HostFifos
    }

    fn layout(&self, p: &LayoutPhase<'_>) -> uep_ep::Result<DispatchLayout> {
        let run = |s| kernels::layout(self.grid, p.topk_idx, s).map_err(launch_failed);
        let (layout, ran) = crate::layout::phase(p, &self.host, run)?;
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
                kernels::fp8_cast(self.grid, Loads::X16, x, round_scale, q, scales)
            }
            Cast::Nvfp4(n) => {
                kernels::nvfp4_cast(self.grid, x, n, q, bytemuck::cast_slice_mut(scales))
            }
        }
        .map_err(launch_failed)?;
        self.ran.ran(Phase::Cast);
        Ok(())
    }

    fn reduce(&self, p: &ReducePhase<'_>, out: &mut [bf16]) -> uep_ep::Result<()> {
        p.check(out.len())?;
        if p.tokens() == 0 || p.hidden == 0 {
            return self.host.reduce(p, out);
        }
        // Each source where it is: the caller's tensor, or the area of symmetric memory
        // the phase's publication makes readable.
        let sources: Vec<&[u16]> = (p.sources.iter())
            .map(|&s| p.memory.rows(s))
            .collect::<uep_ep::Result<_>>()?;
        let out: &mut [u16] = bytemuck::cast_slice_mut(out);
        kernels::reduce(
            self.grid, &sources, p.starts, p.parts, p.hidden, p.weighted, out,
        )
        .map_err(launch_failed)?;
        self.ran.ran(Phase::Reduce);
        Ok(())
    }

    fn ll_pack(&self, p: &LlPackPhase<'_>) -> uep_ep::Result<()> {
        // A warp a token, a lane a slot: top-k past a warp's width runs on the host.
        if p.tokens() == 0 || p.areas.shape.topk > 32 {
            return self.host.ll_pack(p);
        }
        pack::ll_pack(self.grid, p)?;
        self.ran.ran(Phase::LlPack);
        Ok(())
    }

    fn ll_unpack(&self, p: &LlUnpackPhase<'_>) -> uep_ep::Result<LlUnpacked> {
        let unpacked = unpack::ll_unpack(self.grid, p)?;
        self.ran.ran(Phase::LlUnpack);
        Ok(unpacked)
    }

    fn ll_combine_pack(&self, p: &LlCombinePackPhase<'_>) -> uep_ep::Result<()> {
        combine::ll_combine_pack(self.grid, p)?;
        self.ran.ran(Phase::LlCombinePack);
        Ok(())
    }

    fn ll_place(&self, p: &LlPlacePhase<'_>) -> uep_ep::Result<LlPlacement> {
        if p.topk_idx.is_empty() {
            return self.host.ll_place(p);
        }
        let placement = place::ll_place(self.grid, p)?;
        self.ran.ran(Phase::LlPlace);
        Ok(placement)
    }

    fn normal_combine_send(&self, p: &NormalCombineSendPhase<'_>) -> uep_ep::Result<()> {
        // A warp a row, a lane a slot's weight: top-k past a warp's width runs on the host.
        if p.rows() == 0 || p.shape.topk > 32 {
            return self.host.normal_combine_send(p);
        }
        normal::normal_combine_send(self.grid, p)?;
        self.ran.ran(Phase::NormalCombineSend);
        Ok(())
    }

    fn normal_notify(&self, p: &NotifyPhase<'_>) -> uep_ep::Result<()> {
        normal::normal_notify(self.grid, p)?;
        self.ran.ran(Phase::NormalNotify);
        Ok(())
    }

    fn normal_pack(&self, p: &NormalPackPhase<'_>) -> uep_ep::Result<()> {
        // A warp a block of tokens and a destination, a lane a slot: top-k past a
        // warp's width runs on the host.
        if p.tokens() == 0 || p.shape.topk > 32 {
            return self.host.normal_pack(p);
        }
        normal_pack::normal_pack(self.grid, p, self.split(p.tokens()))?;
        self.ran.ran(Phase::NormalPack);
        Ok(())
    }

    fn relay(&self, p: &RelayPhase<'_>) -> uep_ep::Result<()> {
        // A warp a token, a lane a slot: top-k past a warp's width runs on the host.
        if p.tokens() == 0 || p.shape.topk > 32 {
            return self.host.relay(p);
        }
        normal::relay(self.grid, p)?;
        self.ran.ran(Phase::Relay);
        Ok(())
    }
}
