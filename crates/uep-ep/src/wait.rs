//! Waiting: the one primitive every wait of the EP layer goes through.
//!
//! A GPU kernel spins on a flag in registered memory; on a host shared by several ranks
//! a pure spin would steal the cores the other ranks need, so a wait spins briefly,
//! then yields, then sleeps ([`Backoff`]). Whatever it waits for, [`Wait::until`]
//! also watches, in one place:
//!
//! * the abort word: a rank that failed says so, and nobody waits for it;
//! * the peer waited on: a process on this host that is gone will never store;
//! * the ranks on other nodes: one the liveness watch found gone never will either;
//! * the proxy: a network path that stopped will never deliver;
//! * the deadline: a wait that cannot finish fails with a message naming the rank,
//!   the call, the peer, the counter, what it expected and what it saw.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use uep_shm::Region;

use crate::area::Mem;
use crate::error::{EpError, Lost, Result};
use crate::map::ControlAreas;

/// Spin iterations before the first yield; short, because a peer on the same core
/// cannot make progress while we spin.
const SPIN_LIMIT: u32 = 64;
/// Yields before falling back to short sleeps.
const YIELD_LIMIT: u32 = 256;
/// Sleep once a wait has gone on for a while: cheap on the cores, and still far
/// below the deadlines a user sets.
const SLEEP: Duration = Duration::from_micros(20);
/// How often (in backoff steps) a wait looks at the slower signals: `/proc` for a
/// peer's process, the proxy's health.
const SLOW_CHECK_EVERY: u32 = 256;

/// Busy-wait without ever yielding or sleeping: how a GPU kernel waits. For comparing
/// the backoff against in benchmarks (`uep bench --spin-waits`); on a shared host it
/// steals the cores the other ranks need.
static SPIN_ONLY: AtomicBool = AtomicBool::new(false);

/// Make every wait of this process a pure spin (`true`) or the default backoff.
pub fn set_spin_only(spin: bool) {
    SPIN_ONLY.store(spin, Ordering::Relaxed);
}

/// Spin, then yield, then sleep: one step of a bounded wait.
#[derive(Debug, Default)]
pub struct Backoff {
    step: u32,
}

impl Backoff {
    /// A fresh backoff, starting with spins.
    pub fn new() -> Self {
        Self { step: 0 }
    }

    /// Steps taken so far.
    pub fn step(&self) -> u32 {
        self.step
    }

    /// Wait a little, longer each time.
    pub fn snooze(&mut self) {
        if SPIN_ONLY.load(Ordering::Relaxed) {
            std::hint::spin_loop();
        } else if self.step < SPIN_LIMIT {
            for _ in 0..(1 << (self.step / 16).min(4)) {
                std::hint::spin_loop();
            }
        } else if self.step < SPIN_LIMIT + YIELD_LIMIT {
            std::thread::yield_now();
        } else {
            std::thread::sleep(SLEEP);
        }
        // Keeps counting under SPIN_ONLY too, so the slow checks still run.
        self.step = self.step.wrapping_add(1);
    }
}

/// The process id a node peer's `region` names, if that process is gone: how a wait
/// tells that a peer on this host died.
pub(crate) fn dead_process(region: &Region, control: &ControlAreas) -> Result<Option<u32>> {
    let pid = region.word(control.pid, 0)?.load(Ordering::Acquire) as u32;
    Ok((pid != 0 && process_gone(pid)).then_some(pid))
}

/// Whether process `pid` is gone (exited, or a zombie waiting to be reaped).
pub fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may contain spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => true,
    }
}

/// Pack an epoch and a 32-bit value into one counter word.
pub fn epoch_word(epoch: u32, value: u32) -> u64 {
    ((epoch as u64) << 32) | value as u64
}

/// Who a wait waits on: the peer's rank and, when it shares this host, its region
/// (where its process id is).
#[derive(Clone, Copy, Debug)]
pub struct Peer<'a> {
    /// The peer's rank.
    pub rank: usize,
    /// Its region, when mapped (same host).
    pub region: Option<&'a Region>,
}

/// Everything the waits of one call check besides their own condition; see the module
/// docs. Cheap to copy.
#[derive(Clone, Copy)]
pub struct Wait<'a> {
    /// When to give up.
    pub deadline: Instant,
    /// The deadline as a duration, for messages.
    timeout: Duration,
    /// This rank's region and where its control words are.
    region: &'a Region,
    control: &'a ControlAreas,
    /// Whether other ranks' failures end the wait: the abort word and the liveness
    /// watch (not while this rank tells others that it failed, or waits for its own
    /// proxy).
    watch_peers: bool,
    /// Elastic mode: only the awaited peer's loss ends the wait (the caller masks it
    /// and goes on); other ranks' losses are not this wait's business.
    elastic: bool,
    /// The proxy and the ranks on other nodes, when there is a network path.
    net: Option<&'a dyn Remote>,
    /// Elastic mode: asked at the slower pace to look at the ranks not waited on.
    elsewhere: Option<&'a dyn LostElsewhere>,
}

