//! The control plane: the small collectives a job needs before (and beside) its data
//! path, as an interface.
//!
//! uep exchanges only a few kilobytes out of band: shared-memory names, host identities,
//! transport addresses and keys, config fingerprints. Whoever already connects the
//! job's ranks can carry them: uep's own authenticated TCP rendezvous ([`crate::Group`]),
//! or a framework's process group (the Python package passes `torch.distributed`'s
//! `all_gather_object`). The data path never touches the control plane.

use std::fmt::Debug;

use crate::error::BootstrapError;

/// What uep needs of a job's control plane. Every rank calls the collectives in the same
/// order; implementations fail (rather than hang) when a rank is gone, as far as the
/// underlying transport allows.
pub trait ControlPlane: Send + Sync + Debug {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn world_size(&self) -> usize;

    /// Gathers `data` from every rank; element `i` of the result is rank `i`'s data.
    /// Payloads may differ in length between ranks.
    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError>;

    /// Tells the other ranks, as far as this control plane can, that this rank failed
    /// because of `reason`, so that their pending collectives end. Best effort; never
    /// fails. (The data path has its own abort signal; this is for the control plane's
    /// collectives.)
    fn abort(&self, reason: &str);

    /// A barrier: returns once every rank has entered it.
    fn barrier(&self) -> Result<(), BootstrapError> {
        self.all_gather(&[]).map(|_| ())
    }
}

impl ControlPlane for crate::Group {
    fn rank(&self) -> usize {
        crate::Group::rank(self)
    }

    fn world_size(&self) -> usize {
        crate::Group::world_size(self)
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        crate::Group::all_gather(self, data)
    }

    fn abort(&self, reason: &str) {
        crate::Group::abort(self, reason)
    }

    fn barrier(&self) -> Result<(), BootstrapError> {
        crate::Group::barrier(self)
    }
}

/// Identifies the host this process runs on, as ranks that share memory see it: the
/// machine's boot id, its hostname and the network namespace. Ranks with equal ids can
/// map each other's `/dev/shm` segments; ranks in different network namespaces count as
/// different hosts (the tests emulate hosts with namespaces), so their traffic crosses
/// a real interface.
pub fn host_id() -> String {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let boot = read("/proc/sys/kernel/random/boot_id");
    let host = read("/proc/sys/kernel/hostname");
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}/{}", host.trim(), boot.trim(), netns)
}
