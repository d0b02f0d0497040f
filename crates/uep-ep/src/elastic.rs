//! Elastic low-latency mode: a rank found dead or unreachable is masked, and the
//! low-latency calls go on without it (DeepEP's shrink mode, Mooncake's
//! `active_ranks`), with every survivor agreeing on the mask before it uses it.
//!
//! * **Masking.** A wait on a rank that the liveness checks find gone (its process on
//!   this host, the watch over other nodes, a failed proxy operation) masks it instead
//!   of failing: the call goes on, that rank counts zero tokens, and rows routed to its
//!   experts contribute nothing. The mask is sticky: later calls skip the rank, send
//!   it nothing and wait for nothing from it. Callers may mask ranks themselves
//!   ([`Buffer::low_latency_update_mask`](crate::Buffer::low_latency_update_mask)).
//! * **Agreement.** Ranks learn of a death at different moments, so after the receive
//!   of every low-latency dispatch and combine, the survivors exchange their masks (one
//!   small message to every rank not found dead, the *agreement round*) and use the
//!   union. A rank that died after its data reached some survivors but not others is
//!   in the mask of those it missed, so in everyone's union; one that dies during the
//!   round itself had delivered all its data, so it counts in this call everywhere and
//!   is masked from the next. The mask a caller reads
//!   ([`Buffer::low_latency_mask`](crate::Buffer::low_latency_mask)) is the one the last call used: such a rank enters
//!   it when the next call begins (DeepEP's tests check each call's output against the
//!   mask read right after it). The union is the same on every survivor as long as no
//!   two deaths interleave with one call's round (a whole node killed at once counts
//!   as one). A rank that finds itself in a peer's mask fails: it was excluded.
//! * **Partitions.** A rank that finds half of the job or more unreachable (not dead:
//!   unreachable) fails instead of serving alone, so that a cut network does not split
//!   the job into halves that both go on.
//! * **Normal mode** needs every rank: on an elastic Buffer with a masked rank it fails
//!   at once (as DeepEP's does).
//!
//! A masked rank cannot rejoin this Buffer: it missed calls, so its sequence numbers
//! differ from the survivors'. [`Buffer::low_latency_clean_mask`](crate::Buffer::low_latency_clean_mask) is for ranks masked
//! by the caller that never stopped calling.

use std::sync::atomic::Ordering;

use crate::area::Mem;
use crate::ctx::Ctx;
use crate::error::{EpError, Result};
use crate::invalid;
use crate::liveness::Gone;
use crate::mask::Elastic;
use crate::packet::Channel;

/// A mask as bits, one per rank, in `words` words.
fn to_words(mask: &[bool], words: usize) -> Vec<u64> {
    let mut w = vec![0u64; words];
    for (r, _) in mask.iter().enumerate().filter(|(_, &m)| m) {
        w[r / 64] |= 1 << (r % 64);
    }
    w
}

