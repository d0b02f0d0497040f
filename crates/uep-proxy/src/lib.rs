//! uep CPU proxy (docs/architecture.md, "uep-proxy"): device kernels push 16-byte commands into FIFOs;
//! proxy threads pop them and post one-sided writes carrying 32-bit
//! immediates on a [`Transport`]; the receiving proxies apply the ordering
//! and atomics emulation into the rank's registered region, which the
//! kernels poll.
//!
//! Every transport is treated as UNORDERED and without remote atomics
//! (EFA-like), whatever its [`uep_transport::Caps`] say.
//!
//! # Using it
//!
//! 1. Open one transport per proxy thread and connect thread *i*'s
//!    transports of all ranks to each other (the bootstrap's job).
//! 2. [`Proxy::start`] with the rank's [`uep_shm::Region`] (the same memory
//!    the transports registered) and a [`CounterLayout`] saying where the
//!    receive-side counters live in it (the same on every rank).
//! 3. Producers build commands with [`cmds`] and push them into
//!    [`Proxy::fifo`]s; commands that must stay ordered use one FIFO.
//!    [`uep_fifo::Fifo::is_consumed`] of a Quiet or Barrier slot is its
//!    completion signal. Call [`Proxy::wake`] before a burst of pushes to
//!    cut the latency of a parked proxy.
//! 4. Poll [`Proxy::check`] while waiting (a fatal error stops a thread);
//!    [`Proxy::shutdown`] drains and joins.
//!
//! # What each thread does
//!
//! Round-robin over its FIFOs: poll the tail, decode (an undecodable
//! command is a fatal [`ProxyError::Undecodable`]), map the piggyback to an
//! immediate (table in [`cmds`]), bounds-check against the local region and
//! the transport's `validate_write` (a bad command is a fatal
//! [`ProxyError::Rejected`]; nothing is posted), respect
//! [`ProxyConfig::max_writes_in_flight_per_fifo`],
//! [`ProxyConfig::max_bytes_in_flight_per_thread`] and the stream's send
//! window (below), post (`post_write`, or
//! `post_imm` when the length is zero; back-pressure is retried after
//! polling), then pop. Write and Atomic pop once posted; Quiet pops once
//! every earlier command of its FIFO has its send completion; Barrier first
//! waits for the same, sends a barrier message to every peer in scope and
//! pops once each such peer's barrier counter reached its seq. Between
//! rounds it retires send completions and applies arrived immediates
//! (validated first; malformed ones are counted in
//! [`ProxyStats::malformed_imms`], logged, never applied):
//!
//! * tail increments: `fetch_add` (Release) of the (source, channel) tail
//!   named by the immediate's stream, strictly in sequence order through a
//!   reorder window;
//! * LL count signals: once N arrivals of (buffer, expert, source) were
//!   seen, store `(k << 32) | N` (Release), k = 1, 2, ... per signal, and
//!   consume N arrivals; an early signal waits. A signal may carry data of
//!   its own (the last piece of what it counts): that data is placed before
//!   its immediate arrives, so N counts only the other writes;
//! * atomics: `fetch_add` of the value; barriers: raise the source's
//!   counter to the (unwrapped) barrier seq.
//!
//! The send side and the receive side of a signal meet on the same thread
//! index, so a count signal and the data it counts, or a channel's writes,
//! must be pushed to FIFOs of the same thread (one FIFO keeps them ordered
//! at the sender too).
//!
//! # Normal-mode streams and the send window
//!
//! The receiving transport does not say who sent a write, so a normal-mode
//! [`uep_wire::WriteImm`] carries `stream = src * num_channels + channel`
//! in 10 bits: a job needs `num_ranks * num_channels <= 1024`
//! ([`CounterLayout::validate`], at [`Proxy::start`]). Each thread numbers
//! the writes of each (destination, channel) with a 12-bit wrapping seq;
//! the receiver accepts a seq less than 2048 ahead of the one it expects
//! next. To keep every arrival inside that window whatever the transport
//! reorders, a thread posts a stream's write only while fewer than 2048 of
//! the stream's writes are outstanding counted from the oldest one without
//! a send completion (a count of writes in flight alone would not do: one
//! delayed write can stay outstanding while later ones complete). This
//! relies on one property of the transport: a write whose send completion
//! was seen reaches the target's receive queue before any write posted to
//! that target afterwards. The bound is a compile-time constant checked
//! against the modulus, so no [`ProxyConfig`] can break it.
//!
//! A command waiting longer than [`ProxyConfig::timeout`] (or operations
//! whose completions stop coming) is a fatal [`ProxyError::Timeout`] naming
//! the FIFO, the command and what it waits for.
//!
//! # Idling
//!
//! An idle thread spins for half of [`ProxyConfig::spin_before_park`],
//! yields for the other half, then parks with sleeps growing from 50 µs to
//! [`ProxyConfig::max_park`] (at most 50 µs while operations are
//! outstanding, or while an [`ArrivalWatch`] says someone waits for an
//! arrival on the thread's endpoint). [`Proxy::wake`] and
//! [`Proxy::wake_thread`] unpark at once.
#![forbid(unsafe_code)]

