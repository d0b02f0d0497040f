//! uep command FIFO (docs/architecture.md, "uep-fifo"): a bounded ring of 16-byte
//! [`TransferCmd`]s through which device code (producers) hands commands to a
//! CPU proxy thread (the single consumer).
//!
//! The ring works over any memory: an owned heap allocation
//! ([`Fifo::new_heap`]) or a shared mapping, e.g. a `/dev/shm` file mapped by
//! several processes ([`Fifo::from_raw`]).
//!
//! # Memory layout
//!
//! All words are native-endian `u64`s accessed only atomically. The region
//! starts 128-byte aligned and is [`region_bytes`]`(capacity)` long.
//!
//! | offset          | word          | written by | meaning |
//! |-----------------|---------------|------------|---------|
//! | 0               | magic         | init       | [`MAGIC`] ("uepFIFO1"), stored last with Release |
//! | 8               | capacity      | init       | number of slots, a power of two |
//! | 128             | head          | producers  | next index to claim (monotonic `u64`) |
//! | 136             | cached_tail   | producers  | a recent copy of `tail` |
//! | 144             | producer_claimed | [`Producer`] | non-zero while an exclusive producer exists |
//! | 256             | tail          | consumer   | next index to pop (monotonic `u64`) |
//! | 264             | claimed       | consumer   | non-zero while a [`Consumer`] exists |
//! | 384 + 16·(i mod capacity) | word0, word1 | both | slot of index `i`; `word0 == 0` = empty |
//!
//! Each index sits on its own 128-byte line, on the side that writes it.
//!
//! # Protocol
//!
//! * **Claim** (producers): read `head` and `cached_tail`; if the cache says
//!   the ring is full, reload the real `tail` (Acquire) and refresh the cache
//!   (Release). One compare-exchange of `head` to `head + 1` (AcqRel) claims
//!   slot `head`. Back-pressure is the capacity: nothing is claimed while
//!   `head - tail == capacity`.
//! * **Publish**: store `word1` (Relaxed), then `word0` (Release). A valid
//!   command's `word0` is never zero, so for a consumer that gates on `word0`
//!   this pair *is* the design's "one 16-byte release store": `word0` becomes
//!   non-zero only after `word1` is in place, and the Acquire load of `word0`
//!   makes `word1` visible.
//! * **Poll** (consumer): Acquire-load `word0` of slot `tail`; non-zero means
//!   ready, then read `word1`.
//! * **Pop**: zero both words, then Release-store `tail + 1`. A producer
//!   reuses the slot only after seeing that tail (directly, or through the
//!   cache's Release/Acquire chain), so the zeroing happens before its
//!   writes.
//! * **Completion**: `Write`/`Atomic` pop when posted; `Quiet`/`Barrier` pop
//!   only when done, so [`Fifo::is_consumed`] (`tail > slot`) is the
//!   producer's completion signal.
//!
//! # Device producers
//!
//! A GPU kernel produces as the exclusive producer (the host holds a [`DeviceLease`]):
//! one warp a ring keeps `head` in registers and follows the table above with these PTX
//! instructions, system scope since the consumer is a CPU thread (`crates/uep-cuda`,
//! `kernels/fifo.cuh`, `docs/cuda.md`):
//!
//! | step | PTX |
//! |------|-----|
//! | read `head`, `tail` at start; reload `tail` when full | `ld.acquire.sys.global.u64` |
//! | publish: `word1`, then `word0` | `st.relaxed.sys.global.u64`, then `st.release.sys.global.u64` |
//! | store `head` back at the end | `st.release.sys.global.u64` |
//!
//! The release of `word0` is the "16-byte store" of the design: a `v2.u64` vector store
//! is two accesses with no order between them in the PTX memory model.
//!
//! # Single consumer
//!
//! Exactly one consumer may poll and pop. [`Consumer`] enforces it: claiming
//! one sets the `claimed` word in the region (so it holds across processes),
//! a second claim fails with [`FifoError::ConsumerTaken`], and dropping the
//! handle releases it. A process that dies holding the claim leaves it set;
//! re-initialise the region ([`Fifo::from_raw`] with `init = true`) to
//! recover. Misuse can lose or repeat commands but never causes undefined
//! behaviour: every shared word is an atomic.
#![deny(unsafe_code)]

use std::fmt;
use std::ops::Deref;
use std::time::{Duration, Instant};

