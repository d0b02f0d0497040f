//! uep's CUDA device: GPU kernels that pack and push 16-byte commands into FIFOs in
//! pinned host memory, drained by uep's CPU proxies (UCCL-EP's host-pinned mode: any
//! NIC, no GPUDirect).
//!
//! Built with the `cuda` feature, the crate embeds kernels that `nvcc` compiled for
//! sm_90 and sm_80 (`kernels/*.cu`, resource report in the build log) and drives them
//! through the CUDA driver API ([`cudarc`], loaded at run time): a binary built with
//! the feature still starts on a machine with no driver and [`Gpu::open`] says so.
//! Without the feature every entry point returns [`CudaError::NotBuilt`].
//!
//! The kernels are one source built three ways (`kernels/port.cuh`): by nvcc for a GPU
//! (this feature), by the system C++ compiler for the [`EmuDevice`] (always built: CI
//! runs every kernel on CPU threads, bit for bit against the host device), and by
//! hipcc for AMD GPUs (`./dev hip-check`, compile only).
//!
//! What runs on a GPU so far:
//! * [`fifo_bench`]: kernels (one block, or one a multiprocessor) push `Write`
//!   commands to CPU consumers: commands per second and push→pop round trips;
//! * [`quant`]: the low-latency dispatch's FP8 cast, checked bit for bit against
//!   `uep_ep::quant` on fresh random inputs;
//! * `CudaDevice`: `uep_ep::device::Device` on a GPU, so `Buffer::with_device` runs
//!   the EP operations with their compute phases (layout, cast, reduce) as these
//!   kernels; the data-moving phases still run on CPU threads (`docs/cuda.md` says
//!   what is missing).
#![deny(unsafe_code)]

mod api;
pub mod emu;
mod error;
#[cfg(feature = "cuda")]
mod gpu;
#[doc(hidden)]
pub mod host_check;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod rings;

#[cfg(feature = "cuda")]
mod device;
pub mod fifo_bench;
pub mod inputs;
pub mod layout;
#[cfg(feature = "cuda")]
pub mod ll_send;
pub mod quant;
#[cfg(feature = "cuda")]
pub mod reduce;
pub mod selftest;

#[cfg(feature = "cuda")]
pub use device::CudaDevice;
pub use emu::EmuDevice;
pub use error::CudaError;
#[cfg(feature = "cuda")]
pub use gpu::Gpu;
#[cfg(feature = "cuda")]
pub use pinned::{CudaFifos, Pinned};

/// What a checked kernel measured: its median time and the bytes it must move.
#[derive(Clone, Copy, Debug)]
pub struct Measured {
    /// The inputs' seed (replay with it).
    pub seed: u64,
    /// Median kernel time (device events).
    pub time: std::time::Duration,
    /// Bytes the kernel must read and write at the least.
    pub bytes: u64,
}

impl Measured {
    /// Bytes a second.
    pub fn bandwidth(&self) -> f64 {
        self.bytes as f64 / self.time.as_secs_f64()
    }
}

/// Whether this build carries the CUDA device (the `cuda` feature).
pub const BUILT: bool = cfg!(feature = "cuda");

/// What [`probe`] found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Compute capability, major and minor.
    pub capability: (i32, i32),
    /// Multiprocessors.
    pub sms: u32,
    /// Device memory in bytes.
    pub memory: usize,
}

/// The first CUDA device, or why there is none (not built, no driver, no device).
///
/// ```
/// // On a machine without a GPU (or a build without `cuda`) this is a clear error.
/// match uep_cuda::probe() {
///     Ok(info) => println!("{} with {} SMs", info.name, info.sms),
///     Err(e) => println!("no CUDA device: {e}"),
/// }
/// ```
pub fn probe() -> Result<DeviceInfo, CudaError> {
    #[cfg(feature = "cuda")]
    {
        Gpu::open(0)?.info()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(CudaError::NotBuilt)
    }
}