pub mod cmds;
mod error;
mod layout;
mod recv;
mod stats;
mod worker;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use uep_fifo::{Consumer, Fifo, FifoAlloc, HeapFifos, DEFAULT_CAPACITY};
use uep_shm::Region;
use uep_transport::Transport;
use uep_wire::MAX_RANKS;

pub use error::{ProxyError, Result};
pub use layout::{CounterLayout, COUNTER_BYTES};
pub use stats::ProxyStats;

use stats::ThreadStats;
use worker::{Shared, WorkerInit};

/// Most FIFOs per proxy thread (a FIFO index travels in 12 bits of an
/// operation's completion context).
pub(crate) const MAX_FIFOS_PER_THREAD: usize = 4096;

/// How a [`Proxy`] runs. `Default` gives the paper's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyConfig {
    /// Proxy threads, one transport each (default 4).
    pub threads: usize,
    /// FIFOs per thread (default 8).
    pub fifos_per_thread: usize,
    /// Slots per FIFO, a power of two (default 2048).
    pub fifo_capacity: usize,
    /// Most operations in flight from one FIFO (default 8, normal mode; the
    /// EP layer may use 32 for LL).
    pub max_writes_in_flight_per_fifo: usize,
    /// Most bytes in flight from one thread; a single larger write may go
    /// alone (default 16 MiB).
    pub max_bytes_in_flight_per_thread: usize,
    /// How long a command may wait (for completions, back-pressure or
    /// barrier peers), and how long the drain at shutdown may take, before
    /// the thread fails with [`ProxyError::Timeout`] (default 60 s).
    pub timeout: Duration,
    /// How long an idle thread spins and yields before it parks
    /// (default 50 µs).
    pub spin_before_park: Duration,
    /// Longest sleep of a parked idle thread, i.e. the worst added latency
    /// without [`Proxy::wake`] (default 1 ms).
    pub max_park: Duration,
    /// Ranks per node for `SameRail` / `NodeLeader` barriers (ranks
    /// `n * rpn .. (n + 1) * rpn` form node `n`); `None` = one node.
    pub ranks_per_node: Option<usize>,
    /// A peer's failure is its own (default `false`): an operation to a peer that
    /// fails marks the peer lost ([`Proxy::is_lost`]) and the thread carries on,
    /// instead of stopping with a fatal [`ProxyError::Transport`]. For elastic jobs,
    /// which mask a lost rank and keep serving.
    pub elastic: bool,
    /// TESTS ONLY (default `true`). When `false` the receiver applies tail
    /// increments and LL count signals the moment they arrive, ignoring
    /// sequence numbers and arrival counts: used to show that the emulation
    /// is what keeps counters behind their data.
    pub emulate_ordering: bool,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            threads: 4,
            fifos_per_thread: 8,
            fifo_capacity: DEFAULT_CAPACITY,
            max_writes_in_flight_per_fifo: 8,
            max_bytes_in_flight_per_thread: 16 << 20,
            timeout: Duration::from_secs(60),
            spin_before_park: Duration::from_micros(50),
            max_park: Duration::from_millis(1),
            ranks_per_node: None,
            elastic: false,
            emulate_ordering: true,
        }
    }
}

