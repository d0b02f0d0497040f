//! The `Buffer`: one per rank, owning the registered memory every EP call works in.
//!
//! Every public call that communicates is *collective* and runs through
//! [`Buffer::collective`], the one place where an error becomes the abort broadcast:
//! the failing rank writes why into every rank of its node (and, through the proxy,
//! of the other nodes), so that nobody waits for it, and every later call on any rank's
//! Buffer fails at once instead of pairing with the wrong call of another rank.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_bootstrap::ControlPlane;
use uep_shm::Region;

use crate::area::Mem;
use crate::config::BufferConfig;
use crate::device::{Device, HostDevice};
use crate::elastic::Elastic;
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::{RegionMap, ABORT_MSG_BYTES};
use crate::net::{NetPath, LL_BUFFERS};
use crate::symm::{Bank, Lease, Symmetric};
use crate::topology::Topology;
use crate::wait::{abort_reason, Peer, Wait};

/// How long a failing rank spends telling the other nodes (its own deadline if shorter).
/// It raises only after, and survivors promise to raise within two seconds of a death;
/// a peer this misses still learns from its liveness watch once this rank exits. (At
/// 2 s, a write to a peer that was itself exiting once held a survivor's report to
/// 2.4 s in CI.)
const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a Buffer that told other nodes of a failure keeps its proxy when dropped.
const ABORT_LINGER: Duration = Duration::from_millis(300);

/// Sequence numbers of the collective calls; equal on every rank between calls.
#[derive(Debug, Default)]
pub(crate) struct Seqs {
    pub dispatch: u32,
    pub combine: u32,
    pub ll: u32,
    pub ll_combine: u32,
    pub barrier: u64,
    /// Per LL buffer: a dispatch whose receive (hook) has not run yet.
    pub ll_unreceived: [Option<u32>; LL_BUFFERS],
    /// Per LL combine area: a combine whose receive has not run yet.
    pub ll_combine_unreceived: [Option<u32>; LL_BUFFERS],
}

/// Output banks that can be leased (see [`Bank`]).
#[derive(Debug)]
pub(crate) struct Banks {
    pub normal: Option<[Bank; 2]>,
    pub ll: Option<[Bank; LL_BUFFERS]>,
}

/// One rank's handle on expert-parallel communication: registered memory mapped by the
/// node's ranks, and the calls of the DeepEP programming model.
pub struct Buffer {
    pub(crate) cp: Arc<dyn ControlPlane>,
    pub(crate) cfg: BufferConfig,
    pub(crate) topo: Topology,
    pub(crate) map: RegionMap,
    pub(crate) symm: Symmetric,
    pub(crate) device: HostDevice,
    /// Identifies this Buffer in the handles it returns.
    pub(crate) id: u64,
    pub(crate) seq: Seqs,
    pub(crate) banks: Banks,
    /// The network path, when some ranks are on other nodes. Its proxy writes into
    /// `symm`'s memory (holding a handle on it): `Drop` stops it first.
    pub(crate) net: Option<NetPath>,
    /// The mask of an elastic Buffer (see [`crate::elastic`]).
    pub(crate) elastic: Option<std::cell::RefCell<Elastic>>,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let Some(net) = self.net.take() else {
            return;
        };
        if net.abort_sent() || abort_reason(self.symm.local(), &self.map.control).is_some() {
            // After telling other nodes of a failure, keep the proxy a moment: a send
            // completion only says the bytes left; closing the connections at once could
            // lose them. No drain: a failed job's peers may never complete anything.
            if net.abort_in_flight() {
                std::thread::sleep(ABORT_LINGER);
            }
            drop(net);
        } else {
            net.shutdown();
        }
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("topology", &self.topo)
            .field("cfg", &self.cfg)
            .field("bytes", &self.map.total)
            .finish_non_exhaustive()
    }
}

