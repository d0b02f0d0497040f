//! Rejoin: a process started to replace a masked rank takes its place in a running job.
//!
//! 1. **The joiner** ([`Buffer::join`](crate::Buffer::join)) opens the job's door
//!    ([`door`](crate::door)), makes its own segment, maps the survivors' (their names
//!    are at the door), and posts a request: its process and segment.
//! 2. **Each survivor**, at every agreement that may let ranks in (after a combine, or a
//!    barrier) and while some rank is gone, reads the door: it maps a live requester's
//!    segment (if its caller admits that rank, [`Buffer::admit`](crate::Buffer::admit),
//!    or lets everyone in) and from then on proposes the rank *unmasked*.
//! 3. **The agreement decides.** It decides the union of the proposals, so the rank
//!    leaves the decided mask only once every survivor proposed it unmasked: then all
//!    survivors let it in at the same call, and a survivor that has not mapped it yet
//!    only delays the decision. The call of that agreement still runs without it.
//! 4. **The first dispatch (or barrier) after**, with no low-latency call waiting for
//!    its receive, every survivor puts the joiner's region in its predecessor's place,
//!    forgets the predecessor's masking, and writes the same welcome at the door: the
//!    call numbers, agreements, the mask and the caller's step. The joiner reads it,
//!    returns from `join`, and makes that call with them.
//!
//! A joiner that dies before it is let in is dropped (its process is watched); after,
//! it is a rank like any other, masked again by the next wait on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_bootstrap::{BootstrapError, ControlPlane};
use uep_shm::{Region, Segment};

