//! The caller's control plane: its `torch.distributed` group (or MPI communicator).
//!
//! The Python layer hands over one callable, `all_gather(bytes) -> list[bytes]`, built
//! on `dist.all_gather_object` over the group the caller passed to `Buffer`: the job's
//! trusted control plane. uep uses it once, when the Buffer is made, to invite every
//! rank to a group of its own (`uep_bootstrap::Group::form_over`: a fresh port and
//! secret); nothing of uep's travels on the caller's group after that.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use uep_bootstrap::{BootstrapError, ControlPlane};

/// A [`ControlPlane`] over a Python `all_gather(bytes) -> list[bytes]`.
pub struct PyControlPlane {
    rank: usize,
    world_size: usize,
    all_gather: Py<PyAny>,
}

impl std::fmt::Debug for PyControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyControlPlane")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl PyControlPlane {
    /// Rank `rank` of `world_size`, exchanging through `all_gather`.
    pub fn new(rank: usize, world_size: usize, all_gather: Py<PyAny>) -> Self {
        PyControlPlane {
            rank,
            world_size,
            all_gather,
        }
    }
}

impl ControlPlane for PyControlPlane {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let failed = |reason: String| BootstrapError::External {
            collective: "all_gather",
            reason,
        };
        Python::attach(|py| {
            let out = self
                .all_gather
                .call1(py, (PyBytes::new(py, data),))
                .map_err(|e| failed(e.to_string()))?;
            let parts: Vec<Bound<'_, PyBytes>> =
                out.extract(py).map_err(|e: PyErr| failed(e.to_string()))?;
            let parts: Vec<Vec<u8>> = parts.iter().map(|b| b.as_bytes().to_vec()).collect();
            if parts.len() != self.world_size {
                return Err(failed(format!(
                    "{} parts for {} ranks",
                    parts.len(),
                    self.world_size
                )));
            }
            Ok(parts)
        })
    }

    fn abort(&self, reason: &str) {
        // A process group cannot be aborted from here; the data path's own abort
        // signal tells the other ranks (and gloo's timeout ends its collectives).
        tracing::warn!(rank = self.rank, reason, "giving up");
    }
}
