//! Rejoin: a process started to replace a masked rank takes its place in a running job.
//!
//! 1. **The joiner** ([`Buffer::join`](crate::Buffer::join)) opens the job's door
//!    ([`door`](crate::door)), makes its own segment, maps its node's survivors' (their
//!    names are at the door), and, in a job of several nodes, opens its endpoints
//!    (connected to the members' the door names) and its liveness listener
//!    ([`crate::net::Joining`]); then it posts a request: its process, segment and
//!    endpoints.
//! 2. **Each survivor**, at every agreement that may let ranks in (after a combine, or a
//!    barrier) and while some rank is gone, reads the door: for a live requester (if
//!    its caller admits that rank, [`Buffer::admit`](crate::Buffer::admit), or lets
//!    everyone in) it maps its segment (same node) or reads its endpoints (another
//!    node), and from then on proposes the lowest such rank *unmasked*, none while one
//!    waits to be let in.
//! 3. **The agreement decides.** It decides the union of the proposals, so the rank
//!    leaves the decided mask only once every survivor proposed it unmasked: then all
//!    survivors let it in at the same call, one joiner at a time, and a survivor that
//!    has not mapped it yet only delays the decision. The call of that agreement still
//!    runs without it.
//! 4. **The first dispatch (or barrier) after**, with no low-latency call waiting for
//!    its receive, every survivor puts the joiner's region in its predecessor's place
//!    (same node) or readmits it on its network path (another node:
//!    `NetPath::readmit`), forgets the predecessor's masking, writes the same welcome at
//!    the door (the call numbers, agreements, the mask and the caller's step), and
//!    says it is ready. The joiner reads the welcome, waits until every live rank is
//!    ready (or died since: that one is lost to it from the start, as it is to the
//!    survivors), starts its network path, returns from `join`, and makes that call
//!    with them.
//!
//! A joiner that dies before it is let in is dropped (its process is watched); after,
//! it is a rank like any other, masked again by the next wait on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_bootstrap::{BootstrapError, ControlPlane};
use uep_shm::Region;
use uep_transport::PeerAddr;

use crate::area::Mem;
use crate::config::{BufferConfig, JobStore};
use crate::ctx::Ctx;
use crate::device::Device;
use crate::door::{Calls, Door, FirstCall, Process, Reach, Welcome};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::RegionMap;
use crate::mask::{Elastic, Joiner};
use crate::net::Joining;
use crate::symm::{MemHandle, Symmetric, SymmetricAlloc};
use crate::topology::Topology;
use crate::wait::LostElsewhere;

/// The digest of the config every rank must share: the door's check of a joiner.
pub(crate) fn config_digest(fingerprint: &str) -> u64 {
    crate::fnv::hash(fingerprint.bytes().map(u64::from))
}

impl Ctx {
    /// Before an agreement that may let ranks in: map the segments of new requesters
    /// for ranks masked by the agreements whose process is gone (a rank some other
    /// survivor found dead is masked here by the agreement alone), if the caller admits
    /// them; drop requesters that died.
    pub(crate) fn read_door(&self) -> Result<()> {
        let (Some(door), Some(el)) = (&self.door, &self.elastic) else {
            return Ok(());
        };
        if !door.worth_a_look() {
            return Ok(());
        }
        let mut e = el.borrow_mut();
        for r in 0..self.topo.num_ranks {
            if !(e.masked[r] && e.agreed[r]) || e.doorway.let_in[r].is_some() {
                continue;
            }
            if let Some(j) = &e.doorway.asking[r] {
                if j.process.gone() == Some(true) {
                    tracing::warn!(rank = self.topo.rank, "rank {r}'s replacement died asking");
                    self.device.symmetric_alloc().forget(&j.handle);
                    e.doorway.asking[r] = None;
                }
                continue;
            }
            let Some(req) = door.request(r)? else {
                continue;
            };
            // Cheap tests first: this runs at every combine while a rank is masked.
            let wanted = e.doorway.auto || e.doorway.admit[r];
            // A joiner on another host is taken as alive: if it died, the first wait
            // on it after it is let in masks it again.
            let gone = req.process.gone() == Some(true);
            if req.stamp == e.doorway.answered[r] || !wanted || gone {
                continue;
            }
            if !member_gone(door, r)? {
                tracing::debug!(
                    rank = self.topo.rank,
                    "rank {r} is masked but its process lives: its replacement waits"
                );
                continue;
            }
            match self.reach_joiner(door, r, &req.handle) {
                Ok(Some((region, reach))) => {
                    e.doorway.asking[r] = Some(Joiner {
                        stamp: req.stamp,
                        process: req.process,
                        handle: req.handle,
                        region,
                        reach,
                    })
                }
                Ok(None) => {}
                Err(err) => tracing::warn!(
                    rank = self.topo.rank,
                    "cannot reach rank {r}'s replacement: {err}"
                ),
            }
        }
        Ok(())
    }