pub use uep_wire::TransferCmd;

#[allow(unsafe_code)]
mod ring;
mod sync;

use ring::Ring;
use sync::Ordering::{AcqRel, Acquire, Relaxed, Release};

/// Slots a FIFO has by default (the paper's figure).
pub const DEFAULT_CAPACITY: usize = 2048;
/// Largest capacity accepted (2^30 slots, 16 GiB of slots).
pub const MAX_CAPACITY: usize = 1 << 30;
/// Required alignment of a FIFO region.
pub const REGION_ALIGN: usize = ring::LINE;
/// Bytes before the first slot.
pub const HEADER_BYTES: usize = ring::HEADER_BYTES;
/// Byte offset of `head` in a region (device producers read and store it).
pub const HEAD_OFFSET: usize = ring::HEAD_OFFSET;
/// Byte offset of `tail` in a region (device producers poll it).
pub const TAIL_OFFSET: usize = ring::TAIL_OFFSET;
/// The magic word at offset 0 of an initialised region ("uepFIFO1" little-endian).
pub const MAGIC: u64 = ring::MAGIC;

/// Busy-wait iterations before [`Fifo::push`] starts yielding the thread.
const SPIN_LIMIT: u32 = 128;

/// Bytes a FIFO of `capacity` slots needs: the header plus 16 bytes a slot.
/// Saturates rather than overflowing for absurd capacities (which
/// [`Fifo::new_heap`] and [`Fifo::from_raw`] reject anyway).
pub const fn region_bytes(capacity: usize) -> usize {
    HEADER_BYTES.saturating_add(capacity.saturating_mul(ring::SLOT_BYTES))
}

/// Memory a FIFO can live in: host memory that a device's kernels store into (pinned
/// and mapped on a GPU, a shared mapping for CPU kernels), owned by whoever made it.
///
/// # Safety
///
/// An implementation promises that `base()..base() + len()` stays valid for reads and
/// writes for as long as the value lives, is [`REGION_ALIGN`]-aligned, and that nothing
/// else accesses those bytes except atomically, word by word, as the FIFO protocol
/// does (another `Fifo` over them, or device code following the protocol table above).
// An unsafe trait, so that the memory's contract is stated once, by its implementer,
// and `Fifo::in_memory` is safe to call.
#[allow(unsafe_code)]
pub unsafe trait FifoMemory: Send + Sync + 'static {
    /// The first byte.
    fn base(&self) -> *mut u8;
    /// Bytes from [`FifoMemory::base`].
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes the FIFOs a proxy consumes, in memory the producers can store into: the seam
/// through which a device hands the proxy its command rings.
///
/// ```
/// use uep_fifo::{FifoAlloc, HeapFifos};
/// let fifo = HeapFifos.alloc_fifo(64).unwrap();
/// assert_eq!(fifo.capacity(), 64);
/// ```
pub trait FifoAlloc: Send + Sync {
    /// A new, empty FIFO of `capacity` slots (a power of two).
    fn alloc_fifo(&self, capacity: usize) -> Result<Fifo, FifoError>;
}

/// FIFOs on the heap: for producers that are threads of the proxy's own process.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeapFifos;

impl FifoAlloc for HeapFifos {
    fn alloc_fifo(&self, capacity: usize) -> Result<Fifo, FifoError> {
        Fifo::new_heap(capacity)
    }
}

/// A slot's monotonically increasing 64-bit index (it never wraps in
/// practice: 2^64 commands). Returned by a push; compare with
/// [`Fifo::is_consumed`] for completion.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct Slot(pub u64);

impl fmt::Display for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {}", self.0)
    }
}

/// Why [`Fifo::try_push`] did not push. Cheap to return on the hot path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    /// Every slot is claimed and not yet popped.
    #[error("FIFO full: head {head}, tail {tail}, capacity {capacity}")]
    Full {
        /// Producer index seen.
        head: u64,
        /// Consumer index seen.
        tail: u64,
        /// Slots in the ring.
        capacity: usize,
    },
    /// The command's `word0` is zero, which would read as an empty slot.
    #[error("command word0 is zero: a zero word0 marks an empty slot, so it cannot be pushed")]
    ZeroWord0,
    /// An exclusive [`Producer`] holds this FIFO: shared pushes are refused.
    #[error("FIFO has an exclusive producer: push through that Producer handle")]
    ExclusiveProducer,
}

