//! The FIFO's memory: the header and slot layout, and the storage it lives
//! in (an owned aligned heap allocation, or a caller-provided mapping).
//!
//! This is the only module with `unsafe`: it turns a region of bytes into
//! references to atomics. Everything else in the crate works on those
//! references, and every shared word is an atomic, so no access elsewhere can
//! be a data race whatever the callers do.

use std::ptr::NonNull;

use crate::sync::{AtomicU64, Ordering};
use crate::FifoError;
#[cfg(not(loom))]
use crate::{check_capacity, Fifo};

/// Bytes of one header line. 128 rather than 64 so adjacent-line
/// prefetchers do not couple the producer and consumer lines.
pub(crate) const LINE: usize = 128;
/// Bytes before the first slot: the meta, producer and consumer lines.
pub(crate) const HEADER_BYTES: usize = 3 * LINE;
/// Byte offset of the producers' `head`.
pub(crate) const HEAD_OFFSET: usize = LINE;
/// Byte offset of the consumer's `tail`.
pub(crate) const TAIL_OFFSET: usize = 2 * LINE;
/// Bytes of one slot (one `TransferCmd`).
pub(crate) const SLOT_BYTES: usize = 16;
/// "uepFIFO1", little-endian: the layout's magic and version.
pub(crate) const MAGIC: u64 = u64::from_le_bytes(*b"uepFIFO1");

/// Line 0: written once at initialisation.
#[repr(C, align(128))]
pub(crate) struct MetaLine {
    pub(crate) magic: AtomicU64,
    pub(crate) capacity: AtomicU64,
}

/// Line 1: written by producers.
#[repr(C, align(128))]
pub(crate) struct ProducerLine {
    /// Next slot index to claim (monotonic).
    pub(crate) head: AtomicU64,
    /// A recent value of the consumer's `tail`, so producers rarely read the
    /// consumer's line.
    pub(crate) cached_tail: AtomicU64,
    /// Non-zero while an exclusive `Producer` handle exists (in any process).
    pub(crate) producer_claimed: AtomicU64,
}

/// Line 2: written by the consumer.
#[repr(C, align(128))]
pub(crate) struct ConsumerLine {
    /// Next slot index to pop (monotonic).
    pub(crate) tail: AtomicU64,
    /// Non-zero while a `Consumer` handle exists (in any process).
    pub(crate) consumer_claimed: AtomicU64,
}

/// The first [`HEADER_BYTES`] of a region.
#[repr(C)]
pub(crate) struct Header {
    pub(crate) meta: MetaLine,
    pub(crate) prod: ProducerLine,
    pub(crate) cons: ConsumerLine,
}

/// One 16-byte slot; `word0 == 0` means empty.
#[repr(C, align(16))]
pub(crate) struct SlotCell {
    pub(crate) word0: AtomicU64,
    pub(crate) word1: AtomicU64,
}

// The shared layout is a contract with other processes (and device code):
// pin it. Under loom the atomics are loom's and never placed in raw memory.
#[cfg(not(loom))]
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<Header>() == HEADER_BYTES);
    assert!(offset_of!(Header, prod) == LINE);
    assert!(offset_of!(Header, cons) == 2 * LINE);
    assert!(offset_of!(Header, prod) + offset_of!(ProducerLine, head) == HEAD_OFFSET);
    assert!(offset_of!(Header, cons) + offset_of!(ConsumerLine, tail) == TAIL_OFFSET);
    assert!(size_of::<SlotCell>() == SLOT_BYTES);
    assert!(align_of::<Header>() == LINE);
    // The casts below rely on AtomicU64 being a plain u64 in memory.
    assert!(size_of::<AtomicU64>() == 8 && align_of::<AtomicU64>() == 8);
};

