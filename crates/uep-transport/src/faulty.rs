//! [`FaultyTransport`]: reproducible reordering, delay and burst splitting
//! over any [`Transport`], to prove the EP layer's ordering emulation.
//!
//! Posted writes (and imm-only writes) are held in a window and issued to the
//! inner transport from the poll calls, in a shuffled order, some only after
//! a random number of polls, and sometimes only part of the ready set per
//! poll. Nothing is ever dropped or duplicated: each posted operation is
//! issued to the inner transport exactly once, and its completion is the
//! inner one (so it is reported only after the inner write completed).

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::{Arrival, Caps, Completion, PeerAddr, Transport, TransportError, WriteOp};

/// Fault-injection settings. The same seed and the same sequence of calls
/// (and inner answers) reproduce the same issue order.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultConfig {
    /// Seed of the ChaCha8 generator that makes every decision.
    pub seed: u64,
    /// Most operations held at once (1..=4096); a post beyond it answers
    /// [`TransportError::WouldBlock`] until a poll issues some.
    pub window: usize,
    /// Probability (0..=1) that a posted operation is held for extra polls.
    pub delay_prob: f64,
    /// Upper bound of that extra hold, in poll calls (>= 1 when delaying).
    pub max_delay_polls: u32,
    /// Probability (0..=1) that a poll issues only a random part of the
    /// ready operations (the rest wait for a later poll).
    pub split_prob: f64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            window: 16,
            delay_prob: 0.2,
            max_delay_polls: 4,
            split_prob: 0.3,
        }
    }
}

impl FaultConfig {
    /// Default settings with the given seed.
    pub fn with_seed(seed: u64) -> Self {
        Self {
            seed,
            ..Self::default()
        }
    }

    /// Checks the ranges documented on each field.
    pub fn validate(&self) -> Result<(), TransportError> {
        let prob = |name: &str, p: f64| {
            if (0.0..=1.0).contains(&p) {
                Ok(())
            } else {
                Err(TransportError::Invalid(format!(
                    "FaultConfig.{name} = {p} is not a probability; use 0.0..=1.0"
                )))
            }
        };
        prob("delay_prob", self.delay_prob)?;
        prob("split_prob", self.split_prob)?;
        if !(1..=4096).contains(&self.window) {
            return Err(TransportError::Invalid(format!(
                "FaultConfig.window = {} is out of range; use 1..=4096",
                self.window
            )));
        }
        if self.delay_prob > 0.0 && self.max_delay_polls == 0 {
            return Err(TransportError::Invalid(
                "FaultConfig.max_delay_polls is 0 while delay_prob > 0; use >= 1".into(),
            ));
        }
        Ok(())
    }
}

/// Counters of what [`FaultyTransport`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Operations accepted by a post.
    pub posted: u64,
    /// Operations handed to the inner transport.
    pub issued: u64,
    /// Operations issued while an operation posted before them was still held.
    pub reordered: u64,
    /// Operations given an extra hold of one or more polls.
    pub delayed: u64,
    /// Polls that issued only part of the ready operations.
    pub bursts_split: u64,
}

impl FaultStats {
    /// Total injected faults (reordered + delayed + bursts split).
    pub fn injected(&self) -> u64 {
        self.reordered + self.delayed + self.bursts_split
    }
}

#[derive(Clone, Copy, Debug)]
enum Op {
    Write {
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
        imm: u32,
    },
    Imm {
        peer: usize,
        imm: u32,
    },
}

#[derive(Debug)]
struct Held {
    seq: u64,
    op: Op,
    ctx: u64,
    /// Polls still to wait before the operation may be issued.
    delay: u32,
}

/// Wraps a transport and injects reordering, delays and split bursts into
/// its send path. Reports `ordered = false` and no native atomics.
///
/// Held operations are issued only from [`Transport::poll_send`] /
/// [`Transport::poll_recv`]; keep polling until [`FaultyTransport::held`] is
/// 0 before dropping, or the held operations are never sent.
pub struct FaultyTransport<T: Transport> {
    inner: T,
    cfg: FaultConfig,
    rng: ChaCha8Rng,
    held: Vec<Held>,
    next_seq: u64,
    stats: FaultStats,
    caps: Caps,
    /// A counter shared with other threads that mirrors `stats.injected()`, and what
    /// this injector last added to it (several injectors may share one total).
    mirror: Option<(Arc<AtomicU64>, u64)>,
}