    /// What this rank needs of the joiner of `rank` whose memory opens by `handle`: it
    /// mapped (on this node) and how it is reached across nodes (a job of several
    /// nodes; `None` until its request carries it).
    fn reach_joiner(
        &self,
        door: &Door,
        rank: usize,
        handle: &MemHandle,
    ) -> Result<Option<(Option<Region>, Option<Reach>)>> {
        let reach = match self.topo.num_nodes > 1 {
            true => match door.asking_reach(rank)? {
                Some(reach) => Some(reach),
                None => return Ok(None),
            },
            false => None,
        };
        let region = match self.topo.is_local(rank) {
            true => Some(self.device.symmetric_alloc().open(
                handle,
                self.map.total,
                Duration::ZERO,
            )?),
            false => None,
        };
        Ok(Some((region, reach)))
    }

    /// The joiners let in by the decided mask `union` of an agreement that may let ranks
    /// in: every survivor proposed them unmasked. They take part from the next dispatch
    /// or barrier ([`Ctx::let_in`]).
    pub(crate) fn decide_joiners(e: &mut Elastic, union: &[bool], admits: bool) {
        let d = &mut e.doorway;
        for ((asking, let_in), &masked) in d.asking.iter_mut().zip(&mut d.let_in).zip(union) {
            if admits && !masked && asking.is_some() {
                *let_in = asking.take();
            }
        }
    }

    /// At a dispatch or barrier with no low-latency call waiting for its receive: the
    /// ranks let in take part from this call (module docs, step 4).
    pub(crate) fn let_in(&mut self, first: FirstCall, calls: Calls) -> Result<()> {
        let Some(el) = &self.elastic else {
            return Ok(());
        };
        // Until the next let-in: nobody let in at this call waits any more.
        *self.said_lost.borrow_mut() = None;
        let mut e = el.borrow_mut();
        if !e.doorway.waiting() {
            return Ok(());
        }
        let joiners: Vec<(usize, Joiner)> = (0..self.topo.num_ranks)
            .filter_map(|r| e.doorway.let_in[r].take().map(|j| (r, j)))
            .collect();
        let deadline = Instant::now() + self.cfg.timeout;
        for (r, j) in &joiners {
            match (&j.region, &j.reach) {
                (Some(region), _) => self.symm.replace_peer(*r, region.clone()),
                (None, Some(reach)) => self.net()?.readmit(*r, reach, deadline)?,
                (None, None) => {
                    return Err(EpError::internal(format!(
                        "rank {r}'s joiner is not reached"
                    )))
                }
            }
            e.readmit(*r);
            e.decided_base[*r] = e.round;
            e.doorway.answered[*r] = j.stamp;
            e.doorway.admit[*r] = false;
            tracing::info!(
                rank = self.topo.rank,
                "rank {r} rejoins (process {})",
                j.process.pid
            );
        }
        let welcome = Welcome {
            round: e.round,
            digest: e.digest,
            calls,
            step: e.doorway.step,
            first,
            masked: e.masked.clone(),
        };
        let door = self
            .door
            .as_ref()
            .ok_or_else(|| EpError::internal("no door".into()))?;
        // Every joiner's segment is named before any joiner reads its welcome (and
        // maps the others by those names).
        for (r, j) in &joiners {
            door.set_member(*r, j.process, &j.handle)?;
            if let Some(reach) = &j.reach {
                door.set_reach(*r, &reach.as_member())?;
            }
        }
        // The joiners wait for every live rank to be ready; one that dies first is said
        // lost at the door by the waits of this call (`LostElsewhere`).
        *self.said_lost.borrow_mut() = Some(vec![false; self.topo.num_ranks]);
        for (r, j) in &joiners {
            door.welcome(*r, j.stamp, &welcome)?;
            // Ready for its traffic: everything above is done on this rank.
            door.ready(*r, self.topo.rank, j.stamp)?;
        }
        Ok(())
    }