enum Storage {
    /// Owned allocation from `std::alloc`, freed on drop.
    #[cfg(not(loom))]
    Heap {
        base: NonNull<u8>,
        layout: std::alloc::Layout,
    },
    /// Memory the caller keeps alive (`Fifo::from_raw`).
    #[cfg(not(loom))]
    Borrowed,
    /// Memory a [`FifoMemory`](crate::FifoMemory) owner keeps alive for as long as the
    /// ring holds it (`Fifo::in_memory`).
    #[cfg(not(loom))]
    Kept(#[allow(dead_code)] std::sync::Arc<dyn crate::FifoMemory>),
    /// Boxes of loom atomics (`Box::into_raw`), freed on drop.
    #[cfg(loom)]
    Loom,
}

/// A header and `capacity` slots, wherever they live.
pub(crate) struct Ring {
    header: NonNull<Header>,
    slots: NonNull<SlotCell>,
    capacity: usize,
    storage: Storage,
}

// SAFETY: the ring only hands out shared references to atomics, which are
// themselves Send + Sync; the pointers stay valid for the Ring's lifetime
// (owned storage, or the `from_raw` caller's guarantee), wherever it moves.
unsafe impl Send for Ring {}
// SAFETY: as above: all access through `&Ring` is to atomics.
unsafe impl Sync for Ring {}

impl Ring {
    /// An owned, zeroed ring of `capacity` (a checked power of two) slots.
    #[cfg(not(loom))]
    pub(crate) fn new_heap(capacity: usize) -> Result<Ring, FifoError> {
        let bytes = crate::region_bytes(capacity);
        let layout = std::alloc::Layout::from_size_align(bytes, LINE)
            .map_err(|_| FifoError::AllocFailed { bytes })?;
        // SAFETY: `layout` has non-zero size (at least HEADER_BYTES).
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(base).ok_or(FifoError::AllocFailed { bytes })?;
        let ring = Ring {
            header: base.cast(),
            // SAFETY: HEADER_BYTES < bytes, so the offset stays inside the
            // allocation; the result is 128-aligned, so 16-aligned.
            slots: unsafe { base.add(HEADER_BYTES) }.cast(),
            capacity,
            storage: Storage::Heap { base, layout },
        };
        // Zeroed memory is already a valid empty ring; write magic/capacity.
        ring.init_header();
        Ok(ring)
    }

    /// An owned ring of loom atomics.
    #[cfg(loom)]
    pub(crate) fn new_heap(capacity: usize) -> Result<Ring, FifoError> {
        let zero = || AtomicU64::new(0);
        let header = Box::new(Header {
            meta: MetaLine {
                magic: zero(),
                capacity: zero(),
            },
            prod: ProducerLine {
                head: zero(),
                cached_tail: zero(),
                producer_claimed: zero(),
            },
            cons: ConsumerLine {
                tail: zero(),
                consumer_claimed: zero(),
            },
        });
        let slots: Box<[SlotCell]> = (0..capacity)
            .map(|_| SlotCell {
                word0: zero(),
                word1: zero(),
            })
            .collect();
        let ring = Ring {
            header: NonNull::from(Box::leak(header)),
            slots: NonNull::from(Box::leak(slots)).cast(),
            capacity,
            storage: Storage::Loom,
        };
        ring.init_header();
        Ok(ring)
    }

    /// Views caller memory as a ring; see `Fifo::from_raw` for the contract.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as
    /// the returned Ring (and anything derived from it) lives, and every
    /// other access to those bytes must be an atomic access of the same
    /// 8-byte words (other `Ring`s over the same memory, or device code
    /// following the documented protocol).
    #[cfg(not(loom))]
    pub(crate) unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        capacity: usize,
        init: bool,
    ) -> Result<Ring, FifoError> {
        let base = NonNull::new(ptr).ok_or(FifoError::NullRegion)?;
        if ptr as usize % LINE != 0 {
            return Err(FifoError::MisalignedRegion {
                addr: ptr as usize,
                align: LINE,
            });
        }
        let needed = crate::region_bytes(capacity);
        if len < needed {
            return Err(FifoError::RegionTooSmall {
                len,
                needed,
                capacity,
            });
        }
        let ring = Ring {
            header: base.cast(),
            // SAFETY: `needed > HEADER_BYTES` bytes are valid from `ptr`, so
            // the offset stays in bounds; it is 128-aligned.
            slots: unsafe { base.add(HEADER_BYTES) }.cast(),
            capacity,
            storage: Storage::Borrowed,
        };
        if init {
            let h = ring.header();
            // Hide the ring from attachers until it is consistent again.
            h.meta.magic.store(0, Ordering::Relaxed);
            h.prod.head.store(0, Ordering::Relaxed);
            h.prod.cached_tail.store(0, Ordering::Relaxed);
            h.cons.tail.store(0, Ordering::Relaxed);
            h.cons.consumer_claimed.store(0, Ordering::Relaxed);
            h.prod.producer_claimed.store(0, Ordering::Relaxed);
            for i in 0..capacity as u64 {
                let cell = ring.slot(i);
                cell.word0.store(0, Ordering::Relaxed);
                cell.word1.store(0, Ordering::Relaxed);
            }
            ring.init_header();
        } else {
            let h = ring.header();
            // Acquire pairs with init_header's Release of the magic, so the
            // zeroed indices and slots are visible once the magic is.
            let magic = h.meta.magic.load(Ordering::Acquire);
            if magic != MAGIC {
                return Err(FifoError::BadMagic {
                    found: magic,
                    expected: MAGIC,
                });
            }
            let found = h.meta.capacity.load(Ordering::Relaxed);
            if found != capacity as u64 {
                return Err(FifoError::CapacityMismatch {
                    expected: capacity,
                    found,
                });
            }
        }
        Ok(ring)
    }

