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

#[derive(Default)]
struct State {
    /// `[rank]`: the endpoint's registered region, once it exists.
    regions: Vec<Option<Region>>,
    /// `[rank]`: arrivals not polled yet.
    inbox: Vec<VecDeque<u32>>,
    /// `[rank]`: send completions not polled yet.
    done: Vec<Vec<u64>>,
    /// `[rank]`: operations posted and not completed (polled) yet.
    in_flight: Vec<usize>,
    /// Every post, in posting order.
    posts: Vec<Post>,
    /// `[rank]`: hold back the completions of the next this-many posts.
    hold: Vec<usize>,
    /// `[rank]`: completions held back.
    held: Vec<Vec<u64>>,
}

/// An in-memory network of `num_ranks` endpoints (one per rank; a proxy with several
/// threads uses one network per thread). Clones share it.
#[derive(Clone)]
pub struct MemNet {
    state: Arc<Mutex<State>>,
    /// Most operations in flight per endpoint before a post answers `WouldBlock`.
    max_in_flight: usize,
}

impl std::fmt::Debug for MemNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemNet")
            .field("ranks", &self.lock().regions.len())
            .finish_non_exhaustive()
    }
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
            state: Arc::new(Mutex::new(State {
                regions: vec![None; num_ranks],
                inbox: vec![VecDeque::new(); num_ranks],
                done: vec![Vec::new(); num_ranks],
                in_flight: vec![0; num_ranks],
                hold: vec![0; num_ranks],
                held: vec![Vec::new(); num_ranks],
                posts: Vec::new(),
            })),
            max_in_flight: max_in_flight.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the others' results.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rank `rank`'s endpoint, writing from and into `region` (the memory a real
    /// transport would register).
    pub fn endpoint(&self, rank: usize, region: Region) -> MemTransport {
        self.lock().regions[rank] = Some(region.clone());
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
        self.lock().posts.clone()
    }

    /// Hold back the send completions of `rank`'s next `n` posts (they arrive at once,
    /// but the sender learns of it only after [`MemNet::release_held`]).
    pub fn hold_completions(&self, rank: usize, n: usize) {
        self.lock().hold[rank] = n;
    }

    /// Complete the posts whose completions were held back.
    pub fn release_held(&self, rank: usize) {
        let mut s = self.lock();
        let held = std::mem::take(&mut s.held[rank]);
        s.done[rank].extend(held);
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
        let mut s = self.net.lock();
        if s.in_flight[self.rank] >= max {
            return Err(TransportError::WouldBlock);
        }
        if len > 0 {
            let Some(Some(to)) = s.regions.get(peer) else {
                return Err(TransportError::Invalid(format!(
                    "mem transport: rank {peer} has no endpoint"
                )));
            };
            to.copy_from(dst as usize, &self.region, src as usize, len)
                .map_err(|e| TransportError::Invalid(format!("mem transport: {e}")))?;
        }
        s.posts.push(Post {
            from: self.rank,
            to: peer,
            len,
            imm,
        });
        s.inbox[peer].push_back(imm);
        s.in_flight[self.rank] += 1;
        if s.hold[self.rank] > 0 {
            s.hold[self.rank] -= 1;
            s.held[self.rank].push(ctx);
        } else {
            s.done[self.rank].push(ctx);
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
        let ranks = self.net.lock().regions.len();
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
        let s = self.net.lock();
        // A signal needs only a rank of the network; data needs the peer's region.
        let remote_len = match s.regions.get(peer) {
            Some(Some(to)) => to.len() as u64,
            Some(None) if len == 0 => 0,
            _ => {
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
        let mut s = self.net.lock();
        let done = std::mem::take(&mut s.done[self.rank]);
        s.in_flight[self.rank] -= done.len();
        out.extend(done.iter().map(|&ctx| Completion::Write { ctx }));
        Ok(done.len())
    }

    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        let mut s = self.net.lock();
        let n = s.inbox[self.rank].len();
        out.extend(s.inbox[self.rank].drain(..).map(|imm| Arrival { imm }));
        Ok(n)
    }
}