    /// The caller admits a replacement of `rank` (`Buffer::admit`).
    pub(crate) fn admit(&self, rank: usize) -> Result<()> {
        let el = self.elastic_state()?;
        if self.door.is_none() || rank >= self.topo.num_ranks || rank == self.topo.rank {
            return Err(invalid!(
                "rank {} cannot admit rank {rank}: admitting needs a door (BufferConfig::door) \
                 and another rank of the job's {}",
                self.topo.rank,
                self.topo.num_ranks
            ));
        }
        el.borrow_mut().doorway.admit[rank] = true;
        Ok(())
    }

    /// The caller's step (`Buffer::set_step`).
    pub(crate) fn set_step(&self, step: u64) {
        if let Some(el) = &self.elastic {
            el.borrow_mut().doorway.step = step;
        }
    }

    /// The Buffer closes: the lowest rank not masked removes the door's name (the job
    /// ends; nobody can join it any more), and the job's segment names whose process is
    /// gone: a node that died whole has no rank left to remove its ranks', and a
    /// replacement killed before it asked is named nowhere but there.
    pub(crate) fn close_door(&mut self) {
        let me = self.topo.rank;
        let lowest = (0..me).all(|r| self.masked(r));
        // Each host's segment names are removed there: by the lowest live rank of each node.
        let node = self.topo.node_ranks(self.topo.node);
        let node_lowest = node.take_while(|&r| r < me).all(|r| self.masked(r));
        let Some(door) = self.door.as_mut().filter(|_| node_lowest) else {
            return;
        };
        if let Ok(h) = door.header() {
            self.device.symmetric_alloc().forget_dead(h.job);
        }
        if !lowest {
            return;
        }
        if let Err(e) = door.close() {
            tracing::warn!(rank = me, "{e}");
        }
    }

    /// A rank found gone: the door says so, for a joiner that may still wait for it to
    /// be ready (a joiner on another host cannot ask about its process); on this node
    /// its segment's name goes too (a joiner must not map it, and nobody else removes
    /// it).
    pub(crate) fn member_lost(&self, rank: usize) {
        if let Some((p, handle)) = self.say_lost(rank) {
            if self.topo.is_local(rank) && p.here() {
                self.device.symmetric_alloc().forget(&handle);
            }
        }
    }

    /// Write at the door that the process it names for `rank` is lost; that process.
    fn say_lost(&self, rank: usize) -> Option<(Process, MemHandle)> {
        let door = self.door.as_ref()?;
        let (p, handle) = door.member(rank).ok().flatten()?;
        if let Err(e) = door.set_lost(rank, p) {
            tracing::warn!(
                rank = self.topo.rank,
                "saying at the door that rank {rank} is lost: {e}"
            );
        }
        Some((p, handle))
    }
}

impl LostElsewhere for Ctx {
    /// While a joiner let in at this call may still wait for the survivors to be ready,
    /// every live rank found lost (by the watch, or on this node by its process) is said
    /// lost at the door, once: the joiner may wait for it while this rank waits for the
    /// joiner. Masking it stays the business of the wait on it.
    fn lost_elsewhere(&self) {
        let mut said = self.said_lost.borrow_mut();
        let Some(said) = said.as_mut() else {
            return;
        };
        // A wait may run while the caller holds the mask (an agreement's): then every
        // rank is looked at, masked or not (saying a dead one lost twice is harmless).
        let masked = (self.elastic.as_ref()).and_then(|e| e.try_borrow().ok());
        let masked = |r: usize| masked.as_ref().is_some_and(|e| e.masked[r]);
        for (r, said) in said.iter_mut().enumerate() {
            if !*said && !masked(r) && self.lost_now(r) {
                *said = true;
                self.say_lost(r);
            }
        }
    }
}

impl Ctx {
    /// Whether `rank` is found lost now: by the watch over other nodes, or (this node)
    /// its process is gone.
    fn lost_now(&self, rank: usize) -> bool {
        if rank == self.topo.rank {
            return false;
        }
        if let Some(region) = self.symm.peer(rank) {
            let dead = crate::wait::dead_process(region, &self.map.control);
            return dead.is_ok_and(|pid| pid.is_some());
        }
        (self.net.as_ref()).is_some_and(|n| n.liveness().lost(rank).is_some())
    }
}

