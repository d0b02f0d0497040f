//! Shared memory for uep: the host's NVLink.
//!
//! Every rank creates one named segment in `/dev/shm` (its *symmetric region*), the
//! ranks of a node map each other's segments, and from then on device kernels store
//! straight into a peer's memory and publish with release stores on counters that
//! live in the same memory.
//!
//! Two rules keep `/dev/shm` clean even when a job is killed:
//! * a segment's name is unlinked as soon as every peer has mapped it
//!   ([`Segment::unlink`]); the memory then lives exactly as long as some process
//!   maps it, and the kernel frees it when the last one exits, however it exits;
//! * names carry the creator's pid (`uep-<job>-r<rank>-p<pid>`), so
//!   [`clean_stale`] can remove what a process that died inside the short
//!   create-to-unlink window left behind.
//!
//! This is one of the few modules with `unsafe`: mapping memory and copying bytes into
//! memory that other processes also access.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

/// Where POSIX shared memory lives on Linux.
pub const SHM_DIR: &str = "/dev/shm";
/// Prefix of every segment name uep creates (what `uep clean` looks for).
pub const NAME_PREFIX: &str = "uep-";

/// Shared-memory errors; each names the segment and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// An OS call on a segment failed.
    #[error("shared memory segment {path}: {what}: {source}")]
    Io {
        /// The segment's path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// A peer's segment did not appear before the deadline.
    #[error(
        "shared memory segment {path} did not appear within {waited:?} (is the peer rank running?)"
    )]
    NotFound {
        /// The segment's path.
        path: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
    /// A segment exists but is not the size both sides agreed on.
    #[error("shared memory segment {path} has {found} bytes, expected {expected} (ranks disagree on the buffer size)")]
    SizeMismatch {
        /// The segment's path.
        path: PathBuf,
        /// The size found.
        found: u64,
        /// The size expected.
        expected: u64,
    },
    /// An access outside the region or with the wrong alignment.
    #[error("access of {len} bytes at offset {offset} (align {align}) is outside the {size}-byte region or misaligned")]
    OutOfBounds {
        /// Offset of the access.
        offset: usize,
        /// Length of the access.
        len: usize,
        /// Required alignment.
        align: usize,
        /// Region size.
        size: usize,
    },
    /// A segment name that is not a plain file name.
    #[error("invalid segment name {0:?}: use letters, digits, '-', '_' and '.' only")]
    BadName(String),
}

/// Result alias of this crate.
pub type Result<T, E = ShmError> = std::result::Result<T, E>;

/// The name of rank `rank`'s segment in job `job`, created by process `pid`.
pub fn segment_name(job: &str, rank: usize, pid: u32) -> String {
    format!("{NAME_PREFIX}{job}-r{rank}-p{pid}")
}

fn check_name(name: &str) -> Result<PathBuf> {
    let ok = !name.is_empty()
        && name.len() < 200
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.');
    if ok {
        Ok(Path::new(SHM_DIR).join(name))
    } else {
        Err(ShmError::BadName(name.to_string()))
    }
}

/// A mapped shared-memory segment. Dropping it unmaps; the owner's drop also unlinks
/// the name if [`Segment::unlink`] has not done so already.
pub struct Segment {
    path: PathBuf,
    map: MmapRaw,
    region: Region,
    owner: bool,
    linked: bool,
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("path", &self.path)
            .field("len", &self.len())
            .field("owner", &self.owner)
            .finish()
    }
}