/// Errors of FIFO construction, blocking push, consumer claim and pop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FifoError {
    /// Capacity not a power of two in `1..=MAX_CAPACITY`.
    #[error("FIFO capacity {capacity} is invalid: it must be a power of two from 1 to {max}")]
    InvalidCapacity {
        /// The capacity given.
        capacity: usize,
        /// [`MAX_CAPACITY`].
        max: usize,
    },
    /// The heap allocation failed.
    #[error("allocating {bytes} bytes for a FIFO failed")]
    AllocFailed {
        /// Bytes requested.
        bytes: usize,
    },
    /// `from_raw` got a null pointer.
    #[error("FIFO region pointer is null")]
    NullRegion,
    /// `from_raw` got a pointer that is not [`REGION_ALIGN`]-aligned.
    #[error("FIFO region at {addr:#x} is not {align}-byte aligned")]
    MisalignedRegion {
        /// The address given.
        addr: usize,
        /// [`REGION_ALIGN`].
        align: usize,
    },
    /// `from_raw` got a region shorter than `region_bytes(capacity)`.
    #[error(
        "FIFO region of {len} bytes is too small for capacity {capacity}: needs {needed} bytes"
    )]
    RegionTooSmall {
        /// Bytes given.
        len: usize,
        /// Bytes needed.
        needed: usize,
        /// Capacity asked for.
        capacity: usize,
    },
    /// Attaching to a region that was never initialised (or is being re-initialised).
    #[error("FIFO region has magic {found:#018x}, expected {expected:#018x}: not initialised")]
    BadMagic {
        /// Word found at offset 0.
        found: u64,
        /// [`MAGIC`].
        expected: u64,
    },
    /// Attaching with a different capacity than the region was created with.
    #[error(
        "FIFO region was initialised with capacity {found}, but capacity {expected} was expected"
    )]
    CapacityMismatch {
        /// Capacity the caller expected.
        expected: usize,
        /// Capacity in the header.
        found: u64,
    },
    /// [`Fifo::push`] waited until its deadline on a full FIFO.
    #[error(
        "push to FIFO {fifo} timed out after {waited:?}: full with head {head}, tail {tail}, \
         capacity {capacity} (is its consumer running?)"
    )]
    PushTimeout {
        /// The FIFO's label.
        fifo: String,
        /// Producer index at timeout.
        head: u64,
        /// Consumer index at timeout.
        tail: u64,
        /// Slots in the ring.
        capacity: usize,
        /// Time spent waiting.
        waited: Duration,
    },
    /// [`Fifo::push`] was given a command with a zero `word0`.
    #[error("push to FIFO {fifo}: command word0 is zero (it would read as an empty slot)")]
    ZeroWord0 {
        /// The FIFO's label.
        fifo: String,
    },
    /// A second exclusive [`Producer`] was claimed, or a shared push met one.
    #[error("FIFO {fifo} has an exclusive producer: only that Producer handle may push")]
    ProducerTaken {
        /// The FIFO's label.
        fifo: String,
    },
    /// A second [`Consumer`] was claimed.
    #[error("FIFO {fifo} already has a consumer (only one may poll and pop)")]
    ConsumerTaken {
        /// The FIFO's label.
        fifo: String,
    },
    /// [`Consumer::pop`] of a slot other than the one at the tail.
    #[error("pop of {slot} from FIFO {fifo}, but the tail is at {tail}: slots pop in order")]
    PopNotAtTail {
        /// The FIFO's label.
        fifo: String,
        /// The slot given.
        slot: Slot,
        /// The slot at the tail.
        tail: Slot,
    },
    /// [`Consumer::pop`] of a slot whose command is not published yet.
    #[error("pop of {slot} from FIFO {fifo}, but it holds no command yet (poll it first)")]
    PopNotReady {
        /// The FIFO's label.
        fifo: String,
        /// The slot given.
        slot: Slot,
    },
}

/// A bounded multi-producer, single-consumer ring of [`TransferCmd`]s over
/// a memory region (see the crate docs for layout and protocol).
///
/// `Fifo` is `Send + Sync`: share it (`&Fifo`, `Arc<Fifo>`) between the
/// producers and the one [`Consumer`].
pub struct Fifo {
    ring: Ring,
    capacity: u64,
    label: String,
}

