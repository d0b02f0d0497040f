//! The caller's control plane: its `torch.distributed` group (or MPI communicator).
//!
//! The Python layer hands over one callable, `all_gather(bytes) -> list[bytes]`, built
//! on `dist.all_gather_object` over the group the caller passed to `Buffer`: the job's
//! trusted control plane. uep uses it once, when the Buffer is made, to invite every
//! rank to a group of its own (`uep_bootstrap::Group::form_over`: a fresh port and
//! secret); nothing of uep's travels on the caller's group after that.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use uep_bootstrap::{BootstrapError, ControlPlane, Store};

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

/// A [`Store`] over a Python `torch.distributed.Store` (torchrun's `TCPStore`, which the
/// launcher's agent keeps at `MASTER_ADDR:MASTER_PORT`): where an elastic job's door
/// lives, reached from every host and by a replacement that has no process group.
pub struct PyStore {
    store: Py<PyAny>,
}

impl std::fmt::Debug for PyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the launcher's store")
    }
}

impl PyStore {
    /// Over `store`, an object with torch's `Store` methods (`set`, `get`, `check`,
    /// `add`, `delete_key`).
    pub fn new(store: Py<PyAny>) -> Self {
        PyStore { store }
    }

    fn call<T>(
        &self,
        what: &'static str,
        f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T, BootstrapError> {
        Python::attach(|py| f(py, self.store.bind(py))).map_err(|e| BootstrapError::External {
            collective: what,
            reason: e.to_string(),
        })
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), BootstrapError> {
        self.call("store set", |py, s| {
            s.call_method1("set", (key, PyBytes::new(py, value)))
                .map(drop)
        })
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, BootstrapError> {
        // torch's get waits for a key that is not there: ask first.
        self.call("store get", |_, s| {
            if !s.call_method1("check", (vec![key],))?.extract::<bool>()? {
                return Ok(None);
            }
            let v = s.call_method1("get", (key,))?;
            Ok(Some(v.cast::<PyBytes>()?.as_bytes().to_vec()))
        })
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64, BootstrapError> {
        self.call("store add", |_, s| {
            s.call_method1("add", (key, delta))?.extract()
        })
    }

    fn delete(&self, key: &str) -> Result<(), BootstrapError> {
        self.call("store delete", |_, s| {
            s.call_method1("delete_key", (key,)).map(drop)
        })
    }
}