impl Segment {
    /// Create segment `name` of `len` bytes, zero-filled. Pages are allocated lazily by the
    /// kernel, so a large, sparsely used region costs only what is touched.
    pub fn create(name: &str, len: usize) -> Result<Segment> {
        let path = check_name(name)?;
        let io = |what: &'static str| {
            let path = path.clone();
            move |source| ShmError::Io { path, what, source }
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io("create"))?;
        let seg = (|| {
            file.set_len(len.max(1) as u64).map_err(io("set size"))?;
            Self::map(&path, &file, len.max(1))
        })();
        match seg {
            Ok(map) => Ok(Segment::new(path, map, true)),
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                Err(e)
            }
        }
    }

    /// Open and map a peer's segment, waiting up to `timeout` for it to appear and
    /// reach `len` bytes (the creator sizes it right after creating it).
    pub fn open(name: &str, len: usize, timeout: Duration) -> Result<Segment> {
        let path = check_name(name)?;
        let start = Instant::now();
        let len = len.max(1);
        loop {
            match OpenOptions::new().read(true).write(true).open(&path) {
                Ok(file) => {
                    let found = file
                        .metadata()
                        .map_err(|source| ShmError::Io {
                            path: path.clone(),
                            what: "stat",
                            source,
                        })?
                        .len();
                    if found == len as u64 {
                        let map = Self::map(&path, &file, len)?;
                        return Ok(Segment::new(path, map, false));
                    }
                    if found > len as u64 || start.elapsed() > timeout {
                        return Err(ShmError::SizeMismatch {
                            path,
                            found,
                            expected: len as u64,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    if start.elapsed() > timeout {
                        return Err(ShmError::NotFound {
                            path,
                            waited: start.elapsed(),
                        });
                    }
                }
                Err(source) => {
                    return Err(ShmError::Io {
                        path,
                        what: "open",
                        source,
                    })
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn new(path: PathBuf, map: MmapRaw, owner: bool) -> Segment {
        let region = Region {
            ptr: map.as_mut_ptr(),
            len: map.len(),
        };
        Segment {
            path,
            map,
            region,
            owner,
            linked: true,
        }
    }

    fn map(path: &Path, file: &File, len: usize) -> Result<MmapRaw> {
        MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(|source| ShmError::Io {
                path: path.to_path_buf(),
                what: "mmap",
                source,
            })
    }

    /// Remove the segment's name; mappings stay valid. Call once every peer has mapped it.
    pub fn unlink(&mut self) -> Result<()> {
        if self.linked {
            self.linked = false;
            match std::fs::remove_file(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(ShmError::Io {
                        path: self.path.clone(),
                        what: "unlink",
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// The segment's path in `/dev/shm`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The mapped memory.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never: segments have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner {
            let _ = self.unlink();
        }
    }
}

/// Remove `uep-*` segments whose creating process no longer exists; returns their paths.
/// Segments of live processes are left alone, so this is safe to run beside a job.
pub fn clean_stale() -> Result<Vec<PathBuf>> {
    let dir = Path::new(SHM_DIR);
    let entries = std::fs::read_dir(dir).map_err(|source| ShmError::Io {
        path: dir.to_path_buf(),
        what: "list",
        source,
    })?;
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(NAME_PREFIX) {
            continue;
        }
        let pid = name
            .rsplit_once("-p")
            .and_then(|(_, p)| p.parse::<u32>().ok());
        let alive = pid.is_some_and(|p| Path::new("/proc").join(p.to_string()).exists());
        if !alive && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// A view of mapped memory shared with other processes (or with a transport).
///
/// Bytes are moved in and out only by copies and read/written concurrently only
/// through atomics. Which ranges are written by whom, and when, is the job of the
/// protocol above (counters with release/acquire); every access here is bounds-checked.
#[derive(Clone, Copy, Debug)]
pub struct Region {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a Region is an address range of a mapping that outlives it (the owner keeps
// the Segment alive); all access goes through bounds-checked copies and atomics, which
// are sound to issue from any thread.
unsafe impl Send for Region {}
// SAFETY: as above; shared access is by atomics and copies only.
unsafe impl Sync for Region {}

impl Region {
    /// A region over `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The memory must stay mapped, readable and writable for as long as this Region
    /// and its copies are used, and be at least 8-byte aligned.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Region {
        Region { ptr, len }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address (for registration with a transport).
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn check(&self, offset: usize, len: usize, align: usize) -> Result<()> {
        let end = offset.checked_add(len);
        if end.is_none_or(|e| e > self.len) || offset % align != 0 {
            return Err(ShmError::OutOfBounds {
                offset,
                len,
                align,
                size: self.len,
            });
        }
        Ok(())
    }

    /// The 64-bit atomic at `offset` (8-byte aligned).
    pub fn atomic_u64(&self, offset: usize) -> Result<&AtomicU64> {
        self.check(offset, 8, 8)?;
        // SAFETY: in bounds and aligned (checked); the mapping outlives `self` and is
        // only ever accessed atomically at this offset by protocol.
        Ok(unsafe { &*(self.ptr.add(offset) as *const AtomicU64) })
    }

    /// The 32-bit atomic at `offset` (4-byte aligned).
    pub fn atomic_u32(&self, offset: usize) -> Result<&AtomicU32> {
        self.check(offset, 4, 4)?;
        // SAFETY: as for `atomic_u64`.
        Ok(unsafe { &*(self.ptr.add(offset) as *const AtomicU32) })
    }

    /// Copy `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len(), 1)?;
        // SAFETY: the destination is in bounds (checked). `src` may itself point into a
        // mapping (a received row passed back to combine), so use memmove semantics.
        unsafe { std::ptr::copy(src.as_ptr(), self.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// Copy `dst.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len(), 1)?;
        // SAFETY: the source is in bounds (checked); `dst` is an exclusive Rust slice,
        // so it cannot alias the source range while we hold it.
        unsafe { std::ptr::copy(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copy `len` bytes from `src_off` of `src` to `dst_off` of `self` (regions may be
    /// the same; the ranges must not overlap unless `src_off >= dst_off` in one region,
    /// for which this uses a memmove).
    pub fn copy_from(
        &self,
        dst_off: usize,
        src: &Region,
        src_off: usize,
        len: usize,
    ) -> Result<()> {
        self.check(dst_off, len, 1)?;
        src.check(src_off, len, 1)?;
        // SAFETY: both ranges are in bounds (checked); `copy` has memmove semantics, so
        // overlap within one mapping is handled.
        unsafe { std::ptr::copy(src.ptr.add(src_off), self.ptr.add(dst_off), len) };
        Ok(())
    }

    /// Borrow `count` values of `T` at `offset` as a slice.
    ///
    /// # Safety
    /// For the lifetime of the returned slice no one (no peer process, no thread, no
    /// transport) may write the range: the caller's protocol must guarantee it.
    pub unsafe fn slice<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Result<&[T]> {
        let bytes = count
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(ShmError::OutOfBounds {
                offset,
                len: usize::MAX,
                align: 1,
                size: self.len,
            })?;
        self.check(offset, bytes, std::mem::align_of::<T>())?;
        // SAFETY: in bounds and aligned (checked); `T: Pod` accepts any bit pattern; the
        // caller guarantees no concurrent writer for the slice's lifetime.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.add(offset) as *const T, count) })
    }

    /// Borrow `count` values of `T` at `offset` mutably.
    ///
    /// # Safety
    /// For the lifetime of the returned slice no one else may read or write the range,
    /// and no other slice over it may exist.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut<T: bytemuck::Pod>(
        &self,
        offset: usize,
        count: usize,
    ) -> Result<&mut [T]> {
        let bytes = count
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(ShmError::OutOfBounds {
                offset,
                len: usize::MAX,
                align: 1,
                size: self.len,
            })?;
        self.check(offset, bytes, std::mem::align_of::<T>())?;
        // SAFETY: in bounds and aligned (checked); exclusivity is the caller's contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset) as *mut T, count) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn unique(tag: &str) -> String {
        format!("{NAME_PREFIX}test-{tag}-p{}", std::process::id())
    }

    #[test]
    fn create_open_share_and_unlink() {
        let name = unique("share");
        let mut a = Segment::create(&name, 1 << 20).unwrap();
        let b = Segment::open(&name, 1 << 20, Duration::from_secs(1)).unwrap();
        a.region().write(4096, b"hello").unwrap();
        let mut got = [0u8; 5];
        b.region().read(4096, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        a.region()
            .atomic_u64(64)
            .unwrap()
            .store(7, Ordering::Release);
        assert_eq!(
            b.region().atomic_u64(64).unwrap().load(Ordering::Acquire),
            7
        );
        a.unlink().unwrap();
        assert!(!Path::new(SHM_DIR).join(&name).exists());
        // The mapping survives the unlink.
        b.region().write(0, b"x").unwrap();
    }

    #[test]
    fn owner_drop_unlinks() {
        let name = unique("drop");
        let seg = Segment::create(&name, 4096).unwrap();
        assert!(seg.path().exists());
        drop(seg);
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn errors_are_specific() {
        let name = unique("errs");
        let _a = Segment::create(&name, 4096).unwrap();
        assert!(matches!(
            Segment::open(&name, 8192, Duration::from_millis(20)),
            Err(ShmError::SizeMismatch {
                found: 4096,
                expected: 8192,
                ..
            })
        ));
        assert!(matches!(
            Segment::open(&unique("missing"), 4096, Duration::from_millis(5)),
            Err(ShmError::NotFound { .. })
        ));
        assert!(matches!(
            Segment::create("../etc/x", 1),
            Err(ShmError::BadName(_))
        ));
        let r = _a.region();
        assert!(r.write(4090, &[0; 7]).is_err());
        assert!(r.atomic_u64(4).is_err());
        assert!(r.atomic_u64(4096).is_err());
        assert!(r.write(usize::MAX, &[0]).is_err());
    }

    #[test]
    fn clean_stale_removes_dead_creators_only() {
        // pid 0 never names a live user process.
        let dead = format!("{NAME_PREFIX}test-stale-r0-p0");
        let path = Path::new(SHM_DIR).join(&dead);
        std::fs::write(&path, b"x").unwrap();
        let live = Segment::create(&unique("live-r0"), 64).unwrap();
        let removed = clean_stale().unwrap();
        assert!(removed.contains(&path));
        assert!(!path.exists());
        assert!(live.path().exists());
    }
}
