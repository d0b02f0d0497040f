//! The rank's symmetric memory region as seen by a transport.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;

use crate::TransportError;

/// Describes the memory a transport registers: the rank's one symmetric
/// region (possibly several GiB, sparse). Cloning is cheap.
///
/// The address is kept as an integer so this type is plainly `Send + Sync`;
/// only the libfabric wrapper turns it back into a pointer, under the
/// contract of [`RegionRef::from_raw`].
#[derive(Clone)]
pub struct RegionRef {
    addr: usize,
    len: usize,
    // Keeps the backing memory alive for as long as any transport holds us.
    owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl RegionRef {
    /// Describes `len` bytes at `ptr`.
    ///
    /// # Safety
    ///
    /// For as long as this `RegionRef` (or a clone, or any transport built
    /// from it) exists, `ptr..ptr + len` must stay mapped, must not be freed
    /// or moved, and may be written at any time by the transport and by
    /// remote peers. Rust code that reads it must therefore not hold
    /// references (`&[u8]`/`&mut [u8]`) to it across transport calls; use
    /// raw pointers, atomics or volatile access, as a shared mapping would.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<Self, TransportError> {
        if ptr.is_null() {
            return Err(TransportError::Invalid(
                "region pointer is null; pass the base of a mapped region".into(),
            ));
        }
        if len == 0 {
            return Err(TransportError::Invalid(
                "region length is 0; a registered region needs at least one byte".into(),
            ));
        }
        Ok(Self {
            addr: ptr as usize,
            len,
            owner: None,
        })
    }

    /// Describes a [`HeapRegion`], keeping it alive. Safe: the heap region
    /// is interior-mutable (atomics), never moves, and the `Arc` outlives
    /// every transport built from this `RegionRef`.
    pub fn from_heap(region: &Arc<HeapRegion>) -> Self {
        Self {
            addr: region.words.as_ptr() as usize,
            len: region.len,
            owner: Some(region.clone() as Arc<dyn Any + Send + Sync>),
        }
    }

    /// Describes a shared-memory [`uep_shm::Region`], keeping its mapping alive. Safe: a
    /// Region is accessed only by copies and atomics, so a transport or a remote peer
    /// writing it at any time cannot break a Rust reference.
    pub fn from_shm(region: &uep_shm::Region) -> Result<Self, TransportError> {
        // SAFETY: the owner set below keeps the mapping for as long as this RegionRef
        // (and every transport built from it) exists; see the doc comment for access.
        let r = unsafe { Self::from_raw(region.as_ptr(), region.len())? };
        Ok(r.with_owner(region.keepalive()))
    }

    /// Additionally keeps `owner` alive while this region is in use (e.g.
    /// the mapping object behind a [`RegionRef::from_raw`] pointer).
    pub fn with_owner(mut self, owner: Arc<dyn Any + Send + Sync>) -> Self {
        self.owner = Some(owner);
        self
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never true for a usable region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address as an integer (for FI_MR_VIRT_ADDR addressing and logs).
    pub fn addr(&self) -> usize {
        self.addr
    }
}

impl fmt::Debug for RegionRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegionRef")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("owned", &self.owner.is_some())
            .finish()
    }
}

/// A zero-initialised, 8-byte-aligned heap region that transports may write
/// into concurrently: the backing store is atomics, so reading it from safe
/// Rust while a NIC writes is not undefined behaviour. Meant for tests and
/// single-process setups; production ranks use their shared mapping via
/// [`RegionRef::from_raw`].
pub struct HeapRegion {
    words: Box<[AtomicU64]>,
    len: usize,
}

