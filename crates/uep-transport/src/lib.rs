//! uep transports: what a CPU proxy thread needs from an RDMA-capable library.
//!
//! One [`Transport`] value is one endpoint with its completion queues, owned
//! by one proxy thread (`Send`, not `Sync`). Proxy thread *i* of a rank talks
//! only to proxy thread *i* of each peer. Each rank registers ONE symmetric
//! memory region ([`RegionRef`]); every post names byte OFFSETS into the local
//! and the peer's region, never pointers, and is bounds-checked before
//! anything is sent (docs/architecture.md: no remote write lands outside a registered
//! region).
//!
//! Implementations:
//! * [`LibfabricTransport`]: libfabric RDM endpoint, `fi_writedata` carrying a
//!   32-bit immediate as remote CQ data (default provider `tcp;ofi_rxm`).
//! * [`FaultyTransport`]: wraps any transport and, reproducibly from a seed,
//!   reorders, delays and splits bursts of posted writes (never drops or
//!   duplicates) so the EP layer's ordering emulation can be proven.
//!
//! Delivery is assumed UNORDERED and remote atomics ABSENT unless
//! [`Caps::ordered`] / [`Caps::native_atomics`] say otherwise.

mod fabric;
mod faulty;
mod ffi;
pub mod mem;
mod region;
pub mod stream;

pub use fabric::{
    apply_env_defaults, list_providers, route_source, FabricOptions, LibfabricTransport,
    ProviderInfo, DEFAULT_PROVIDER, ENV_DEFAULTS,
};
pub use faulty::{FaultConfig, FaultStats, FaultyTransport};
pub use region::{HeapRegion, RegionRef};

use std::fmt;

/// Opens a rank's transports, one per proxy thread: the seam through which a network
/// path gets its wire (libfabric by default, [`mem::MemNet`] in tests).
pub trait Connector: Send + Sync + fmt::Debug {
    /// Rank `rank`'s transport for proxy thread `thread`, registering `region`; the
    /// path connects it to the same thread of every peer.
    fn open(
        &self,
        rank: usize,
        thread: usize,
        region: &uep_shm::Region,
    ) -> Result<Box<dyn Transport>, TransportError>;
}

/// Opens libfabric transports with the given options.
#[derive(Clone, Debug, Default)]
pub struct LibfabricConnector(pub FabricOptions);

impl Connector for LibfabricConnector {
    fn open(
        &self,
        _rank: usize,
        _thread: usize,
        region: &uep_shm::Region,
    ) -> Result<Box<dyn Transport>, TransportError> {
        let registered = RegionRef::from_shm(region)?;
        Ok(Box::new(LibfabricTransport::new(&self.0, registered)?))
    }
}

impl Connector for Vec<mem::MemNet> {
    /// An endpoint of network `thread` (one network per proxy thread).
    fn open(
        &self,
        rank: usize,
        thread: usize,
        region: &uep_shm::Region,
    ) -> Result<Box<dyn Transport>, TransportError> {
        let net = self.get(thread).ok_or_else(|| {
            TransportError::Invalid(format!(
                "mem transport: {} networks for proxy thread {thread}",
                self.len()
            ))
        })?;
        Ok(Box::new(net.endpoint(rank, region.clone())))
    }
}

/// What a transport can do; fixed for the transport's lifetime.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Writes to one peer become visible, and their immediates are observed
    /// at the target, in posting order. When `false` the EP layer must
    /// emulate ordering with immediates.
    pub ordered: bool,
    /// [`Transport::post_atomic_add`] works and stays ordered after earlier
    /// writes to the same peer. When `false` the EP layer emulates atomics.
    pub native_atomics: bool,
    /// Largest `len` one [`Transport::post_write`] accepts.
    pub max_write_bytes: usize,
    /// Provider name, e.g. `tcp;ofi_rxm`, for logs and `uep info`.
    pub provider: String,
}

