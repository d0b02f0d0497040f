//! The network path across a rejoin (`elastic::join`): the survivors readmit a new
//! process of a rank, and the new process builds its path from the door instead of a
//! control plane.
//!
//! Both sides start the pair's state from zero: the survivors' proxies forget the old
//! process ([`uep_proxy::Proxy::readmit`]: streams, fences, counters) and this path its
//! counts of packets and signals from and to it; the new process starts with nothing
//! sent or received. Barrier numbers are the job's, not the pair's: the new process
//! starts its barrier counters at the job's count. The survivors connect their
//! liveness watch to the new process, which listens for them from before it asks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use uep_fifo::FifoAlloc;
use uep_shm::Region;
use uep_transport::{PeerAddr, Transport};

use super::{connect_endpoints, open_endpoints, own_host, NetPath, Parts, CHANNELS};
use crate::area::Mem;
use crate::config::NetConfig;
use crate::door::Reach;
use crate::error::{EpError, Result};
use crate::liveness::Listening;
use crate::map::NetAreas;
use crate::topology::Topology;

impl NetPath {
    /// How this rank is reached across nodes: its endpoints, for the door.
    pub(crate) fn reach(&self) -> Reach {
        Reach {
            addrs: self.addrs.iter().map(|a| a.0.clone()).collect(),
            watch: None,
            host: self.hosts[self.me].clone(),
        }
    }

    /// A new process took rank `rank` (it is masked here, its old process gone, and it
    /// sends nothing until this returns): reach it at `reach` from now on, with every
    /// count of the pair from zero, and watch it.
    pub(crate) fn readmit(&self, rank: usize, reach: &Reach, deadline: Instant) -> Result<()> {
        let (me, r_n) = (self.me, self.num_ranks);
        let watch = reach.watch.as_ref().ok_or_else(|| {
            EpError::Protocol(format!(
                "rank {me}: rank {rank}'s replacement did not say where its liveness watch listens"
            ))
        })?;
        let addrs: Vec<PeerAddr> = reach.addrs.iter().cloned().map(PeerAddr).collect();
        self.proxy
            .readmit(rank, &addrs)
            .map_err(|source| EpError::Proxy {
                rank: me,
                source: Box::new(source),
            })?;
        self.received[rank].set(0);
        for ch in 0..CHANNELS {
            self.fenced[ch * r_n + rank].set(0);
            self.quiets.borrow_mut()[ch * r_n + rank] = None;
        }
        // Laid out `[key][source]`.
        for expected in self.fences_expected.iter().skip(rank).step_by(r_n) {
            expected.set(0);
        }
        let node = rank / self.ranks_per_node;
        let host = self.hosts.get(rank).cloned().unwrap_or_default();
        self.liveness
            .readmit(me, (rank, node, &host), watch, deadline)
    }
}

/// A joiner's network side before it is let in: its endpoints, connected to the
/// members' as the door names them, and its liveness watch's listener, both of which
/// the survivors connect to when they let it in.
pub(crate) struct Joining {
    me: usize,
    transports: Vec<Box<dyn Transport>>,
    /// `[thread][rank]`: the addresses the endpoints were pointed at.
    peers: Vec<Vec<PeerAddr>>,
    listening: Listening,
    faults: Arc<AtomicU64>,
    host: String,
    /// `[rank]`: the members' hosts, as the door names them (for messages).
    hosts: Vec<String>,
}

impl Joining {
    /// Open rank `me`'s endpoints over `region`, one per proxy thread of the job
    /// (`peers[t]`: every rank's endpoint of thread `t`, as the door names them).
    pub(crate) fn open(
        me: usize,
        region: &Region,
        cfg: &NetConfig,
        peers: &[Vec<PeerAddr>],
    ) -> Result<Joining> {
        let host = own_host(cfg);
        let listening = Listening::new(me, &host)?;
        let endpoints = open_endpoints(me, region, cfg)?;
        let faults = Arc::new(AtomicU64::new(0));
        let transports = connect_endpoints(me, endpoints, peers, cfg, &faults)?;
        Ok(Joining {
            me,
            transports,
            peers: peers.to_vec(),
            listening,
            faults,
            hosts: vec![String::new(); peers.first().map_or(0, Vec::len)],
            host,
        })
    }

    /// Point the endpoints at `peers` (`[thread][rank]`, as the door names them once
    /// this joiner was let in) where they changed since it opened: a rank that itself
    /// rejoined meanwhile. Nothing was sent yet, so nothing else changes.
    pub(crate) fn refresh(&mut self, peers: &[Vec<PeerAddr>]) -> Result<()> {
        let me = self.me;
        let known = self.transports.iter_mut().zip(&mut self.peers);
        for ((tr, known), peers) in known.zip(peers) {
            for (r, (was, addr)) in known.iter_mut().zip(peers).enumerate() {
                if r == me || addr.0.is_empty() || was == addr {
                    continue;
                }
                tr.replace_peer(r, addr)
                    .map_err(|source| EpError::Transport {
                        context: format!("rank {me}: reaching rank {r}, which rejoined"),
                        source: Box::new(source),
                    })?;
                *was = addr.clone();
            }
        }
        Ok(())
    }

    /// The members' hosts (`None`: unnamed), which name them in messages.
    pub(crate) fn name_hosts(&mut self, hosts: impl Iterator<Item = Option<String>>) {
        self.hosts = hosts.map(Option::unwrap_or_default).collect();
    }

    /// How the survivors reach this joiner: its endpoints and its watch.
    pub(crate) fn reach(&self) -> Reach {
        Reach {
            addrs: (self.transports.iter()).map(|t| t.local_addr().0).collect(),
            watch: Some(self.listening.advert.clone()),
            host: self.host.clone(),
        }
    }

    /// The joiner's path, once every live rank let it in: its proxy started, the live
    /// ranks of other nodes watched (they connected to it), the `masked` ones given up
    /// on, those that `died` before they let it in lost at once (as a closed watch
    /// would find them), and its barrier counters at the job's `barriers`.
    pub(crate) fn start(
        self,
        (topo, region, areas): (Topology, &Region, NetAreas),
        cfg: &NetConfig,
        fifos: &dyn FifoAlloc,
        (masked, died, barriers): (&[bool], &[Option<u32>], u64),
    ) -> Result<NetPath> {
        let me = topo.rank;
        let remote = |r: usize| r != me && topo.node_of(r) != topo.node;
        let watched: Vec<usize> = (0..topo.num_ranks)
            .filter(|&r| remote(r) && !masked[r] && died[r].is_none())
            .collect();
        let mut hosts = self.hosts;
        hosts.resize(topo.num_ranks, String::new());
        hosts[me] = self.host.clone();
        let liveness =
            (self.listening).accept(&topo, &watched, &hosts, (cfg.liveness, cfg.proxy.timeout))?;
        for (r, pid) in died.iter().enumerate().filter(|&(r, _)| remote(r)) {
            if let Some(pid) = pid {
                let detail = format!("its process {pid} died before it let rank {me} in");
                liveness.lose((r, topo.node_of(r), &hosts[r]), detail);
            }
        }
        for src in 0..topo.num_ranks {
            region
                .word(areas.barriers, src)?
                .store(barriers, Ordering::Release);
        }
        let parts = Parts {
            hosts,
            liveness,
            faults: self.faults,
            transports: self.transports,
        };
        let net = NetPath::assemble(topo, region, areas, cfg, fifos, parts)?;
        for r in (0..topo.num_ranks).filter(|&r| masked[r] || died[r].is_some()) {
            net.mark_lost(r);
        }
        Ok(net)
    }
}