/// Asked, in elastic mode, to look at the ranks a wait does not wait on (only the
/// awaited rank's loss ends an elastic wait), at the pace of the wait's slower checks.
/// The elastic layer says at its door which ranks are lost while a joiner it just let
/// in may wait for one of them, and the survivors for the joiner.
pub trait LostElsewhere {
    /// Look for ranks lost other than the awaited one.
    fn lost_elsewhere(&self);
}

/// What a wait watches beyond this node: the proxy's health and the ranks on other
/// nodes. The network path implements it; the wait sits below it.
pub trait Remote {
    /// A fatal error of the proxy, if any.
    fn check(&self) -> Result<()>;
    /// Whether `rank` (on another node) is gone, and how that was known.
    fn lost(&self, rank: usize) -> Option<Lost>;
    /// The first rank on another node found gone, if any (one load when none is).
    fn first_lost(&self) -> Option<Lost>;
    /// After the proxy failed: the first rank on another node found gone, waiting a
    /// moment for the watch's verdict (a write to a peer that just died fails before
    /// the watch reads its closed connection, and the verdict names the dead rank).
    fn lost_behind_failure(&self) -> Option<Lost>;
    /// For a rank on another node: where it is and that only the network reaches it,
    /// for the message of a wait on it that timed out.
    fn remote_note(&self, rank: usize) -> Option<String>;
}

impl<'a> Wait<'a> {
    /// The waits of a call starting now, with `timeout` to go.
    pub(crate) fn new(
        timeout: Duration,
        region: &'a Region,
        control: &'a ControlAreas,
        net: Option<&'a dyn Remote>,
    ) -> Self {
        Wait {
            deadline: Instant::now() + timeout,
            timeout,
            region,
            control,
            watch_peers: true,
            elastic: false,
            net,
            elsewhere: None,
        }
    }

    /// The same, in elastic mode (see the field), telling `to` of ranks lost other than
    /// the awaited one ([`LostElsewhere`]).
    pub(crate) fn elastic_noting(self, to: &'a dyn LostElsewhere) -> Self {
        Wait {
            elastic: true,
            elsewhere: Some(to),
            ..self
        }
    }

    /// The same, not ended by other ranks' failures (the abort word, the liveness
    /// watch): for this rank's own progress.
    pub(crate) fn ignoring_peers(self) -> Self {
        Wait {
            watch_peers: false,
            ..self
        }
    }

    /// The same, giving up at `deadline` if that is sooner.
    pub(crate) fn sooner(self, deadline: Instant) -> Self {
        Wait {
            deadline: self.deadline.min(deadline),
            ..self
        }
    }

    /// Wait until `ready()` returns a value, watching `peer`; `what()` names who waits
    /// for what, `seen()` says what was seen if the deadline passes.
    pub fn until<T>(
        &self,
        peer: Option<Peer<'_>>,
        what: &dyn Fn() -> String,
        seen: &dyn Fn() -> String,
        mut ready: impl FnMut() -> Option<T>,
    ) -> Result<T> {
        let mut backoff = Backoff::new();
        loop {
            if let Some(v) = ready() {
                return Ok(v);
            }
            self.check(peer, what, backoff.step())?;
            if Instant::now() >= self.deadline {
                let mut detail = seen();
                if let Some(note) = peer.zip(self.net).and_then(|(p, n)| n.remote_note(p.rank)) {
                    detail = format!("{detail}; {note}");
                }
                return Err(EpError::Timeout {
                    what: what(),
                    detail,
                    waited: self.timeout,
                });
            }
            backoff.snooze();
        }
    }

    /// Wait until `word >= target` (acquire loads); returns what was seen.
    pub fn at_least(
        &self,
        word: &AtomicU64,
        target: u64,
        peer: Option<Peer<'_>>,
        what: &dyn Fn() -> String,
    ) -> Result<Seen> {
        let seen = || format!("expected >= {target}, saw {}", word.load(Ordering::Acquire));
        let value = self.until(peer, what, &seen, || {
            let v = word.load(Ordering::Acquire);
            (v >= target).then_some(v)
        })?;
        Ok(Seen { value })
    }

