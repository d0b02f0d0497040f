//! The crate's error type.

use std::io;
use std::time::Duration;

use crate::launcher::EnvSource;

/// Everything that can go wrong while discovering ranks, rendezvousing or launching.
///
/// Messages name what was wrong and what is allowed, so that they can be shown to a user as is.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// None of the supported launchers' variables were found.
    #[error(
        "no rank environment found: expected torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, \
         LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), Open MPI variables (OMPI_COMM_WORLD_RANK, ...) \
         or Slurm variables (SLURM_PROCID, ...); start the program with torchrun, mpirun, srun or `uep`"
    )]
    NoRankEnv,

    /// A variable the detected launcher should have set is missing (or empty).
    #[error("{var} is not set ({launcher} environment detected); expected {expected}")]
    MissingVar {
        /// The variable's name.
        var: &'static str,
        /// Which launcher's variables were detected.
        launcher: EnvSource,
        /// What the variable should contain.
        expected: String,
    },

    /// A variable is set to something unusable.
    #[error("{var}={value:?} is invalid: expected {expected}")]
    InvalidVar {
        /// The variable's name.
        var: &'static str,
        /// The value found.
        value: String,
        /// What the variable should contain.
        expected: String,
    },

    /// Individually valid variables contradict each other, or a hand-built [`crate::WorldInfo`]
    /// is inconsistent.
    #[error("inconsistent rank layout: {0}")]
    InconsistentWorld(String),

    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// A joining rank could not open a connection to rank 0 in time.
    #[error(
        "could not reach rank 0 at {addr} within {timeout:?} ({attempts} attempts; last error: {last}); \
         check MASTER_ADDR, MASTER_PORT (uep listens on MASTER_PORT + 1, or on UEP_MASTER_PORT) and that rank 0 is running"
    )]
    ConnectTimeout {
        /// The rendezvous address, `MASTER_ADDR:port`.
        addr: String,
        /// The connect timeout.
        timeout: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: String,
    },

    /// The job's key-value store ([`crate::Store`]) could not be reached in time.
    #[error(
        "could not reach the job's store at {addr} within {timeout:?} ({attempts} attempts; last \
         error: {last}); check UEP_STORE (the launcher's store) and that the launcher is running"
    )]
    StoreUnreachable {
        /// The store's address.
        addr: String,
        /// How long this process tried.
        timeout: Duration,
        /// Connection attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: String,
    },

    /// Rank 0 refused this rank's hello; `reason` is rank 0's own explanation.
    #[error("rank 0 at {addr} rejected rank {rank}: {reason}")]
    Rejected {
        /// The rendezvous address, `MASTER_ADDR:port`.
        addr: String,
        /// This rank.
        rank: usize,
        /// Why rank 0 refused.
        reason: String,
    },

    /// A peer sent something that does not follow the bootstrap protocol.
    #[error("bootstrap protocol error with {peer}: {detail}")]
    Protocol {
        /// Who sent it (an address or a rank).
        peer: String,
        /// What was wrong.
        detail: String,
    },

    /// Rank 0 gave up waiting for ranks to join.
    #[error(
        "only {joined} of {world_size} ranks joined within {timeout:?}; missing ranks {missing:?}{}",
        fmt_rejections(.rejections)
    )]
    JoinTimeout {
        /// Ranks that joined, rank 0 included.
        joined: usize,
        /// The expected number of ranks.
        world_size: usize,
        /// The join timeout.
        timeout: Duration,
        /// Ranks that never joined.
        missing: Vec<usize>,
        /// Joiners that were turned away meanwhile (address and reason), often the real cause.
        rejections: Vec<String>,
    },

    /// A collective did not complete in time on this rank.
    #[error("timed out after {timeout:?} {what}")]
    Timeout {
        /// What this rank was waiting for.
        what: String,
        /// The group's timeout.
        timeout: Duration,
    },

    /// A rank of the group failed (aborted, crashed, left, or timed out), so the group is unusable.
    #[error("rank {rank} failed: {reason}")]
    RankFailed {
        /// The rank that failed.
        rank: usize,
        /// What happened to it.
        reason: String,
    },

    /// A collective of a control plane outside uep (a framework's process group) failed:
    /// some rank may have died or left.
    #[error("the control plane's {collective} failed (did a rank die or leave?): {reason}")]
    External {
        /// Which collective.
        collective: &'static str,
        /// What the control plane said.
        reason: String,
    },

    /// A [`crate::LaunchSpec`] cannot be launched as given.
    #[error("invalid launch spec: {0}")]
    InvalidLaunch(String),

    /// A rank's process could not be started.
    #[error("failed to spawn rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank being spawned.
        rank: usize,
        /// The program path.
        program: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },

    /// The launch's overall timeout expired; the ranks still running were killed.
    #[error(
        "launch timed out after {timeout:?}; killed ranks {running:?} that were still running"
    )]
    LaunchTimeout {
        /// The launch timeout.
        timeout: Duration,
        /// Ranks that were still running and got killed.
        running: Vec<usize>,
    },
}

fn fmt_rejections(rejections: &[String]) -> String {
    if rejections.is_empty() {
        String::new()
    } else {
        format!(
            "; joiners turned away meanwhile: [{}]",
            rejections.join("; ")
        )
    }
}

impl BootstrapError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        BootstrapError::Io {
            context: context.into(),
            source,
        }
    }
}