/// Whether the process the door names for `rank` is gone (on another host: the
/// agreement masked it, which is all this host can know).
fn member_gone(door: &Door, rank: usize) -> Result<bool> {
    Ok(door
        .member(rank)?
        .is_none_or(|(p, _)| p.gone() != Some(false)))
}

/// A joiner's control plane: its founding group's collectives are over (it has none
/// to take part in); it tells so instead of hanging.
#[derive(Debug)]
struct Detached {
    rank: usize,
    world: usize,
}

impl ControlPlane for Detached {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_gather(&self, _: &[u8]) -> std::result::Result<Vec<Vec<u8>>, BootstrapError> {
        Err(BootstrapError::External {
            collective: "all_gather",
            reason: format!(
                "rank {} rejoined a running job through its door: it has no control plane",
                self.rank
            ),
        })
    }

    fn abort(&self, _: &str) {}
}

impl BufferConfig {
    /// The config of the elastic job of `world` ranks (its room, reserved ranks
    /// included) at door `name` (in `store`, or on this host), for a process that does
    /// not know its shapes ([`Buffer::join`](crate::Buffer::join)): its shapes, ranks
    /// per node and room, elastic,
    /// with that door; the rest (deadline `timeout`, kernel threads, admission) as
    /// [`BufferConfig::new`] makes them.
    pub fn from_door(
        name: &str,
        store: Option<JobStore>,
        world: usize,
        timeout: Duration,
    ) -> Result<BufferConfig> {
        let at = (name, store.as_ref());
        let door = Door::open(at, world, timeout).map_err(|e| no_job(name, &store, &e))?;
        let h = door.header()?;
        let mut cfg = BufferConfig::new(1, 8, 1, 0, 0);
        (cfg.normal, cfg.ll, cfg.ranks_per_node) = (h.normal, h.ll, h.ranks_per_node);
        cfg.max_ranks = h.max_ranks;
        (cfg.elastic, cfg.door, cfg.door_store) = (true, Some(name.into()), store);
        cfg.timeout = timeout;
        Ok(cfg)
    }
}

fn no_job(name: &str, store: &Option<JobStore>, e: &EpError) -> EpError {
    let place = match store {
        Some(s) => format!("in {:?}", s.0),
        None => "on this host".into(),
    };
    EpError::Resource(format!("no running job at door {name} {place}: {e}"))
}

/// What a joiner needs to know before it asks.
struct Entry {
    door: Door,
    map: RegionMap,
    topo: Topology,
    job: u64,
}

/// Open the door of `cfg` for rank `rank` of `world` and check the job is the one this
/// config describes.
fn enter(cfg: &BufferConfig, rank: usize, world: usize) -> Result<Entry> {
    cfg.validate(world)?;
    let name = match (&cfg.door, cfg.elastic) {
        (Some(name), true) => name,
        _ => {
            return Err(invalid!(
                "joining a job needs elastic mode and its door (BufferConfig::door)"
            ))
        }
    };
    if rank >= world {
        return Err(invalid!("rank {rank} cannot join a job of {world} ranks"));
    }
    let door = Door::open((name.as_str(), cfg.door_store.as_ref()), world, cfg.timeout)
        .map_err(|e| no_job(name, &cfg.door_store, &e))?;
    let h = door.header()?;
    // The job's nodes as its founding ranks found them (from their hosts).
    let topo = Topology::new(rank, world, h.node_ranks)?;
    let map = RegionMap::new(cfg, world, topo.num_nodes > 1);
    if h.digest != config_digest(&cfg.fingerprint(map.total)) || h.bytes != map.total {
        return Err(invalid!(
            "rank {rank} was given another Buffer config than the job at door {name} \
             ({} bytes here, {} there)",
            map.total,
            h.bytes
        ));
    }
    Ok(Entry {
        door,
        map,
        topo,
        job: h.job,
    })
}