/// Opaque address of a remote endpoint plus the descriptor of its registered
/// region (base, length, key), exchanged once by bootstrap.
///
/// An empty `PeerAddr` means "no endpoint" (e.g. a rank's own slot when the
/// bootstrap leaves it out); posting to such a peer is an error.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PeerAddr(pub Vec<u8>);

/// A send-side completion: an operation posted with `ctx` finished at the
/// initiator (for a write: the data left the local region and may be reused;
/// the target observes it through its own [`Arrival`]).
///
/// The proxy's send window (uep-proxy) also relies on this: a write whose
/// completion has been seen reaches the target before any write posted to the
/// same peer after that. Reliable connections, EFA's SRD with delivery-complete
/// semantics, `tcp;ofi_rxm` (one ordered socket per peer) and the fault injector
/// (which reports the inner completion) all give it; a transport that does not
/// must hold its completions back until it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Completion {
    /// A [`Transport::post_write`] or [`Transport::post_imm`] completed.
    Write {
        /// The poster's context value.
        ctx: u64,
    },
    /// A [`Transport::post_atomic_add`] completed.
    Atomic {
        /// The poster's context value.
        ctx: u64,
    },
}

impl Completion {
    /// The poster's context value, whatever the kind.
    pub fn ctx(&self) -> u64 {
        match *self {
            Completion::Write { ctx } | Completion::Atomic { ctx } => ctx,
        }
    }
}

/// One one-sided write: `len` bytes from the local region at `local_off` to `peer`'s
/// region at `remote_off`, carrying the immediate `imm`; `ctx` names it in its
/// completion.
///
/// ```
/// use uep_transport::WriteOp;
/// let op = WriteOp { peer: 1, local_off: 0, remote_off: 4096, len: 64, imm: 7, ctx: 42 };
/// assert_eq!(op.len, 64);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteOp {
    /// The target rank.
    pub peer: usize,
    /// Where the bytes are in the local region.
    pub local_off: u64,
    /// Where they go in the peer's region.
    pub remote_off: u64,
    /// Bytes to write.
    pub len: usize,
    /// The 32-bit immediate the peer's arrival carries.
    pub imm: u32,
    /// Comes back in the write's [`Completion::Write`].
    pub ctx: u64,
}

/// A receive-side event: a write carrying `imm` landed in the local region.
/// Its data is visible to the local process once this is observed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arrival {
    /// The 32-bit immediate the writer attached.
    pub imm: u32,
}

