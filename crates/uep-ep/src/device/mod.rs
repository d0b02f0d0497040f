//! The device seam: what the EP layer needs of whatever runs its kernels.
//!
//! uep's kernels do what DeepEP's do (pack, store into same-node peers, reduce), with
//! one difference that makes the design portable: for a peer on another node they
//! never touch a NIC. They pack rows into staged memory and, while they pack, push
//! 16-byte commands into a FIFO that a CPU proxy drains (a port of the network path). A
//! device therefore provides:
//!
//! * **lanes and launch**: run a kernel over a range of work items spread over its
//!   parallel lanes (threads here, SMs on a GPU) and say when all of it is done; or
//!   start kernels and let the host work until they complete ([`Device::overlap`]);
//! * **the copy phases** ([`Device::read`], [`Device::write`]): the host's own small
//!   reads of what peers published (taking what the wait acquired) and writes of what
//!   it publishes, so that symmetric memory may be memory only the device reaches;
//! * **the signal and wait phases** ([`Device::signal`], [`Device::wait`]): store the
//!   words that publish what a rank wrote, and wait for its peers' (named as ranks and
//!   areas), so that a GPU stores and spins inside its kernels on memory it owns while
//!   the host watches the peers;
//! * **host-mapped FIFO memory** ([`Device::fifo_alloc`]): the proxy's command rings
//!   live in memory the kernels can store into and the proxy can read (pinned, mapped
//!   host memory on a GPU; a shared mapping for CPU kernels), instead of the proxy's
//!   own heap;
//! * **symmetric memory** ([`Device::symmetric_alloc`]): this rank's region and its
//!   node peers' opened by a [`MemHandle`] exchanged over the control plane (a
//!   `/dev/shm` name here, an IPC handle on a GPU);
//! * **the compute phases** as whole methods over typed descriptors ([`LayoutPhase`],
//!   [`CastPhase`], [`ReducePhase`]): each names the caller's tensors and areas of
//!   symmetric memory, so a GPU implements it with its own kernel and matches the
//!   host's definition bit for bit;
//! * **the data-moving phases** ([`LlPackPhase`], [`LlUnpackPhase`],
//!   [`LlCombinePackPhase`], [`NotifyPhase`], [`NormalPackPhase`], [`RelayPhase`],
//!   [`NormalCombineSendPhase`]): each
//!   names the ranks and areas a kernel stores into and the staged packets whose ports
//!   it pushes into; their default methods run the host definition over
//!   [`Device::launch`].
//!
//! [`HostDevice`] is the first implementation: CPU threads over contiguous chunks of
//! the work. `docs/architecture.md` maps each kernel phase to DeepEP's kernel of the
//! same job and says what a GPU device must add.

mod copy;
pub(crate) mod host;
mod kernels;
pub(crate) mod normal;
pub(crate) mod pack;
mod phase;
mod place;
mod signal;

use std::ops::Range;

use half::bf16;
use uep_fifo::FifoAlloc;

use crate::error::{EpError, Result};
use crate::layout::DispatchLayout;