/// The joiner's side (module docs, step 1 and the welcome): the context of its Buffer,
/// where the job is, and how long it waited to be let in.
pub(crate) fn join(
    cfg: BufferConfig,
    rank: usize,
    world: usize,
    device: Arc<dyn Device>,
) -> Result<(Ctx, Welcome, Duration)> {
    let Entry {
        door,
        map,
        topo,
        job,
    } = enter(&cfg, rank, world)?;
    let (me, pid) = (Process::me(), std::process::id());
    let alloc = device.symmetric_alloc();
    let (own, handle) = alloc.create(job, rank, map.total)?;
    own.region()
        .word(map.control.pid, 0)?
        .store(pid.into(), std::sync::atomic::Ordering::Release);
    let mut peers = vec![None; world];
    for r in topo.node_ranks(topo.node).filter(|&r| r != rank) {
        peers[r] = map_member((&door, alloc), r, map.total)?;
    }
    // Across nodes: endpoints the survivors connect to when they let this one in.
    let net_cfg = joiner_net(&cfg, &door, topo)?;
    let mut joining = (net_cfg.as_ref())
        .map(|(c, peers)| Joining::open(rank, own.region(), c, peers))
        .transpose()?;
    let asked = Instant::now();
    let reach = joining.as_ref().map(Joining::reach);
    let stamp = door.post_request(rank, (me, &handle), reach.as_ref())?;
    let welcome = wait_welcome(&door, rank, stamp, cfg.timeout)?;
    let died = wait_ready(&door, (rank, stamp), &welcome, cfg.timeout)?;
    // A rank that rejoined since this one opened its endpoints has new ones.
    if let Some(j) = &mut joining {
        let reaches = member_reaches(&door, world)?;
        j.refresh(&member_addrs(&reaches))?;
        j.name_hosts(reaches.iter().map(|r| r.as_ref().map(|r| r.host.clone())));
    }
    let waited = asked.elapsed();
    map_node(
        (&door, alloc),
        (topo, rank),
        (&welcome, &died),
        &mut peers,
        map.total,
    )?;
    let symm = Symmetric::from_parts(rank, own, peers);
    name_the_dead(&symm, &map, &died)?;
    start_words(&symm, &map, &welcome.calls)?;
    let net = match (joining, net_cfg, map.net) {
        (Some(j), Some((c, _)), Some(areas)) => Some(j.start(
            (topo, symm.local(), areas),
            &c,
            device.fifo_alloc(),
            (&welcome.masked, &died, welcome.calls.barriers),
        )?),
        _ => None,
    };
    let e = joiner_state(rank, cfg.auto_admit, &welcome);
    door.set_member(rank, me, &handle)?;
    let cx = Ctx {
        device,
        cp: Arc::new(Detached { rank, world }),
        topo,
        id: rand::random::<u64>() ^ ((rank as u64) << 48) ^ u64::from(pid),
        map,
        symm,
        cfg,
        net,
        elastic: Some(std::cell::RefCell::new(e)),
        door: Some(door),
        said_lost: Default::default(),
    };
    Ok((cx, welcome, waited))
}

/// Map the ranks of the joiner's node that its welcome says are live (those it could
/// not map before it asked, its `peers` still `None`), and a blank region for each one
/// still masked or `died` since: writes to it go nowhere, as they do into a dead rank's
/// memory on the ranks that mapped it alive.
fn map_node(
    (door, alloc): (&Door, &dyn SymmetricAlloc),
    (topo, rank): (Topology, usize),
    (welcome, died): (&Welcome, &[Option<u32>]),
    peers: &mut [Option<Region>],
    bytes: usize,
) -> Result<()> {
    for r in topo.node_ranks(topo.node).filter(|&r| r != rank) {
        if peers[r].is_none() && !welcome.masked[r] && died[r].is_none() {
            peers[r] = map_member((door, alloc), r, bytes)?;
            if peers[r].is_none() {
                let elsewhere = door.member(r)?.is_some_and(|(p, _)| !p.here());
                let why = match elsewhere {
                    true => ", which runs on another host: a rank starts on its node's host",
                    false => "",
                };
                return Err(EpError::Resource(format!(
                    "rank {rank} rejoined, but cannot map the memory of rank {r}{why}"
                )));
            }
        }
        if peers[r].is_none() {
            peers[r] = Some(Region::anonymous(bytes)?);
        }
    }
    Ok(())
}

/// The joiner's elastic state from its welcome: the same mask, agreements and digest
/// as the survivors', and every peer's decisions counted from this agreement on.
fn joiner_state(rank: usize, auto_admit: bool, welcome: &Welcome) -> Elastic {
    let world = welcome.masked.len();
    let mut e = Elastic::new(world, auto_admit);
    for r in (0..world).filter(|&r| welcome.masked[r]) {
        e.mask_absent(r, format!("masked when rank {rank} rejoined"));
    }
    (e.round, e.digest) = (welcome.round, welcome.digest);
    e.decided_base = vec![welcome.round; world];
    e
}