    fn init_header(&self) {
        let h = self.header();
        h.meta
            .capacity
            .store(self.capacity as u64, Ordering::Relaxed);
        h.meta.magic.store(MAGIC, Ordering::Release);
    }

    /// The header lines.
    pub(crate) fn header(&self) -> &Header {
        // SAFETY: `header` points to a live, aligned Header for the Ring's
        // lifetime (owned storage, or the from_raw contract); any bit pattern
        // is a valid AtomicU64 and only shared references are created.
        unsafe { self.header.as_ref() }
    }

    /// The slot holding monotonic index `index` (`index mod capacity`).
    pub(crate) fn slot(&self, index: u64) -> &SlotCell {
        let i = index as usize & (self.capacity - 1);
        // SAFETY: `i < capacity` (capacity is a power of two) and the ring
        // owns or borrows `capacity` contiguous, aligned slots.
        unsafe { self.slots.add(i).as_ref() }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        match self.storage {
            #[cfg(not(loom))]
            Storage::Heap { base, layout } => {
                // SAFETY: `base` came from `alloc_zeroed(layout)` and is freed
                // once; no reference into it outlives `&self`.
                unsafe { std::alloc::dealloc(base.as_ptr(), layout) }
            }
            #[cfg(not(loom))]
            Storage::Borrowed | Storage::Kept(_) => {}
            #[cfg(loom)]
            Storage::Loom => {
                // SAFETY: both pointers came from `Box::leak` in `new_heap`
                // with these exact types and lengths, and are freed once.
                unsafe {
                    drop(Box::from_raw(self.header.as_ptr()));
                    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                        self.slots.as_ptr(),
                        self.capacity,
                    )));
                }
            }
        }
    }
}

#[cfg(not(loom))]
impl Fifo {
    /// A FIFO over caller memory, e.g. a shared mapping used by several
    /// processes.
    ///
    /// With `init = true` the header and all slots are (re)written: the ring
    /// becomes empty with `capacity` slots, and any consumer claim is
    /// cleared. With `init = false` the region must already hold an
    /// initialised ring of exactly `capacity` slots ([`FifoError::BadMagic`],
    /// [`FifoError::CapacityMismatch`] otherwise). The region must be
    /// [`REGION_ALIGN`](crate::REGION_ALIGN)-aligned and at least
    /// [`region_bytes`](crate::region_bytes)`(capacity)`
    /// long; these are checked.
    ///
    /// # Safety
    ///
    /// * `ptr` must be valid for reads and writes of `len` bytes until the
    ///   returned `Fifo` (and every [`Consumer`](crate::Consumer) borrowing it) is dropped;
    ///   keep the mapping alive at least that long.
    /// * Every other access to the region, in this or any process, must be
    ///   an atomic access of its 8-byte words, i.e. another `Fifo` over the
    ///   same memory or device code that follows the documented protocol.
    /// * While `init = true` runs, nothing else may use the region.
    pub unsafe fn from_raw(
        ptr: *mut u8,
        len: usize,
        init: bool,
        capacity: usize,
    ) -> Result<Fifo, FifoError> {
        check_capacity(capacity)?;
        // SAFETY: the caller upholds `Ring::from_raw`'s contract, which is
        // this function's.
        let ring = unsafe { Ring::from_raw(ptr, len, capacity, init)? };
        Ok(Fifo::with_ring(ring))
    }

