//! What every operation of a Buffer works with: the control plane, the topology, the
//! symmetric memory and its map, the device, the network path and the elastic mask,
//! fixed when the Buffer is made. The operations (`normal`, `ll`, `elastic`) borrow it
//! and keep their own state (sequence numbers, output banks) beside it in the Buffer.
//! It is also where an error becomes the abort broadcast ([`Ctx::collective`]).

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use uep_bootstrap::ControlPlane;
use uep_shm::Region;

use crate::area::{Area, Mem};
use crate::config::BufferConfig;
use crate::device::{CopyPhase, Device, SignalPhase, Store, Until, WaitPhase, Word};
use crate::door::Door;
use crate::error::{EpError, Result};
use crate::map::{RegionMap, ABORT_MSG_BYTES};
use crate::mask::Elastic;
use crate::net::NetPath;
use crate::symm::Symmetric;
use crate::topology::Topology;
use crate::wait::{abort_reason, Peer, Seen, Wait};

/// How long a failing rank spends telling the other nodes (its own deadline if shorter).
/// It raises only after, and survivors promise to raise within two seconds of a death;
/// a peer this misses still learns from its liveness watch once this rank exits. (At
/// 2 s, a write to a peer that was itself exiting once held a survivor's report to
/// 2.4 s in CI.)
const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a Buffer that told other nodes of a failure keeps its proxy when dropped.
pub(crate) const ABORT_LINGER: Duration = Duration::from_millis(300);

/// The context of every operation of one rank's Buffer (module docs).
pub(crate) struct Ctx {
    pub cp: Arc<dyn ControlPlane>,
    pub cfg: BufferConfig,
    pub topo: Topology,
    pub map: RegionMap,
    pub symm: Symmetric,
    pub device: Arc<dyn Device>,
    /// Identifies the Buffer in the handles it returns.
    pub id: u64,
    /// The network path, when some ranks are on other nodes. Its proxy writes into
    /// `symm`'s memory (holding a handle on it): the Buffer's `Drop` stops it first.
    pub net: Option<NetPath>,
    /// The mask of an elastic Buffer (see [`crate::elastic`]).
    pub elastic: Option<RefCell<Elastic>>,
    /// Where replacements find an elastic job ([`crate::door`]).
    pub door: Option<Door>,
    /// While a joiner let in at this call may wait for the survivors: `[rank]` whether
    /// this rank said at the door that `rank` is lost ([`crate::wait::LostElsewhere`]).
    pub said_lost: RefCell<Option<Vec<bool>>>,
}

impl Ctx {
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
        self.symm.peer_region(peer)
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

