//! Normal mode on an elastic Buffer: calls that go on when a rank dies.
//!
//! A normal call runs under the mask the survivors last agreed on ([`CallMask`]): the
//! masked ranks are sent nothing and waited for by nobody, their tokens and experts
//! count nothing, and another node's masked relay has a live substitute (`paths`). A
//! wait on a rank lost during the call masks it ([`Ctx::unless_lost`]) and the call
//! goes on to its end, sending everything it owes the others (what it sends may be
//! incomplete), so that no survivor waits for it. Then the survivors agree
//! ([`crate::elastic`]): if the decided mask is the one the call ran under, nobody
//! lost anyone and every output is complete; else each survivor runs the call again
//! under the decided mask. Data a rank lost mid-call had sent is never used: the
//! outputs of the call that ran under a mask without it are dropped.
//!
//! A combine whose dispatch ran under a smaller mask may find a relay masked since:
//! the source tells the substitute which of its tokens went to that node and to which
//! of its ranks (a *plan*, the metadata of the dispatch packet the substitute never
//! got), so the substitute can reduce them.

use std::borrow::Cow;

use super::paths::{CallMask, Relays};
use super::{NormalHandle, Relayed};
use crate::area::Mem;
use crate::ctx::Ctx;
use crate::error::{EpError, Result};
use crate::net::Staged;
use crate::packet::{Channel, DispatchHeader, DispatchPacket, RowFormat};
use crate::protocol;
use crate::wait::Wait;

impl Ctx {
    /// The mask a normal call starts under: the one last agreed (nobody on a Buffer
    /// that is not elastic).
    pub(super) fn normal_mask(&self) -> Result<CallMask> {
        let masked = match &self.elastic {
            Some(e) => e.borrow().agreed.clone(),
            None => vec![false; self.topo.num_ranks],
        };
        CallMask::new(self.topo, masked)
    }

    /// After a call ran under `mask`: `None` if it stands (not elastic, or the
    /// survivors decided on `mask` itself), else the decided mask to run it again under.
    /// `admits`: the agreement may let replacements in (a combine's; `elastic::join`).
    pub(super) fn normal_agree(
        &self,
        call: &str,
        mask: &CallMask,
        admits: bool,
    ) -> Result<Option<CallMask>> {
        if self.elastic.is_none() {
            return Ok(None);
        }
        let decided = self.agree(call, admits)?;
        if decided == mask.masked {
            return Ok(None);
        }
        tracing::warn!(
            rank = self.topo.rank,
            "{call}: ranks {:?} lost during the call; running it again without them",
            lost(&decided, &mask.masked)
        );
        // The call reads the ordered streams again: settle the agreement's first.
        self.settle_last()?;
        CallMask::new(self.topo, decided).map(Some)
    }

    /// Stage a packet for `peer` unless it was lost (`None`; in elastic mode only).
    pub(super) fn stage_unless_lost(
        &self,
        channel: Channel,
        peer: usize,
        wait: &Wait<'_>,
    ) -> Result<Option<Staged>> {
        if self.gone(peer) {
            return Ok(None);
        }
        let staged = self.net()?.stage(channel, peer, wait);
        self.unless_lost(peer, staged)
    }

    /// A cached dispatch reuses a handle's routing, which counted ranks masked since:
    /// refused, on every survivor alike (their masks are the same).
    pub(super) fn refuse_stale_handle(
        &self,
        handle: Option<&NormalHandle>,
        mask: &CallMask,
    ) -> Result<()> {
        match handle {
            Some(h) if h.masked != mask.masked => Err(EpError::StaleHandle(format!(
                "the handle was made before rank(s) {:?} were masked, so its routing sends to \
                 them; dispatch with topk_idx (or a new layout) instead of the cached handle",
                lost(&mask.masked, &h.masked)
            ))),
            _ => Ok(()),
        }
    }

