//! Elastic mode: a rank found dead or unreachable is masked, and the calls (low-latency
//! and normal) go on without it (DeepEP's shrink mode, Mooncake's
//! `active_ranks`), with every survivor agreeing on the mask before it uses it.
//!
//! * **Masking.** A wait on a rank that the liveness checks find gone (its process on
//!   this host, the watch over other nodes, a failed proxy operation) masks it instead
//!   of failing: the call goes on, that rank counts zero tokens, and rows routed to its
//!   experts contribute nothing. The mask is sticky: later calls skip the rank, send
//!   it nothing and wait for nothing from it. Callers may mask ranks themselves
//!   ([`Buffer::low_latency_update_mask`](crate::Buffer::low_latency_update_mask)).
//! * **Agreement.** Ranks learn of a death at different moments, so after the receive
//!   of every low-latency dispatch and combine, the survivors agree on the union of
//!   their masks ([`crate::agree`]: flooding consensus with early decision; with
//!   nobody dying, one small message to every rank, waited for, and one decision
//!   nobody waits for; [`mailbox`] carries them). It is the same on every survivor
//!   whatever the number and timing of deaths, in calls or in the agreement itself. A
//!   rank that died after its data reached some survivors but not others is in the
//!   mask of those it missed, so in the union; one found gone during the agreement,
//!   and in no survivor's mask, had delivered all its data, so it counts in this call
//!   everywhere and is masked from the next. The mask a caller reads
//!   ([`Buffer::low_latency_mask`](crate::Buffer::low_latency_mask)) is the one the
//!   last call used: such a rank enters it when the next call begins (DeepEP's tests
//!   check each call's output against the mask read right after it). A rank that
//!   finds itself in the union fails: it was excluded.
//! * **Partitions.** A rank that finds half of the job or more unreachable (not dead:
//!   unreachable) fails instead of serving alone, so that a cut network does not split
//!   the job into halves that both go on.
//! * **Normal mode** masks too: a normal call runs under the last agreed mask, the
//!   survivors agree after it, and run it again without the ranks lost during it
//!   (`normal::elastic`).
//!
//! * **Rejoin.** A process started to replace a masked rank takes its place at a call
//!   every survivor agrees on ([`join`], through the job's [`door`](crate::door)); on one node for
//!   now. [`Buffer::low_latency_clean_mask`](crate::Buffer::low_latency_clean_mask) is
//!   for ranks masked by the caller that never stopped calling.

pub(crate) mod join;
mod mailbox;

use crate::ctx::Ctx;
use crate::error::{EpError, Result};
use crate::invalid;
use crate::liveness::Gone;
use crate::mask::{Elastic, Fault};

impl Ctx {
    /// `[rank]`: whether the rank is masked (DeepEP's
    /// `low_latency_query_mask_buffer`): the mask the last low-latency call used, and
    /// the caller's own changes since; all `false` on a Buffer that is not elastic.
    /// A rank found gone during a call's agreement round counted in that call, so it
    /// appears here once the next call begins.
    pub(crate) fn low_latency_mask(&self) -> Vec<bool> {
        match &self.elastic {
            Some(e) => {
                let e = e.borrow();
                (e.masked.iter().zip(&e.deferred))
                    .map(|(&m, &d)| m && !d)
                    .collect()
            }
            None => vec![false; self.topo.num_ranks],
        }
    }

    /// A low-latency call (or agreement round) begins: the ranks found gone in the last
    /// round are in the mask it uses, so the caller sees them from now on.
    pub(crate) fn ll_call_begins(&self) {
        if let Some(e) = &self.elastic {
            e.borrow_mut().deferred.fill(false);
        }
    }

    /// When each masked rank was masked (`None` for the others).
    pub(crate) fn low_latency_masked_at(&self) -> Vec<Option<std::time::SystemTime>> {
        match &self.elastic {
            Some(e) => e.borrow().masked_at.clone(),
            None => vec![None; self.topo.num_ranks],
        }
    }

    /// Why each masked rank was masked (`None` for the others).
    pub(crate) fn low_latency_mask_reasons(&self) -> Vec<Option<String>> {
        match &self.elastic {
            Some(e) => e.borrow().why.clone(),
            None => vec![None; self.topo.num_ranks],
        }
    }

    /// The mask the last combine (either mode) used (its agreed mask).
    pub(crate) fn last_combine_mask(&self) -> Vec<bool> {
        match &self.elastic {
            Some(e) => e.borrow().last_combine.clone(),
            None => vec![false; self.topo.num_ranks],
        }
    }

    /// A combine (either mode) on an elastic Buffer records the mask it used, for
    /// the caller.
    pub(crate) fn note_combine_mask(&self, masked: &[bool]) {
        if let Some(e) = &self.elastic {
            e.borrow_mut().last_combine = masked.to_vec();
        }
    }