/// A joiner's network config in a job of several nodes, and `[thread][rank]` the
/// members' endpoints as the door names them: as many proxy threads as the founding
/// ranks run (a peer's thread `t` talks to this rank's thread `t`), elastic.
fn joiner_net(
    cfg: &BufferConfig,
    door: &Door,
    topo: Topology,
) -> Result<Option<(crate::config::NetConfig, Vec<Vec<PeerAddr>>)>> {
    if topo.num_nodes == 1 {
        return Ok(None);
    }
    let peers = member_addrs(&member_reaches(door, topo.num_ranks)?);
    if peers.is_empty() {
        return Err(EpError::Protocol(
            "no rank of the job published its network addresses at the door".into(),
        ));
    }
    let threads = peers.len();
    let mut net = cfg.net.clone();
    (net.proxy.threads, net.proxy.elastic) = (threads, true);
    Ok(Some((net, peers)))
}

/// `[rank]`: how each member is reached, as the door names it now.
fn member_reaches(door: &Door, world: usize) -> Result<Vec<Option<Reach>>> {
    (0..world).map(|r| door.reach(r)).collect()
}

/// `[thread][rank]`: every member's endpoint of each proxy thread of the job (as many
/// as the members publish; empty where the door names none).
fn member_addrs(reaches: &[Option<Reach>]) -> Vec<Vec<PeerAddr>> {
    let threads = (reaches.iter().flatten().map(|r| r.addrs.len()).max()).unwrap_or(0);
    let addr = |r: &Option<Reach>, t: usize| r.as_ref().and_then(|r| r.addrs.get(t)).cloned();
    (0..threads)
        .map(|t| {
            (reaches.iter())
                .map(|r| PeerAddr(addr(r, t).unwrap_or_default()))
                .collect()
        })
        .collect()
}

/// Wait until every rank that let this one in (request `stamp`) is ready for its
/// traffic: the live ranks of the welcome but this one. One that died since (its
/// process gone, as this host can tell, or found lost by a survivor, as the door says)
/// is not waited for: `[rank]` the process id of each such, which the call this one
/// makes first finds lost, as the survivors do.
fn wait_ready(
    door: &Door,
    (rank, stamp): (usize, u64),
    w: &Welcome,
    timeout: Duration,
) -> Result<Vec<Option<u32>>> {
    let mut waiting: Vec<usize> = (0..w.masked.len())
        .filter(|&r| r != rank && !w.masked[r])
        .collect();
    let live = waiting.len();
    let mut died = vec![None; w.masked.len()];
    let start = Instant::now();
    let (deadline, mut next_look) = (start + timeout, start + DEATH_LOOKS);
    loop {
        let look = Instant::now() >= next_look;
        let mut still = Vec::with_capacity(waiting.len());
        for r in waiting {
            if door.is_ready(rank, r, stamp)? {
                continue;
            }
            let dead = match look {
                true => died_since(door, r)?,
                false => None,
            };
            match dead {
                Some(pid) => {
                    tracing::warn!(rank, "rank {r} died before it was ready for this one");
                    died[r] = Some(pid);
                }
                None => still.push(r),
            }
        }
        if look {
            next_look = Instant::now() + DEATH_LOOKS;
        }
        waiting = still;
        if waiting.is_empty() {
            return Ok(died);
        }
        if Instant::now() >= deadline {
            return Err(EpError::Timeout {
                what: format!("rank {rank}: waiting for the ranks that let it in"),
                detail: format!("ranks {waiting:?} of the {live} live ranks are not ready for it"),
                waited: timeout,
            });
        }
        std::thread::sleep(door.poll());
    }
}

/// How often a joiner asks whether a survivor it waits for died: two more looks at
/// the door each (at a store, round trips), which every poll would slow the usual
/// case, where all are ready within a few polls.
const DEATH_LOOKS: Duration = Duration::from_millis(20);

/// The process id of rank `r` if the process the door names for it is gone, as its
/// host says, or was found lost by a survivor.
fn died_since(door: &Door, r: usize) -> Result<Option<u32>> {
    Ok(match door.member(r)? {
        Some((p, _)) if p.gone() == Some(true) || door.lost(r)? == Some(p) => Some(p.pid),
        _ => None,
    })
}