/// Which region a bounds error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The poster's own region (the write's source).
    Local,
    /// The target peer's advertised region.
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Errors of every transport operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// Back-pressure, not a failure: the send queue is full. Poll
    /// [`Transport::poll_send`] / [`Transport::poll_recv`] and retry the post.
    #[error("transport send queue is full (would block): poll the completion queues and retry")]
    WouldBlock,
    /// The operation is not available on this transport.
    #[error("{op} is not supported by transport {provider}: {why}")]
    Unsupported {
        /// Operation name.
        op: &'static str,
        /// Provider / transport name.
        provider: String,
        /// Why, and what to use instead.
        why: String,
    },
    /// A post names bytes outside a registered region; nothing was sent.
    #[error(
        "{side} range [{offset}, {offset}+{len}) is outside the {side} region of {region_len} bytes \
         (peer {peer}, local_off {local_off}, remote_off {remote_off}, len {len}); \
         every byte must lie inside the registered region"
    )]
    OutOfBounds {
        /// Which region the range falls outside of.
        side: Side,
        /// Target peer rank.
        peer: usize,
        /// Offset into the local region, as posted.
        local_off: u64,
        /// Offset into the remote region, as posted.
        remote_off: u64,
        /// The offending offset (`local_off` or `remote_off`).
        offset: u64,
        /// Length of the access in bytes.
        len: u64,
        /// Size of the region on `side`.
        region_len: u64,
    },
    /// An atomic target is not naturally aligned.
    #[error("atomic target offset {remote_off} for peer {peer} is not {align}-byte aligned")]
    Misaligned {
        /// Target peer rank.
        peer: usize,
        /// Offset into the remote region.
        remote_off: u64,
        /// Required alignment in bytes.
        align: u64,
    },
    /// A write is longer than the transport allows.
    #[error("write of {len} bytes exceeds this transport's maximum of {max} bytes per write")]
    TooLarge {
        /// Requested length.
        len: usize,
        /// [`Caps::max_write_bytes`].
        max: usize,
    },
    /// The peer index cannot be targeted.
    #[error("peer {peer} cannot be targeted: {reason}")]
    BadPeer {
        /// Target peer rank.
        peer: usize,
        /// What is wrong (unknown rank, not connected, empty address).
        reason: String,
    },
    /// A [`PeerAddr`] could not be decoded or does not match this transport.
    #[error("address of peer {peer} is unusable: {reason}")]
    BadPeerAddr {
        /// Peer rank whose address is bad.
        peer: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A libfabric call failed.
    #[error("{call} failed: {msg} (fi errno {code})")]
    Fabric {
        /// The fi_* call.
        call: &'static str,
        /// Positive libfabric error number.
        code: i32,
        /// `fi_strerror` text.
        msg: String,
    },
    /// An operation failed asynchronously (a completion-queue error entry).
    #[error(
        "{queue} completion error for ctx {ctx:?}: {msg} (fi errno {err}, provider errno {prov_errno})"
    )]
    Completion {
        /// `"send"` or `"recv"`.
        queue: &'static str,
        /// The failed operation's context, when it was one of ours.
        ctx: Option<u64>,
        /// The peer the failed operation was for, when known.
        peer: Option<usize>,
        /// Positive libfabric error number.
        err: i32,
        /// Provider-specific error number.
        prov_errno: i32,
        /// `fi_cq_strerror` text.
        msg: String,
    },
    /// The transport was configured or used in a way it does not allow.
    #[error("invalid transport use: {0}")]
    Invalid(String),
}

/// The operations a CPU proxy thread needs from an RDMA-capable library.
///
/// All posts are non-blocking and answer [`TransportError::WouldBlock`] when
/// the send queue is full; the caller then polls both queues and retries.
/// Providers with manual progress (e.g. `tcp;ofi_rxm`) only move data while
/// the owner polls, so a proxy must poll regularly on both sides.
pub trait Transport: Send {
    /// What this transport can do.
    fn caps(&self) -> &Caps;

    /// This endpoint's address and region descriptor, for bootstrap exchange.
    fn local_addr(&self) -> PeerAddr;

    /// Learns every peer's address; `peers[r]` is rank `r`'s (this rank's own
    /// entry may be the real address or empty). Call once, before posting.
    fn connect(&mut self, peers: &[PeerAddr]) -> Result<(), TransportError>;

    /// Replaces `peer`'s address with `addr`, after [`Transport::connect`]: a process
    /// started to replace a peer that died (elastic rejoin). The caller has abandoned
    /// every operation to the old one ([`Transport::abandon_peer`]); posts to `peer`
    /// go to the new one from now on. By default `Unsupported`.
    fn replace_peer(&mut self, peer: usize, addr: &PeerAddr) -> Result<(), TransportError> {
        let _ = (peer, addr);
        Err(TransportError::Unsupported {
            op: "replace_peer",
            provider: self.caps().provider.clone(),
            why: "this transport cannot take a replacement peer".into(),
        })
    }