impl ProxyConfig {
    /// Checks every field against its documented range for a job of
    /// `num_ranks` ranks.
    pub fn validate(&self, num_ranks: usize) -> Result<()> {
        let bad = |what: String| Err(ProxyError::Invalid(what));
        if !(1..=256).contains(&self.threads) {
            return bad(format!(
                "ProxyConfig.threads = {} (allowed 1..=256)",
                self.threads
            ));
        }
        if !(1..=MAX_FIFOS_PER_THREAD).contains(&self.fifos_per_thread) {
            return bad(format!(
                "ProxyConfig.fifos_per_thread = {} (allowed 1..={MAX_FIFOS_PER_THREAD})",
                self.fifos_per_thread
            ));
        }
        if self.max_writes_in_flight_per_fifo == 0 {
            return bad("ProxyConfig.max_writes_in_flight_per_fifo is 0 (allowed >= 1)".into());
        }
        if self.max_bytes_in_flight_per_thread == 0 {
            return bad("ProxyConfig.max_bytes_in_flight_per_thread is 0 (allowed >= 1)".into());
        }
        if self.timeout.is_zero() {
            return bad("ProxyConfig.timeout is 0 (allowed > 0)".into());
        }
        if self.max_park.is_zero() || self.max_park > Duration::from_secs(1) {
            return bad(format!(
                "ProxyConfig.max_park = {:?} (allowed > 0 and <= 1 s)",
                self.max_park
            ));
        }
        if let Some(rpn) = self.ranks_per_node {
            if rpn == 0 || num_ranks % rpn != 0 {
                return bad(format!(
                    "ProxyConfig.ranks_per_node = {rpn} must be >= 1 and divide the {num_ranks} \
                     ranks"
                ));
            }
        }
        Ok(())
    }
}

/// A rank's running proxy: its threads and their FIFOs.
///
/// Dropping it stops the threads at once (without draining: queued
/// commands and operations in flight are abandoned), joins them and logs
/// their errors; [`Proxy::shutdown`] is the orderly way.
pub struct Proxy {
    rank: usize,
    num_ranks: usize,
    cfg: ProxyConfig,
    /// Thread-major: FIFO `index` of thread `t` is at `t * fifos_per_thread + index`.
    fifos: Vec<Arc<Fifo>>,
    threads: Vec<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    stats: Vec<Arc<CachePadded<ThreadStats>>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("rank", &self.rank)
            .field("num_ranks", &self.num_ranks)
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

/// The arguments of [`Proxy::start_in`], checked before anything starts.
fn check_start(
    rank: usize,
    num_ranks: usize,
    cfg: &ProxyConfig,
    region: &Region,
    counters: &CounterLayout,
    transports: usize,
) -> Result<()> {
    if num_ranks == 0 || num_ranks > MAX_RANKS || rank >= num_ranks {
        return Err(ProxyError::Invalid(format!(
            "rank {rank} of {num_ranks} ranks (allowed: 1..={MAX_RANKS} ranks, rank below \
             the count)"
        )));
    }
    cfg.validate(num_ranks)?;
    if transports != cfg.threads {
        return Err(ProxyError::Invalid(format!(
            "{transports} transports for {} proxy threads: pass exactly one connected \
             transport per thread",
            cfg.threads
        )));
    }
    if counters.num_ranks != num_ranks {
        return Err(ProxyError::Invalid(format!(
            "CounterLayout.num_ranks = {} but the job has {num_ranks} ranks",
            counters.num_ranks
        )));
    }
    counters.validate(region.len())
}

impl Proxy {
    /// Starts `cfg.threads` proxy threads for `rank` of `num_ranks`.
    ///
    /// `region` is this rank's registered symmetric region (the memory the
    /// transports registered); the threads hold a handle on it, which keeps the
    /// mapping alive for as long as they run. `counters` places the receive-side counters in it;
    /// `transports[i]`, ALREADY connected to thread `i` of every peer, goes
    /// to thread `i`. Fails, starting nothing, on an invalid configuration
    /// or layout.
    ///
    /// Its FIFOs are on the heap ([`HeapFifos`]): for producers that are threads of
    /// this process. A device whose kernels push commands hands its own memory with
    /// [`Proxy::start_in`].
    pub fn start(
        rank: usize,
        num_ranks: usize,
        cfg: ProxyConfig,
        region: Region,
        counters: CounterLayout,
        transports: Vec<Box<dyn Transport>>,
    ) -> Result<Proxy> {
        Proxy::start_in(
            rank, num_ranks, cfg, region, counters, transports, &HeapFifos,
        )
    }