/// `mask[r] |= bit r of words`.
fn merge(mask: &mut [bool], words: &[u64]) {
    for (r, m) in mask.iter_mut().enumerate() {
        if words.get(r / 64).is_some_and(|w| w >> (r % 64) & 1 == 1) {
            *m = true;
        }
    }
}

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

    /// Why each masked rank was masked (`None` for the others).
    pub(crate) fn low_latency_mask_reasons(&self) -> Vec<Option<String>> {
        match &self.elastic {
            Some(e) => e.borrow().why.clone(),
            None => vec![None; self.topo.num_ranks],
        }
    }

    /// The mask the last low-latency combine used (its agreed mask).
    pub(crate) fn low_latency_last_combine_mask(&self) -> Vec<bool> {
        match &self.elastic {
            Some(e) => e.borrow().last_combine.clone(),
            None => vec![false; self.topo.num_ranks],
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
            e.masked[rank] = true;
            e.deferred[rank] = false;
            e.why[rank].get_or_insert_with(|| format!("masked by rank {me}'s caller"));
        } else if !e.gone[rank] {
            e.masked[rank] = false;
            e.why[rank] = None;
        }
        Ok(())
    }

    /// Unmask every rank that was not found gone (DeepEP's
    /// `low_latency_clean_mask_buffer`).
    pub(crate) fn low_latency_clean_mask(&self) -> Result<()> {
        let mut e = self.elastic_state()?.borrow_mut();
        for r in 0..e.masked.len() {
            if !e.gone[r] {
                e.masked[r] = false;
                e.why[r] = None;
            }
        }
        Ok(())
    }

    fn elastic_state(&self) -> Result<&std::cell::RefCell<Elastic>> {
        self.elastic.as_ref().ok_or_else(|| {
            invalid!("the mask needs an elastic Buffer (BufferConfig::elastic, enable_shrink=True)")
        })
    }

    /// The waits of a low-latency call: on an elastic Buffer, only the awaited rank's
    /// loss ends a wait (and [`Ctx::unless_lost`] masks it).
    pub(crate) fn ll_wait(&self) -> crate::wait::Wait<'_> {
        match self.elastic {
            Some(_) => self.wait().elastic(),
            None => self.wait(),
        }
    }

    /// Whether `rank` is masked (never, on a Buffer that is not elastic).
    pub(crate) fn masked(&self, rank: usize) -> bool {
        self.elastic
            .as_ref()
            .is_some_and(|e| e.borrow().masked[rank])
    }

    /// Normal mode needs every rank.
    pub(crate) fn require_every_rank(&self, call: &str) -> Result<()> {
        let masked: Vec<usize> = (0..self.topo.num_ranks)
            .filter(|&r| self.masked(r))
            .collect();
        if masked.is_empty() {
            return Ok(());
        }
        Err(invalid!(
            "{call} is normal mode, which needs every rank, but rank(s) {masked:?} are masked \
             ({}); use low-latency mode, or a new Buffer",
            self.low_latency_mask_reasons()
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join("; ")
        ))
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
            e.masked[rank] = true;
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
        Ok(None)
    }

    /// The agreement round (module docs): every survivor's mask to every rank not
    /// found gone, then the union of what the unmasked ranks sent. Returns the mask
    /// this call uses; ranks found gone during the round are masked from the next call.
    pub(crate) fn agree(&self, call: &str) -> Result<Vec<bool>> {
        let el = self.elastic_state()?;
        self.ll_call_begins();
        let (me, n) = (self.topo.rank, self.topo.num_ranks);
        let (round, mine, gone) = {
            let mut e = el.borrow_mut();
            e.round += 1;
            (e.round, e.masked.clone(), e.gone.clone())
        };
        let words = self.map.control.mask_words;
        let parity = (round % 2) as usize;
        let bits = to_words(&mine, words);
        let wait = self.wait().elastic();
        let local = self.symm.local();
        let ch = Channel::agree(parity);
        for r in (0..n).filter(|&r| r != me && !gone[r]) {
            if self.topo.is_local(r) {
                let (seq, mask) = self.map.control.agree_slot(parity, me)?;
                let region = self.peer_region(r)?;
                region.put(mask, &bits)?;
                region.word(seq, 0)?.store(round, Ordering::Release);
            } else {
                let net = self.net()?;
                let staged = net.stage(ch, r, &wait)?;
                let len = 8 * (1 + words);
                local.put(staged.area.prefix(len)?.cast::<u64>().prefix(1)?, &[round])?;
                local.put(
                    staged.area.prefix(len)?.cast::<u64>().slice(1..1 + words)?,
                    &bits,
                )?;
                net.send(staged, len, &[])?;
            }
        }
        let mut union = mine.clone();
        for r in (0..n).filter(|&r| r != me && !mine[r]) {
            let what = || format!("rank {me}: {call}: agreeing on the mask with rank {r}");
            let got = if self.topo.is_local(r) {
                let (seq, mask) = self.map.control.agree_slot(parity, r)?;
                let word = local.word(seq, 0)?;
                let waited = wait.at_least(word, round, Some(self.peer(r)), &what);
                match self.unless_lost(r, waited)? {
                    Some(_) => Some(local.get_vec(mask)?),
                    None => None,
                }
            } else {
                let net = self.net()?;
                match self.unless_lost(r, net.recv(ch, r, &wait, &what))? {
                    Some(landing) => {
                        let msg = local.get_vec(landing.cast::<u64>().prefix(1 + words)?)?;
                        if msg[0] != round {
                            return Err(EpError::internal(format!(
                                "rank {me}: {call}: rank {r} sent agreement round {}, expected {round}",
                                msg[0]
                            )));
                        }
                        Some(msg[1..].to_vec())
                    }
                    None => None,
                }
            };
            if let Some(words) = got {
                merge(&mut union, &words);
            }
        }
        if union[me] {
            let by: Vec<usize> = (0..n).filter(|&r| r != me && !union[r]).collect();
            return Err(EpError::Excluded { rank: me, by });
        }
        let mut e = el.borrow_mut();
        for (r, &m) in union.iter().enumerate() {
            if m && !e.masked[r] {
                e.masked[r] = true;
                e.why[r] = Some("masked by the other survivors".into());
            }
            // Masked during the round (not in the union): this call counts it.
            e.deferred[r] = e.masked[r] && !m;
        }
        Ok(union)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_travel_as_bits() {
        let mut mask = vec![false; 130];
        for r in [0, 63, 64, 129] {
            mask[r] = true;
        }
        let w = to_words(&mask, 3);
        let mut back = vec![false; 130];
        merge(&mut back, &w);
        assert_eq!(back, mask);
    }
}