impl fmt::Debug for Fifo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fifo")
            .field("label", &self.label)
            .field("capacity", &self.capacity)
            .field("head", &self.head())
            .field("tail", &self.tail())
            .finish()
    }
}

fn check_capacity(capacity: usize) -> Result<(), FifoError> {
    if !capacity.is_power_of_two() || capacity > MAX_CAPACITY {
        return Err(FifoError::InvalidCapacity {
            capacity,
            max: MAX_CAPACITY,
        });
    }
    Ok(())
}

impl Fifo {
    fn with_ring(ring: Ring) -> Fifo {
        Fifo {
            capacity: ring.capacity() as u64,
            ring,
            label: "<unnamed>".to_owned(),
        }
    }

    /// A FIFO in its own 128-byte-aligned heap allocation, freed on drop.
    /// `capacity` must be a power of two ([`DEFAULT_CAPACITY`] is the paper's).
    pub fn new_heap(capacity: usize) -> Result<Fifo, FifoError> {
        check_capacity(capacity)?;
        Ok(Fifo::with_ring(Ring::new_heap(capacity)?))
    }

    /// Names the FIFO in error messages (e.g. "rank 3 channel 5").
    pub fn with_label(mut self, label: impl Into<String>) -> Fifo {
        self.label = label.into();
        self
    }

    /// The label given by [`Fifo::with_label`].
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.ring.capacity()
    }

    /// The next index producers will claim.
    pub fn head(&self) -> u64 {
        self.ring.header().prod.head.load(Acquire)
    }

    /// The next index the consumer will pop.
    pub fn tail(&self) -> u64 {
        self.ring.header().cons.tail.load(Acquire)
    }

    /// Slots claimed and not yet popped (a snapshot; includes slots whose
    /// producer has claimed but not yet published).
    pub fn len(&self) -> usize {
        // Tail first: both only grow and tail <= head, so this cannot underflow.
        let tail = self.tail();
        let head = self.head();
        head.saturating_sub(tail).min(self.capacity) as usize
    }

    /// Whether no slot is claimed (a snapshot).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the consumer has popped `slot` (`tail > slot`). For `Quiet`
    /// and `Barrier`, which pop only when done, this is the completion
    /// signal; everything the consumer did before popping is visible after
    /// this returns `true` (Acquire).
    pub fn is_consumed(&self, slot: Slot) -> bool {
        self.tail() > slot.0
    }

    /// Claims a slot and publishes `cmd` in it, or fails at once if the ring
    /// is full. Any number of threads (or processes) may push concurrently;
    /// pushes from one thread are delivered in the order made.
    pub fn try_push(&self, cmd: TransferCmd) -> Result<Slot, PushError> {
        if cmd.word0 == 0 {
            return Err(PushError::ZeroWord0);
        }
        let prod = &self.ring.header().prod;
        if prod.producer_claimed.load(Relaxed) != 0 {
            return Err(PushError::ExclusiveProducer);
        }
        // Head is read with Acquire and claimed with Release so that seeing a
        // head value also shows the tail its claimer saw: a Full report then
        // always has `head - tail == capacity` (no stale-tail spurious Full).
        // On x86 this costs nothing (every RMW is a full barrier).
        let mut head = prod.head.load(Acquire);
        loop {
            // Acquire pairs with the Release below, extending the chain
            // consumer-zeroes-slot -> tail store -> reload -> cache store to
            // this producer, so a slot it reuses is really free.
            let cached = prod.cached_tail.load(Acquire);
            // Wrapping: a cache newer than our `head` reads as "full" and
            // takes the reload path, which refreshes `head`.
            if head.wrapping_sub(cached) >= self.capacity {
                let tail = self.ring.header().cons.tail.load(Acquire);
                // Skip the store while the ring stays full, so waiting
                // producers do not keep dirtying their shared line.
                if tail != cached {
                    prod.cached_tail.store(tail, Release);
                }
                if tail > head {
                    head = prod.head.load(Acquire);
                    continue;
                }
                if head - tail >= self.capacity {
                    return Err(PushError::Full {
                        head,
                        tail,
                        capacity: self.capacity(),
                    });
                }
            }
            // Publication of the command itself is word0's Release, not this.
            match prod
                .head
                .compare_exchange_weak(head, head + 1, AcqRel, Acquire)
            {
                Ok(_) => break,
                Err(actual) => head = actual,
            }
        }
        let cell = self.ring.slot(head);
        cell.word1.store(cmd.word1, Relaxed);
        cell.word0.store(cmd.word0, Release);
        Ok(Slot(head))
    }

    /// Like [`Fifo::try_push`], but waits while the ring is full: spins
    /// briefly, then yields the thread between attempts, until `deadline`,
    /// after which it fails with [`FifoError::PushTimeout`] naming the
    /// FIFO's head, tail and capacity. A deadline in the past still makes
    /// one attempt.
    pub fn push(&self, cmd: TransferCmd, deadline: Instant) -> Result<Slot, FifoError> {
        push_until(&self.label, deadline, || self.try_push(cmd))
    }

    /// Claims the single consumer of this FIFO (see [`Consumer::claim`]).
    pub fn consumer(&self) -> Result<Consumer<&Fifo>, FifoError> {
        Consumer::claim(self)
    }

    /// Claims this FIFO's only producer (see [`Producer::claim`]).
    pub fn producer(&self) -> Result<Producer<&Fifo>, FifoError> {
        Producer::claim(self)
    }
}

