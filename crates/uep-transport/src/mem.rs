//! An in-memory network: endpoints of one process whose one-sided writes are copied
//! between their registered regions at once, for tests of everything above the wire
//! (the proxy, the EP layer) without sockets.
//!
//! Like the wire uep assumes, it is unordered as far as callers may tell (nothing
//! promises order), has no remote atomics, and says nothing of who sent a write. Tests
//! can watch and steer it through the [`MemNet`]: every post in order
//! ([`MemNet::posts`]), a bound on operations in flight per endpoint (back-pressure as
//! `WouldBlock`), and send completions held back on demand
//! ([`MemNet::hold_completions`]).
//!
//! ```
//! use uep_shm::Region;
//! use uep_transport::{mem::MemNet, Arrival, PeerAddr, Transport, WriteOp};
//!
//! let net = MemNet::new(2);
//! let (r0, r1) = (Region::anonymous(4096).unwrap(), Region::anonymous(4096).unwrap());
//! let (mut a, mut b) = (net.endpoint(0, r0.clone()), net.endpoint(1, r1.clone()));
//! let peers = [a.local_addr(), b.local_addr()];
//! a.connect(&peers).unwrap();
//! b.connect(&peers).unwrap();
//! r0.write(0, b"hello, rank 1!!!").unwrap();
//! a.post_write(WriteOp { peer: 1, local_off: 0, remote_off: 64, len: 16, imm: 7, ctx: 1 }).unwrap();
//! let mut got = [0u8; 16];
//! r1.read(64, &mut got).unwrap();
//! assert_eq!(&got, b"hello, rank 1!!!");
//! let mut arrivals = Vec::new();
//! b.poll_recv(&mut arrivals).unwrap();
//! assert_eq!(arrivals, vec![Arrival { imm: 7 }]);
//! ```

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use uep_shm::Region;

use crate::{
    check_range, Arrival, Caps, Completion, PeerAddr, Side, Transport, TransportError, WriteOp,
};

/// One post as the network saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Post {
    /// The sending rank.
    pub from: usize,
    /// The receiving rank.
    pub to: usize,
    /// Bytes written (0 for a signal).
    pub len: usize,
    /// The immediate.
    pub imm: u32,
}

/// One endpoint's side of the network. Each has its own locks, so that hundreds of
/// endpoints polling at once do not queue on one (a single lock starved some proxy
/// threads for minutes in a 384-rank job).
#[derive(Default)]
struct Port {
    /// The endpoint's registered region, once it exists.
    region: Mutex<Option<Region>>,
    /// Arrivals not polled yet.
    inbox: Mutex<VecDeque<u32>>,
    /// What the endpoint sent and has not learnt of yet.
    sent: Mutex<Sent>,
    /// Its posts, each with its place in the network's order.
    posts: Mutex<Vec<(u64, Post)>>,
}

/// A sender's completions.
#[derive(Default)]
struct Sent {
    /// Send completions not polled yet.
    done: Vec<u64>,
    /// Operations posted and not completed (polled) yet.
    in_flight: usize,
    /// Hold back the completions of the next this-many posts.
    hold: usize,
    /// Completions held back.
    held: Vec<u64>,
}

/// An in-memory network of `num_ranks` endpoints (one per rank; a proxy with several
/// threads uses one network per thread). Clones share it.
#[derive(Clone)]
pub struct MemNet {
    /// `[rank]`: that endpoint's side.
    ports: Arc<[Port]>,
    /// Numbers the posts in the order the network took them.
    order: Arc<AtomicU64>,
    /// Most operations in flight per endpoint before a post answers `WouldBlock`.
    max_in_flight: usize,
}

impl std::fmt::Debug for MemNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemNet")
            .field("ranks", &self.ports.len())
            .finish_non_exhaustive()
    }
}

/// Locks `m`; a panicking test thread must not hide the others' results.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemNet {
    /// A network of `num_ranks` endpoints, with no bound on operations in flight.
    pub fn new(num_ranks: usize) -> MemNet {
        MemNet::with_max_in_flight(num_ranks, usize::MAX)
    }

    /// A network whose endpoints answer `WouldBlock` past `max_in_flight` operations
    /// posted and not yet completed.
    pub fn with_max_in_flight(num_ranks: usize, max_in_flight: usize) -> MemNet {
        MemNet {
            ports: (0..num_ranks).map(|_| Port::default()).collect(),
            order: Arc::new(AtomicU64::new(0)),
            max_in_flight: max_in_flight.max(1),
        }
    }

    /// The region of `rank`'s endpoint, if it exists.
    fn region(&self, rank: usize) -> Option<Region> {
        self.ports.get(rank).and_then(|p| lock(&p.region).clone())
    }

    /// Rank `rank`'s endpoint, writing from and into `region` (the memory a real
    /// transport would register).
    pub fn endpoint(&self, rank: usize, region: Region) -> MemTransport {
        *lock(&self.ports[rank].region) = Some(region.clone());
        MemTransport {
            rank,
            net: self.clone(),
            region,
            caps: Caps {
                ordered: false,
                native_atomics: false,
                max_write_bytes: 1 << 30,
                provider: "mem".into(),
            },
        }
    }

    /// Every post so far, in posting order.
    pub fn posts(&self) -> Vec<Post> {
        let mut all: Vec<(u64, Post)> = (self.ports.iter())
            .flat_map(|p| lock(&p.posts).clone())
            .collect();
        all.sort_unstable_by_key(|&(n, _)| n);
        all.into_iter().map(|(_, post)| post).collect()
    }

    /// Hold back the send completions of `rank`'s next `n` posts (they arrive at once,
    /// but the sender learns of it only after [`MemNet::release_held`]).
    pub fn hold_completions(&self, rank: usize, n: usize) {
        lock(&self.ports[rank].sent).hold = n;
    }

    /// Complete the posts whose completions were held back.
    pub fn release_held(&self, rank: usize) {
        let mut sent = lock(&self.ports[rank].sent);
        let held = std::mem::take(&mut sent.held);
        sent.done.extend(held);
    }
}

