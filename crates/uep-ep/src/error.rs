//! Errors of the EP layer: every message says what was wrong and what is allowed.

/// Result alias of the EP layer.
pub type Result<T, E = EpError> = std::result::Result<T, E>;

/// Everything that can go wrong in an EP call.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// An argument is out of range, has the wrong shape, or does not fit the Buffer.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A wait passed its deadline; the message names rank, peer, counter, expected and seen.
    #[error("timeout: {0}")]
    Timeout(String),
    /// A peer rank reported an error or went away.
    #[error("peer failure: {0}")]
    Peer(String),
    /// Shared-memory failure.
    #[error(transparent)]
    Shm(#[from] uep_shm::ShmError),
    /// Bootstrap (rendezvous) failure.
    #[error(transparent)]
    Bootstrap(#[from] uep_bootstrap::BootstrapError),
}

/// Build an [`EpError::InvalidArgument`] with `format!` syntax.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::EpError::InvalidArgument(format!($($arg)*)) };
}