impl Buffer {
    /// Create this rank's registered memory, map the node's peers, connect the other
    /// nodes, and synchronise. Collective: every rank of the control plane calls it with
    /// the same shapes.
    pub fn new<C: ControlPlane + 'static>(cp: C, cfg: BufferConfig) -> Result<Buffer> {
        Buffer::with_control_plane(Arc::new(cp), cfg)
    }

    /// [`Buffer::new`] on a shared control plane.
    pub fn with_control_plane(cp: Arc<dyn ControlPlane>, cfg: BufferConfig) -> Result<Buffer> {
        let (rank, num_ranks) = (cp.rank(), cp.world_size());
        if let Err(e) = cfg.validate(num_ranks) {
            cp.abort(&e.to_string());
            return Err(e);
        }
        // Hosts (which ranks share memory) and a job id for the segment names, in one
        // exchange.
        let token = rand::random::<u64>();
        let hello = format!("{token:016x} {}", uep_bootstrap::host_id());
        let hellos = cp.all_gather(hello.as_bytes())?;
        let hellos: Vec<String> = hellos
            .iter()
            .map(|h| String::from_utf8_lossy(h).into_owned())
            .collect();
        let job = hellos[0].split(' ').next().unwrap_or("0").to_string();
        let hosts: Vec<String> = hellos
            .iter()
            .map(|h| h.split_once(' ').map_or("", |(_, host)| host).to_string())
            .collect();
        let topo = Topology::from_hosts(rank, &hosts, cfg.ranks_per_node)?;
        let map = RegionMap::new(&cfg, num_ranks, topo.num_nodes > 1);
        // Every rank must agree on the shapes: compare them first, so a mismatch is a
        // clear error rather than a size mismatch of segments.
        let fingerprint = cfg.fingerprint(map.total);
        let all = cp.all_gather(fingerprint.as_bytes())?;
        if let Some((peer, other)) = all
            .iter()
            .enumerate()
            .find(|(_, f)| f.as_slice() != fingerprint.as_bytes())
        {
            return Err(invalid!(
                "rank {rank} and rank {peer} were given different Buffer configs: {fingerprint} vs {}",
                String::from_utf8_lossy(other)
            ));
        }
        let name = uep_shm::segment_name(&job, rank, std::process::id());
        let own = uep_shm::Segment::create(&name, map.total);
        // Everyone takes part in every exchange, failed or not, so nobody waits.
        let names = cp.all_gather(own.as_ref().map(|_| name.as_bytes()).unwrap_or(b""))?;
        let own = own?;
        own.region()
            .word(map.control.pid, 0)?
            .store(std::process::id() as u64, Ordering::Release);
        let names: Vec<String> = names
            .iter()
            .map(|n| String::from_utf8_lossy(n).into_owned())
            .collect();
        if let Some(peer) = names.iter().position(String::is_empty) {
            return Err(EpError::Resource(format!(
                "rank {peer} could not create its shared memory segment of {} bytes",
                map.total
            )));
        }
        let local: Vec<usize> = topo.node_ranks(topo.node).collect();
        let symm = Symmetric::map_peers(rank, own, &names, &local, map.total, cfg.timeout);
        // Everyone has mapped everything (or failed) past this exchange; then the names go.
        let verdicts = cp.all_gather(&[symm.is_ok() as u8])?;
        let mut symm = symm?;
        if let Some(peer) = verdicts.iter().position(|v| v.first() != Some(&1)) {
            return Err(EpError::Resource(format!(
                "rank {peer} could not map the shared memory of its node"
            )));
        }
        symm.unlink()?;
        // An elastic job's proxies outlive a peer's failure.
        let mut net_cfg = cfg.net.clone();
        net_cfg.proxy.elastic |= cfg.elastic;
        let device = HostDevice::new(cfg.device_threads);
        let net = match map.net {
            Some(areas) if topo.num_nodes > 1 => Some(NetPath::start(
                cp.as_ref(),
                topo,
                symm.local(),
                areas,
                &net_cfg,
                device.fifo_alloc(),
            )?),
            _ => None,
        };
        let banks = Banks {
            normal: map
                .normal
                .map(|n| [Bank::new(n.banks[0].area), Bank::new(n.banks[1].area)]),
            ll: map.ll.map(|ll| ll.map(|a| Bank::new(a.bank))),
        };
        let elastic = cfg
            .elastic
            .then(|| std::cell::RefCell::new(Elastic::new(num_ranks)));
        Ok(Buffer {
            device,
            cp,
            topo,
            map,
            symm,
            id: rand::random::<u64>() ^ ((rank as u64) << 48) ^ std::process::id() as u64,
            cfg,
            seq: Seqs::default(),
            banks,
            net,
            elastic,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.topo.rank
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.topo.num_ranks
    }

    /// Where the ranks sit (nodes, this rank's node and index).
    pub fn topology(&self) -> Topology {
        self.topo
    }

    /// The config.
    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    /// Bytes of registered memory this rank owns.
    pub fn bytes(&self) -> usize {
        self.map.total
    }

    /// Set the deadline of every wait.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.cfg.timeout = timeout;
    }

    /// The control plane (for out-of-band collectives such as result checks).
    pub fn control_plane(&self) -> &dyn ControlPlane {
        self.cp.as_ref()
    }

    /// Bytes this rank has handed to its proxy for ranks on other nodes so far: every
    /// packet (token rows, their metadata and headers), as sent, not as computed.
    pub fn net_bytes_sent(&self) -> u64 {
        self.net.as_ref().map_or(0, NetPath::sent_bytes)
    }

    /// Keeps this rank's registered memory mapped while held, even past the Buffer:
    /// for a binding that hands a view of it (the combine buffer) to code that keeps it.
    pub fn memory_keepalive(&self) -> std::sync::Arc<dyn std::any::Any + Send + Sync> {
        self.symm.local().keepalive()
    }

    /// The addresses of this rank's registered memory, for a binding to check that a
    /// caller's output does not overlap what the Buffer reads (the combine buffer).
    pub fn memory_span(&self) -> std::ops::Range<usize> {
        let local = self.symm.local();
        local.as_ptr() as usize..local.as_ptr() as usize + local.len()
    }

    /// Faults injected into this rank's network path so far (see `NetConfig::faults`).
    pub fn faults_injected(&self) -> u64 {
        self.net.as_ref().map_or(0, NetPath::faults_injected)
    }

    /// The outputs of the normal dispatch `handle` describes (x, scales, top-k ids,
    /// weights; empty ranges where it carried none), mapped to outlive the Buffer's
    /// next calls: for callers that hand outputs to code that keeps them (the Python
    /// package's tensors). Without a copy; an output still held when its bank is
    /// reused is copied then (see [`Bank`]).
    pub fn lease_dispatch(&mut self, handle: &crate::NormalHandle) -> Result<Lease> {
        if handle.buffer_id != self.id {
            return Err(invalid!(
                "the handle was made by another Buffer (or another rank)"
            ));
        }
        let parts = self.dispatch_areas(handle)?;
        let banks = self
            .banks
            .normal
            .as_mut()
            .ok_or_else(|| invalid!("this Buffer has no normal-mode buffers"))?;
        Lease::of(&mut banks[handle.bank], &self.symm, &parts, &parts)
    }

    /// The rows and column-major scales (empty for bf16) of low-latency buffer `buffer`
    /// with `fp8` rows, mapped to outlive the Buffer's next calls (see
    /// [`Buffer::lease_dispatch`]). With `handle`, only its valid rows are kept when the
    /// bank is reused while held; without (leased before the receive), all of them.
    pub fn lease_ll(
        &mut self,
        buffer: usize,
        fp8: bool,
        handle: Option<&crate::LlHandle>,
    ) -> Result<Lease> {
        let areas = self.ll_areas(buffer)?;
        let s = areas.shape;
        let (r_n, m) = (self.topo.num_ranks, s.max_tokens);
        let rows_per_expert = r_n * m;
        let epr = s.experts_per_rank(r_n);
        let (rb, groups) = if fp8 {
            (s.hidden, s.hidden / 128)
        } else {
            (2 * s.hidden, 0)
        };
        let x = areas.recv_x.prefix(epr * rows_per_expert * rb)?;
        let scales = areas
            .out_scales
            .prefix(epr * rows_per_expert * groups)?
            .cast::<u8>();
        let mut keep = Vec::new();
        match handle {
            Some(h) => {
                for (le, &n) in h.recv_count.iter().enumerate() {
                    let first = le * rows_per_expert;
                    keep.push(x.slice(first * rb..(first + n as usize) * rb)?);
                    for g in 0..groups {
                        let at = (le * groups + g) * rows_per_expert;
                        keep.push(areas.out_scales.slice(at..at + n as usize)?.cast());
                    }
                }
            }
            None => keep.extend([x, scales]),
        }
        let banks = self
            .banks
            .ll
            .as_mut()
            .ok_or_else(|| invalid!("this Buffer has no low-latency buffers"))?;
        Lease::of(
            &mut banks[buffer % LL_BUFFERS],
            &self.symm,
            &[x, scales],
            &keep,
        )
    }

    /// The waits of a call starting now.
    pub(crate) fn wait(&self) -> Wait<'_> {
        Wait::new(
            self.cfg.timeout,
            self.symm.local(),
            &self.map.control,
            self.net.as_ref().map(|n| n as &dyn crate::wait::Remote),
        )
    }

    /// Who `rank` is for a wait: its region when it shares this host (so that its
    /// process is watched).
    pub(crate) fn peer(&self, rank: usize) -> Peer<'_> {
        Peer {
            rank,
            region: self.symm.peer(rank),
        }
    }

    /// The region of `peer` (a rank of this node).
    pub(crate) fn peer_region(&self, peer: usize) -> Result<&Region> {
        self.symm.peer(peer).ok_or_else(|| {
            EpError::internal(format!(
                "rank {peer} shares no memory with rank {}",
                self.topo.rank
            ))
        })
    }

    /// The network path (several nodes only).
    pub(crate) fn net(&self) -> Result<&NetPath> {
        self.net.as_ref().ok_or_else(|| {
            EpError::internal(format!(
                "rank {} has no network path (one node)",
                self.topo.rank
            ))
        })
    }

    /// Run one collective call `f`: refuse it on a Buffer whose job already failed, and
    /// turn its error into the abort broadcast, unless every rank found it together
    /// ([`EpError::Capacity`]).
    pub(crate) fn collective<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.ensure_usable()?;
        f(self).map_err(|e| {
            if !matches!(e, EpError::Capacity { .. } | EpError::Unusable { .. }) {
                self.broadcast_failure(&e);
            }
            e
        })
    }

    /// Calls after a failure would pair with the wrong calls of other ranks: refuse them.
    fn ensure_usable(&self) -> Result<()> {
        match abort_reason(self.symm.local(), &self.map.control) {
            None => Ok(()),
            Some((peer, reason)) => Err(EpError::Unusable {
                rank: self.topo.rank,
                peer,
                reason,
            }),
        }
    }

    /// Tell every rank that this one failed with `e`: its message and (if no rank failed
    /// first) its abort word into every region of the node, this rank's included, and
    /// through the proxy into the regions of the other nodes.
    fn broadcast_failure(&self, e: &EpError) {
        let me = self.topo.rank;
        let mut bytes = format!("rank {me}: {e}").into_bytes();
        // Cut at a character boundary; the reader stops at the first 0.
        bytes.truncate(ABORT_MSG_BYTES - 1);
        while std::str::from_utf8(&bytes).is_err() {
            bytes.pop();
        }
        bytes.push(0);
        let Ok(slot) = self.map.control.abort_msg_of(me) else {
            return;
        };
        for peer in self.topo.node_ranks(self.topo.node) {
            let Some(region) = self.symm.peer(peer) else {
                continue;
            };
            if region.put(slot, &bytes).is_ok() {
                if let Ok(word) = region.word(self.map.control.abort, 0) {
                    let _ = word.compare_exchange(
                        0,
                        me as u64 + 1,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
            }
        }
        // Only the rank that failed first tells the other nodes: the others of its node
        // share its abort word, and the ranks of other nodes hear it from it.
        let origin = self
            .symm
            .local()
            .word(self.map.control.abort, 0)
            .is_ok_and(|w| w.load(Ordering::Acquire) == me as u64 + 1);
        if let (Some(net), true) = (&self.net, origin) {
            let remote: Vec<usize> = (0..self.topo.num_ranks)
                .filter(|&r| !self.topo.is_local(r))
                .collect();
            let wait = self.wait().sooner(Instant::now() + ABORT_SEND_TIMEOUT);
            if let Err(why) = net.send_abort(&self.map.control, &remote, &wait) {
                tracing::warn!(rank = me, "could not tell the other nodes: {why}");
            }
        }
    }

    /// Give up on this job: tell every rank that this one failed because of `reason`
    /// (their waits end with it, and their later calls fail), as a call that rejects
    /// its input does. For callers that check input before entering a collective call
    /// (the Python package). Returns the error that was broadcast.
    pub fn abort(&mut self, reason: &str) -> EpError {
        let e = invalid!("{reason}");
        if self.ensure_usable().is_ok() {
            self.broadcast_failure(&e);
        }
        self.cp.abort(reason);
        e
    }

    /// A barrier over all ranks, hierarchical: release stores among the node's ranks;
    /// on several nodes the node leaders (local rank 0) then meet through the proxy's
    /// barrier (zero-length writes carrying a barrier immediate) and release their node.
    ///
    /// On an elastic Buffer it is an agreement round instead (every rank not masked
    /// meets every other), which also spreads the mask.
    pub fn barrier(&mut self) -> Result<()> {
        self.collective(|b| {
            if b.elastic.is_some() {
                return b.agree("barrier").map(drop);
            }
            b.seq.barrier += 1;
            b.barrier_phases(b.seq.barrier)
        })
    }

    fn barrier_phases(&self, seq: u64) -> Result<()> {
        let (me, topo, c) = (self.topo.rank, self.topo, &self.map.control);
        let wait = self.wait();
        for peer in topo.node_ranks(topo.node) {
            self.peer_region(peer)?
                .word(c.barrier, me)?
                .store(seq, Ordering::Release);
        }
        let local = self.symm.local();
        for peer in topo.node_ranks(topo.node) {
            let what =
                || format!("rank {me}: barrier {seq}: waiting for rank {peer} (barrier[{peer}])");
            wait.at_least(
                local.word(c.barrier, peer)?,
                seq,
                Some(self.peer(peer)),
                &what,
            )?;
        }
        if topo.num_nodes == 1 {
            return Ok(());
        }
        let leader = topo.node * topo.ranks_per_node;
        if me == leader {
            self.net()?.barrier(seq, &wait)?;
            for peer in topo.node_ranks(topo.node).filter(|&p| p != me) {
                self.peer_region(peer)?
                    .word(c.barrier_release, 0)?
                    .store(seq, Ordering::Release);
            }
        } else {
            let what = || {
                format!("rank {me}: barrier {seq}: waiting for rank {leader} to meet the other nodes (barrier_release)")
            };
            wait.at_least(
                local.word(c.barrier_release, 0)?,
                seq,
                Some(self.peer(leader)),
                &what,
            )?;
        }
        Ok(())
    }
}