/// One rank's endpoint on a [`MemNet`].
pub struct MemTransport {
    rank: usize,
    net: MemNet,
    region: Region,
    caps: Caps,
}

impl MemTransport {
    fn port(&self) -> &Port {
        &self.net.ports[self.rank]
    }

    /// Deliver a post of `len` bytes (0: a signal) to `peer` at once.
    fn deliver(
        &mut self,
        peer: usize,
        src: u64,
        dst: u64,
        len: usize,
        imm: u32,
        ctx: u64,
    ) -> Result<(), TransportError> {
        let max = self.net.max_in_flight;
        // The sender's lock is held throughout, so its posts keep their order.
        let mut sent = lock(&self.port().sent);
        if sent.in_flight >= max {
            return Err(TransportError::WouldBlock);
        }
        if len > 0 {
            let Some(to) = self.net.region(peer) else {
                return Err(TransportError::Invalid(format!(
                    "mem transport: rank {peer} has no endpoint"
                )));
            };
            to.copy_from(dst as usize, &self.region, src as usize, len)
                .map_err(|e| TransportError::Invalid(format!("mem transport: {e}")))?;
        }
        let n = self.net.order.fetch_add(1, Ordering::Relaxed);
        let post = Post {
            from: self.rank,
            to: peer,
            len,
            imm,
        };
        lock(&self.port().posts).push((n, post));
        // The data is in place before the arrival can be polled.
        lock(&self.net.ports[peer].inbox).push_back(imm);
        sent.in_flight += 1;
        if sent.hold > 0 {
            sent.hold -= 1;
            sent.held.push(ctx);
        } else {
            sent.done.push(ctx);
        }
        Ok(())
    }
}

impl Transport for MemTransport {
    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn local_addr(&self) -> PeerAddr {
        PeerAddr((self.rank as u64).to_le_bytes().to_vec())
    }

    fn connect(&mut self, peers: &[PeerAddr]) -> Result<(), TransportError> {
        let ranks = self.net.ports.len();
        if peers.len() != ranks {
            return Err(TransportError::Invalid(format!(
                "mem transport: {} peer addresses for a network of {ranks}",
                peers.len()
            )));
        }
        Ok(())
    }

    fn validate_write(
        &self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError> {
        // A signal needs only a rank of the network; data needs the peer's region.
        let remote_len = match self.net.region(peer) {
            Some(to) => to.len() as u64,
            None if len == 0 && peer < self.net.ports.len() => 0,
            None => {
                return Err(TransportError::Invalid(format!(
                    "mem transport: rank {peer} has no endpoint"
                )))
            }
        };
        let len = len as u64;
        check_range(
            Side::Local,
            peer,
            local_off,
            remote_off,
            len,
            self.region.len() as u64,
        )?;
        check_range(Side::Remote, peer, local_off, remote_off, len, remote_len)
    }

    fn post_write(&mut self, op: WriteOp) -> Result<(), TransportError> {
        let WriteOp {
            peer,
            local_off,
            remote_off,
            len,
            imm,
            ctx,
        } = op;
        self.validate_write(peer, local_off, remote_off, len)?;
        self.deliver(peer, local_off, remote_off, len, imm, ctx)
    }

    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError> {
        self.validate_write(peer, 0, 0, 0)?;
        self.deliver(peer, 0, 0, 0, imm, ctx)
    }

    fn post_atomic_add(&mut self, _: usize, _: u64, _: u64, _: u64) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            op: "post_atomic_add",
            provider: "mem".into(),
            why: "the in-memory network has no remote atomics (the proxy emulates them)".into(),
        })
    }

    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        let mut sent = lock(&self.port().sent);
        let done = std::mem::take(&mut sent.done);
        sent.in_flight -= done.len();
        out.extend(done.iter().map(|&ctx| Completion::Write { ctx }));
        Ok(done.len())
    }

    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut inbox = lock(&self.port().inbox);
        let n = inbox.len();
        out.extend(inbox.drain(..).map(|imm| Arrival { imm }));
        Ok(n)
    }
}