/// Each node peer that `died` since the welcome names its process in the region this
/// rank holds for it, so the first wait on it finds it dead (its process id there is
/// how a wait tells).
fn name_the_dead(symm: &Symmetric, map: &RegionMap, died: &[Option<u32>]) -> Result<()> {
    for (r, pid) in died.iter().enumerate() {
        if let (Some(pid), Some(region)) = (pid, symm.peer(r)) {
            (region.word(map.control.pid, 0)?)
                .store((*pid).into(), std::sync::atomic::Ordering::Release);
        }
    }
    Ok(())
}

/// Map rank `r`'s memory by the handle the door names, if its process lives.
fn map_member(
    (door, alloc): (&Door, &dyn SymmetricAlloc),
    r: usize,
    bytes: usize,
) -> Result<Option<Region>> {
    Ok(match door.member(r)? {
        Some((p, handle)) if p.gone() == Some(false) => {
            alloc.open(&handle, bytes, Duration::ZERO).ok()
        }
        _ => None,
    })
}

/// Wait for the survivors' welcome of request `stamp`.
fn wait_welcome(door: &Door, rank: usize, stamp: u64, timeout: Duration) -> Result<Welcome> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(w) = door.welcomed(rank, stamp)? {
            return Ok(w);
        }
        if Instant::now() >= deadline {
            return Err(EpError::Timeout {
                what: format!("rank {rank}: waiting to be let in at the door"),
                detail: "no survivor let it in: is the job still running, elastic, and \
                         admitting this rank (BufferConfig::auto_admit or Buffer::admit)?"
                    .into(),
                waited: timeout,
            });
        }
        std::thread::sleep(door.poll());
    }
}

/// The words of a joiner's region that peers read before they write it, as if it had
/// made every call so far: it entered the last low-latency dispatch and combine, and
/// received every combine.
fn start_words(symm: &Symmetric, map: &RegionMap, calls: &Calls) -> Result<()> {
    use std::sync::atomic::Ordering::Release;
    let (local, c) = (symm.local(), &map.control);
    local
        .word(c.ll_entered, 0)?
        .store(calls.ll_dispatch.into(), Release);
    local
        .word(c.ll_combine_entered, 0)?
        .store(calls.ll_combine.into(), Release);
    for b in 0..crate::net::LL_BUFFERS {
        local
            .word(c.ll_combine_received, b)?
            .store(calls.ll_combine.into(), Release);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A survivor that dies between the welcome and saying it is ready is not waited
    /// for: the joiner goes on at once and names its process (it once waited out its
    /// whole timeout, and the job with it), whether its host says so or, on another
    /// host, a survivor that found it lost. One that lives but is not ready is named
    /// when the wait runs out.
    #[test]
    fn a_survivor_that_died_before_it_was_ready_is_not_waited_for() {
        let name = format!("{}test-ready-{}", uep_shm::DOOR_PREFIX, std::process::id());
        let cfg = BufferConfig::new(64, 512, 8, 0, 128);
        let mut door = Door::create((&name, None), 5, &cfg, (1, 1, 1, 5)).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let (me, handle) = (Process::me(), MemHandle::new(b"segment".to_vec()).unwrap());
        let elsewhere = |pid| Process {
            pid,
            host: me.host ^ 1,
        };
        for (r, p) in [(0, me), (1, Process { pid: dead, ..me }), (2, me)] {
            door.set_member(r, p, &handle).unwrap();
        }
        door.set_member(3, elsewhere(4242), &handle).unwrap();
        // A survivor found another process of rank 3 lost: that says nothing of this one.
        door.set_lost(3, elsewhere(4241)).unwrap();
        let stamp = door.post_request(4, (me, &handle), None).unwrap();
        let welcome = Welcome {
            round: 1,
            digest: 2,
            calls: Calls::default(),
            step: 0,
            first: FirstCall::Dispatch,
            masked: vec![false; 5],
        };
        door.ready(4, 0, stamp).unwrap();
        door.ready(4, 2, stamp).unwrap();
        let short = Duration::from_millis(50);
        let err = wait_ready(&door, (4, stamp), &welcome, short).unwrap_err();
        let text = err.to_string();
        let named = "ranks [3] of the 4 live ranks are not ready";
        assert!(text.contains(named), "{text}");

        door.set_lost(3, elsewhere(4242)).unwrap();
        let start = Instant::now();
        let died = wait_ready(&door, (4, stamp), &welcome, Duration::from_secs(20)).unwrap();
        assert_eq!(died, [None, Some(dead), None, Some(4242), None]);
        let took = start.elapsed();
        assert!(took < Duration::from_secs(5), "{took:?}");
        door.close().unwrap();
    }
}
