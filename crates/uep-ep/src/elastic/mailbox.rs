//! The agreement's messages on the wire. The protocol is [`crate::agree`]; this
//! module carries it:
//!
//! * to a rank of this node, into its region: round messages in a slot per (round
//!   parity, sender), decided masks in a slot per sender, each written and then
//!   published by its first word (a stamp), stored last;
//! * to a rank on another node, through the network path: round messages in the
//!   sender's ordered stream (landing in a slot per round parity), decided masks on a
//!   fenced key, so that a rank reads a peer's decision only when it needs it.
//!
//! A rank that decides without reading every round message a peer sent it (it decided
//! first, or adopted a decision) leaves them in that peer's stream; the peer's decided
//! mask says how many it sent, and the next agreement counts the rest as received
//! before its first read ([`Ctx::settle`]), and a normal call on an elastic Buffer
//! before its own (normal mode reads the same streams).
//!
//! Slots are reused safely: a round's slot is written again two rounds later, which no
//! rank reaches before every rank that awaits the sender has read it; a decided mask
//! is written again in the next agreement, which no rank decides before every rank it
//! awaits has settled this one.

use std::sync::atomic::Ordering;

use crate::agree::{bit, to_bits, to_mask, Agreement, Bits, Heard, Msg};
use crate::area::{Area, Mem};
use crate::ctx::Ctx;
use crate::error::{EpError, Result};
use crate::net::NetPath;
use crate::packet::Channel;
use crate::wait::{Peer, Wait};

/// The stamp of round `round` of agreement `k`, which its slot holds once written.
fn stamp(k: u64, round: u32) -> u64 {
    k << 16 | u64::from(round)
}

/// One agreement's messages, as seen by one rank.
pub(super) struct Mailbox<'a> {
    cx: &'a Ctx,
    /// The agreement's number (the same on every rank).
    k: u64,
    call: &'a str,
    wait: Wait<'a>,
    /// Words of a rank set.
    words: usize,
    /// `[rank]`: round messages read from its stream (ranks on other nodes).
    read: Vec<u32>,
    /// `[rank]`: its decided mask read.
    decided: Vec<bool>,
    /// Messages sent (for fault injection).
    sent: std::cell::Cell<usize>,
    /// The ranks round 1 awaits: the only ones this agreement sends to (the others
    /// were found gone, or are out since an earlier agreement masked them).
    awaited: Bits,
    /// `[rank]`: the count of its decisions this agreement's makes (`Elastic::decided_base`).
    decisions: Vec<u64>,
}

/// A message as words: `[stamp, set, view]` or `[k, rounds, set]`.
fn encode(k: u64, msg: &Msg) -> Vec<u64> {
    match msg {
        Msg::Round { round, set, view } => {
            let mut w = vec![stamp(k, *round)];
            w.extend(set);
            w.extend(view);
            w
        }
        Msg::Decided { set, rounds } => {
            let mut w = vec![k, u64::from(*rounds)];
            w.extend(set);
            w
        }
    }
}

