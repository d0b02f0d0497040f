//! Errors of the EP layer: every message says what was wrong and what is allowed.
//!
//! Variants say what happened, with the failures of the layers below kept as sources;
//! [`EpError::kind`] sorts them into what a caller can act on ([`ErrorKind`]): bad
//! input, a Buffer too small for a call (every rank returns it together and the Buffer
//! stays usable), a deadline passed, a peer lost or one that gave up, corrupt data from
//! a peer, a resource (memory, mapping, transport) that failed, the control plane, or a
//! bug of uep's own.

use std::time::{Duration, Instant};

/// Result alias of the EP layer.
pub type Result<T, E = EpError> = std::result::Result<T, E>;

/// Everything that can go wrong in an EP call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EpError {
    /// An argument is out of range, has the wrong shape, or does not fit the Buffer.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A call needs more room than the Buffer has. Found by all ranks of the call at the
    /// same point, before any data moved: the Buffer stays usable, and a larger one
    /// (or smaller inputs) will do.
    #[error("capacity: {what}")]
    Capacity {
        /// What did not fit, and the limit.
        what: String,
        /// The most tokens any rank dispatched in the call.
        tokens: usize,
    },
    /// A wait passed its deadline.
    #[error("timeout: {what}: {detail} after {waited:?} (raise it with UEP_TIMEOUT_S or Buffer::set_timeout)")]
    Timeout {
        /// Who waited for what (rank, call, peer, counter).
        what: String,
        /// What was expected and what was seen.
        detail: String,
        /// The deadline that passed.
        waited: Duration,
    },
    /// A peer's process is gone.
    #[error("peer failure: {what}: rank {peer} (pid {pid}) has died")]
    PeerDied {
        /// Who waited for what.
        what: String,
        /// The rank that died.
        peer: usize,
        /// Its process id.
        pid: u32,
    },
    /// A socket or file operation of this rank failed.
    #[error("{context}: {source}")]
    Io {
        /// What this rank was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A peer on another node was found gone by the liveness watch (its host closed
    /// the connection, or stopped answering).
    #[error("peer failure: {what}: {lost}")]
    PeerLost {
        /// Who waited for what.
        what: String,
        /// Who was lost, and how that was known.
        lost: Box<Lost>,
    },
    /// Elastic mode: the other ranks masked this one (they found it gone, or their
    /// callers masked it) and went on without it.
    #[error("peer failure: rank {rank} was masked by its peers; ranks {by:?} go on without it")]
    Excluded {
        /// This rank.
        rank: usize,
        /// The ranks that go on.
        by: Vec<usize>,
    },
    /// Elastic mode: a cached dispatch handle routes to ranks masked since it was
    /// made. Every survivor refuses it alike, before sending anything, and the Buffer
    /// stays usable.
    #[error("invalid argument: {0}")]
    StaleHandle(String),
    /// A peer gave up (bad input, a timeout, a dead peer of its own) and said why.
    #[error("peer failure: {what}: rank {peer} aborted: {reason}")]
    PeerAborted {
        /// Who waited for what.
        what: String,
        /// The rank that gave up first.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// A call on a Buffer whose job already failed: it would pair with the wrong calls
    /// of other ranks.
    #[error("peer failure: rank {rank}: this Buffer is unusable after rank {peer} failed ({reason}); create a new Buffer")]
    Unusable {
        /// This rank.
        rank: usize,
        /// The rank that failed first.
        peer: usize,
        /// Its error.
        reason: String,
    },
    /// The proxy that carries traffic to other nodes stopped.
    #[error("peer failure: rank {rank}: proxy: {source}")]
    Proxy {
        /// This rank.
        rank: usize,
        /// What the proxy reported.
        #[source]
        source: Box<uep_proxy::ProxyError>,
    },
    /// The transport (libfabric) failed.
    #[error("transport: {context}: {source}")]
    Transport {
        /// What was being done.
        context: String,
        /// The transport's error.
        #[source]
        source: Box<uep_transport::TransportError>,
    },
    /// A kernel thread of the host device panicked.
    #[error("a device thread panicked: {0}")]
    Panicked(String),
    /// Shared-memory failure.
    #[error(transparent)]
    Shm(Box<uep_shm::ShmError>),
    /// Control-plane (bootstrap) failure.
    #[error(transparent)]
    Bootstrap(Box<uep_bootstrap::BootstrapError>),
    /// A peer sent data that breaks the protocol (a corrupt or inconsistent packet):
    /// nothing this rank's caller passed is wrong.
    #[error("protocol: {0}")]
    Protocol(String),
    /// Memory, a mapping or another resource this rank or a peer needed could not be
    /// had.
    #[error("resource: {0}")]
    Resource(String),
    /// A broken invariant of uep itself (please report it).
    #[error("internal error: {0}")]
    Internal(String),
}

/// What kind of failure an [`EpError`] is: what a caller can act on.
///
/// ```
/// use uep_ep::{EpError, ErrorKind};
/// let e = EpError::InvalidArgument("topk_idx must be int64".into());
/// assert_eq!(e.kind(), ErrorKind::InvalidArgument);
/// assert_eq!(e.kind().to_string(), "invalid");
/// assert!(!e.is_peer_failure());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Bad input to a call, or a config that does not fit the job.
    InvalidArgument,
    /// A call needs more room than the Buffer has (the Buffer stays usable).
    Capacity,
    /// A wait passed its deadline.
    Timeout,
    /// A peer died or became unreachable (or this rank was masked by its peers).
    PeerLost,
    /// A peer gave up and said why; this Buffer is unusable after it.
    PeerAborted,
    /// A peer's data broke the protocol.
    Protocol,
    /// Memory, a mapping, a socket or the transport failed.
    Resource,
    /// The control plane (rendezvous, collectives of set-up) failed.
    ControlPlane,
    /// A bug of uep's own (a kernel thread that panicked included).
    Internal,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ErrorKind::InvalidArgument => "invalid",
            ErrorKind::Capacity => "capacity",
            ErrorKind::Timeout => "timeout",
            ErrorKind::PeerLost => "peer_lost",
            ErrorKind::PeerAborted => "peer_aborted",
            ErrorKind::Protocol => "protocol",
            ErrorKind::Resource => "resource",
            ErrorKind::ControlPlane => "control_plane",
            ErrorKind::Internal => "internal",
        })
    }
}