impl<T: Transport> std::fmt::Debug for FaultyTransport<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyTransport")
            .field("caps", &self.caps)
            .field("cfg", &self.cfg)
            .field("held", &self.held.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<T: Transport> FaultyTransport<T> {
    /// Wraps `inner` with the given fault settings.
    pub fn new(inner: T, cfg: FaultConfig) -> Result<Self, TransportError> {
        cfg.validate()?;
        let ic = inner.caps();
        let caps = Caps {
            ordered: false,
            // Reordering would break write-then-atomic order, so atomics must
            // be emulated above this layer.
            native_atomics: false,
            max_write_bytes: ic.max_write_bytes,
            provider: format!("faulty({})", ic.provider),
        };
        Ok(Self {
            rng: ChaCha8Rng::seed_from_u64(cfg.seed),
            inner,
            cfg,
            held: Vec::new(),
            next_seq: 0,
            mirror: None,
            stats: FaultStats::default(),
            caps,
        })
    }

    /// Counters of injected faults so far.
    pub fn fault_stats(&self) -> FaultStats {
        self.stats
    }

    /// Operations posted but not yet handed to the inner transport.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The wrapped transport.
    pub fn inner(&self) -> &T {
        &self.inner
    }

    /// The wrapped transport, mutably (posting to it directly bypasses the
    /// fault injection).
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    fn hold(&mut self, op: Op, ctx: u64) -> Result<(), TransportError> {
        if self.held.len() >= self.cfg.window {
            return Err(TransportError::WouldBlock);
        }
        let delay = if self.cfg.delay_prob > 0.0 && self.rng.gen_bool(self.cfg.delay_prob) {
            self.stats.delayed += 1;
            self.rng.gen_range(1..=self.cfg.max_delay_polls)
        } else {
            0
        };
        self.held.push(Held {
            seq: self.next_seq,
            op,
            ctx,
            delay,
        });
        self.next_seq += 1;
        self.stats.posted += 1;
        Ok(())
    }

    /// One poll's worth of issuing: age delays, shuffle the ready set, maybe
    /// cut it short, and hand it to the inner transport in that order.
    /// Also add every injected fault to `total`, which other threads can read while this
    /// transport is owned by a proxy thread.
    pub fn mirror_injected(mut self, total: Arc<AtomicU64>) -> Self {
        self.mirror = Some((total, 0));
        self
    }

    fn publish(&mut self) {
        if let Some((total, published)) = &mut self.mirror {
            let now = self.stats.injected();
            total.fetch_add(now - *published, Ordering::Relaxed);
            *published = now;
        }
    }

    fn tick(&mut self) -> Result<(), TransportError> {
        if self.held.is_empty() {
            return Ok(());
        }
        for h in &mut self.held {
            h.delay = h.delay.saturating_sub(1);
        }
        let mut ready: Vec<usize> = (0..self.held.len())
            .filter(|&i| self.held[i].delay == 0)
            .collect();
        if ready.is_empty() {
            return Ok(());
        }
        ready.shuffle(&mut self.rng);
        if ready.len() > 1 && self.cfg.split_prob > 0.0 && self.rng.gen_bool(self.cfg.split_prob) {
            let k = self.rng.gen_range(1..ready.len());
            ready.truncate(k);
            self.stats.bursts_split += 1;
        }
        let mut issued = vec![false; self.held.len()];
        let mut result = Ok(());
        for &i in &ready {
            let h = &self.held[i];
            let r = match h.op {
                Op::Write {
                    peer,
                    local_off,
                    remote_off,
                    len,
                    imm,
                } => self.inner.post_write(WriteOp {
                    peer,
                    local_off,
                    remote_off,
                    len,
                    imm,
                    ctx: h.ctx,
                }),
                Op::Imm { peer, imm } => self.inner.post_imm(peer, imm, h.ctx),
            };
            match r {
                Ok(()) => {}
                // Inner queue full: the rest stay held for a later poll.
                Err(TransportError::WouldBlock) => break,
                Err(e) => {
                    // Validated at post time, so this is a hard transport
                    // failure; the operation is reported (not silently lost).
                    issued[i] = true;
                    result = Err(e);
                    break;
                }
            }
            // Overtook an earlier post that is still held?
            let seq = h.seq;
            if self
                .held
                .iter()
                .enumerate()
                .any(|(j, o)| !issued[j] && j != i && o.seq < seq)
            {
                self.stats.reordered += 1;
            }
            issued[i] = true;
            self.stats.issued += 1;
        }
        let mut k = 0;
        self.held.retain(|_| {
            k += 1;
            !issued[k - 1]
        });
        result
    }
}

impl<T: Transport> Transport for FaultyTransport<T> {
    fn caps(&self) -> &Caps {
        &self.caps
    }

    fn local_addr(&self) -> PeerAddr {
        self.inner.local_addr()
    }

    fn connect(&mut self, peers: &[PeerAddr]) -> Result<(), TransportError> {
        self.inner.connect(peers)
    }

    fn replace_peer(&mut self, peer: usize, addr: &PeerAddr) -> Result<(), TransportError> {
        self.inner.replace_peer(peer, addr)
    }

    fn validate_write(
        &self,
        peer: usize,
        local_off: u64,
        remote_off: u64,
        len: usize,
    ) -> Result<(), TransportError> {
        self.inner.validate_write(peer, local_off, remote_off, len)
    }

    fn post_write(&mut self, op: WriteOp) -> Result<(), TransportError> {
        let WriteOp {
            peer,
            local_off,
            remote_off,
            len,
            imm,
            ctx,
        } = op;
        // Reject bad posts now, not when the held op is issued much later.
        self.inner
            .validate_write(peer, local_off, remote_off, len)?;
        self.hold(
            Op::Write {
                peer,
                local_off,
                remote_off,
                len,
                imm,
            },
            ctx,
        )
    }

    fn post_imm(&mut self, peer: usize, imm: u32, ctx: u64) -> Result<(), TransportError> {
        self.inner.validate_write(peer, 0, 0, 0)?;
        self.hold(Op::Imm { peer, imm }, ctx)
    }

    fn post_atomic_add(
        &mut self,
        _peer: usize,
        _remote_off: u64,
        _value: u64,
        _ctx: u64,
    ) -> Result<(), TransportError> {
        Err(TransportError::Unsupported {
            op: "post_atomic_add",
            provider: self.caps.provider.clone(),
            why: "the fault injector reorders operations, so atomics must be emulated".into(),
        })
    }

    fn poll_send(&mut self, out: &mut Vec<Completion>) -> Result<usize, TransportError> {
        self.tick()?;
        self.publish();
        self.inner.poll_send(out)
    }

    fn poll_recv(&mut self, out: &mut Vec<Arrival>) -> Result<usize, TransportError> {
        // Polls of either queue count as "later polls" for held operations.
        self.tick()?;
        self.publish();
        self.inner.poll_recv(out)
    }

    fn abandon_peer(&mut self, peer: usize) -> Vec<u64> {
        // Held operations never reached the inner transport: they end here.
        let mut gone = Vec::new();
        self.held.retain(|h| {
            let to = match h.op {
                Op::Write { peer, .. } | Op::Imm { peer, .. } => peer,
            };
            if to == peer {
                gone.push(h.ctx);
            }
            to != peer
        });
        gone.extend(self.inner.abandon_peer(peer));
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::{MemNet, MemTransport};
    use crate::Side;

    /// Ranks 0 and 1 of an in-memory network of 4 KiB regions that answers
    /// WouldBlock past `cap` operations in flight: rank 0's endpoint, and rank 1's.
    fn pair(cap: usize) -> (MemNet, MemTransport, MemTransport) {
        let net = MemNet::with_max_in_flight(2, cap);
        let region = || uep_shm::Region::anonymous(4096).unwrap();
        let (a, b) = (net.endpoint(0, region()), net.endpoint(1, region()));
        (net, a, b)
    }

    /// Posts `n` writes then one signal, polling on back-pressure, and drains.
    /// Returns the (ctx, imm) of each post in the order the network saw them, the
    /// completions, and the injector's counts.
    fn run(cfg: FaultConfig, cap: usize, n: u64) -> (Vec<(u64, u32)>, Vec<u64>, FaultStats) {
        let (net, t, mut peer) = pair(cap);
        let mut t = FaultyTransport::new(t, cfg).unwrap();
        let mut done = Vec::new();
        let mut arr = Vec::new();
        for i in 0..=n {
            loop {
                let r = if i < n {
                    t.post_write(WriteOp {
                        peer: 1,
                        local_off: i * 8,
                        remote_off: i * 8,
                        len: 8,
                        imm: i as u32,
                        ctx: i,
                    })
                } else {
                    t.post_imm(1, u32::MAX, i)
                };
                match r {
                    Ok(()) => break,
                    Err(TransportError::WouldBlock) => {
                        t.poll_send(&mut done).unwrap();
                        peer.poll_recv(&mut arr).unwrap();
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }
        let mut polls = 0;
        while t.held() > 0 || done.len() < (n + 1) as usize {
            t.poll_send(&mut done).unwrap();
            peer.poll_recv(&mut arr).unwrap();
            polls += 1;
            assert!(polls < 10_000, "fault injector never drained");
        }
        assert_eq!(arr.len(), (n + 1) as usize);
        let ctxs = done.iter().map(|c| c.ctx()).collect();
        // Writes carry their index as the immediate; the signal (u32::MAX) is post n.
        let issued = (net.posts().iter())
            .map(|p| {
                (
                    if p.imm == u32::MAX {
                        n
                    } else {
                        u64::from(p.imm)
                    },
                    p.imm,
                )
            })
            .collect();
        (issued, ctxs, t.fault_stats())
    }

    #[test]
    fn never_drops_or_duplicates() {
        for seed in 0..40 {
            for (window, cap) in [(1, 1), (4, 2), (16, 64), (16, 3)] {
                let cfg = FaultConfig {
                    seed,
                    window,
                    delay_prob: 0.3,
                    max_delay_polls: 3,
                    split_prob: 0.5,
                };
                let (issued, mut ctxs, st) = run(cfg, cap, 100);
                let mut got: Vec<u64> = issued.iter().map(|x| x.0).collect();
                got.sort_unstable();
                assert_eq!(
                    got,
                    (0..=100).collect::<Vec<_>>(),
                    "seed {seed} window {window}"
                );
                ctxs.sort_unstable();
                assert_eq!(
                    ctxs,
                    (0..=100).collect::<Vec<_>>(),
                    "completions, seed {seed}"
                );
                assert_eq!((st.posted, st.issued), (101, 101));
            }
        }
    }

    #[test]
    fn reorders_reproducibly_and_signal_can_overtake() {
        let cfg = FaultConfig::with_seed(7);
        let a = run(cfg.clone(), 64, 50);
        let b = run(cfg, 64, 50);
        assert_eq!(a.0, b.0, "same seed must give the same issue order");
        let c = run(FaultConfig::with_seed(8), 64, 50);
        assert_ne!(a.0, c.0, "different seeds should differ");
        assert!(a.2.reordered > 0 && a.2.delayed > 0, "{:?}", a.2);
        let overtook = (0..20).any(|seed| {
            let (issued, _, _) = run(FaultConfig::with_seed(seed), 64, 8);
            let sig = issued.iter().position(|x| x.1 == u32::MAX).unwrap();
            sig < 8
        });
        assert!(overtook, "the signal never overtook an earlier data write");
    }

    #[test]
    fn no_faults_config_keeps_order() {
        let cfg = FaultConfig {
            seed: 1,
            window: 1,
            delay_prob: 0.0,
            max_delay_polls: 0,
            split_prob: 0.0,
        };
        let (issued, _, st) = run(cfg, 64, 30);
        let order: Vec<u64> = issued.iter().map(|x| x.0).collect();
        assert_eq!(order, (0..=30).collect::<Vec<_>>());
        assert_eq!(st.injected(), 0);
    }

    #[test]
    fn rejects_bad_posts_and_configs() {
        let mut t = FaultyTransport::new(pair(4).1, FaultConfig::default()).unwrap();
        let e = t
            .post_write(WriteOp {
                peer: 0,
                local_off: 4090,
                remote_off: 0,
                len: 8,
                imm: 1,
                ctx: 1,
            })
            .unwrap_err();
        assert!(
            matches!(
                e,
                TransportError::OutOfBounds {
                    side: Side::Local,
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(t.held(), 0, "a rejected post must not be held");
        assert!(matches!(
            t.post_atomic_add(0, 0, 1, 1),
            Err(TransportError::Unsupported { .. })
        ));
        assert!(!t.caps().ordered && !t.caps().native_atomics);
        assert_eq!(t.caps().provider, "faulty(mem)");
        for bad in [
            FaultConfig {
                window: 0,
                ..FaultConfig::default()
            },
            FaultConfig {
                delay_prob: 1.5,
                ..FaultConfig::default()
            },
            FaultConfig {
                split_prob: -0.1,
                ..FaultConfig::default()
            },
            FaultConfig {
                max_delay_polls: 0,
                ..FaultConfig::default()
            },
        ] {
            assert!(FaultyTransport::new(pair(1).1, bad).is_err());
        }
    }
}
