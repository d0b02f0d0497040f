//! The device seam: what the EP layer needs of whatever runs its kernels.
//!
//! uep's kernels do what DeepEP's do (pack, store into same-node peers, reduce), with
//! one difference that makes the design portable: for a peer on another node they
//! never touch a NIC. They pack rows into staged memory and, while they pack, push
//! 16-byte commands into a FIFO that a CPU proxy drains ([`crate::net::Port`]). A
//! device therefore provides:
//!
//! * **lanes and launch**: run a kernel over a range of work items spread over its
//!   parallel lanes (threads here, SMs on a GPU) and say when all of it is done;
//! * **host-mapped FIFO memory** ([`Device::fifo_alloc`]): the proxy's command rings
//!   live in memory the kernels can store into and the proxy can read (pinned, mapped
//!   host memory on a GPU; a shared mapping for CPU kernels), instead of the proxy's
//!   own heap.
//!
//! [`HostDevice`] is the first implementation: CPU threads over contiguous chunks of
//! the work. `docs/architecture.md` maps each kernel phase to DeepEP's kernel of the
//! same job and says what a GPU device must add.

mod host;

use std::ops::Range;

use uep_fifo::FifoAlloc;

use crate::error::Result;

pub use host::{HostDevice, HostFifos};

/// What runs the EP layer's kernels; see the module docs.
///
/// ```
/// use uep_ep::device::{Device, HostDevice};
/// let device = HostDevice::new(2);
/// let sum = std::sync::atomic::AtomicUsize::new(0);
/// device
///     .launch(10, &|items: std::ops::Range<usize>| {
///         sum.fetch_add(items.sum::<usize>(), std::sync::atomic::Ordering::Relaxed);
///         Ok(())
///     })
///     .unwrap();
/// assert_eq!(sum.into_inner(), 45);
/// assert_eq!(device.lanes(), 2);
/// ```
pub trait Device: std::fmt::Debug + Send + Sync {
    /// A short name for messages and tables (`"host"`).
    fn name(&self) -> &str;

    /// Parallel lanes a launch spreads over.
    fn lanes(&self) -> usize;

    /// Run `kernel` on contiguous chunks of `0..n`, at most one a lane, and return once
    /// every chunk is done, with the first error.
    fn launch(&self, n: usize, kernel: &(dyn Fn(Range<usize>) -> Result<()> + Sync)) -> Result<()>;

    /// Makes the proxy's command FIFOs in memory this device's kernels store into.
    fn fifo_alloc(&self) -> &dyn FifoAlloc;
}