/// An exclusive producer: while it exists it is the FIFO's only producer, so a push
/// needs no atomic read-modify-write. The shared path claims `head` with a
/// compare-exchange, which on x86 is a full fence that keeps a producer from
/// overlapping its slot stores with the wait for the next cache line; this path
/// publishes `head` with a plain release store instead (`uep bench fifo` measures both).
///
/// Claim it before any shared push starts: shared pushes already past their check when
/// the claim lands could race it. Misuse can lose commands, never memory safety.
pub struct Producer<P: Deref<Target = Fifo>> {
    fifo: P,
    /// Local copy of `head`: this handle is its only writer.
    head: u64,
    /// The last `tail` read from the consumer's line.
    cached_tail: u64,
}

impl<P: Deref<Target = Fifo>> fmt::Debug for Producer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("fifo", &*self.fifo)
            .field("head", &self.head)
            .finish()
    }
}

impl<P: Deref<Target = Fifo>> Producer<P> {
    /// Claims the exclusive producer role; fails with [`FifoError::ProducerTaken`] if
    /// another handle (in any process) holds it.
    pub fn claim(fifo: P) -> Result<Producer<P>, FifoError> {
        let prod = &fifo.ring.header().prod;
        // Acquire: continue from the previous producer's head (its Release on drop).
        if prod
            .producer_claimed
            .compare_exchange(0, 1, Acquire, Relaxed)
            .is_err()
        {
            return Err(FifoError::ProducerTaken {
                fifo: fifo.label.clone(),
            });
        }
        let head = prod.head.load(Acquire);
        let cached_tail = fifo.ring.header().cons.tail.load(Acquire);
        Ok(Producer {
            fifo,
            head,
            cached_tail,
        })
    }

    /// The FIFO produced into.
    pub fn fifo(&self) -> &Fifo {
        &self.fifo
    }

    /// Publishes `cmd` in the next slot, or fails at once if the ring is full.
    pub fn try_push(&mut self, cmd: TransferCmd) -> Result<Slot, PushError> {
        if cmd.word0 == 0 {
            return Err(PushError::ZeroWord0);
        }
        let capacity = self.fifo.capacity;
        if self.head - self.cached_tail >= capacity {
            // Acquire pairs with the consumer's Release of tail: the slot it freed
            // (zeroed) is seen as free before we write it.
            self.cached_tail = self.fifo.ring.header().cons.tail.load(Acquire);
            if self.head - self.cached_tail >= capacity {
                return Err(PushError::Full {
                    head: self.head,
                    tail: self.cached_tail,
                    capacity: self.fifo.capacity(),
                });
            }
        }
        let head = self.head;
        let cell = self.fifo.ring.slot(head);
        cell.word1.store(cmd.word1, Relaxed);
        cell.word0.store(cmd.word0, Release);
        self.head = head + 1;
        // Only for observers of head (len, a later claimer): the consumer gates on word0.
        self.fifo.ring.header().prod.head.store(self.head, Release);
        Ok(Slot(head))
    }

