//! Why the CUDA device could not do what was asked.

/// An error of the CUDA device.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The binary was built without the `cuda` feature.
    #[error("this uep was built without the `cuda` feature (cargo build --features cuda)")]
    NotBuilt,
    /// No CUDA driver library (`libcuda.so`) could be loaded.
    #[error("no CUDA driver on this machine (libcuda.so was not found): no CUDA device is there")]
    NoDriver,
    /// The driver loaded but has no device of that ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count}")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: i32,
    },
    /// A driver call failed.
    #[error("CUDA driver call failed while {what}: {detail}")]
    Driver {
        /// What was being done.
        what: &'static str,
        /// The driver's message.
        detail: String,
    },
    /// Bad arguments to a bench or check.
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// Consumers did not see every command in time, or saw a wrong one.
    #[error("FIFO check failed: {0}")]
    Fifo(String),
    /// A kernel's output differs from the host's.
    #[error("{0}")]
    Mismatch(String),
}