    /// [`Proxy::start`] with FIFOs that `fifos` makes: memory the producers (a
    /// device's kernels) can store into.
    pub fn start_in(
        rank: usize,
        num_ranks: usize,
        cfg: ProxyConfig,
        region: Region,
        counters: CounterLayout,
        transports: Vec<Box<dyn Transport>>,
        fifos: &dyn FifoAlloc,
    ) -> Result<Proxy> {
        check_start(rank, num_ranks, &cfg, &region, &counters, transports.len())?;
        let alloc = fifos;
        let mut fifos = Vec::with_capacity(cfg.threads * cfg.fifos_per_thread);
        for t in 0..cfg.threads {
            for i in 0..cfg.fifos_per_thread {
                let label = format!("rank {rank} proxy thread {t} FIFO {i}");
                fifos.push(Arc::new(
                    alloc.alloc_fifo(cfg.fifo_capacity)?.with_label(label),
                ));
            }
        }
        let shared = Arc::new(Shared::new(cfg.threads, num_ranks));
        let stats: Vec<_> = (0..cfg.threads)
            .map(|_| Arc::new(CachePadded::new(ThreadStats::default())))
            .collect();
        let mut proxy = Proxy {
            rank,
            num_ranks,
            cfg: cfg.clone(),
            fifos,
            threads: Vec::with_capacity(cfg.threads),
            shared,
            stats,
        };
        for (t, transport) in transports.into_iter().enumerate() {
            let range = t * cfg.fifos_per_thread..(t + 1) * cfg.fifos_per_thread;
            let consumers = proxy.fifos[range]
                .iter()
                .map(|f| Consumer::claim(Arc::clone(f)))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let init = WorkerInit {
                rank,
                thread: t,
                num_ranks,
                cfg: cfg.clone(),
                region: region.clone(),
                counters: counters.clone(),
                transport,
                consumers,
                shared: Arc::clone(&proxy.shared),
                stats: Arc::clone(&proxy.stats[t]),
            };
            let handle = std::thread::Builder::new()
                .name(format!("uep-proxy-r{rank}-t{t}"))
                .spawn(move || worker::run(init))
                .map_err(|e| ProxyError::Spawn {
                    rank,
                    thread: t,
                    msg: e.to_string(),
                })?;
            // On error above, dropping `proxy` stops the threads started so far.
            proxy.threads.push(Some(handle));
        }
        tracing::debug!(rank, num_ranks, threads = cfg.threads, "proxy started");
        Ok(proxy)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &ProxyConfig {
        &self.cfg
    }

    /// Number of FIFOs (threads x FIFOs per thread).
    pub fn num_fifos(&self) -> usize {
        self.fifos.len()
    }

    /// FIFO `index` of proxy thread `thread`, for producers to push into.
    pub fn fifo(&self, thread: usize, index: usize) -> Result<&Arc<Fifo>> {
        if thread >= self.cfg.threads || index >= self.cfg.fifos_per_thread {
            return Err(ProxyError::Invalid(format!(
                "FIFO (thread {thread}, index {index}) does not exist: {} threads x {} FIFOs",
                self.cfg.threads, self.cfg.fifos_per_thread
            )));
        }
        Ok(&self.fifos[thread * self.cfg.fifos_per_thread + index])
    }

    /// Counters of every thread, summed.
    pub fn stats(&self) -> ProxyStats {
        let mut s = ProxyStats::default();
        for t in &self.stats {
            t.add_to(&mut s);
        }
        s
    }

    /// Unparks every proxy thread so that commands pushed now are seen at
    /// once rather than after the current idle sleep.
    pub fn wake(&self) {
        for t in self.threads.iter().flatten() {
            t.thread().unpark();
        }
    }

    /// Unparks proxy thread `thread` (the owner of the FIFOs a producer just
    /// pushed into), so that it sees the commands at once rather than after
    /// its current idle sleep of up to [`ProxyConfig::max_park`]. Cheap when
    /// the thread is awake; an unknown thread is ignored.
    pub fn wake_thread(&self, thread: usize) {
        if let Some(Some(t)) = self.threads.get(thread) {
            t.thread().unpark();
        }
    }

    /// A handle that unparks proxy thread `thread` ([`Proxy::wake_thread`]) without a
    /// reference to the proxy: for producers on other threads (a kernel's), which may
    /// outlive no borrow of it. `None` for an unknown thread.
    pub fn waker(&self, thread: usize) -> Option<Waker> {
        match self.threads.get(thread) {
            Some(Some(t)) => Some(Waker(t.thread().clone())),
            _ => None,
        }
    }

    /// Keeps proxy thread `thread` polling its endpoint closely (idle sleeps
    /// of at most 50 µs instead of up to [`ProxyConfig::max_park`]) until the
    /// returned guard drops, and wakes it now. For a waiter that expects an
    /// arrival: with manual-progress transports (`tcp;ofi_rxm`) the bytes
    /// only move while the receiving thread polls, so a parked receiver
    /// would add its whole sleep to the wait. An unknown thread is ignored.
    pub fn watch_arrivals(&self, thread: usize) -> ArrivalWatch<'_> {
        let counter = self.shared.watchers.get(thread).map(|w| &**w);
        if let Some(w) = counter {
            w.fetch_add(1, Ordering::AcqRel);
        }
        self.wake_thread(thread);
        ArrivalWatch { counter }
    }