pub use crate::layout::WeightLanes;
pub use crate::map::LlAreas;
pub use crate::map::{NormalBank, NotifySlot};
pub use crate::net::{Counted, KernelPort};
pub use crate::packet::LlDispatchPacket;
pub use crate::packet::{DispatchPacket, NotifyHead, NotifyPacket, RowFormat};
pub use crate::symm::{MemHandle, ShmSymmetric, SymmetricAlloc, HANDLE_BYTES};
pub use crate::wait::{Peer, Seen, Wait};
pub use copy::CopyPhase;
pub use host::{HostDevice, HostFifos};
pub use kernels::{KernelLog, KernelPhases, Phase};
pub use normal::{
    Dest, NormalCombineSendPhase, NormalPackPhase, NormalPlan, NotifyPhase, NotifySink, RelayPhase,
    RelayedRow, ReturnSink, RowSink, NOT_SENT,
};
pub use pack::{
    CombineRemote, DispatchRemote, LlCombinePackPhase, LlCombineSink, LlLanded, LlPackPhase,
    LlSink, LlTokens, LlUnpackPhase, LlUnpacked, Sink,
};
pub use phase::{CastPhase, LayoutPhase, Part, ReducePhase, Rows, Symmetric};
pub(crate) use place::fingerprint;
pub use place::{LlPlacePhase, LlPlacement};
pub use signal::{SignalPhase, Store, Until, WaitPhase, Word};

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

    /// The phases that ran as kernels on this device since the last call (which it
    /// forgets): what a report names as a call's kernel phases. By default none: the
    /// host device runs every phase's host definition on CPU threads.
    fn take_kernel_phases(&self) -> KernelPhases {
        KernelPhases::default()
    }

    /// How a launch over `n` items cuts them: `(chunks, items a chunk)`, chunk `c`
    /// being `c * per..(c + 1) * per` (the last one shorter). A kernel that lays out
    /// each chunk's output before the launch (the normal dispatch's pack) relies on it.
    fn split(&self, n: usize) -> (usize, usize) {
        let chunks = self.lanes().clamp(1, n.max(1));
        (chunks, n.div_ceil(chunks).max(1))
    }

    /// Run `kernel` on the chunks of `0..n` that [`Device::split`] gives, one a lane,
    /// and return once every chunk is done, with the first error.
    fn launch(&self, n: usize, kernel: &(dyn Fn(Range<usize>) -> Result<()> + Sync)) -> Result<()>;

    /// An asynchronous launch and the wait on its completion, with host work between:
    /// starts `kernels` (the phases it calls, in order), runs `host` on the calling
    /// thread while they run, and returns once both are done, with the kernels' error
    /// first. `host` must not wait for anything that peers do only after this rank's
    /// kernels end. A GPU enqueues the phases on its stream without synchronising,
    /// runs `host`, then waits on the stream's event; the host device runs `kernels`
    /// on a thread of their own when it has more than one lane. By default one after
    /// the other (kernels, then host): the same results, without the overlap.
    /// `dyn Device`'s `overlapped` is the typed form.
    fn overlap(
        &self,
        kernels: &mut (dyn FnMut() -> Result<()> + Send),
        host: &mut dyn FnMut() -> Result<()>,
    ) -> Result<()> {
        kernels()?;
        host()
    }

    /// Makes the proxy's command FIFOs in memory this device's kernels store into.
    fn fifo_alloc(&self) -> &dyn FifoAlloc;

    /// Makes this rank's symmetric memory and opens its node peers' by the handles
    /// exchanged over the control plane (and kept at an elastic job's door). By default
    /// the host's shared memory ([`ShmSymmetric`]), which every device can use while
    /// the host reads what its waits acquire.
    fn symmetric_alloc(&self) -> &dyn SymmetricAlloc {
        &ShmSymmetric
    }

    /// Phase *layout*: the dispatch layout of a routing, exactly as
    /// [`crate::get_dispatch_layout`] defines it (its errors too).
    fn layout(&self, phase: &LayoutPhase<'_>) -> Result<DispatchLayout>;

    /// Phase *cast* (low-latency dispatch send): `q` gets `[tokens, hidden]` e4m3 codes
    /// and `scales` `[tokens, hidden / 128]` scales, bit for bit
    /// [`crate::quant::quantize_token`]'s.
    fn cast(&self, phase: &CastPhase<'_>, q: &mut [u8], scales: &mut [f32]) -> Result<()>;

    /// Phase *reduce* (both combines' receive): `out` gets `[tokens, hidden]` rows,
    /// each the sum [`ReducePhase`] describes, bit for bit
    /// [`crate::quant::reduce_rows`]'s.
    fn reduce(&self, phase: &ReducePhase<'_>, out: &mut [bf16]) -> Result<()>;

    /// Phase *read* ([`CopyPhase`]): `out` gets the area's bytes, which peers
    /// published to this rank in the call whose wait acquired `seen` (the counts of a
    /// notify slot, a combine's flag and block offsets, a dispatch's source indices). A
    /// GPU copies them out of its memory; by default the host's copy.
    fn read(&self, phase: &CopyPhase<'_>, seen: &Seen, out: &mut [u8]) -> Result<()> {
        let _published = seen;
        phase.host_read(out)
    }

    /// Phase *write* ([`CopyPhase`]): `bytes` into the area, before a signal publishes
    /// them (a combine's block offsets, a dispatch's padding rows). A GPU copies them
    /// into its memory; by default the host's copy.
    fn write(&self, phase: &CopyPhase<'_>, bytes: &[u8]) -> Result<()> {
        phase.host_write(bytes)
    }

    /// Phase *signal* ([`SignalPhase`]): each store, in order, with release, after
    /// everything this rank's kernels stored before (the end of DeepEP's send kernels:
    /// a count, an epoch, a "done" into this rank's or a same-node peer's memory). By
    /// default the host definition, on the calling thread.
    fn signal(&self, phase: &SignalPhase<'_>) -> Result<()> {
        host::signal(phase)
    }

    /// Phase *wait* ([`WaitPhase`]): until every word, stored by a peer with release,
    /// reaches what it must, in order; returns what each wait acquired ([`Seen`]: the
    /// value, and the proof that reading what the word publishes is safe). Every
    /// receive of both modes opens with it, as DeepEP's receive kernels open with their
    /// spin. A GPU spins inside a kernel on the memory it owns while the host watches
    /// ([`Wait`]) and stops the kernel if the wait is hopeless. By default the host
    /// definition, spinning on the calling thread.
    fn wait(&self, phase: &WaitPhase<'_>) -> Result<Vec<Seen>> {
        host::wait(phase)
    }

    /// The placement phase of a low-latency dispatch ([`LlPlacePhase`]): checks the
    /// routing and says where every copy goes ([`LlPlacement`]), computed where
    /// `topk_idx` lives. By default the host definition, on the calling thread.
    fn ll_place(&self, phase: &LlPlacePhase<'_>) -> Result<LlPlacement> {
        place::host_place(phase)
    }

    /// The pack phase of a low-latency dispatch ([`LlPackPhase`]): stores every copy
    /// at its same-node rank and every token into its packets, pushing the packets'
    /// rows to the proxy as they fill. By default the host definition over
    /// [`Device::launch`].
    fn ll_pack(&self, phase: &LlPackPhase<'_>) -> Result<()> {
        host::ll_pack(self, phase)
    }

    /// The pack phase of a low-latency combine ([`LlCombinePackPhase`]): returns every
    /// expert output row to its source, same-node ones into their combine rows, the
    /// others' into packets whose blocks it pushes as each is copied. By default the
    /// host definition over [`Device::launch`].
    fn ll_combine_pack(&self, phase: &LlCombinePackPhase<'_>) -> Result<()> {
        host::ll_combine_pack(self, phase)
    }

    /// The receive phase of a low-latency dispatch ([`LlUnpackPhase`]): packs every
    /// local expert's rows to the front and says where each came from. By default the
    /// host definition, on the calling thread.
    fn ll_unpack(&self, phase: &LlUnpackPhase<'_>) -> Result<LlUnpacked> {
        host::ll_unpack(phase)
    }

    /// The notify phase of a normal dispatch ([`NotifyPhase`]): this rank's counts
    /// into every same-node rank's slot and the other nodes' packets. By default the
    /// host definition, on the calling thread.
    fn normal_notify(&self, phase: &NotifyPhase<'_>) -> Result<()> {
        host::normal_notify(phase)
    }

    /// The pack phase of a normal dispatch ([`NormalPackPhase`]): stores every token
    /// into each destination of its plan and pushes the rows that go straight to
    /// another node's relay as they fill. By default the host definition over
    /// [`Device::launch`].
    fn normal_pack(&self, phase: &NormalPackPhase<'_>) -> Result<()> {
        host::normal_pack(self, phase)
    }

    /// The send phase of a normal combine ([`NormalCombineSendPhase`]): returns every
    /// received row to its source's slot on this node. By default the host definition
    /// over [`Device::launch`].
    fn normal_combine_send(&self, phase: &NormalCombineSendPhase<'_>) -> Result<()> {
        host::normal_combine_send(self, phase)
    }

    /// The forward phase of a normal dispatch across nodes ([`RelayPhase`]), on the
    /// rank that relays a source of another node: stores every token of its landed
    /// packet into the output rows of this node's ranks. By default the host
    /// definition over [`Device::launch`].
    fn relay(&self, phase: &RelayPhase<'_>) -> Result<()> {
        host::relay(self, phase)
    }
}

impl dyn Device + '_ {
    /// [`Device::overlap`] with results: `kernels()` as an asynchronous launch while
    /// `host()` runs on the calling thread.
    ///
    /// ```
    /// use uep_ep::device::{Device, HostDevice};
    /// let device: &dyn Device = &HostDevice::new(2);
    /// let (sum, note) = device
    ///     .overlapped(|| Ok((1..=10).sum::<u32>()), || Ok("meanwhile"))
    ///     .unwrap();
    /// assert_eq!((sum, note), (55, "meanwhile"));
    /// ```
    pub fn overlapped<K: Send, H>(
        &self,
        kernels: impl FnOnce() -> Result<K> + Send,
        host: impl FnOnce() -> Result<H>,
    ) -> Result<(K, H)> {
        let (mut kernels, mut host) = (Some(kernels), Some(host));
        let (mut k, mut h) = (None, None);
        self.overlap(
            &mut || {
                k = Some(kernels.take().ok_or_else(|| unlike_once(self))?()?);
                Ok(())
            },
            &mut || {
                h = Some(host.take().ok_or_else(|| unlike_once(self))?()?);
                Ok(())
            },
        )?;
        k.zip(h).ok_or_else(|| unlike_once(self))
    }
}

/// A device whose overlap ran a side other than once.
fn unlike_once(device: &dyn Device) -> EpError {
    EpError::internal(format!(
        "device {} ran a side of an overlap other than once",
        device.name()
    ))
}