impl<'a> Mailbox<'a> {
    pub(super) fn new(
        cx: &'a Ctx,
        (k, base): (u64, &[u64]),
        call: &'a str,
        awaited: Bits,
    ) -> Mailbox<'a> {
        let n = cx.topo.num_ranks;
        Mailbox {
            cx,
            k,
            call,
            wait: cx.wait().elastic_noting(cx),
            words: cx.map.control.mask_words,
            read: vec![0; n],
            decided: vec![false; n],
            sent: std::cell::Cell::new(0),
            awaited,
            decisions: base.iter().map(|b| k - b).collect(),
        }
    }

    /// Send `msgs` to every rank awaited in round 1 and not found gone since.
    pub(super) fn post(&self, msgs: &[Msg]) -> Result<()> {
        for msg in msgs {
            let words = encode(self.k, msg);
            let to =
                (0..self.cx.topo.num_ranks).filter(|&r| bit(&self.awaited, r) && !self.cx.gone(r));
            for r in to {
                self.cx.fault_point(self.k, self.sent.get());
                self.sent.set(self.sent.get() + 1);
                match self.cx.topo.is_local(r) {
                    true => self.store(r, msg, &words)?,
                    // A peer found gone while its last packet is in flight is masked,
                    // as a wait on it would (its round is then resolved as gone).
                    false => drop(self.cx.unless_lost(r, self.send(r, msg, &words))?),
                }
            }
        }
        Ok(())
    }

    /// The slot of `msg` from `src` in a region of this node: `(stamp, the rest)`.
    fn slot(&self, src: usize, msg: &Msg) -> Result<(Area<u64>, Area<u64>)> {
        let control = &self.cx.map.control;
        match msg {
            Msg::Round { round, .. } => control.agree_slot(*round as usize % 2, src),
            Msg::Decided { .. } => control.decided_slot(src),
        }
    }

    fn store(&self, r: usize, msg: &Msg, words: &[u64]) -> Result<()> {
        let (first, rest) = self.slot(self.cx.topo.rank, msg)?;
        let region = self.cx.peer_region(r)?;
        region.put(rest.prefix(words.len() - 1)?, &words[1..])?;
        region.word(first, 0)?.store(words[0], Ordering::Release);
        Ok(())
    }

    fn send(&self, r: usize, msg: &Msg, words: &[u64]) -> Result<()> {
        let net = self.cx.net()?;
        let ch = match msg {
            Msg::Round { round, .. } => Channel::agree(*round as usize),
            Msg::Decided { .. } => Channel::Decided,
        };
        let staged = net.stage(ch, r, &self.wait)?;
        let len = 8 * words.len();
        let part = staged.area.prefix(len)?;
        self.cx.symm.local().put(part.cast::<u64>(), words)?;
        match msg {
            Msg::Round { .. } => net.send(staged, len, &[]),
            Msg::Decided { .. } => {
                let write = staged.write_of(part)?;
                net.send_fenced(staged, &[vec![write]]).map(drop)
            }
        }
    }

    /// Wait for `q`'s message of `round` or its decided mask, whichever comes; `q` found
    /// gone is masked ([`Ctx::unless_lost`]).
    pub(super) fn hear(&mut self, q: usize, round: u32) -> Result<Heard> {
        let (me, call) = (self.cx.topo.rank, self.call);
        let what =
            || format!("rank {me}: {call}: agreeing on the mask with rank {q} (round {round})");
        let got = match self.cx.topo.is_local(q) {
            true => self.hear_local(q, round, &what),
            false => self.hear_remote(q, round, &what),
        };
        Ok(match self.cx.unless_lost(q, got)? {
            Some(msg) => Heard::Msg(msg),
            None => Heard::Gone,
        })
    }

    fn hear_local(&self, q: usize, round: u32, what: &dyn Fn() -> String) -> Result<Msg> {
        let local = self.cx.symm.local();
        let control = &self.cx.map.control;
        let (r_first, r_rest) = control.agree_slot(round as usize % 2, q)?;
        let (d_first, d_rest) = control.decided_slot(q)?;
        let (r_word, d_word) = (local.word(r_first, 0)?, local.word(d_first, 0)?);
        let want = stamp(self.k, round);
        let seen = || {
            format!(
                "round slot {}, decided slot {}",
                r_word.load(Ordering::Acquire),
                d_word.load(Ordering::Acquire)
            )
        };
        let decided = self.wait.until(Some(self.cx.peer(q)), what, &seen, || {
            match (
                d_word.load(Ordering::Acquire),
                r_word.load(Ordering::Acquire),
            ) {
                (d, _) if d == self.k => Some(true),
                (_, r) if r == want => Some(false),
                _ => None,
            }
        })?;
        match decided {
            true => {
                let (rounds, set) = decided_parts(&local.get_vec(d_rest)?, self.words);
                Ok(Msg::Decided { set, rounds })
            }
            false => self.decode_round(q, round, want, &local.get_vec(r_rest)?),
        }
    }

    fn hear_remote(&mut self, q: usize, round: u32, what: &dyn Fn() -> String) -> Result<Msg> {
        let net = self.cx.net()?;
        let _watch = net.watch_arrivals();
        let ch = Channel::agree(round as usize);
        let peer = Peer {
            rank: q,
            region: None,
        };
        let seen = || "neither its round message nor its decided mask has landed".to_string();
        let landed = self.wait.until(Some(peer), what, &seen, || {
            match net.fenced_landed(Channel::Decided, q, self.decisions[q]) {
                Ok(true) => return Some(Ok(None)),
                Err(e) => return Some(Err(e)),
                Ok(false) => {}
            }
            net.try_recv(ch, q).map(|a| a.map(Some)).transpose()
        })??;
        let local = self.cx.symm.local();
        let Some(area) = landed else {
            let (rounds, set) = self.cx.landed_decision(q, self.k, self.call)?;
            skip_unread(net, q, rounds, self.read[q], &self.wait)?;
            self.decided[q] = true;
            return Ok(Msg::Decided { set, rounds });
        };
        let all = local.get_vec(area.cast::<u64>().prefix(1 + 2 * self.words)?)?;
        self.read[q] += 1;
        self.decode_round(q, round, all[0], &all[1..])
    }

    /// `q`'s round message from its stamp and the rest, checked against the round.
    fn decode_round(&self, q: usize, round: u32, first: u64, rest: &[u64]) -> Result<Msg> {
        let want = stamp(self.k, round);
        if first != want {
            return Err(EpError::Protocol(format!(
                "rank {}: {}: agreement {}: rank {q} sent a round message stamped {first:#x}, expected {want:#x}",
                self.cx.topo.rank, self.call, self.k
            )));
        }
        let w = self.words;
        Ok(Msg::Round {
            round,
            set: rest[..w].to_vec(),
            view: rest[w..2 * w].to_vec(),
        })
    }

    /// The ranks on other nodes whose decided mask was not read, with the round
    /// messages read from each ([`Ctx::settle`] accounts for the rest next time).
    pub(super) fn unsettled(&self) -> Vec<Option<u32>> {
        (0..self.cx.topo.num_ranks)
            .map(|r| {
                let open = bit(&self.awaited, r)
                    && !self.cx.topo.is_local(r)
                    && !self.decided[r]
                    && !self.cx.gone(r);
                open.then_some(self.read[r])
            })
            .collect()
    }
}