impl EpError {
    /// An [`EpError::Internal`].
    pub(crate) fn internal(msg: String) -> EpError {
        EpError::Internal(msg)
    }

    /// Whether the error came from another rank (it is that rank's to report): a peer
    /// lost or one that gave up ([`ErrorKind::PeerLost`], [`ErrorKind::PeerAborted`]).
    pub fn is_peer_failure(&self) -> bool {
        matches!(self.kind(), ErrorKind::PeerLost | ErrorKind::PeerAborted)
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            EpError::InvalidArgument(_) | EpError::StaleHandle(_) => ErrorKind::InvalidArgument,
            EpError::Capacity { .. } => ErrorKind::Capacity,
            EpError::Timeout { .. } => ErrorKind::Timeout,
            // A proxy stops when an operation to a peer fails.
            EpError::PeerDied { .. }
            | EpError::PeerLost { .. }
            | EpError::Excluded { .. }
            | EpError::Proxy { .. } => ErrorKind::PeerLost,
            EpError::PeerAborted { .. } | EpError::Unusable { .. } => ErrorKind::PeerAborted,
            EpError::Protocol(_) => ErrorKind::Protocol,
            EpError::Transport { .. }
            | EpError::Io { .. }
            | EpError::Shm(_)
            | EpError::Resource(_) => ErrorKind::Resource,
            EpError::Bootstrap(b) => bootstrap_kind(b),
            EpError::Panicked(_) | EpError::Internal(_) => ErrorKind::Internal,
        }
    }
}

/// The kind of a control-plane failure: a rank that failed and said so is a peer that
/// aborted, a deadline a timeout, a bad launch environment bad input.
fn bootstrap_kind(e: &uep_bootstrap::BootstrapError) -> ErrorKind {
    use uep_bootstrap::BootstrapError as B;
    match e {
        B::RankFailed { .. } => ErrorKind::PeerAborted,
        B::ConnectTimeout { .. }
        | B::StoreUnreachable { .. }
        | B::JoinTimeout { .. }
        | B::Timeout { .. }
        | B::LaunchTimeout { .. } => ErrorKind::Timeout,
        B::Protocol { .. } => ErrorKind::Protocol,
        B::MissingVar { .. }
        | B::InvalidVar { .. }
        | B::InconsistentWorld(_)
        | B::InvalidLaunch(_) => ErrorKind::InvalidArgument,
        _ => ErrorKind::ControlPlane,
    }
}

impl From<uep_shm::ShmError> for EpError {
    fn from(e: uep_shm::ShmError) -> Self {
        EpError::Shm(Box::new(e))
    }
}

impl From<uep_bootstrap::BootstrapError> for EpError {
    fn from(e: uep_bootstrap::BootstrapError) -> Self {
        EpError::Bootstrap(Box::new(e))
    }
}

/// Build an [`EpError::InvalidArgument`] with `format!` syntax.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::EpError::InvalidArgument(format!($($arg)*)) };
}

/// Build an [`EpError::Protocol`] (a peer's data broke the protocol) with `format!`
/// syntax.
#[macro_export]
macro_rules! protocol {
    ($($arg:tt)*) => { $crate::EpError::Protocol(format!($($arg)*)) };
}

/// How a peer was found gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gone {
    /// Its host closed our connection: the process exited or was killed.
    Died {
        /// The connection's last word (`end of stream`, `connection reset`, ...).
        detail: String,
    },
    /// Its host acknowledged nothing for `silent_for` on the connection to rank
    /// `via`: the host is down or the link to it is cut. One kernel acknowledges for
    /// every rank on a host, so the first such connection condemns them all.
    Unreachable {
        /// How long nothing was acknowledged.
        silent_for: Duration,
        /// The rank on that node whose connection timed out first.
        via: usize,
    },
}

/// A peer found gone: who, where, how, and when this rank learnt it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    /// The rank.
    pub rank: usize,
    /// Its node.
    pub node: usize,
    /// Its host, as it advertised itself.
    pub host: String,
    /// How it was found gone.
    pub how: Gone,
    /// When the watcher reached the verdict.
    pub at: Instant,
}

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (rank, node, host) = (self.rank, self.node, &self.host);
        match &self.how {
            Gone::Died { detail } => write!(
                f,
                "rank {rank} on node {node} ({host}) died: its host closed our liveness \
                 connection ({detail}), so its process exited or was killed"
            ),
            Gone::Unreachable { silent_for, via } => write!(
                f,
                "node {node} ({host}) is unreachable: nothing sent to rank {via} there was \
                 acknowledged for {silent_for:?}, so the host is down or the link to it \
                 is cut"
            ),
        }
    }
}