    /// Mask (`mask = true`) or unmask `rank` (DeepEP's
    /// `low_latency_update_mask_buffer`). A rank found gone cannot be unmasked.
    pub(crate) fn low_latency_update_mask(&self, rank: usize, mask: bool) -> Result<()> {
        let me = self.topo.rank;
        let n = self.topo.num_ranks;
        let e = self.elastic_state()?;
        if rank >= n || (rank == me && mask) {
            return Err(invalid!(
                "rank {rank} cannot be masked by rank {me} (ranks 0..{n}, not itself)"
            ));
        }
        let mut e = e.borrow_mut();
        if mask {
            e.mask(rank);
            e.deferred[rank] = false;
            e.why[rank].get_or_insert_with(|| format!("masked by rank {me}'s caller"));
        } else if !e.gone[rank] {
            e.unmask(rank);
        }
        Ok(())
    }

    /// Unmask every rank that was not found gone (DeepEP's
    /// `low_latency_clean_mask_buffer`).
    pub(crate) fn low_latency_clean_mask(&self) -> Result<()> {
        let mut e = self.elastic_state()?.borrow_mut();
        for r in 0..e.masked.len() {
            if !e.gone[r] {
                e.unmask(r);
            }
        }
        Ok(())
    }

    pub(crate) fn elastic_state(&self) -> Result<&std::cell::RefCell<Elastic>> {
        self.elastic.as_ref().ok_or_else(|| {
            invalid!("the mask needs an elastic Buffer (BufferConfig::elastic, enable_shrink=True)")
        })
    }

    /// The waits of a call (either mode): on an elastic Buffer, only the awaited
    /// rank's loss ends a wait (and [`Ctx::unless_lost`] masks it).
    pub(crate) fn call_wait(&self) -> crate::wait::Wait<'_> {
        match self.elastic {
            Some(_) => self.wait().elastic_noting(self),
            None => self.wait(),
        }
    }

    /// Agreements so far and the digest of their decisions.
    pub(crate) fn agreements(&self) -> (u64, u64) {
        self.elastic.as_ref().map_or((0, 0), |e| {
            let e = e.borrow();
            (e.round, e.digest)
        })
    }

    /// Fault injection (`Buffer::fault_in_agreement`).
    pub(crate) fn fault_in_agreement(
        &self,
        after: u64,
        sends: usize,
        fault: Box<dyn FnOnce() + Send>,
    ) -> Result<()> {
        let mut e = self.elastic_state()?.borrow_mut();
        e.fault = Some(Fault {
            k: e.round + 1 + after,
            sends,
            run: Some(fault),
        });
        Ok(())
    }

    /// Run the injected fault if it is due before the `sent`-th send of agreement `k`.
    pub(crate) fn fault_point(&self, k: u64, sent: usize) {
        let fault = self.elastic.as_ref().and_then(|e| {
            let mut e = e.borrow_mut();
            let f = e.fault.as_mut().filter(|f| (f.k, f.sends) == (k, sent))?;
            f.run.take()
        });
        if let Some(fault) = fault {
            fault();
        }
    }

    /// Whether `rank` was found gone (never, on a Buffer that is not elastic).
    pub(crate) fn gone(&self, rank: usize) -> bool {
        self.elastic.as_ref().is_some_and(|e| e.borrow().gone[rank])
    }

    /// Whether `rank` is masked (never, on a Buffer that is not elastic).
    pub(crate) fn masked(&self, rank: usize) -> bool {
        self.elastic
            .as_ref()
            .is_some_and(|e| e.borrow().masked[rank])
    }

    /// Before a normal call: the ordered streams it reads settled (round messages of
    /// the last agreement that were not read are counted first; [`mailbox`]).
    pub(crate) fn normal_call_begins(&self) -> Result<()> {
        match self.elastic {
            Some(_) => self.settle_last(),
            None => Ok(()),
        }
    }

    /// The outcome of a wait on `rank`: on an elastic Buffer, `rank` found gone is
    /// masked and the wait yields `None`; every other error stays an error.
    pub(crate) fn unless_lost<T>(&self, rank: usize, r: Result<T>) -> Result<Option<T>> {
        let Some(el) = &self.elastic else {
            return r.map(Some);
        };
        let (why, unreachable) = match &r {
            Err(EpError::PeerDied { peer, .. }) if *peer == rank => {
                (r.as_ref().err().map(ToString::to_string), false)
            }
            Err(EpError::PeerLost { lost, .. }) if lost.rank == rank => (
                Some(lost.to_string()),
                matches!(lost.how, Gone::Unreachable { .. }),
            ),
            _ => return r.map(Some),
        };
        let me = self.topo.rank;
        tracing::warn!(
            rank = me,
            "masking rank {rank}: {}",
            why.as_deref().unwrap_or("")
        );
        {
            let mut e = el.borrow_mut();
            e.mask(rank);
            e.gone[rank] = true;
            e.unreachable[rank] |= unreachable;
            e.why[rank] = why;
            // Half the job or more out of reach: this rank is the one cut off, or the
            // network is split; either way it must not serve alone.
            let cut = e.unreachable.iter().filter(|&&u| u).count();
            if unreachable && 2 * cut >= e.masked.len() {
                return r.map(Some);
            }
        }
        if let Some(net) = &self.net {
            if !self.topo.is_local(rank) {
                net.mark_lost(rank);
            }
        }
        self.member_lost(rank);
        Ok(None)
    }
}