use crate::area::Mem;
use crate::config::BufferConfig;
use crate::ctx::Ctx;
use crate::device::Device;
use crate::door::{Calls, Door, FirstCall, Welcome};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::map::RegionMap;
use crate::mask::{Elastic, Joiner};
use crate::symm::Symmetric;
use crate::topology::Topology;
use crate::wait::process_gone;

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
        let mut e = el.borrow_mut();
        for r in 0..self.topo.num_ranks {
            if !(e.masked[r] && e.agreed[r]) || e.doorway.let_in[r].is_some() {
                continue;
            }
            if let Some(j) = &e.doorway.asking[r] {
                if process_gone(j.pid) {
                    tracing::warn!(rank = self.topo.rank, "rank {r}'s replacement died asking");
                    forget_segment(&j.name);
                    e.doorway.asking[r] = None;
                }
                continue;
            }
            let Some(req) = door.request(r)? else {
                continue;
            };
            // Cheap tests first: this runs at every combine while a rank is masked.
            let wanted = e.doorway.auto || e.doorway.admit[r];
            if req.stamp == e.doorway.answered[r] || !wanted || process_gone(req.pid) {
                continue;
            }
            if !member_gone(door, r)? {
                tracing::debug!(
                    rank = self.topo.rank,
                    "rank {r} is masked but its process lives: its replacement waits"
                );
                continue;
            }
            match Segment::open(&req.name, self.map.total, Duration::ZERO) {
                Ok(seg) => {
                    e.doorway.asking[r] = Some(Joiner {
                        stamp: req.stamp,
                        pid: req.pid,
                        name: req.name,
                        region: seg.region().clone(),
                    })
                }
                Err(err) => tracing::warn!(
                    rank = self.topo.rank,
                    "cannot map the segment of rank {r}'s replacement: {err}"
                ),
            }
        }
        Ok(())
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
        let mut e = el.borrow_mut();
        if !e.doorway.waiting() {
            return Ok(());
        }
        let joiners: Vec<(usize, Joiner)> = (0..self.topo.num_ranks)
            .filter_map(|r| e.doorway.let_in[r].take().map(|j| (r, j)))
            .collect();
        for (r, j) in &joiners {
            self.symm.replace_peer(*r, j.region.clone());
            e.readmit(*r);
            e.doorway.answered[*r] = j.stamp;
            e.doorway.admit[*r] = false;
            tracing::info!(
                rank = self.topo.rank,
                "rank {r} rejoins (process {})",
                j.pid
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
            door.set_member(*r, j.pid, &j.name)?;
        }
        for (r, j) in &joiners {
            door.welcome(*r, j.stamp, &welcome)?;
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
    /// ends; nobody can join it any more).
    pub(crate) fn close_door(&mut self) {
        let me = self.topo.rank;
        let lowest = (0..me).all(|r| self.masked(r));
        if let Some(door) = self.door.as_mut().filter(|_| lowest) {
            if let Err(e) = door.close() {
                tracing::warn!(rank = me, "{e}");
            }
        }
    }

    /// A rank of this node found gone: its segment's name goes (a joiner must not map
    /// it, and nobody else removes it).
    pub(crate) fn forget_member(&self, rank: usize) {
        let member = self
            .door
            .as_ref()
            .and_then(|d| d.member(rank).ok().flatten());
        if let Some((_, name)) = member {
            forget_segment(&name);
        }
    }
}

/// Whether the process the door names for `rank` is gone.
fn member_gone(door: &Door, rank: usize) -> Result<bool> {
    Ok(door.member(rank)?.is_none_or(|(pid, _)| process_gone(pid)))
}

fn forget_segment(name: &str) {
    let _ = std::fs::remove_file(std::path::Path::new(uep_shm::SHM_DIR).join(name));
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
    /// The config of the elastic job of `world` ranks at door `name` on this host, for
    /// a replacement that does not know its shapes ([`Buffer::join`](crate::Buffer::join)):
    /// its shapes and ranks per node, elastic, with that door; the rest (deadline
    /// `timeout`, kernel threads, admission) as [`BufferConfig::new`] makes them.
    pub fn from_door(name: &str, world: usize, timeout: Duration) -> Result<BufferConfig> {
        let door = Door::open(name, world, timeout).map_err(|e| no_job(name, &e))?;
        let (normal, ll, ranks_per_node) = door.shapes()?;
        let mut cfg = BufferConfig::new(1, 8, 1, 0, 0);
        (cfg.normal, cfg.ll, cfg.ranks_per_node) = (normal, ll, ranks_per_node);
        (cfg.elastic, cfg.door, cfg.timeout) = (true, Some(name.into()), timeout);
        Ok(cfg)
    }
}

fn no_job(name: &str, e: &EpError) -> EpError {
    EpError::Resource(format!("no running job at door {name} on this host: {e}"))
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
    let door = Door::open(name, world, cfg.timeout).map_err(|e| no_job(name, &e))?;
    let map = RegionMap::new(cfg, world, false);
    let (digest, bytes, job) = door.header()?;
    if digest != config_digest(&cfg.fingerprint(map.total)) || bytes != map.total {
        return Err(invalid!(
            "rank {rank} was given another Buffer config than the job at door {name} \
             ({} bytes here, {bytes} there)",
            map.total
        ));
    }
    let hosts = vec![uep_bootstrap::host_id(); world];
    let topo = Topology::from_hosts(rank, &hosts, cfg.ranks_per_node)?;
    if topo.num_nodes > 1 {
        return Err(invalid!(
            "a rank rejoins a job on one node only for now ({} nodes here)",
            topo.num_nodes
        ));
    }
    Ok(Entry {
        door,
        map,
        topo,
        job,
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
    let pid = std::process::id();
    let name = uep_shm::segment_name(&format!("{job:016x}"), rank, pid);
    let own = Segment::create(&name, map.total)?;
    own.region()
        .word(map.control.pid, 0)?
        .store(pid.into(), std::sync::atomic::Ordering::Release);
    let mut peers = vec![None; world];
    for r in (0..world).filter(|&r| r != rank) {
        peers[r] = map_member(&door, r, map.total)?;
    }
    let asked = Instant::now();
    let stamp = door.post_request(rank, pid, &name)?;
    let welcome = wait_welcome(&door, rank, stamp, cfg.timeout)?;
    let waited = asked.elapsed();
    for r in (0..world).filter(|&r| r != rank) {
        if peers[r].is_none() && !welcome.masked[r] {
            peers[r] = map_member(&door, r, map.total)?;
            if peers[r].is_none() {
                return Err(EpError::Resource(format!(
                    "rank {rank} rejoined, but cannot map the memory of rank {r}"
                )));
            }
        }
        // A rank gone before this one came: a blank region, where writes go nowhere
        // as they do into a dead rank's memory on the ranks that mapped it alive.
        if peers[r].is_none() {
            peers[r] = Some(Region::anonymous(map.total)?);
        }
    }
    let symm = Symmetric::from_parts(rank, own, peers);
    start_words(&symm, &map, &welcome.calls)?;
    let mut e = Elastic::new(world, cfg.auto_admit);
    for r in (0..world).filter(|&r| welcome.masked[r]) {
        e.mask(r);
        e.gone[r] = true;
        e.agreed[r] = true;
        e.why[r] = Some(format!("masked when rank {rank} rejoined"));
    }
    (e.round, e.digest) = (welcome.round, welcome.digest);
    door.set_member(rank, pid, &name)?;
    let cx = Ctx {
        device,
        cp: Arc::new(Detached { rank, world }),
        topo,
        id: rand::random::<u64>() ^ ((rank as u64) << 48) ^ u64::from(pid),
        map,
        symm,
        cfg,
        net: None,
        elastic: Some(std::cell::RefCell::new(e)),
        door: Some(door),
    };
    Ok((cx, welcome, waited))
}

/// Map rank `r`'s segment as the door names it, if its process lives.
fn map_member(door: &Door, r: usize, bytes: usize) -> Result<Option<Region>> {
    Ok(match door.member(r)? {
        Some((pid, name)) if !process_gone(pid) => Segment::open(&name, bytes, Duration::ZERO)
            .ok()
            .map(|s| s.region().clone()),
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
        std::thread::sleep(Duration::from_micros(200));
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
