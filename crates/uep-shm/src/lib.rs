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
use std::ops::Range;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memmap2::{MmapOptions, MmapRaw};

mod stream;
pub use stream::copy_streaming;

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

/// A mapped shared-memory segment. Dropping it unmaps once the last [`Region`] handle of
/// it is gone; the owner's drop also unlinks the name if [`Segment::unlink`] has not
/// done so already.
pub struct Segment {
    path: PathBuf,
    /// Kept open (also after the unlink) so that [`Segment::view`] can map parts of the
    /// same pages again.
    file: File,
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
        let map = file
            .set_len(len.max(1) as u64)
            .map_err(io("set size"))
            .and_then(|()| Self::map(&path, &file, len.max(1)));
        match map {
            Ok(map) => Ok(Segment::new(path, file, map, true)),
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
                        return Ok(Segment::new(path, file, map, false));
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

    fn new(path: PathBuf, file: File, map: MmapRaw, owner: bool) -> Segment {
        Segment {
            path,
            file,
            region: Region::from_mapping(map),
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

    /// The mapped memory (a handle that keeps the mapping alive).
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Whether the mapping is empty (never: segments have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// Map `len` bytes at `offset` (both multiples of [`page_size`]) of this segment a
    /// second time, at an address of their own: a [`View`] that can later be
    /// [detached](View::detach) from the segment.
    pub fn view(&self, offset: usize, len: usize) -> Result<View> {
        View::map(&self.file, &self.path, offset, len, self.len())
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.owner {
            let _ = self.unlink();
        }
    }
}

/// Names of elastic jobs' doors start with this (after [`NAME_PREFIX`]); a door is
/// shared by a job's ranks, not one process's, so [`clean_stale`] leaves it alone.
pub const DOOR_PREFIX: &str = "uep-door-";

/// Remove `uep-*` segments whose creating process no longer exists; returns their paths.
/// Segments of live processes are left alone, so this is safe to run beside a job.
/// Doors ([`DOOR_PREFIX`]) are left too: whether one is stale is for its job's ranks
/// to say (`uep_ep::remove_stale_doors`).
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
        if !name.starts_with(NAME_PREFIX) || name.starts_with(DOOR_PREFIX) {
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

/// The size of a memory page: [`Segment::view`] maps whole pages.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// A handle on mapped memory shared with other processes (or with a transport).
///
/// Cloning is cheap (a reference count), and the mapping lives as long as any handle:
/// no access through a Region can reach memory that was unmapped. Bytes move in and
/// out only by copies and are read and written concurrently only through atomics.
/// Which ranges are written by whom, and when, is the job of the protocol above
/// (counters with release/acquire); every access here is bounds-checked.
#[derive(Clone)]
pub struct Region {
    /// Owns the mapping that `ptr..ptr + len` lies in.
    map: Arc<MmapRaw>,
    ptr: *mut u8,
    len: usize,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: a Region owns (a share of) its mapping, so the address range stays valid
// wherever the handle goes; all access goes through bounds-checked copies and
// atomics, which are sound to issue from any thread.
unsafe impl Send for Region {}
// SAFETY: as above; shared access is by atomics and copies only.
unsafe impl Sync for Region {}

impl Region {
    fn from_mapping(map: MmapRaw) -> Region {
        let (ptr, len) = (map.as_mut_ptr(), map.len());
        Region {
            map: Arc::new(map),
            ptr,
            len,
        }
    }

    /// `len` zeroed bytes of private memory (page-aligned): a region for tests and
    /// single-process setups, with the same access rules as a shared one.
    pub fn anonymous(len: usize) -> Result<Region> {
        let map = MmapOptions::new()
            .len(len.max(1))
            .map_anon()
            .map_err(|source| ShmError::Io {
                path: PathBuf::from("[anonymous]"),
                what: "mmap",
                source,
            })?;
        Ok(Region::from_mapping(map.into()))
    }

    /// Something that keeps this region's mapping alive while held (for a transport
    /// that registers the memory and must not outlive it).
    pub fn keepalive(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        Arc::new(self.clone())
    }

    /// Whether `self` and `other` are handles of the same memory.
    pub fn same_memory(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.map, &other.map)
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Base address (for registration with a transport, and for logs).
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
        // SAFETY: in bounds and aligned (checked); `self` keeps the mapping alive for the
        // returned borrow, and by protocol the word is only ever accessed atomically.
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

    /// [`Region::write`] with streaming stores ([`copy_streaming`]): for rows that the
    /// peer reads much later than the cache would keep them.
    pub fn write_streaming(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len(), 1)?;
        // SAFETY: the destination is in bounds (checked). If `src` lies in this same
        // mapping, the ranges may overlap: then a memmove.
        let (dst, s) = (unsafe { self.ptr.add(offset) }, src.as_ptr());
        let (d0, s0, n) = (dst as usize, s as usize, src.len());
        if d0 >= s0 + n || s0 >= d0 + n {
            // SAFETY: in bounds (checked) and disjoint (just checked).
            unsafe { stream::copy_streaming_raw(dst, s, src.len()) };
        } else {
            // SAFETY: in bounds (checked); memmove semantics for the overlap.
            unsafe { std::ptr::copy(s, dst, src.len()) };
        }
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

/// A second mapping of whole pages of a [`Segment`], at an address of its own: what a
/// rank hands out when the rows its peers wrote are to outlive the call that received
/// them (an output tensor), without copying them.
///
/// While attached, the view shows the segment's pages: what peers write there shows
/// here. [`View::detach`] swaps the pages under the view's addresses for private
/// memory holding the same bytes, in one `mremap`, so that whoever reads through the
/// view keeps its data while the segment's pages go back to the peers. The view is
/// unmapped when dropped.
///
/// A View gives out only its address: it is for readers outside Rust (a tensor's
/// storage), which must not write into it concurrently with a detach.
pub struct View {
    ptr: *mut u8,
    len: usize,
    /// Whether the pages are private now; also serialises detaches.
    detached: Mutex<bool>,
}

// SAFETY: the view owns its mapping (unmapped only in Drop) and gives out nothing but
// the address; the detach is serialised by the mutex.
unsafe impl Send for View {}
// SAFETY: as above.
unsafe impl Sync for View {}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("detached", &self.is_detached())
            .finish()
    }
}

impl View {
    fn map(file: &File, path: &Path, offset: usize, len: usize, total: usize) -> Result<View> {
        let page = page_size();
        let in_bounds = offset.checked_add(len).is_some_and(|end| end <= total);
        if len == 0 || offset % page != 0 || len % page != 0 || !in_bounds {
            return Err(ShmError::OutOfBounds {
                offset,
                len,
                align: page,
                size: total,
            });
        }
        let file_offset = libc::off_t::try_from(offset).map_err(|_| ShmError::OutOfBounds {
            offset,
            len,
            align: page,
            size: total,
        })?;
        // SAFETY: a fresh shared mapping of an open file's in-bounds, page-aligned range
        // (checked); the kernel picks the address, so nothing existing is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(file),
                file_offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ShmError::Io {
                path: path.to_path_buf(),
                what: "mmap a view",
                source: io::Error::last_os_error(),
            });
        }
        Ok(View {
            ptr: ptr.cast(),
            len,
            detached: Mutex::new(false),
        })
    }

    /// The view's first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty (never: views map at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether [`View::detach`] has run.
    pub fn is_detached(&self) -> bool {
        *self.detached.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Give the segment's pages back: from now on the view's addresses hold private
    /// memory with the bytes of `keep` (byte ranges of the view) as they were, and
    /// zeros elsewhere; writes to the segment no longer show here. Idempotent.
    pub fn detach(&self, keep: &[Range<usize>]) -> Result<()> {
        let mut detached = self.detached.lock().unwrap_or_else(|e| e.into_inner());
        if *detached {
            return Ok(());
        }
        if let Some(r) = keep.iter().find(|r| r.start > r.end || r.end > self.len) {
            return Err(ShmError::OutOfBounds {
                offset: r.start,
                len: r.end.saturating_sub(r.start),
                align: 1,
                size: self.len,
            });
        }
        let fail = |what| ShmError::Io {
            path: PathBuf::from("[view]"),
            what,
            source: io::Error::last_os_error(),
        };
        // SAFETY: a fresh private anonymous mapping at an address the kernel picks.
        let fresh = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if fresh == libc::MAP_FAILED {
            return Err(fail("allocate memory to detach a view"));
        }
        for r in keep {
            // SAFETY: both ranges are in bounds of mappings of `self.len` bytes (checked
            // above) and belong to different mappings, so they do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.add(r.start),
                    fresh.cast::<u8>().add(r.start),
                    r.len(),
                )
            };
        }
        // SAFETY: moves the private pages to exactly the view's address range, which
        // this View owns; the kernel unmaps the shared pages there in the same step, so
        // the addresses never go unmapped for a reader.
        let moved = unsafe {
            libc::mremap(
                fresh,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                self.ptr.cast::<libc::c_void>(),
            )
        };
        if moved == libc::MAP_FAILED {
            let err = fail("move private pages under a view");
            // SAFETY: `fresh` is still ours and nothing refers to it.
            unsafe { libc::munmap(fresh, self.len) };
            return Err(err);
        }
        *detached = true;
        Ok(())
    }
}

impl Drop for View {
    fn drop(&mut self) {
        // SAFETY: the view's own mapping (shared or, after a detach, private), which no
        // one can use once the View is gone.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
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
    fn a_region_keeps_its_mapping_alive() {
        let name = unique("alive");
        let seg = Segment::create(&name, 8192).unwrap();
        let region = seg.region().clone();
        drop(seg);
        // The name is gone, the memory is not: the handle owns a share of the mapping.
        assert!(!Path::new(SHM_DIR).join(&name).exists());
        region.write(8000, b"still here").unwrap();
        let mut got = [0u8; 10];
        region.read(8000, &mut got).unwrap();
        assert_eq!(&got, b"still here");
        let anon = Region::anonymous(100).unwrap();
        assert!(anon.same_memory(&anon.clone()) && !anon.same_memory(&region));
        assert_eq!(anon.atomic_u64(8).unwrap().load(Ordering::Relaxed), 0);
    }

    #[test]
    fn streaming_writes_copy_exactly_even_from_the_region_itself() {
        let region = Region::anonymous(3 * 4096).unwrap();
        let bytes: Vec<u8> = (0..3 * 4096).map(|i| (i * 13 + 1) as u8).collect();
        region.write(0, &bytes).unwrap();
        // Disjoint (streaming stores), then overlapping both ways (memmove).
        for (from, to, len) in [(0, 8192 + 3, 4000), (0, 100, 5000), (100, 0, 5000)] {
            let mut want = vec![0u8; region.len()];
            region.read(0, &mut want).unwrap();
            want.copy_within(from..from + len, to);
            // SAFETY: in bounds of the live mapping, which `region` keeps alive; the
            // write below may overlap it, which write_streaming must handle.
            let src = unsafe { std::slice::from_raw_parts(region.as_ptr().add(from), len) };
            region.write_streaming(to, src).unwrap();
            let mut got = vec![0u8; region.len()];
            region.read(0, &mut got).unwrap();
            assert!(got == want, "{from} -> {to}, {len} bytes");
        }
        assert!(region.write_streaming(3 * 4096 - 10, &[0; 11]).is_err());
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one kept range is the point
    fn a_view_shows_the_segment_until_detached() {
        let page = page_size();
        let name = unique("view");
        let mut seg = Segment::create(&name, 4 * page).unwrap();
        let peer = Segment::open(&name, 4 * page, Duration::from_secs(1)).unwrap();
        seg.unlink().unwrap();
        // Views are made after the unlink, from the kept file.
        let view = seg.view(page, 2 * page).unwrap();
        assert_eq!(view.len(), 2 * page);
        let read = |at: usize, n: usize| {
            // SAFETY: in bounds of the view; nothing writes the view's own addresses.
            unsafe { std::slice::from_raw_parts(view.as_ptr().add(at), n) }.to_vec()
        };
        peer.region().write(page + 10, b"first").unwrap();
        peer.region().write(page + page + 7, b"tail").unwrap();
        assert_eq!(read(10, 5), b"first");
        view.detach(&[0..page]).unwrap();
        assert!(view.is_detached());
        view.detach(&[0..1]).unwrap(); // idempotent
        peer.region().write(page + 10, b"later").unwrap();
        // The view kept what it had; the segment moved on; bytes outside `keep` are 0.
        assert_eq!(read(10, 5), b"first");
        assert_eq!(read(page + 7, 4), [0; 4]);
        let mut got = [0u8; 5];
        seg.region().read(page + 10, &mut got).unwrap();
        assert_eq!(&got, b"later");
        // A fresh view sees the segment again.
        let again = seg.view(page, page).unwrap();
        // SAFETY: in bounds; nothing writes the view's addresses.
        let bytes = unsafe { std::slice::from_raw_parts(again.as_ptr().add(10), 5) };
        assert_eq!(bytes, b"later");
        assert!(matches!(
            seg.view(1, page),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(matches!(
            seg.view(0, 5 * page),
            Err(ShmError::OutOfBounds { .. })
        ));
        assert!(
            view.detach(&[0..3 * page]).is_ok(),
            "a detached view ignores keep"
        );
        let fresh = seg.view(0, page).unwrap();
        assert!(matches!(
            fresh.detach(&[0..page + 1]),
            Err(ShmError::OutOfBounds { .. })
        ));
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
