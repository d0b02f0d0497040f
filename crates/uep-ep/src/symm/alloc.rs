//! Where symmetric memory comes from: an allocator the device provides, and the handle a
//! rank's node peers open its memory by, exchanged over the control plane and kept at
//! the door.
//!
//! The handle is opaque bytes that only the kind of allocator that made them opens: on
//! the host a `/dev/shm` segment name ([`ShmSymmetric`]); on a GPU the driver's IPC
//! handle (64 bytes, which is why a handle holds at most [`HANDLE_BYTES`]). The EP layer
//! never looks inside one.

use std::time::Duration;

use uep_shm::{Region, Segment};

use crate::error::Result;
use crate::exchange::Record;

/// The most bytes a [`MemHandle`] holds: the size of a CUDA IPC memory handle.
pub const HANDLE_BYTES: usize = 64;

/// How the ranks of a node open one rank's symmetric memory: at most [`HANDLE_BYTES`]
/// opaque bytes made by a [`SymmetricAlloc`].
///
/// ```
/// use uep_ep::device::MemHandle;
/// let h = MemHandle::new(b"uep-job-r0-p42".to_vec()).unwrap();
/// assert_eq!(h.as_bytes(), b"uep-job-r0-p42");
/// assert!(MemHandle::new(vec![1; 65]).is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemHandle(Vec<u8>);

impl MemHandle {
    /// A handle of `bytes`, refused beyond [`HANDLE_BYTES`].
    pub fn new(bytes: Vec<u8>) -> Result<MemHandle> {
        if bytes.len() > HANDLE_BYTES {
            return Err(crate::invalid!(
                "a memory handle holds at most {HANDLE_BYTES} bytes, got {}",
                bytes.len()
            ));
        }
        Ok(MemHandle(bytes))
    }

    /// The handle's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Record for MemHandle {
    fn put(&self, out: &mut Vec<u8>) {
        out.push(self.0.len() as u8);
        out.extend_from_slice(&self.0);
    }
    fn take(bytes: &mut &[u8]) -> Option<MemHandle> {
        let (&len, rest) = bytes.split_first()?;
        let handle = rest.get(..len as usize)?;
        *bytes = &rest[len as usize..];
        MemHandle::new(handle.to_vec()).ok()
    }
}

/// Makes and opens the symmetric memory of the ranks of a node: the regions that peers
/// store into and that the proxy writes landed packets into.
///
/// The memory is mapped on the host in both allocators there are, because the host
/// side of the EP layer (its waits, the counts and packet headers they acquire) reads
/// it: the host device's is shared memory; a GPU device's would be the same pages
/// registered with its driver (UCCL-EP's host-pinned mode). Memory only a GPU reads
/// needs the waits to run inside its kernels, which the seam does not have yet
/// (`docs/architecture.md`, "The device seam").
///
/// ```
/// use std::time::Duration;
/// use uep_ep::device::{ShmSymmetric, SymmetricAlloc};
/// let alloc = ShmSymmetric;
/// let job = 0x5eed_0000 + u64::from(std::process::id());
/// let (own, handle) = alloc.create(job, 0, 4096).unwrap();
/// let peer = alloc.open(&handle, 4096, Duration::from_secs(1)).unwrap();
/// own.region().write(8, b"stored by rank 0").unwrap();
/// let mut seen = [0u8; 16];
/// peer.read(8, &mut seen).unwrap();
/// assert_eq!(&seen, b"stored by rank 0");
/// alloc.forget(&handle); // the name goes; both mappings stay
/// ```
pub trait SymmetricAlloc: std::fmt::Debug + Send + Sync {
    /// This process's symmetric memory as rank `rank` of job `job`: `bytes` zeroed
    /// bytes, and the handle its node's peers open it by. The handle opens until the
    /// segment is unlinked ([`Segment::unlink`]) or dropped.
    fn create(&self, job: u64, rank: usize, bytes: usize) -> Result<(Segment, MemHandle)>;

