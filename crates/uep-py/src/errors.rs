//! Python exceptions by kind: `uep.UepError` (a `RuntimeError`) and one subclass per
//! [`ErrorKind`], so that a caller can catch what it can act on. Bad input is also a
//! `ValueError`, a deadline also a `TimeoutError`, as Python code expects; the messages
//! are the Rust layer's, unchanged.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use uep_ep::{EpError, ErrorKind};

use crate::UepError;

/// The subclasses: (kind, name, a builtin it also derives from, doc).
const CLASSES: [(ErrorKind, &str, Option<&str>, &str); 9] = [
    (
        ErrorKind::InvalidArgument,
        "InvalidArgumentError",
        Some("ValueError"),
        "Bad input to a call, or a config that does not fit the job (also a ValueError).",
    ),
    (
        ErrorKind::Capacity,
        "CapacityError",
        None,
        "A call needs more room than the Buffer has; every rank raises it, and the Buffer stays usable.",
    ),
    (
        ErrorKind::Timeout,
        "UepTimeoutError",
        Some("TimeoutError"),
        "A wait passed uep's deadline (UEP_TIMEOUT_S, Buffer.set_timeout); also a TimeoutError.",
    ),
    (
        ErrorKind::PeerLost,
        "PeerLostError",
        None,
        "A peer died or became unreachable (or this rank was masked by its peers).",
    ),
    (
        ErrorKind::PeerAborted,
        "PeerAbortedError",
        None,
        "A peer gave up and said why; create a new Buffer to go on.",
    ),
    (
        ErrorKind::Protocol,
        "ProtocolError",
        None,
        "A peer's data broke uep's protocol (a corrupt or inconsistent packet).",
    ),
    (
        ErrorKind::Resource,
        "ResourceError",
        None,
        "Memory, a mapping, a socket or the transport failed.",
    ),
    (
        ErrorKind::ControlPlane,
        "ControlPlaneError",
        None,
        "The control plane (rendezvous or a set-up collective) failed.",
    ),
    (
        ErrorKind::Internal,
        "InternalError",
        None,
        "A bug of uep's own; please report it.",
    ),
];

/// Add `UepError`'s subclasses to the module `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let make_type = builtins.getattr("type")?;
    let base = py.get_type::<UepError>();
    for (_, name, extra, doc) in CLASSES {
        let bases = match extra {
            Some(b) => PyTuple::new(py, [base.as_any().clone(), builtins.getattr(b)?])?,
            None => PyTuple::new(py, [base.as_any().clone()])?,
        };
        let dict = PyDict::new(py);
        dict.set_item("__doc__", doc)?;
        dict.set_item("__module__", "uep")?;
        m.add(name, make_type.call1((name, bases, dict))?)?;
    }
    Ok(())
}

/// The exception of kind `kind` with message `msg` (`UepError` itself if the module's
/// classes cannot be found, which only a broken install would cause).
pub fn raise(kind: ErrorKind, msg: String) -> PyErr {
    let name = CLASSES.iter().find(|c| c.0 == kind).map(|c| c.1);
    Python::attach(|py| {
        let class = name.and_then(|n| py.import("uep._uep").ok()?.getattr(n).ok());
        match class.and_then(|c| c.call1((msg.clone(),)).ok()) {
            Some(e) => PyErr::from_value(e),
            None => UepError::new_err(msg),
        }
    })
}

/// An error of the Rust layer, raised by kind.
pub fn ep_err(e: EpError) -> PyErr {
    raise(e.kind(), e.to_string())
}

/// Bad input found by the binding: `invalid argument: {msg}`.
pub fn invalid(msg: impl std::fmt::Display) -> PyErr {
    raise(
        ErrorKind::InvalidArgument,
        format!("invalid argument: {msg}"),
    )
}

/// A broken invariant of the binding: `internal error: {msg}`.
pub fn internal(msg: impl std::fmt::Display) -> PyErr {
    raise(ErrorKind::Internal, format!("internal error: {msg}"))
}