/// `(rounds, set)` of a decided mask from its words after the agreement's number.
fn decided_parts(rest: &[u64], words: usize) -> (u32, Bits) {
    let rounds = u32::try_from(rest[0]).unwrap_or(u32::MAX);
    (rounds, rest[1..1 + words].to_vec())
}

/// `q`'s stream holds `rounds` round messages of an agreement, `read` of them read:
/// count the others as received (once landed).
fn skip_unread(net: &NetPath, q: usize, rounds: u32, read: u32, wait: &Wait<'_>) -> Result<()> {
    let unread = rounds.checked_sub(read).ok_or_else(|| {
        EpError::Protocol(format!(
            "rank {q} says it sent {rounds} round messages, but {read} were read"
        ))
    })?;
    let what = || format!("waiting for rank {q}'s last {unread} round messages to land");
    net.skip(q, u64::from(unread), wait, &what)
}

impl Ctx {
    /// The agreement round (module docs of `elastic` and `agree`): returns the mask
    /// this call uses, the same on every survivor; ranks found gone meanwhile that no
    /// survivor proposed are masked from the next call.
    pub(crate) fn agree(&self, call: &str, admits: bool) -> Result<Vec<bool>> {
        let el = self.elastic_state()?;
        self.ll_call_begins();
        let (me, n) = (self.topo.rank, self.topo.num_ranks);
        let k = {
            let mut e = el.borrow_mut();
            e.round += 1;
            e.round
        };
        self.settle(k - 1, call)?;
        // A door that cannot be read (its store is gone) lets nobody in; calls go on.
        if admits && el.borrow().agreed.iter().any(|&m| m) {
            if let Err(e) = self.read_door() {
                tracing::warn!(rank = me, "cannot read the door: {e}");
            }
        }
        let (mine, awaited) = {
            let e = el.borrow();
            let words = self.map.control.mask_words;
            // Not awaited: ranks found gone, and ranks still masked since the last
            // agreement (those masked since by a caller are, so that they learn it).
            let awaited = |r: usize| r != me && !e.gone[r] && !(e.agreed[r] && e.masked[r]);
            // Proposed unmasked: those let in already (they are in this call's mask all
            // the same), and the lowest joiner this rank is ready for (`join`) while
            // none waits to be let in. One at a time, so that a joiner is let in by
            // ranks that all took part before it: each survivor proposes at most one,
            // and the union leaves unmasked only one that all proposed.
            let d = &e.doorway;
            let waiting = d.let_in.iter().any(Option::is_some);
            let next = (0..n)
                .find(|&r| d.asking[r].is_some())
                .filter(|_| admits && !waiting);
            let proposed = |r: usize| e.masked[r] && d.let_in[r].is_none() && next != Some(r);
            (
                to_bits(&(0..n).map(proposed).collect::<Vec<_>>(), words),
                to_bits(&(0..n).map(awaited).collect::<Vec<_>>(), words),
            )
        };
        let base = el.borrow().decided_base.clone();
        let mut mail = Mailbox::new(self, (k, &base), call, awaited.clone());
        let (mut a, out) = Agreement::start(me, mine.clone(), awaited);
        mail.post(&out)?;
        while let Some(q) = a.next_awaited() {
            let heard = mail.hear(q, a.round())?;
            mail.post(&a.hear(q, heard)?)?;
        }
        // Nothing left to await means decided (`Agreement::next_awaited`).
        let decided = a.decided().cloned().ok_or_else(|| {
            EpError::internal(format!("rank {me}: {call}: agreement {k} ended undecided"))
        })?;
        el.borrow_mut().unsettled = mail.unsettled();
        self.adopt(call, &mine, &decided, admits)
    }