    /// A peer's memory of `bytes` bytes by its handle, waiting up to `timeout` for it to
    /// be there (its maker sizes it right after making it).
    fn open(&self, handle: &MemHandle, bytes: usize, timeout: Duration) -> Result<Region>;

    /// Release what a process that is gone left behind `handle` (the host: its
    /// segment's name, which nobody else removes). By default nothing: memory that
    /// goes with its process.
    fn forget(&self, _handle: &MemHandle) {}

    /// Release what the processes of job `job` that are gone left on this host (a node
    /// that died whole, a joiner killed before it asked). By default nothing.
    fn forget_dead(&self, _job: u64) {}
}

/// The host's symmetric memory: a `/dev/shm` segment per rank, named by job, rank and
/// process ([`uep_shm::segment_name`]); the handle is the name.
#[derive(Clone, Copy, Debug, Default)]
pub struct ShmSymmetric;

impl SymmetricAlloc for ShmSymmetric {
    fn create(&self, job: u64, rank: usize, bytes: usize) -> Result<(Segment, MemHandle)> {
        let name = uep_shm::segment_name(&format!("{job:016x}"), rank, std::process::id());
        let handle = MemHandle::new(name.clone().into_bytes())?;
        Ok((Segment::create(&name, bytes)?, handle))
    }

    fn open(&self, handle: &MemHandle, bytes: usize, timeout: Duration) -> Result<Region> {
        let name = std::str::from_utf8(handle.as_bytes()).map_err(|_| {
            crate::protocol!("a shared-memory handle is not a segment name: {handle:?}")
        })?;
        Ok(Segment::open(name, bytes, timeout)?.region().clone())
    }

    fn forget(&self, handle: &MemHandle) {
        if let Ok(name) = std::str::from_utf8(handle.as_bytes()) {
            forget_segment(name);
        }
    }

    /// Removes the names `uep-JOB-rR-pPID` whose process is gone.
    fn forget_dead(&self, job: u64) {
        let prefix = format!("{}{job:016x}-", uep_shm::NAME_PREFIX);
        let Ok(entries) = std::fs::read_dir(uep_shm::SHM_DIR) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let pid = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.rsplit_once("-p"));
            if let Some(pid) = pid.and_then(|(_, pid)| pid.parse::<u32>().ok()) {
                if crate::wait::process_gone(pid) {
                    forget_segment(&name);
                }
            }
        }
    }
}

/// Remove segment `name`'s name, if it is one (`check_name` refuses paths).
fn forget_segment(name: &str) {
    if !name.is_empty() && !name.contains('/') && !name.starts_with('.') {
        let _ = std::fs::remove_file(std::path::Path::new(uep_shm::SHM_DIR).join(name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_travel_as_records() {
        for bytes in [vec![], vec![0; 64], b"uep-x-r3-p9".to_vec()] {
            let h = MemHandle::new(bytes).unwrap();
            let mut out = Vec::new();
            h.put(&mut out);
            let mut rest = out.as_slice();
            assert_eq!(MemHandle::take(&mut rest), Some(h));
            assert!(rest.is_empty());
        }
        // Too long, or cut short: not a handle.
        assert_eq!(MemHandle::take(&mut [65u8; 66].as_slice()), None);
        assert_eq!(MemHandle::take(&mut [4u8, 1, 2].as_slice()), None);
    }

    #[test]
    fn shm_handles_open_only_segment_names() {
        let bad = MemHandle::new(vec![0xff, 0xfe]).unwrap();
        let err = ShmSymmetric.open(&bad, 64, Duration::ZERO).unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Protocol, "{err}");
        let gone = MemHandle::new(b"uep-no-such-segment".to_vec()).unwrap();
        assert!(ShmSymmetric.open(&gone, 64, Duration::ZERO).is_err());
    }
}
