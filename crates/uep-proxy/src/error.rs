//! The one error type of the proxy.

use std::time::Duration;

use uep_fifo::FifoError;
use uep_transport::TransportError;
use uep_wire::WireError;

/// Result alias of this crate.
pub type Result<T, E = ProxyError> = std::result::Result<T, E>;

/// What went wrong in the proxy. Command errors name the rank, the proxy
/// thread, the FIFO (its index inside the thread) and the slot, so a bad
/// command can be traced back to the producer that pushed it.
///
/// `Clone` so that [`crate::Proxy::check`] can hand out the first fatal error
/// as often as it is asked.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProxyError {
    /// A configuration value, a [`crate::CounterLayout`] or an argument of a
    /// [`crate::cmds`] helper is out of range.
    #[error("invalid proxy argument: {0}")]
    Invalid(String),

    /// A command helper could not encode its command.
    #[error("cannot encode command: {0}")]
    Wire(#[from] WireError),

    /// A FIFO could not be created.
    #[error("cannot create a proxy FIFO: {0}")]
    Fifo(#[from] FifoError),

    /// A FIFO slot held words that do not decode as a command; the command
    /// was not executed.
    #[error(
        "rank {rank} proxy thread {thread} FIFO {fifo} slot {slot}: undecodable command \
         (word0 {word0:#018x}, word1 {word1:#018x}): {source}; it was not executed"
    )]
    Undecodable {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// FIFO index inside the thread.
        fifo: usize,
        /// The slot index.
        slot: u64,
        /// Raw first word.
        word0: u64,
        /// Raw second word.
        word1: u64,
        /// Why it does not decode (boxed: keeps every `Result` small).
        source: Box<WireError>,
    },

    /// A command decoded but may not be executed (out of bounds, a field the
    /// proxy cannot map, a value that does not fit the immediate). Nothing
    /// was posted for it.
    #[error(
        "rank {rank} proxy thread {thread} FIFO {fifo} slot {slot}: rejected {command}: \
         {reason}; nothing was posted"
    )]
    Rejected {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// FIFO index inside the thread.
        fifo: usize,
        /// The slot index.
        slot: u64,
        /// The decoded command (Debug form).
        command: String,
        /// What is wrong and what is allowed.
        reason: String,
    },

    /// A transport operation failed (not back-pressure: a real error).
    #[error("rank {rank} proxy thread {thread}: {op} failed: {source}")]
    Transport {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// What the proxy was doing (e.g. "posting Write from FIFO 2 slot 7").
        op: String,
        /// The transport's error.
        source: Box<TransportError>,
    },

    /// A command or the drain at shutdown made no progress for the
    /// configured timeout.
    #[error("rank {rank} proxy thread {thread}: no progress for {waited:?}: {what}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// How long it waited.
        waited: Duration,
        /// What it was waiting for (FIFO, slot, command, counters).
        what: String,
    },

    /// A proxy thread could not be spawned.
    #[error("rank {rank}: spawning proxy thread {thread} failed: {msg}")]
    Spawn {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// The OS error text.
        msg: String,
    },

    /// A proxy thread panicked or exited without reporting an error.
    #[error("rank {rank}: proxy thread {thread} {what}")]
    ThreadDied {
        /// This rank.
        rank: usize,
        /// Proxy thread.
        thread: usize,
        /// What happened ("panicked: ...", "exited unexpectedly").
        what: String,
    },
}