    /// What this rank relays in a combine under `mask`: the dispatch's record where
    /// this rank relayed the source then too, else the source's plan. First sends this
    /// rank's own plans to the substitutes relaying for it since its dispatch. Under
    /// the dispatch's own mask that is the dispatch's record, as it is.
    pub(super) fn relayed_now<'h>(
        &self,
        handle: &'h NormalHandle,
        mask: &CallMask,
        wait: &Wait<'_>,
    ) -> Result<Cow<'h, [Relayed]>> {
        let topo = self.topo;
        if handle.masked == mask.masked {
            return Ok(Cow::Borrowed(&handle.relay));
        }
        let then = Relays::new(topo, &handle.masked)?;
        for m in topo.remote_nodes() {
            let now = mask.relays.of(topo.rank, m);
            if let Some(now) = now.filter(|&now| Some(now) != then.of(topo.rank, m)) {
                self.send_plan(handle, m, now.rank, wait)?;
            }
        }
        let mut relayed = Vec::new();
        for src in mask.relays.sources(topo.rank) {
            match handle.relay.iter().find(|r| r.src == src) {
                Some(r) => relayed.push(r.clone()),
                None => relayed.extend(self.recv_plan(src, wait)?),
            }
        }
        Ok(Cow::Owned(relayed))
    }

    /// Tell `relay` which of this rank's tokens went to node `m`, and to which of its
    /// ranks: a dispatch packet without rows.
    fn send_plan(
        &self,
        handle: &NormalHandle,
        m: usize,
        relay: usize,
        wait: &Wait<'_>,
    ) -> Result<()> {
        let Some(staged) = self.stage_unless_lost(Channel::Dispatch, relay, wait)? else {
            return Ok(());
        };
        let r_n = self.topo.num_ranks;
        let (mut tokens, mut masks) = (Vec::new(), Vec::new());
        for (t, row) in handle.is_token_in_rank.chunks_exact(r_n).enumerate() {
            let bits = self.topo.local_bits(m, |r| row[r]);
            if bits != 0 {
                tokens.push(t as i32);
                masks.push(bits);
            }
        }
        let p = DispatchPacket::layout(tokens.len(), 0, PLAN).at_base(staged.area.offset());
        let local = self.symm.local();
        let header = DispatchHeader {
            tokens: tokens.len() as u32,
            ..Default::default()
        };
        local.put(p.header, &[header])?;
        local.put(p.src, &tokens)?;
        local.put(p.mask, &masks)?;
        let sent = self.net()?.send(staged, p.len, &[]);
        self.unless_lost(relay, sent).map(drop)
    }

    /// `src`'s plan ([`Ctx::send_plan`]), checked; `None` if `src` was lost.
    fn recv_plan(&self, src: usize, wait: &Wait<'_>) -> Result<Option<Relayed>> {
        let me = self.topo.rank;
        let what = || format!("rank {me}: combine: waiting for rank {src}'s tokens to relay");
        let landing = self.net()?.recv(Channel::Dispatch, src, wait, &what);
        let Some(landing) = self.unless_lost(src, landing)? else {
            return Ok(None);
        };
        let local = self.symm.local();
        let head: DispatchHeader = local.get_vec(landing.prefix(16)?.cast())?[0];
        let n = head.tokens as usize;
        let t_max = self.normal_areas()?.shape.max_tokens;
        let p = DispatchPacket::layout(n, 0, PLAN).at_base(landing.offset());
        if n > t_max || p.len > landing.len() {
            return Err(protocol!(
                "rank {me}: rank {src}'s relay plan announces {n} tokens (at most {t_max})"
            ));
        }
        let (tokens, masks) = (local.get_vec(p.src)?, local.get_vec(p.mask)?);
        let bad = |&t: &i32| t < 0 || t as usize >= t_max;
        if tokens.iter().any(bad) || masks.iter().any(|&m| m >> self.topo.ranks_per_node != 0) {
            return Err(protocol!(
                "rank {me}: rank {src}'s relay plan names tokens or ranks out of range"
            ));
        }
        Ok(Some(Relayed { src, tokens, masks }))
    }
}

/// A relay plan is a dispatch packet without rows, ids or weights.
const PLAN: RowFormat = RowFormat {
    row_bytes: 0,
    groups: 0,
    topk: 0,
    weights: 0,
};

/// The ranks masked in `now` but not in `before`.
fn lost(now: &[bool], before: &[bool]) -> Vec<usize> {
    (0..now.len()).filter(|&r| now[r] && !before[r]).collect()
}