    /// Marks `rank` lost (the caller found it gone): every thread abandons its
    /// operations in flight to it, drops later commands to it, and leaves it out of
    /// barriers. Never undone.
    pub fn mark_lost(&self, rank: usize) {
        if self.shared.mark_lost(rank) {
            self.wake();
        }
    }

    /// Rank `rank` has a new process (elastic rejoin), whose endpoint for proxy thread
    /// `t` is `addrs[t]`: every thread abandons what was still in flight to the old
    /// one, points its transport at the new one, and starts that rank's streams,
    /// fences and counters again from zero, as the new process's own proxy starts
    /// them; the rank is no longer lost. Returns once every thread did it.
    ///
    /// The caller makes sure that nothing is in flight between the two sides: the old
    /// process is dead (found gone, and its last writes applied or lost with it), no
    /// command to `rank` is queued, and the new one sends nothing before this returns.
    pub fn readmit(&self, rank: usize, addrs: &[uep_transport::PeerAddr]) -> Result<()> {
        if rank >= self.num_ranks || rank == self.rank || addrs.len() != self.threads.len() {
            return Err(ProxyError::Invalid(format!(
                "rank {} cannot readmit rank {rank} of {} with {} addresses for {} threads",
                self.rank,
                self.num_ranks,
                addrs.len(),
                self.threads.len()
            )));
        }
        self.shared.lost[rank].store(false, Ordering::Release);
        for (slot, addr) in self.shared.readmits.iter().zip(addrs) {
            let addr = addr.clone();
            *worker::lock(slot) = worker::Readmit::Asked { rank, addr };
        }
        self.shared.readmit_epoch.fetch_add(1, Ordering::Release);
        self.wake();
        let start = std::time::Instant::now();
        loop {
            self.check()?;
            let mut done = 0;
            for (t, slot) in self.shared.readmits.iter().enumerate() {
                match &*worker::lock(slot) {
                    worker::Readmit::Done(Ok(())) => done += 1,
                    worker::Readmit::Done(Err(why)) => {
                        return Err(ProxyError::Invalid(format!(
                            "rank {} proxy thread {t}: readmitting rank {rank}: {why}",
                            self.rank
                        )))
                    }
                    _ => {}
                }
            }
            if done == self.threads.len() {
                return Ok(());
            }
            if start.elapsed() > self.cfg.timeout {
                return Err(ProxyError::Timeout {
                    rank: self.rank,
                    thread: 0,
                    waited: start.elapsed(),
                    what: format!(
                        "readmitting rank {rank}: {done} threads of {} did",
                        self.threads.len()
                    ),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Whether `rank` is lost: marked by [`Proxy::mark_lost`], or, with
    /// [`ProxyConfig::elastic`], found by a failed operation to it.
    pub fn is_lost(&self, rank: usize) -> bool {
        self.shared.is_lost(rank)
    }

    /// `Err` with the first fatal error of any thread (that thread has
    /// stopped), or if a thread died without one; `Ok` while all run.
    pub fn check(&self) -> Result<()> {
        if let Some(e) = self.shared.first_error() {
            return Err(e);
        }
        if !self.shared.stop.load(Ordering::Acquire) {
            for (t, h) in self.threads.iter().enumerate() {
                if h.as_ref().is_some_and(JoinHandle::is_finished) {
                    return Err(ProxyError::ThreadDied {
                        rank: self.rank,
                        thread: t,
                        what: "exited unexpectedly (panicked?)".into(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Asks every thread to drain (finish the commands already pushed and
    /// wait for their completions) and exit, without waiting. Useful when
    /// several ranks live in one process: stop all, then shut each down,
    /// so that none stops polling while a peer still needs its progress.
    pub fn request_stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
    }

    fn join_all(&mut self) -> Vec<ProxyError> {
        self.request_stop();
        let mut died = Vec::new();
        for (t, h) in self.threads.iter_mut().enumerate() {
            if let Some(h) = h.take() {
                if let Err(p) = h.join() {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    died.push(ProxyError::ThreadDied {
                        rank: self.rank,
                        thread: t,
                        what: format!("panicked: {msg}"),
                    });
                }
            }
        }
        died
    }

    /// Drains (see [`Proxy::request_stop`]), joins every thread, and returns
    /// the first fatal error, if any.
    pub fn shutdown(mut self) -> Result<()> {
        let died = self.join_all();
        if let Some(e) = self.shared.first_error() {
            return Err(e);
        }
        match died.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Unparks one proxy thread; see [`Proxy::waker`]. Cheap when the thread is awake.
#[derive(Clone, Debug)]
pub struct Waker(std::thread::Thread);

impl Waker {
    /// Unparks the thread, so that commands pushed now are seen at once.
    pub fn wake(&self) {
        self.0.unpark();
    }
}

/// A waiter's request that one proxy thread poll closely; see
/// [`Proxy::watch_arrivals`]. The request ends when this drops.
#[derive(Debug)]
#[must_use = "the thread polls closely only while the guard lives"]
pub struct ArrivalWatch<'a> {
    counter: Option<&'a std::sync::atomic::AtomicUsize>,
}

impl Drop for ArrivalWatch<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.counter {
            w.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.threads.iter().all(Option::is_none) {
            return;
        }
        // No drain: a dropped proxy (e.g. on an error path) must not wait
        // for peers that may be gone.
        self.shared.abort.store(true, Ordering::Release);
        let died = self.join_all();
        for e in self.shared.first_error().into_iter().chain(died) {
            tracing::warn!(rank = self.rank, error = %e, "proxy stopped with an error");
        }
    }
}