    /// Like [`Producer::try_push`], but waits while the ring is full (spins, then
    /// yields) until `deadline`.
    pub fn push(&mut self, cmd: TransferCmd, deadline: Instant) -> Result<Slot, FifoError> {
        // Fast path first: the label is cloned (for messages) only when the ring is full.
        if let Ok(slot) = self.try_push(cmd) {
            return Ok(slot);
        }
        let label = self.fifo.label.clone();
        push_until(&label, deadline, || self.try_push(cmd))
    }
}

/// Retry `attempt` while the ring is full: spin briefly, then yield, until `deadline`
/// (a deadline in the past still makes one attempt). The clock is read only once the
/// ring is found full, so a push that succeeds at once costs no clock read.
fn push_until(
    label: &str,
    deadline: Instant,
    mut attempt: impl FnMut() -> Result<Slot, PushError>,
) -> Result<Slot, FifoError> {
    let fifo = || label.to_string();
    let mut started: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        match attempt() {
            Ok(slot) => return Ok(slot),
            Err(PushError::ZeroWord0) => return Err(FifoError::ZeroWord0 { fifo: fifo() }),
            Err(PushError::ExclusiveProducer) => {
                return Err(FifoError::ProducerTaken { fifo: fifo() })
            }
            Err(PushError::Full {
                head,
                tail,
                capacity,
            }) => {
                let now = Instant::now();
                let start = *started.get_or_insert(now);
                if now >= deadline {
                    return Err(FifoError::PushTimeout {
                        fifo: fifo(),
                        head,
                        tail,
                        capacity,
                        waited: now - start,
                    });
                }
            }
        }
        if spins < SPIN_LIMIT {
            spins += 1;
            sync::spin_loop();
        } else {
            sync::yield_now();
        }
    }
}

impl<P: Deref<Target = Fifo>> Drop for Producer<P> {
    fn drop(&mut self) {
        // Release: the next claimer (or shared pushers) continue from our head.
        self.fifo
            .ring
            .header()
            .prod
            .producer_claimed
            .store(0, Release);
    }
}

/// The exclusive producer role lent to device code (a GPU kernel) that pushes by the
/// protocol table above itself: the lease keeps host pushes out (they fail with
/// [`PushError::ExclusiveProducer`]) while the device owns `head`, which it reads from
/// the header when it starts and stores back when it stops.
///
/// ```
/// use uep_fifo::{DeviceLease, Fifo};
/// let fifo = Fifo::new_heap(64).unwrap();
/// let lease = DeviceLease::claim(&fifo).unwrap();
/// assert_eq!(lease.region_addr() % uep_fifo::REGION_ALIGN, 0);
/// assert!(fifo.try_push(uep_fifo::TransferCmd { word0: 3, word1: 0 }).is_err());
/// drop(lease);
/// assert!(fifo.try_push(uep_fifo::TransferCmd { word0: 3, word1: 0 }).is_ok());
/// ```
#[derive(Debug)]
pub struct DeviceLease<P: Deref<Target = Fifo>> {
    fifo: P,
}

impl<P: Deref<Target = Fifo>> DeviceLease<P> {
    /// Takes the exclusive producer role for device code; fails with
    /// [`FifoError::ProducerTaken`] while another producer holds it.
    pub fn claim(fifo: P) -> Result<DeviceLease<P>, FifoError> {
        // Acquire: the device continues from the previous producer's head.
        let prod = &fifo.ring.header().prod;
        if prod
            .producer_claimed
            .compare_exchange(0, 1, Acquire, Relaxed)
            .is_err()
        {
            return Err(FifoError::ProducerTaken {
                fifo: fifo.label.clone(),
            });
        }
        Ok(DeviceLease { fifo })
    }

    /// The address of the region's first byte in this process, for the device to map
    /// (a GPU translates it into its own address of the same pinned pages).
    pub fn region_addr(&self) -> usize {
        self.fifo.ring.header() as *const _ as usize
    }

    /// The FIFO lent.
    pub fn fifo(&self) -> &Fifo {
        &self.fifo
    }
}

impl<P: Deref<Target = Fifo>> Drop for DeviceLease<P> {
    fn drop(&mut self) {
        // Release: host pushes continue from the head the device stored back.
        let prod = &self.fifo.ring.header().prod;
        prod.producer_claimed.store(0, Release);
    }
}

/// The FIFO's single consumer: the only handle that can poll and pop.
///
/// At most one exists per ring at a time, across processes (the claim is a
/// word in the region). `P` is how it holds the FIFO: `&Fifo`, `Arc<Fifo>`,
/// or any other pointer to one.
pub struct Consumer<P: Deref<Target = Fifo>> {
    fifo: P,
    /// Local copy of the tail: this handle is its only writer.
    tail: u64,
}