    /// Settle the last agreement now (module docs): before a normal call reads the
    /// streams, and before the network path closes, so that peers' proxies are not
    /// left holding writes (their decisions) to a closed endpoint.
    pub(crate) fn settle_last(&self) -> Result<()> {
        let k = self.elastic_state()?.borrow().round;
        self.settle(k, "settling the last agreement")
    }

    /// Count the round messages peers on other nodes sent in agreement `k` that were
    /// not read as received, from their decided masks (module docs).
    fn settle(&self, k: u64, call: &str) -> Result<()> {
        let el = self.elastic_state()?;
        let open = std::mem::take(&mut el.borrow_mut().unsettled);
        let base = el.borrow().decided_base.clone();
        let me = self.topo.rank;
        let wait = self.wait().elastic_noting(self);
        for (q, read) in open.into_iter().enumerate() {
            let Some(read) = read.filter(|_| !self.gone(q)) else {
                continue;
            };
            let net = self.net()?;
            let what = || {
                format!("rank {me}: {call}: waiting for rank {q}'s decided mask of agreement {k}")
            };
            let landed = net.wait_fenced(Channel::Decided, q, 0, k - base[q], &wait, &what);
            if self.unless_lost(q, landed)?.is_none() {
                continue;
            }
            let (rounds, _) = self.landed_decision(q, k, call)?;
            let skipped = skip_unread(net, q, rounds, read, &wait);
            self.unless_lost(q, skipped)?;
        }
        Ok(())
    }

    /// Rank `q`'s decided mask of agreement `k`, landed through the network path:
    /// `(rounds, set)`.
    fn landed_decision(&self, q: usize, k: u64, call: &str) -> Result<(u32, Bits)> {
        let words = 2 + self.map.control.mask_words;
        let area = self.net()?.landing(Channel::Decided, q)?.cast::<u64>();
        let all = self.symm.local().get_vec(area.prefix(words)?)?;
        if all[0] != k {
            return Err(EpError::Protocol(format!(
                "rank {}: {call}: rank {q}'s decided mask is of agreement {}, expected {k}",
                self.topo.rank, all[0]
            )));
        }
        Ok(decided_parts(&all[1..], words - 2))
    }

    /// Use the decided set: fail if it masks this rank or lacks what this rank
    /// proposed; else mask its ranks, let in the joiners it leaves out, and remember
    /// it as the agreed mask. Returns the call's mask: the set and the joiners let in,
    /// who take part from the next dispatch or barrier.
    fn adopt(&self, call: &str, mine: &Bits, decided: &Bits, admits: bool) -> Result<Vec<bool>> {
        let (me, n) = (self.topo.rank, self.topo.num_ranks);
        let mut union = to_mask(decided, n);
        let lacks_mine = mine.iter().zip(decided).any(|(m, d)| m & !d != 0);
        if union[me] || lacks_mine {
            if lacks_mine {
                tracing::warn!(
                    rank = me,
                    "{call}: the survivors decided a mask without this rank's"
                );
            }
            let by: Vec<usize> = (0..n).filter(|&r| r != me && !union[r]).collect();
            return Err(EpError::Excluded { rank: me, by });
        }
        let mut e = self.elastic_state()?.borrow_mut();
        Ctx::decide_joiners(&mut e, &union, admits);
        for (r, m) in union.iter_mut().enumerate() {
            *m |= e.doorway.let_in[r].is_some();
        }
        for (r, &m) in union.iter().enumerate() {
            if m && !e.masked[r] {
                e.mask(r);
                e.why[r] = Some("masked by the other survivors".into());
            }
            // Masked during the round (not in the union): this call counts it.
            e.deferred[r] = e.masked[r] && !m;
        }
        e.agreed.clone_from(&union);
        for w in decided {
            e.digest = crate::fnv::step(e.digest, *w);
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
        assert_eq!(to_mask(&to_bits(&mask, 3), 130), mask);
    }

    #[test]
    fn messages_keep_their_fields() {
        let set = vec![5, 1];
        let view = vec![7, 0];
        let round = Msg::Round {
            round: 3,
            set: set.clone(),
            view,
        };
        let w = encode(9, &round);
        assert_eq!(w[0], stamp(9, 3));
        assert_eq!(w.len(), 5);
        let decided = encode(9, &Msg::Decided { set, rounds: 2 });
        assert_eq!(decided, vec![9, 2, 5, 1]);
    }
}
