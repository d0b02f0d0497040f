//! `uep._uep`: the Rust core of the `uep` Python package.
//!
//! The package's Python layer (`python/uep`) is DeepEP's APIs; this module is what it
//! calls: a [`runtime::Runtime`] per `uep.Buffer` (v2's and hybrid-ep's buffers hold
//! one, with the helpers of [`v2`]), bootstrapped over the caller's
//! `torch.distributed` group ([`control`]), with tensors in and out through DLPack
//! without copies ([`dlpack`]), and the GIL released while a call communicates or
//! waits. Every error raises a subclass of `uep.UepError` (a `RuntimeError`) by kind
//! ([`errors`]).
#![deny(unsafe_code)]

use pyo3::create_exception;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

pub mod control;
pub mod dlpack;
pub mod errors;
pub mod runtime;
pub mod v2;

create_exception!(
    _uep,
    UepError,
    PyRuntimeError,
    "An error of uep: bad input, a capacity too small, a timeout, or a peer that died or gave up."
);

/// The version of the package.
const VERSION: &str = env!("CARGO_PKG_VERSION");

#[pymodule]
fn _uep(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Logs go to stderr, filtered by UEP_LOG, as in the CLI.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("UEP_LOG"))
        .with_writer(std::io::stderr)
        .try_init();
    m.add("UepError", m.py().get_type::<UepError>())?;
    errors::register(m)?;
    m.add("__version__", VERSION)?;
    m.add_function(wrap_pyfunction!(v2::host_id, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::door_name, m)?)?;
    m.add_function(wrap_pyfunction!(runtime::fabric_env_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(v2::nodes, m)?)?;
    m.add_function(wrap_pyfunction!(v2::normal_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(v2::sum_slots, m)?)?;
    m.add_class::<runtime::Runtime>()?;
    m.add_class::<runtime::NormalHandlePy>()?;
    m.add_class::<runtime::LlHandlePy>()?;
    m.add_class::<runtime::LlPendingPy>()?;
    m.add_class::<runtime::LlCombinePendingPy>()?;
    Ok(())
}