    /// Checks, without sending, that a write of `len` bytes from `local_off`
    /// to `peer`'s `remote_off` is allowed (known peer, in-bounds on both
    /// sides, not too long). Every post runs the same check.
    fn validate_write(
        &self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError>;

    /// Posts `op`: its bytes from the local region to the peer's, carrying its
    /// immediate; its `ctx` comes back in the matching [`Completion::Write`]. The
    /// local bytes must stay unchanged until then.
    fn post_write(&mut self, op: WriteOp) -> Result<(), TransportError>;

    /// A zero-length write that carries only `imm` (a signal).
    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError>;

    /// Atomically adds `value` to the u64 at `peer`'s `remote_off` (8-byte
    /// aligned). `Err(Unsupported)` unless [`Caps::native_atomics`].
    fn post_atomic_add(
        &mut self,
        peer: usize,
        remote_off: u64,
        value: u64,
        ctx: u64,
    ) -> Result<(), TransportError>;

    /// Appends finished send-side operations to `out`; returns how many.
    /// On a completion error, entries appended before it remain valid.
    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError>;

    /// Appends arrived immediates to `out`; returns how many.
    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError>;

    /// Gives up on every operation in flight to `peer`, which the caller found gone,
    /// and returns their contexts: they will never be reported by
    /// [`Transport::poll_send`], and a completion (or error) that still arrives for one
    /// of them is dropped. The transport may still read the source bytes of an
    /// abandoned write until then. Posting to `peer` afterwards is the caller's
    /// mistake, not prevented.
    fn abandon_peer(&mut self, peer: usize) -> Vec<u64> {
        let _ = peer;
        Vec::new()
    }
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn caps(&self) -> &Caps {
        (**self).caps()
    }
    fn local_addr(&self) -> PeerAddr {
        (**self).local_addr()
    }
    fn connect(&mut self, peers: &[PeerAddr]) -> Result<(), TransportError> {
        (**self).connect(peers)
    }
    fn replace_peer(&mut self, peer: usize, addr: &PeerAddr) -> Result<(), TransportError> {
        (**self).replace_peer(peer, addr)
    }
    fn validate_write(
        &self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError> {
        (**self).validate_write(peer, local_off, remote_off, len)
    }
    fn post_write(&mut self, op: WriteOp) -> Result<(), TransportError> {
        (**self).post_write(op)
    }
    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError> {
        (**self).post_imm(peer, imm, ctx)
    }
    fn post_atomic_add(
        &mut self,
        peer: usize,
        remote_off: u64,
        value: u64,
        ctx: u64,
    ) -> Result<(), TransportError> {
        (**self).post_atomic_add(peer, remote_off, value, ctx)
    }
    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        (**self).poll_send(out)
    }
    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        (**self).poll_recv(out)
    }
    fn abandon_peer(&mut self, peer: usize) -> Vec<u64> {
        (**self).abandon_peer(peer)
    }
}

/// Checks that `[offset, offset + len)` lies inside a region of `region_len`
/// bytes, without overflow. Shared by every implementation so the error text
/// is the same everywhere.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_range(
    side: Side,
    peer: usize,
    local_off: u64,
    remote_off: u64,
    len: u64,
    region_len: u64,
) -> Result<(), TransportError> {
    let offset = match side {
        Side::Local => local_off,
        Side::Remote => remote_off,
    };
    match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(TransportError::OutOfBounds {
            side,
            peer,
            local_off,
            remote_off,
            offset,
            len,
            region_len,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_range_edges() {
        assert!(check_range(Side::Local, 0, 0, 0, 16, 16).is_ok());
        assert!(check_range(Side::Local, 0, 16, 0, 0, 16).is_ok());
        assert!(check_range(Side::Remote, 3, 0, 8, 8, 16).is_ok());
        let e = check_range(Side::Remote, 3, 1, 9, 8, 16).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("peer 3") && msg.contains("remote_off 9"),
            "{msg}"
        );
        assert!(msg.contains("16 bytes") && msg.contains("len 8"), "{msg}");
        // Overflowing offsets must not wrap into range.
        assert!(check_range(Side::Local, 0, u64::MAX, 0, 2, u64::MAX).is_err());
        assert!(check_range(Side::Local, 0, 17, 0, 0, 16).is_err());
    }

    #[test]
    fn completion_ctx() {
        assert_eq!(Completion::Write { ctx: 7 }.ctx(), 7);
        assert_eq!(Completion::Atomic { ctx: 9 }.ctx(), 9);
    }
}