    /// Wait until the high 32 bits of `word` (an epoch) equal `epoch`; what was seen
    /// holds the low 32 bits (the value published with it).
    pub fn epoch(
        &self,
        word: &AtomicU64,
        epoch: u32,
        peer: Option<Peer<'_>>,
        what: &dyn Fn() -> String,
    ) -> Result<Seen> {
        let seen = || {
            let v = word.load(Ordering::Acquire);
            format!(
                "expected epoch {epoch}, saw epoch {} (value {})",
                v >> 32,
                v as u32
            )
        };
        let value = self.until(peer, what, &seen, || {
            let v = word.load(Ordering::Acquire);
            ((v >> 32) as u32 == epoch).then_some(u64::from(v as u32))
        })?;
        Ok(Seen { value })
    }

    /// The abort word, the watched peer's process and the proxy: `Err` if the wait is
    /// hopeless.
    fn check(&self, peer: Option<Peer<'_>>, what: &dyn Fn() -> String, step: u32) -> Result<()> {
        if step % SLOW_CHECK_EVERY == SLOW_CHECK_EVERY - 1 {
            if let Some(Peer {
                rank,
                region: Some(region),
            }) = peer
            {
                if let Some(pid) = dead_process(region, self.control)? {
                    return Err(EpError::PeerDied {
                        what: what(),
                        peer: rank,
                        pid,
                    });
                }
            }
            if let Some(net) = self.net {
                if let Err(failure) = net.check() {
                    let lost = self.watch_peers.then(|| net.lost_behind_failure());
                    return Err(match lost.flatten() {
                        Some(lost) => EpError::PeerLost {
                            what: what(),
                            lost: Box::new(lost),
                        },
                        None => failure,
                    });
                }
            }
        }
        // A rank that failed says why, which tells more than its exit does: the abort
        // word first, then the watch over other nodes.
        if !self.watch_peers {
            return Ok(());
        }
        if let Some((peer, reason)) = abort_reason(self.region, self.control) {
            return Err(EpError::PeerAborted {
                what: what(),
                peer,
                reason,
            });
        }
        let Some(net) = self.net else {
            return Ok(());
        };
        let lost = match self.elastic {
            true => peer.and_then(|p| net.lost(p.rank)),
            false => net.first_lost(),
        };
        if let Some(to) = self.elsewhere {
            if lost.is_none() && step % SLOW_CHECK_EVERY == SLOW_CHECK_EVERY - 1 {
                to.lost_elsewhere();
            }
        }
        match lost {
            Some(lost) => Err(EpError::PeerLost {
                what: what(),
                lost: Box::new(lost),
            }),
            None => Ok(()),
        }
    }
}

/// What a wait on a writer's word acquired: the value it saw, and the proof that the
/// writer published what it wrote before (its epoch, count or announcement). Only the
/// waits make one, and the EP layer reads an area a peer wrote only with one.
#[derive(Debug)]
pub struct Seen {
    value: u64,
}

impl Seen {
    /// The value the wait saw.
    pub fn value(&self) -> u64 {
        self.value
    }

    /// What a wait whose acquire load saw `value` (a word met, or its low half) made.
    pub(crate) fn acquired(value: u64) -> Seen {
        Seen { value }
    }

    /// A `Seen` for tests of readers whose memory no peer writes.
    #[cfg(test)]
    pub(crate) fn nothing_to_wait_for() -> Seen {
        Seen { value: 0 }
    }
}