impl HeapRegion {
    /// Allocates `len` zeroed bytes (rounded up internally to whole words).
    pub fn new(len: usize) -> Arc<Self> {
        let words = len.div_ceil(8);
        Arc::new(Self {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            len,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, len: usize) -> Result<(), TransportError> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransportError::Invalid(format!(
                "heap region access [{off}, {off}+{len}) is outside the region of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `buf.len()` bytes starting at `off` into `buf`.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> Result<(), TransportError> {
        self.check(off, buf.len())?;
        // Pairs with whatever made the data visible (CQ polling takes locks,
        // but be explicit for bytes written by other threads).
        fence(Ordering::Acquire);
        for (i, b) in buf.iter_mut().enumerate() {
            let pos = off + i;
            let w = self.words[pos / 8].load(Ordering::Relaxed).to_le_bytes();
            *b = w[pos % 8];
        }
        Ok(())
    }

    /// Returns `len` bytes starting at `off`.
    pub fn to_vec(&self, off: usize, len: usize) -> Result<Vec<u8>, TransportError> {
        let mut v = vec![0u8; len];
        self.read(off, &mut v)?;
        Ok(v)
    }

    /// Stores `data` at `off`. Not atomic as a whole: do not race it with
    /// transport writes to the same bytes.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<(), TransportError> {
        self.check(off, data.len())?;
        let mut pos = off;
        let mut rest = data;
        while !rest.is_empty() {
            let word = &self.words[pos / 8];
            let start = pos % 8;
            let n = rest.len().min(8 - start);
            let mut w = word.load(Ordering::Relaxed).to_le_bytes();
            w[start..start + n].copy_from_slice(&rest[..n]);
            word.store(u64::from_le_bytes(w), Ordering::Relaxed);
            pos += n;
            rest = &rest[n..];
        }
        fence(Ordering::Release);
        Ok(())
    }

    /// Loads the little-endian u64 at the 8-byte-aligned offset `off`.
    pub fn load_u64(&self, off: usize) -> Result<u64, TransportError> {
        self.check(off, 8)?;
        if off % 8 != 0 {
            return Err(TransportError::Invalid(format!(
                "u64 load at offset {off} is not 8-byte aligned"
            )));
        }
        Ok(u64::from_le(self.words[off / 8].load(Ordering::Acquire)))
    }
}

impl fmt::Debug for HeapRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeapRegion")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_region_roundtrip_unaligned() {
        let r = HeapRegion::new(37);
        let data: Vec<u8> = (1..=20).collect();
        r.write(5, &data).unwrap();
        assert_eq!(r.to_vec(5, 20).unwrap(), data);
        assert_eq!(r.to_vec(0, 5).unwrap(), vec![0; 5]);
        assert_eq!(r.to_vec(25, 12).unwrap(), vec![0; 12]);
        assert!(r.write(30, &[0; 8]).is_err());
        assert!(r.to_vec(usize::MAX, 2).is_err());
        r.write(8, &7u64.to_le_bytes()).unwrap();
        assert!(r.load_u64(8).is_ok());
        assert!(r.load_u64(3).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

        #[test]
        fn heap_region_write_read(off in 0usize..100, data in proptest::collection::vec(proptest::num::u8::ANY, 0..60)) {
            let r = HeapRegion::new(160);
            let before = r.to_vec(0, 160).unwrap();
            r.write(off, &data).unwrap();
            let after = r.to_vec(0, 160).unwrap();
            proptest::prop_assert_eq!(&after[off..off + data.len()], &data[..]);
            // Bytes around the written range are untouched.
            proptest::prop_assert_eq!(&after[..off], &before[..off]);
            proptest::prop_assert_eq!(&after[off + data.len()..], &before[off + data.len()..]);
        }
    }

    #[test]
    fn region_ref_describes_heap() {
        let r = HeapRegion::new(64);
        let rr = RegionRef::from_heap(&r);
        assert_eq!(rr.len(), 64);
        assert_eq!(rr.addr() % 8, 0);
        assert_eq!(
            Arc::strong_count(&r),
            2,
            "RegionRef keeps the heap region alive"
        );
        drop(rr);
        assert_eq!(Arc::strong_count(&r), 1);
    }
}