    /// `area` of `rank`'s memory, which peers published in the call whose wait acquired
    /// `seen`, read through the device.
    pub(crate) fn read_published<T: Pod>(
        &self,
        rank: usize,
        area: Area<T>,
        seen: &Seen,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); area.len()];
        let phase = self.copy_phase(rank, area);
        self.device
            .read(&phase, seen, bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// `values` into `area` of `rank`'s memory through the device, before a signal
    /// publishes them (`values` may be shorter than the area: its first values).
    pub(crate) fn write_area<T: Pod>(
        &self,
        rank: usize,
        area: Area<T>,
        values: &[T],
    ) -> Result<()> {
        let phase = self.copy_phase(rank, area.prefix(values.len())?);
        self.device.write(&phase, bytemuck::cast_slice(values))
    }

    fn copy_phase<T>(&self, rank: usize, area: Area<T>) -> CopyPhase<'_> {
        CopyPhase {
            rank,
            area: area.cast(),
            memory: &self.symm,
        }
    }

    /// Stores through the device's signal phase, in order, each with release.
    pub(crate) fn signal(&self, stores: &[Store]) -> Result<()> {
        self.device.signal(&SignalPhase {
            stores,
            memory: &self.symm,
        })
    }

    /// Waits through the device for `words`, all stored by `peer` (the wait phase every
    /// receive opens with), and returns what each wait acquired.
    pub(crate) fn await_words(
        &self,
        words: &[Word],
        peer: usize,
        wait: &Wait<'_>,
        what: &dyn Fn(usize) -> String,
    ) -> Result<Vec<Seen>> {
        let seen = self.device.wait(&WaitPhase {
            words,
            peer,
            what,
            watch: wait,
            memory: &self.symm,
        })?;
        match seen.len() == words.len() {
            true => Ok(seen),
            false => Err(EpError::internal(format!(
                "device {} acquired {} of {} words",
                self.device.name(),
                seen.len(),
                words.len()
            ))),
        }
    }

    /// [`Ctx::await_words`] for one word.
    pub(crate) fn await_word(
        &self,
        word: Word,
        peer: usize,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<Seen> {
        let mut seen = self.await_words(&[word], peer, wait, &|_| what())?;
        Ok(seen.remove(0))
    }

    /// Wait until every rank of this node (this one among them) stored call `seq`'s
    /// epoch into its slot of `words` here, and return what the waits acquired. `what(r)`
    /// names the wait on rank `r`. Ranks `masked` are not waited for; in elastic mode a
    /// rank lost meanwhile is masked ([`Ctx::unless_lost`]).
    pub(crate) fn node_published(
        &self,
        words: Area<u64>,
        seq: u32,
        masked: &[bool],
        wait: &Wait<'_>,
        what: &dyn Fn(usize) -> String,
    ) -> Result<Seen> {
        let topo = self.topo;
        let mut seen = None;
        for r in topo.node_ranks(topo.node).filter(|&r| !masked[r]) {
            let word = Word::at(topo.rank, words, r, Until::AtLeast(seq as u64))?;
            let got = self.await_word(word, r, wait, &|| what(r));
            seen = self.unless_lost(r, got)?.or(seen);
        }
        seen.ok_or_else(|| {
            EpError::internal(format!("rank {}: call {seq} waited for no rank", topo.rank))
        })
    }

    /// Run one collective call `f`: refuse it on a Buffer whose job already failed, and
    /// turn its error into the abort broadcast, unless every rank found it together
    /// ([`EpError::Capacity`]).
    pub(crate) fn collective<T>(&self, f: impl FnOnce(&Self) -> Result<T>) -> Result<T> {
        self.ensure_usable()?;
        f(self).map_err(|e| {
            // Every rank found these together: nobody needs telling.
            let together = matches!(
                e,
                EpError::Capacity { .. } | EpError::Unusable { .. } | EpError::StaleHandle(_)
            );
            if !together {
                self.broadcast_failure(&e);
            }
            e
        })
    }

    /// Calls after a failure would pair with the wrong calls of other ranks: refuse them.
    pub(crate) fn ensure_usable(&self) -> Result<()> {
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
    pub(crate) fn broadcast_failure(&self, e: &EpError) {
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

    pub(crate) fn barrier_phases(&self, seq: u64) -> Result<()> {
        let (me, topo, c) = (self.topo.rank, self.topo, &self.map.control);
        let wait = self.wait();
        let stores = (topo.node_ranks(topo.node))
            .map(|peer| Store::at(peer, c.barrier, me, seq))
            .collect::<Result<Vec<_>>>()?;
        self.signal(&stores)?;
        for peer in topo.node_ranks(topo.node) {
            let what =
                || format!("rank {me}: barrier {seq}: waiting for rank {peer} (barrier[{peer}])");
            let word = Word::at(me, c.barrier, peer, Until::AtLeast(seq))?;
            self.await_word(word, peer, &wait, &what)?;
        }
        if topo.num_nodes == 1 {
            return Ok(());
        }
        let leader = topo.node * topo.ranks_per_node;
        if me == leader {
            self.net()?.barrier(seq, &wait)?;
            let stores = (topo.node_ranks(topo.node).filter(|&p| p != me))
                .map(|peer| Store::at(peer, c.barrier_release, 0, seq))
                .collect::<Result<Vec<_>>>()?;
            self.signal(&stores)?;
        } else {
            let what = || {
                format!("rank {me}: barrier {seq}: waiting for rank {leader} to meet the other nodes (barrier_release)")
            };
            let word = Word::at(me, c.barrier_release, 0, Until::AtLeast(seq))?;
            self.await_word(word, leader, &wait, &what)?;
        }
        Ok(())
    }
}