/// The first rank that failed and why, if any rank did (from this rank's abort word
/// and that rank's message slot).
pub fn abort_reason(region: &Region, control: &ControlAreas) -> Option<(usize, String)> {
    let who = region.word(control.abort, 0).ok()?.load(Ordering::Acquire);
    let who = (who as usize).checked_sub(1)?;
    let slot = control.abort_msg_of(who).ok()?;
    let mut reason = vec![0u8; slot.len()];
    let _ = region.get(slot, &mut reason);
    let end = reason.iter().position(|&b| b == 0).unwrap_or(reason.len());
    Some((who, String::from_utf8_lossy(&reason[..end]).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BufferConfig;
    use crate::map::RegionMap;

    fn region() -> (Region, RegionMap) {
        let map = RegionMap::new(&BufferConfig::new(4, 8, 1, 4, 0), 2, false);
        (Region::anonymous(map.total).unwrap(), map)
    }

    #[test]
    fn waits_time_out_with_a_message() {
        let (r, map) = region();
        let w = Wait::new(Duration::from_millis(5), &r, &map.control, None);
        let c = AtomicU64::new(3);
        let err = w
            .at_least(&c, 4, None, &|| {
                "rank 1 waiting for rank 2's counter".into()
            })
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rank 2")
                && msg.contains(">= 4")
                && msg.contains("saw 3")
                && msg.contains("5ms"),
            "{msg}"
        );
        let err = w.epoch(&c, 9, None, &|| "x".into()).unwrap_err();
        assert!(err.to_string().contains("expected epoch 9"), "{err}");
    }

    #[test]
    fn the_abort_word_ends_a_wait_with_the_reason() {
        let (r, map) = region();
        r.put(map.control.abort_msg_of(1).unwrap(), b"rank 1: bad input")
            .unwrap();
        r.word(map.control.abort, 0)
            .unwrap()
            .store(2, Ordering::Release);
        let w = Wait::new(Duration::from_secs(60), &r, &map.control, None);
        let c = AtomicU64::new(0);
        let err = w
            .at_least(&c, 1, None, &|| "rank 0 waiting".into())
            .unwrap_err();
        assert!(
            matches!(&err, EpError::PeerAborted { peer: 1, reason, .. } if reason == "rank 1: bad input"),
            "{err}"
        );
        // Not while telling others of a failure.
        let quiet = Wait::new(Duration::from_millis(5), &r, &map.control, None).ignoring_peers();
        assert!(matches!(
            quiet.at_least(&c, 1, None, &|| "x".into()),
            Err(EpError::Timeout { .. })
        ));
    }

    #[test]
    fn a_dead_peer_ends_the_wait_long_before_the_deadline() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert!(process_gone(pid));
        assert!(!process_gone(std::process::id()));
        let (r, map) = region();
        let peer_region = Region::anonymous(map.total).unwrap();
        peer_region
            .word(map.control.pid, 0)
            .unwrap()
            .store(pid as u64, Ordering::Release);
        let start = Instant::now();
        let w = Wait::new(Duration::from_secs(60), &r, &map.control, None);
        let c = AtomicU64::new(0);
        let peer = Peer {
            rank: 3,
            region: Some(&peer_region),
        };
        let err = w
            .at_least(&c, 1, Some(peer), &|| "rank 0 waiting for rank 3".into())
            .unwrap_err();
        assert!(
            err.to_string()
                .ends_with(&format!("rank 3 (pid {pid}) has died")),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn waits_see_a_later_store() {
        let (r, map) = region();
        let c = std::sync::Arc::new(AtomicU64::new(0));
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            c2.store(epoch_word(5, 42), Ordering::Release);
        });
        let w = Wait::new(Duration::from_secs(5), &r, &map.control, None);
        assert_eq!(w.epoch(&c, 5, None, &|| "x".into()).unwrap().value(), 42);
        t.join().unwrap();
    }

    /// A network whose watch found rank 3 lost.
    struct Rank3Lost;

    impl Remote for Rank3Lost {
        fn check(&self) -> Result<()> {
            Ok(())
        }
        fn lost(&self, rank: usize) -> Option<Lost> {
            (rank == 3).then(|| Lost {
                rank,
                node: 1,
                host: "127.0.0.1".into(),
                how: crate::error::Gone::Died {
                    detail: "test".into(),
                },
                at: Instant::now(),
            })
        }
        fn first_lost(&self) -> Option<Lost> {
            self.lost(3)
        }
        fn lost_behind_failure(&self) -> Option<Lost> {
            self.first_lost()
        }
        fn remote_note(&self, _: usize) -> Option<String> {
            None
        }
    }

    #[derive(Default)]
    struct Told(std::cell::Cell<u32>);

    impl LostElsewhere for Told {
        fn lost_elsewhere(&self) {
            self.0.set(self.0.get() + 1);
        }
    }

    /// In elastic mode a wait on rank 1 goes on while rank 3 is lost (only the awaited
    /// rank's loss ends it), and asks whoever it notes losses for to look; a wait on
    /// rank 3 itself ends with its loss and asks nobody.
    #[test]
    fn an_elastic_wait_tells_of_a_rank_lost_elsewhere() {
        let (r, map) = region();
        let (net, told) = (Rank3Lost, Told::default());
        let w = Wait::new(Duration::from_millis(30), &r, &map.control, Some(&net));
        let w = w.elastic_noting(&told);
        let c = AtomicU64::new(0);
        let on = |rank| Some(Peer { rank, region: None });
        let err = w.at_least(&c, 1, on(1), &|| "x".into()).unwrap_err();
        assert!(matches!(err, EpError::Timeout { .. }), "{err}");
        assert!(told.0.get() >= 1, "never told");

        let told = Told::default();
        let w = Wait::new(Duration::from_secs(5), &r, &map.control, Some(&net));
        let err = (w.elastic_noting(&told))
            .at_least(&c, 1, on(3), &|| "x".into())
            .unwrap_err();
        assert!(matches!(err, EpError::PeerLost { .. }), "{err}");
        assert_eq!(told.0.get(), 0);
    }
}