impl<P: Deref<Target = Fifo>> fmt::Debug for Consumer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("fifo", &*self.fifo)
            .field("tail", &self.tail)
            .finish()
    }
}

impl<P: Deref<Target = Fifo>> Consumer<P> {
    /// Claims the consumer role; fails with [`FifoError::ConsumerTaken`] if
    /// another handle (in any process) holds it.
    pub fn claim(fifo: P) -> Result<Consumer<P>, FifoError> {
        let cons = &fifo.ring.header().cons;
        // Acquire: see the previous consumer's pops (its Release on drop).
        if cons
            .consumer_claimed
            .compare_exchange(0, 1, Acquire, Relaxed)
            .is_err()
        {
            return Err(FifoError::ConsumerTaken {
                fifo: fifo.label.clone(),
            });
        }
        let tail = cons.tail.load(Relaxed);
        Ok(Consumer { fifo, tail })
    }

    /// The FIFO consumed.
    pub fn fifo(&self) -> &Fifo {
        &self.fifo
    }

    /// The slot at the tail: the next one [`Consumer::poll`] looks at.
    pub fn tail(&self) -> Slot {
        Slot(self.tail)
    }

    /// The command at the tail, if published; does not remove it (a `Quiet`
    /// stays at the tail until [`Consumer::pop`], so producers can wait on it).
    pub fn poll(&mut self) -> Option<(Slot, TransferCmd)> {
        let cell = self.fifo.ring.slot(self.tail);
        // Acquire pairs with the producer's Release of word0: word1 is ready.
        let word0 = cell.word0.load(Acquire);
        if word0 == 0 {
            return None;
        }
        let word1 = cell.word1.load(Relaxed);
        Some((Slot(self.tail), TransferCmd { word0, word1 }))
    }

    /// Removes the command at the tail, which must be `slot` and published
    /// (poll it first): zeroes the slot, then advances the tail (Release),
    /// which frees the slot for producers and signals
    /// [`Fifo::is_consumed`].
    pub fn pop(&mut self, slot: Slot) -> Result<(), FifoError> {
        if slot.0 != self.tail {
            return Err(FifoError::PopNotAtTail {
                fifo: self.fifo.label.clone(),
                slot,
                tail: Slot(self.tail),
            });
        }
        let cell = self.fifo.ring.slot(self.tail);
        if cell.word0.load(Acquire) == 0 {
            return Err(FifoError::PopNotReady {
                fifo: self.fifo.label.clone(),
                slot,
            });
        }
        cell.word1.store(0, Relaxed);
        cell.word0.store(0, Relaxed);
        self.tail += 1;
        // Release: the zeroing (and whatever the proxy did to complete the
        // command) happens before any producer that sees this tail.
        self.fifo.ring.header().cons.tail.store(self.tail, Release);
        Ok(())
    }
}