    /// A new, empty FIFO of `capacity` slots at the start of `memory`, which it keeps
    /// alive: memory a device provides (host memory its kernels can store into), handed
    /// to the proxy as a [`FifoAlloc`](crate::FifoAlloc) would. Checks alignment and
    /// size as [`Fifo::from_raw`] does.
    pub fn in_memory(
        memory: std::sync::Arc<dyn crate::FifoMemory>,
        capacity: usize,
    ) -> Result<Fifo, FifoError> {
        check_capacity(capacity)?;
        // SAFETY: `FifoMemory`'s contract: the bytes stay valid while `memory` lives,
        // which the ring keeps, and are touched elsewhere only atomically; nothing else
        // uses them while `init` runs (the memory is new to this FIFO).
        let mut ring = unsafe { Ring::from_raw(memory.base(), memory.len(), capacity, true)? };
        ring.storage = Storage::Kept(memory);
        Ok(Fifo::with_ring(ring))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::*;

    fn cmd(n: u64) -> TransferCmd {
        TransferCmd {
            word0: n | 1,
            word1: n,
        }
    }

    #[test]
    fn from_raw_validates_region() {
        #[repr(C, align(128))]
        struct Buf([u8; 1024]);
        let mut buf = Box::new(Buf([0xAB; 1024]));
        let p = buf.0.as_mut_ptr();
        // SAFETY: (test) `buf` outlives every Fifo made here and is only
        // accessed through them.
        unsafe {
            assert!(matches!(
                Fifo::from_raw(p, 1024, false, 4),
                Err(FifoError::BadMagic { .. })
            ));
            assert!(matches!(
                Fifo::from_raw(p.add(8), 1000, true, 4),
                Err(FifoError::MisalignedRegion { align: 128, .. })
            ));
            assert!(matches!(
                Fifo::from_raw(p, 1024, true, 64),
                Err(FifoError::RegionTooSmall { needed, .. }) if needed == region_bytes(64)
            ));
            assert!(matches!(
                Fifo::from_raw(std::ptr::null_mut(), 1024, true, 4),
                Err(FifoError::NullRegion)
            ));
            let a = Fifo::from_raw(p, 1024, true, 32).unwrap();
            assert!(matches!(
                Fifo::from_raw(p, 1024, false, 16),
                Err(FifoError::CapacityMismatch {
                    expected: 16,
                    found: 32
                })
            ));
            let b = Fifo::from_raw(p, 1024, false, 32).unwrap();
            // The garbage bytes were cleared by init: the ring is empty.
            assert!(b.is_empty());
            let s = a.try_push(cmd(5)).unwrap();
            let mut c = b.consumer().unwrap();
            assert!(matches!(a.consumer(), Err(FifoError::ConsumerTaken { .. })));
            assert_eq!(c.poll(), Some((s, cmd(5))));
            c.pop(s).unwrap();
            assert!(a.is_consumed(s));
        }
    }

    /// Memory from a test allocation, freed when the last holder drops it.
    struct Owned(Box<[u8]>, usize);

    // SAFETY: (test) the boxed bytes live as long as the value and are touched only
    // through the FIFO; `base` rounds up to the alignment inside the allocation.
    unsafe impl FifoMemory for Owned {
        fn base(&self) -> *mut u8 {
            self.0.as_ptr().wrapping_add(self.1) as *mut u8
        }
        fn len(&self) -> usize {
            self.0.len() - self.1
        }
    }

    #[test]
    fn in_memory_keeps_its_memory_and_starts_empty() {
        let bytes = vec![0xABu8; region_bytes(16) + REGION_ALIGN].into_boxed_slice();
        let skew = bytes.as_ptr().align_offset(REGION_ALIGN);
        let mem = std::sync::Arc::new(Owned(bytes, skew));
        let weak = std::sync::Arc::downgrade(&mem);
        let fifo = Fifo::in_memory(mem, 16).unwrap();
        assert!(fifo.is_empty());
        let s = fifo.try_push(cmd(9)).unwrap();
        let mut c = fifo.consumer().unwrap();
        assert_eq!(c.poll(), Some((s, cmd(9))));
        c.pop(s).unwrap();
        drop(c);
        assert!(weak.upgrade().is_some(), "the FIFO holds its memory");
        drop(fifo);
        assert!(weak.upgrade().is_none(), "and lets go of it when dropped");
        let small = std::sync::Arc::new(Owned(vec![0u8; 512].into_boxed_slice(), 0));
        assert!(Fifo::in_memory(small, 64).is_err());
    }
}