impl<P: Deref<Target = Fifo>> Drop for Consumer<P> {
    fn drop(&mut self) {
        self.fifo
            .ring
            .header()
            .cons
            .consumer_claimed
            .store(0, Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(n: u64) -> TransferCmd {
        TransferCmd {
            word0: n | 1,
            word1: n,
        }
    }

    #[test]
    fn fifo_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Fifo>();
        check::<Consumer<std::sync::Arc<Fifo>>>();
    }

    #[test]
    fn exclusive_producer_is_exclusive_and_ordered() {
        let f = Fifo::new_heap(4).unwrap().with_label("rank 1 fifo 0");
        f.try_push(cmd(1)).unwrap();
        let mut p = f.producer().unwrap();
        assert!(matches!(f.producer(), Err(FifoError::ProducerTaken { .. })));
        assert_eq!(f.try_push(cmd(9)), Err(PushError::ExclusiveProducer));
        assert!(matches!(
            f.push(cmd(9), Instant::now()),
            Err(FifoError::ProducerTaken { .. })
        ));
        // It continues after the shared push, and back-pressure holds.
        for i in 2..5 {
            assert_eq!(p.try_push(cmd(i)).unwrap(), Slot(i - 1));
        }
        assert!(matches!(
            p.try_push(cmd(5)),
            Err(PushError::Full {
                head: 4,
                tail: 0,
                capacity: 4
            })
        ));
        assert!(matches!(
            p.push(cmd(5), Instant::now()),
            Err(FifoError::PushTimeout { .. })
        ));
        assert_eq!(
            p.try_push(TransferCmd { word0: 0, word1: 1 }),
            Err(PushError::ZeroWord0)
        );
        let mut c = f.consumer().unwrap();
        for i in [1, 2, 3, 4] {
            let (slot, got) = c.poll().unwrap();
            assert_eq!(got, cmd(i));
            c.pop(slot).unwrap();
        }
        assert_eq!(p.try_push(cmd(6)).unwrap(), Slot(4));
        assert_eq!(f.len(), 1);
        drop(p);
        // Shared pushes resume after the handle's last slot.
        assert_eq!(f.try_push(cmd(7)).unwrap(), Slot(5));
    }

    #[test]
    fn capacity_must_be_power_of_two() {
        for bad in [0, 3, 6, 2047, MAX_CAPACITY * 2] {
            assert!(matches!(
                Fifo::new_heap(bad),
                Err(FifoError::InvalidCapacity { capacity, .. }) if capacity == bad
            ));
        }
        let f = Fifo::new_heap(DEFAULT_CAPACITY).unwrap();
        assert_eq!(f.capacity(), 2048);
        assert_eq!(region_bytes(2048), 384 + 2048 * 16);
        assert_eq!(region_bytes(usize::MAX), usize::MAX);
    }

    #[test]
    fn push_poll_pop_and_backpressure() {
        let f = Fifo::new_heap(4).unwrap().with_label("rank 0 channel 1");
        let mut c = f.consumer().unwrap();
        assert!(c.poll().is_none());
        for i in 0..4 {
            assert_eq!(f.try_push(cmd(i)).unwrap(), Slot(i));
        }
        assert_eq!(f.len(), 4);
        assert_eq!(
            f.try_push(cmd(9)),
            Err(PushError::Full {
                head: 4,
                tail: 0,
                capacity: 4
            })
        );
        let err = f
            .push(cmd(9), Instant::now() + Duration::from_millis(20))
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0 channel 1") && msg.contains("head 4, tail 0, capacity 4"),
            "{msg}"
        );
        let (s, got) = c.poll().unwrap();
        assert_eq!((s, got), (Slot(0), cmd(0)));
        assert!(!f.is_consumed(Slot(0)));
        assert!(matches!(
            c.pop(Slot(1)),
            Err(FifoError::PopNotAtTail { .. })
        ));
        c.pop(s).unwrap();
        assert!(f.is_consumed(Slot(0)) && !f.is_consumed(Slot(1)));
        // The freed slot is reused for index 4 (the cache is refreshed).
        assert_eq!(f.try_push(cmd(4)).unwrap(), Slot(4));
        for i in 1..5 {
            let (s, got) = c.poll().unwrap();
            assert_eq!((s, got), (Slot(i), cmd(i)));
            c.pop(s).unwrap();
        }
        assert!(c.poll().is_none());
        assert!(matches!(c.pop(Slot(5)), Err(FifoError::PopNotReady { .. })));
        assert!(f.is_empty());
    }

    #[test]
    fn zero_word0_is_rejected() {
        let f = Fifo::new_heap(2).unwrap();
        let zero = TransferCmd { word0: 0, word1: 7 };
        assert_eq!(f.try_push(zero), Err(PushError::ZeroWord0));
        assert!(matches!(
            f.push(zero, Instant::now()),
            Err(FifoError::ZeroWord0 { .. })
        ));
        assert_eq!(f.head(), 0);
    }

    #[test]
    fn one_consumer_at_a_time() {
        let f = std::sync::Arc::new(Fifo::new_heap(2).unwrap());
        let mut c = Consumer::claim(f.clone()).unwrap();
        assert!(matches!(f.consumer(), Err(FifoError::ConsumerTaken { .. })));
        f.try_push(cmd(1)).unwrap();
        let (s, _) = c.poll().unwrap();
        c.pop(s).unwrap();
        drop(c);
        // A new consumer resumes at the tail.
        let mut c = f.consumer().unwrap();
        assert_eq!(c.tail(), Slot(1));
        f.try_push(cmd(2)).unwrap();
        assert_eq!(c.poll(), Some((Slot(1), cmd(2))));
    }
}
