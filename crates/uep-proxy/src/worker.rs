//! One proxy thread: consumes its FIFOs, posts writes, retires completions
//! and applies the receive-side emulation.
//!
//! # The send window (why sequence numbers never alias)
//!
//! The receiver accepts a [`WriteImm`] only when its seq is less than
//! [`REORDER_LIMIT`] (half of [`WRITE_SEQ_MODULUS`]) ahead of the next
//! number it expects for that stream. A count of operations in flight does
//! not bound that distance: one delayed write may stay outstanding while
//! thousands of later ones complete around it. So each stream
//! (destination, channel) of a thread has a send window: a write with seq
//! `s` is posted only once every write of the stream below
//! `s - SEND_WINDOW + 1` has its send completion ([`SendStream`]).
//!
//! Assumed of the transport: a write whose send completion the sender has
//! seen is observed by the target (its arrival is polled) before any write
//! to that target posted afterwards. This holds when delivery is ordered per
//! peer (libfabric `tcp;ofi_rxm`), when the completion means delivered
//! (RDMA reliable connections, EFA SRD), and for the fault injector, which
//! reports a write's completion only after issuing it to the inner
//! transport. Then, when the receiver takes seq `s`, every write below
//! `s - SEND_WINDOW + 1` was taken before, so its next expected number `n`
//! satisfies `s - SEND_WINDOW < n <= s`: `s - n < SEND_WINDOW <=
//! REORDER_LIMIT`, and the writes it still waits for lie in a span shorter
//! than half the modulus, so their wrapped numbers are distinct and read
//! as "ahead". `SEND_WINDOW <= REORDER_LIMIT` is checked at compile time,
//! so no configuration can break it; the per-FIFO and per-byte limits only
//! make the window throttle less often.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use uep_fifo::{Consumer, Fifo, Slot};
use uep_shm::Region;
use uep_transport::{Arrival, Completion, Transport, TransportError, WriteOp};
use uep_wire::{
    AtomicImm, BarrierImm, BarrierScope, Command, LlImm, LlSignal, TransferCmd, WriteImm,
    MAX_STREAMS, MAX_WRITE_LEN, WRITE_SEQ_BITS, WRITE_SEQ_MODULUS,
};

use crate::cmds::{classify, Signal};
use crate::error::{ProxyError, Result};
use crate::layout::CounterLayout;
use crate::recv::{Recv, REORDER_LIMIT};
use crate::stats::{StatsRef, ThreadStats};
use crate::{ProxyConfig, MAX_FIFOS_PER_THREAD};

/// Commands taken from one FIFO before moving to the next (fairness).
const BURST: usize = 16;
/// Shortest park, and the longest one while work is outstanding.
const MIN_PARK: Duration = Duration::from_micros(50);

/// Most writes of one stream from the oldest without a send completion to
/// the newest posted, inclusive (module docs).
pub(crate) const SEND_WINDOW: usize = REORDER_LIMIT as usize;
const _: () =
    assert!(SEND_WINDOW as u32 <= REORDER_LIMIT && 2 * REORDER_LIMIT <= WRITE_SEQ_MODULUS);

/// Sender side of one stream (destination rank, channel) of a thread.
#[derive(Debug, Default)]
struct SendStream {
    /// Sequence number of the next write (unwrapped).
    next: u64,
    /// Completion flags of the writes from the oldest one without a send
    /// completion up to `next` (exclusive): `done[i]` belongs to seq
    /// `next - done.len() + i`. Never longer than [`SEND_WINDOW`].
    done: VecDeque<bool>,
}

impl SendStream {
    /// Whether the next write must wait for the oldest one's completion.
    fn window_full(&self) -> bool {
        self.done.len() >= SEND_WINDOW
    }

    /// Records that seq `next` was posted.
    fn posted(&mut self) {
        self.done.push_back(false);
        self.next += 1;
    }

    /// Records the send completion of the write with wrapped seq `wseq`;
    /// `false` if no such write is outstanding.
    fn completed(&mut self, wseq: u16) -> bool {
        let oldest = self.next - self.done.len() as u64;
        // `done` is shorter than the modulus, so the wrapped distance from
        // the oldest outstanding write names exactly one entry.
        let i = (u32::from(wseq).wrapping_sub(oldest as u32) % WRITE_SEQ_MODULUS) as usize;
        match self.done.get_mut(i) {
            Some(d) if !*d => *d = true,
            _ => return false,
        }
        while self.done.front() == Some(&true) {
            self.done.pop_front();
        }
        true
    }
}

/// What an operation's completion context carries, packed into the `u64`
/// the transport hands back, so a completion retires its FIFO, its bytes
/// and its stream's window entry without a lookup table.
///
/// | bits    | field |
/// |---------|-------|
/// | 0..=23  | bytes (a Write moves at most [`MAX_WRITE_LEN`]) |
/// | 24..=35 | FIFO index in the thread (below [`MAX_FIFOS_PER_THREAD`]) |
/// | 36..=47 | wrapped seq of a normal write |
/// | 48..=58 | stream key + 1 of a normal write (0 = not a normal write) |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct OpCtx {
    fifo: usize,
    len: u32,
    /// (stream key `dst * num_channels + channel`, wrapped seq).
    stream: Option<(usize, u16)>,
}

const CTX_LEN_BITS: u32 = 24;
const CTX_FIFO_SHIFT: u32 = CTX_LEN_BITS;
const CTX_FIFO_BITS: u32 = 12;
const CTX_SEQ_SHIFT: u32 = CTX_FIFO_SHIFT + CTX_FIFO_BITS;
const CTX_STREAM_SHIFT: u32 = CTX_SEQ_SHIFT + WRITE_SEQ_BITS;
const CTX_STREAM_BITS: u32 = 11;
const _: () = assert!(
    MAX_WRITE_LEN < 1 << CTX_LEN_BITS
        && MAX_FIFOS_PER_THREAD <= 1 << CTX_FIFO_BITS
        && MAX_STREAMS < 1 << CTX_STREAM_BITS
        && CTX_STREAM_SHIFT + CTX_STREAM_BITS <= 64
);

const fn mask(bits: u32) -> u64 {
    (1 << bits) - 1
}

impl OpCtx {
    fn pack(self) -> u64 {
        let (key1, seq) = match self.stream {
            Some((key, seq)) => (key as u64 + 1, u64::from(seq)),
            None => (0, 0),
        };
        u64::from(self.len)
            | (self.fifo as u64) << CTX_FIFO_SHIFT
            | seq << CTX_SEQ_SHIFT
            | key1 << CTX_STREAM_SHIFT
    }

    fn unpack(ctx: u64) -> OpCtx {
        let key1 = (ctx >> CTX_STREAM_SHIFT) & mask(CTX_STREAM_BITS);
        OpCtx {
            fifo: ((ctx >> CTX_FIFO_SHIFT) & mask(CTX_FIFO_BITS)) as usize,
            len: (ctx & mask(CTX_LEN_BITS)) as u32,
            stream: (key1 != 0).then(|| {
                (
                    key1 as usize - 1,
                    ((ctx >> CTX_SEQ_SHIFT) & mask(WRITE_SEQ_BITS)) as u16,
                )
            }),
        }
    }
}

/// State shared by the [`crate::Proxy`] handle and its threads.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// Drain and exit.
    pub(crate) stop: AtomicBool,
    /// Exit at once, abandoning queued commands and operations in flight
    /// (used by `Drop`, so an error path never waits for a drain).
    pub(crate) abort: AtomicBool,
    /// The first fatal error of any thread.
    pub(crate) error: Mutex<Option<ProxyError>>,
    /// Per thread: how many [`crate::ArrivalWatch`]es are alive, i.e. how many
    /// waiters expect an arrival on that thread's endpoint. While non-zero the
    /// thread polls closely instead of parking for long (module docs of the
    /// crate, "Idling").
    pub(crate) watchers: Vec<CachePadded<AtomicUsize>>,
    /// `[rank]`: the peer is lost (found gone by the caller, or, with
    /// [`ProxyConfig::elastic`], by a failed completion). Set once, never cleared.
    pub(crate) lost: Vec<AtomicBool>,
    /// Bumped after every change of `lost`, so threads notice with one load.
    pub(crate) lost_epoch: AtomicU64,
    /// `[thread]`: a readmission for that thread to carry out ([`crate::Proxy::readmit`]).
    pub(crate) readmits: Vec<Mutex<Readmit>>,
    /// Bumped after a readmission is asked, so threads notice with one load.
    pub(crate) readmit_epoch: AtomicU64,
}

/// One thread's part of a readmission ([`crate::Proxy::readmit`]).
#[derive(Debug, Default)]
pub(crate) enum Readmit {
    /// Nothing asked.
    #[default]
    Idle,
    /// Rank `rank` has a new process whose endpoint for this thread is `addr`.
    Asked {
        rank: usize,
        addr: uep_transport::PeerAddr,
    },
    /// The thread did it (or says why not).
    Done(std::result::Result<(), String>),
}

/// A lock whose holder cannot leave the data half-changed: poisoning is ignored.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// State for `threads` threads of a job of `num_ranks`.
    pub(crate) fn new(threads: usize, num_ranks: usize) -> Shared {
        Shared {
            watchers: (0..threads).map(|_| CachePadded::default()).collect(),
            lost: (0..num_ranks).map(|_| AtomicBool::new(false)).collect(),
            readmits: (0..threads).map(|_| Mutex::default()).collect(),
            ..Shared::default()
        }
    }

    /// Marks `rank` lost; `true` if it was not already.
    pub(crate) fn mark_lost(&self, rank: usize) -> bool {
        let fresh = self
            .lost
            .get(rank)
            .is_some_and(|l| !l.swap(true, Ordering::AcqRel));
        if fresh {
            self.lost_epoch.fetch_add(1, Ordering::Release);
        }
        fresh
    }

    /// Whether `rank` is lost.
    pub(crate) fn is_lost(&self, rank: usize) -> bool {
        self.lost
            .get(rank)
            .is_some_and(|l| l.load(Ordering::Acquire))
    }

    /// Whether someone waits for an arrival on thread `thread`.
    fn watched(&self, thread: usize) -> bool {
        self.watchers
            .get(thread)
            .is_some_and(|w| w.load(Ordering::Acquire) > 0)
    }

    /// Records `e` unless an earlier error is already recorded.
    pub(crate) fn fail(&self, e: ProxyError) {
        let mut g = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(e);
        }
    }

    /// The first recorded error.
    pub(crate) fn first_error(&self) -> Option<ProxyError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Everything a thread is started with.
pub(crate) struct WorkerInit {
    pub(crate) rank: usize,
    pub(crate) thread: usize,
    pub(crate) num_ranks: usize,
    pub(crate) cfg: ProxyConfig,
    pub(crate) region: Region,
    pub(crate) counters: CounterLayout,
    pub(crate) transport: Box<dyn Transport>,
    pub(crate) consumers: Vec<Consumer<Arc<Fifo>>>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) stats: StatsRef,
}

/// A Barrier at a FIFO's tail, part-way done.
#[derive(Debug)]
struct BarrierProgress {
    slot: Slot,
    peers: Vec<usize>,
    /// Barrier messages posted so far (to `peers[..sent]`).
    sent: usize,
}

struct FifoState {
    consumer: Consumer<Arc<Fifo>>,
    /// Operations posted from this FIFO and not yet completed.
    in_flight: usize,
    /// The tail command that is waiting, and since when.
    blocked: Option<(Slot, Instant)>,
    barrier: Option<BarrierProgress>,
}

/// What executing the command at a FIFO's tail did.
enum Step {
    /// Finished: pop it.
    Done,
    /// Cannot finish yet; try again later.
    Wait,
}

struct Worker {
    rank: usize,
    thread: usize,
    num_ranks: usize,
    cfg: ProxyConfig,
    region: Region,
    counters: CounterLayout,
    transport: Box<dyn Transport>,
    fifos: Vec<FifoState>,
    /// Send window per stream key `dst * num_channels + channel`.
    streams: Vec<SendStream>,
    bytes_in_flight: u64,
    /// Operations in flight over all FIFOs.
    total_in_flight: usize,
    /// Last send completion, or when the first operation of a busy period
    /// was posted.
    last_completion: Instant,
    recv: Recv,
    shared: Arc<Shared>,
    stats: StatsRef,
    completions: Vec<Completion>,
    arrivals: Vec<Arrival>,
    /// `Shared::lost_epoch` when this thread last abandoned lost peers' operations.
    lost_seen: u64,
    /// Peers whose operations this thread has abandoned.
    abandoned: Vec<bool>,
    /// `Shared::readmit_epoch` when this thread last looked for a readmission.
    readmit_seen: u64,
}

/// Runs one proxy thread to completion, recording a fatal error in `shared`.
pub(crate) fn run(init: WorkerInit) {
    let shared = init.shared.clone();
    let (rank, thread) = (init.rank, init.thread);
    let mut w = Worker::new(init);
    match w.main_loop() {
        Ok(()) => tracing::debug!(rank, thread, "proxy thread drained and stopped"),
        Err(e) => {
            tracing::error!(rank, thread, error = %e, "proxy thread stopped on a fatal error");
            shared.fail(e);
        }
    }
}

impl Worker {
    fn new(init: WorkerInit) -> Worker {
        let recv = Recv::new(
            init.counters.clone(),
            init.region.clone(),
            init.cfg.emulate_ordering,
            Arc::clone(&init.stats),
        );
        Worker {
            rank: init.rank,
            thread: init.thread,
            num_ranks: init.num_ranks,
            streams: (0..init.num_ranks * init.counters.num_channels)
                .map(|_| SendStream::default())
                .collect(),
            cfg: init.cfg,
            region: init.region,
            counters: init.counters,
            transport: init.transport,
            fifos: init
                .consumers
                .into_iter()
                .map(|consumer| FifoState {
                    consumer,
                    in_flight: 0,
                    blocked: None,
                    barrier: None,
                })
                .collect(),
            bytes_in_flight: 0,
            total_in_flight: 0,
            last_completion: Instant::now(),
            recv,
            shared: init.shared,
            stats: init.stats,
            completions: Vec::new(),
            arrivals: Vec::new(),
            lost_seen: 0,
            abandoned: vec![false; init.num_ranks],
            readmit_seen: 0,
        }
    }

    fn main_loop(&mut self) -> Result<()> {
        let mut idle = Idle::new();
        let mut next = 0;
        let mut stop_since: Option<Instant> = None;
        loop {
            if self.shared.abort.load(Ordering::Acquire) {
                return Ok(());
            }
            self.abandon_lost();
            self.readmit();
            let mut work = self.poll_send()?;
            work |= self.poll_recv()?;
            let n = self.fifos.len();
            for i in 0..n {
                work |= self.step_fifo((next + i) % n)?;
            }
            next = (next + 1) % n;
            self.check_stuck()?;
            if self.shared.stop.load(Ordering::Acquire) {
                if self.drained() {
                    return Ok(());
                }
                let since = *stop_since.get_or_insert_with(Instant::now);
                if since.elapsed() > self.cfg.timeout {
                    return Err(self.timeout(
                        since.elapsed(),
                        format!("draining at shutdown: {}", self.describe_outstanding()),
                    ));
                }
            }
            if work {
                idle.reset();
            } else {
                let busy = self.total_in_flight > 0
                    || self.fifos.iter().any(|f| f.blocked.is_some())
                    || self.recv.has_pending()
                    || self.shared.watched(self.thread);
                if idle.wait(&self.cfg, busy) {
                    ThreadStats::bump(&self.stats.idle_parks, 1);
                }
            }
        }
    }

    /// Nothing queued, nothing in flight.
    fn drained(&mut self) -> bool {
        self.total_in_flight == 0 && self.fifos.iter_mut().all(|f| f.consumer.poll().is_none())
    }

    fn transport_err(&self, op: impl Into<String>, source: TransportError) -> ProxyError {
        ProxyError::Transport {
            rank: self.rank,
            thread: self.thread,
            op: op.into(),
            source: Box::new(source),
        }
    }

    fn timeout(&self, waited: Duration, what: String) -> ProxyError {
        ProxyError::Timeout {
            rank: self.rank,
            thread: self.thread,
            waited,
            what,
        }
    }

    /// Gives up on the operations in flight to peers newly marked lost: they are
    /// retired as if completed (a Quiet behind them may pop), and the transport drops
    /// their late completions.
    fn abandon_lost(&mut self) {
        let epoch = self.shared.lost_epoch.load(Ordering::Acquire);
        if epoch == self.lost_seen {
            return;
        }
        self.lost_seen = epoch;
        for peer in 0..self.num_ranks {
            if self.shared.is_lost(peer) && !self.abandoned[peer] {
                self.abandoned[peer] = true;
                let gone: Vec<Completion> = self
                    .transport
                    .abandon_peer(peer)
                    .into_iter()
                    .map(|ctx| Completion::Write { ctx })
                    .collect();
                ThreadStats::bump(&self.stats.abandoned, gone.len() as u64);
                // Contexts the transport hands back are ours and in flight.
                if let Err(e) = self.retire(&gone) {
                    tracing::warn!(
                        rank = self.rank,
                        thread = self.thread,
                        "abandoning rank {peer}'s operations: {e}"
                    );
                }
            }
        }
    }

    /// Carries out this thread's part of a readmission, if one was asked.
    fn readmit(&mut self) {
        let epoch = self.shared.readmit_epoch.load(Ordering::Acquire);
        if epoch == self.readmit_seen {
            return;
        }
        self.readmit_seen = epoch;
        let shared = Arc::clone(&self.shared);
        let mut slot = lock(&shared.readmits[self.thread]);
        if let Readmit::Asked { rank, addr } = std::mem::take(&mut *slot) {
            *slot = Readmit::Done(self.start_again(rank, &addr));
        }
    }

    /// Rank `rank` starts again as a new process at `addr`: what was in flight to the
    /// old one is abandoned, and its streams, fences and counters start from zero on
    /// both sides, as the new process's do.
    fn start_again(
        &mut self,
        rank: usize,
        addr: &uep_transport::PeerAddr,
    ) -> std::result::Result<(), String> {
        let gone: Vec<Completion> = (self.transport.abandon_peer(rank).into_iter())
            .map(|ctx| Completion::Write { ctx })
            .collect();
        self.retire(&gone).map_err(|e| e.to_string())?;
        self.transport
            .replace_peer(rank, addr)
            .map_err(|e| e.to_string())?;
        let nc = self.counters.num_channels;
        for stream in &mut self.streams[rank * nc..(rank + 1) * nc] {
            *stream = SendStream::default();
        }
        self.recv.forget_source(rank)?;
        self.abandoned[rank] = false;
        tracing::debug!(
            rank = self.rank,
            thread = self.thread,
            "rank {rank} starts again"
        );
        Ok(())
    }

    /// Retires send completions; `true` if any. With [`ProxyConfig::elastic`], a
    /// failed operation marks its peer lost instead of stopping the thread.
    fn poll_send(&mut self) -> Result<bool> {
        let mut buf = std::mem::take(&mut self.completions);
        buf.clear();
        let polled = self.transport.poll_send(&mut buf);
        // Entries appended before an error are valid: retire them first.
        let retired = self.retire(&buf);
        self.completions = buf;
        retired?;
        match polled {
            Err(TransportError::Completion {
                ctx: Some(ctx),
                peer: Some(peer),
                ref msg,
                ..
            }) if self.cfg.elastic => {
                tracing::warn!(
                    rank = self.rank,
                    thread = self.thread,
                    "an operation to rank {peer} failed ({msg}): rank {peer} is lost"
                );
                self.shared.mark_lost(peer);
                self.retire(&[Completion::Write { ctx }])?;
                Ok(true)
            }
            polled => {
                polled.map_err(|e| self.transport_err("polling send completions", e))?;
                Ok(!self.completions.is_empty())
            }
        }
    }

    fn retire(&mut self, done: &[Completion]) -> Result<()> {
        if done.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        for c in done {
            let ctx = c.ctx();
            let op = OpCtx::unpack(ctx);
            let stream_ok = match op.stream {
                Some((key, seq)) => self.streams.get_mut(key).is_some_and(|s| s.completed(seq)),
                None => true,
            };
            match self.fifos.get_mut(op.fifo) {
                Some(fs) if fs.in_flight > 0 && stream_ok => {
                    fs.in_flight -= 1;
                    self.total_in_flight -= 1;
                    // A completion is progress for a command waiting on it.
                    if let Some((_, since)) = &mut fs.blocked {
                        *since = now;
                    }
                    self.bytes_in_flight = self.bytes_in_flight.saturating_sub(op.len.into());
                }
                _ => {
                    return Err(self.transport_err(
                        "retiring a send completion",
                        TransportError::Invalid(format!(
                            "completion with ctx {ctx:#x} matches no operation in flight \
                             ({op:?})"
                        )),
                    ))
                }
            }
        }
        self.last_completion = now;
        ThreadStats::bump(&self.stats.completions, done.len() as u64);
        Ok(())
    }

    /// Applies arrived immediates; `true` if any.
    fn poll_recv(&mut self) -> Result<bool> {
        let mut buf = std::mem::take(&mut self.arrivals);
        buf.clear();
        let polled = self.transport.poll_recv(&mut buf);
        for a in &buf {
            if let Err(why) = self.recv.apply(a.imm) {
                ThreadStats::bump(&self.stats.malformed_imms, 1);
                tracing::warn!(
                    rank = self.rank,
                    thread = self.thread,
                    imm = format_args!("{:#010x}", a.imm),
                    "malformed immediate ignored: {why}"
                );
            }
        }
        let any = !buf.is_empty();
        self.arrivals = buf;
        polled.map_err(|e| self.transport_err("polling receive completions", e))?;
        Ok(any)
    }

    /// Executes commands at FIFO `f`'s tail; `true` if any was popped.
    fn step_fifo(&mut self, f: usize) -> Result<bool> {
        let mut popped = false;
        for _ in 0..BURST {
            let Some((slot, raw)) = self.fifos[f].consumer.poll() else {
                self.fifos[f].blocked = None;
                break;
            };
            match self.exec(f, slot, raw)? {
                Step::Done => {
                    let fs = &mut self.fifos[f];
                    fs.blocked = None;
                    fs.barrier = None;
                    fs.consumer.pop(slot)?;
                    ThreadStats::bump(&self.stats.commands, 1);
                    popped = true;
                }
                Step::Wait => {
                    let fs = &mut self.fifos[f];
                    if fs.blocked.is_none_or(|(s, _)| s != slot) {
                        fs.blocked = Some((slot, Instant::now()));
                    }
                    break;
                }
            }
        }
        Ok(popped)
    }

    fn reject(&self, f: usize, slot: Slot, cmd: &Command, reason: impl Into<String>) -> ProxyError {
        ThreadStats::bump(&self.stats.rejected_commands, 1);
        ProxyError::Rejected {
            rank: self.rank,
            thread: self.thread,
            fifo: f,
            slot: slot.0,
            command: format!("{cmd:?}"),
            reason: reason.into(),
        }
    }

    /// Whether a command to `dst` is to be dropped: the peer is lost, and nothing
    /// posted to it would ever complete.
    fn to_lost(&self, dst: usize) -> bool {
        if self.shared.is_lost(dst) {
            ThreadStats::bump(&self.stats.dropped_to_lost, 1);
            true
        } else {
            false
        }
    }

    fn exec(&mut self, f: usize, slot: Slot, raw: TransferCmd) -> Result<Step> {
        let cmd = raw.decode().map_err(|source| {
            ThreadStats::bump(&self.stats.rejected_commands, 1);
            ProxyError::Undecodable {
                rank: self.rank,
                thread: self.thread,
                fifo: f,
                slot: slot.0,
                word0: raw.word0,
                word1: raw.word1,
                source: Box::new(source),
            }
        })?;
        match cmd {
            Command::Write { .. } => self.exec_write(f, slot, &cmd),
            Command::Atomic { .. } => self.exec_atomic(f, slot, &cmd),
            Command::Quiet => {
                if self.fifos[f].in_flight > 0 {
                    return Ok(Step::Wait);
                }
                ThreadStats::bump(&self.stats.quiets, 1);
                Ok(Step::Done)
            }
            Command::Barrier { scope, seq } => self.exec_barrier(f, slot, &cmd, scope, seq),
        }
    }

    /// Posts a write (or a zero-length signal); maps back-pressure to Wait.
    /// `stream` is the (key, wrapped seq) of a normal write, whose send
    /// window then advances.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        f: usize,
        slot: Slot,
        cmd: &Command,
        dst: usize,
        src_off: u64,
        dst_off: u64,
        len: u32,
        imm: u32,
        stream: Option<(usize, u16)>,
    ) -> Result<Step> {
        let c = OpCtx {
            fifo: f,
            len,
            stream,
        }
        .pack();
        let r = if len == 0 {
            self.transport.post_imm(dst, imm, c)
        } else {
            self.transport.post_write(WriteOp {
                peer: dst,
                local_off: src_off,
                remote_off: dst_off,
                len: len as usize,
                imm,
                ctx: c,
            })
        };
        match r {
            Ok(()) => {
                if self.total_in_flight == 0 {
                    // A new busy period: the completion timeout counts from now.
                    self.last_completion = Instant::now();
                }
                self.total_in_flight += 1;
                self.fifos[f].in_flight += 1;
                self.bytes_in_flight += u64::from(len);
                if let Some((key, _)) = stream {
                    self.streams[key].posted();
                }
                Ok(Step::Done)
            }
            Err(TransportError::WouldBlock) => {
                ThreadStats::bump(&self.stats.would_block, 1);
                Ok(Step::Wait)
            }
            Err(
                e @ (TransportError::OutOfBounds { .. }
                | TransportError::TooLarge { .. }
                | TransportError::BadPeer { .. }
                | TransportError::Misaligned { .. }),
            ) => Err(self.reject(f, slot, cmd, e.to_string())),
            Err(e) => {
                Err(self.transport_err(format!("posting {cmd:?} from FIFO {f} slot {}", slot.0), e))
            }
        }
    }

    fn check_peer(&self, f: usize, slot: Slot, cmd: &Command, dst: usize) -> Result<()> {
        if dst >= self.num_ranks {
            return Err(self.reject(
                f,
                slot,
                cmd,
                format!(
                    "dst rank {dst} is not a rank (allowed 0..{})",
                    self.num_ranks
                ),
            ));
        }
        Ok(())
    }

    fn exec_write(&mut self, f: usize, slot: Slot, cmd: &Command) -> Result<Step> {
        let Command::Write {
            flags,
            dst_rank,
            src_off,
            dst_off,
            len,
            piggyback,
        } = *cmd
        else {
            return Ok(Step::Wait);
        };
        let dst = usize::from(dst_rank);
        self.check_peer(f, slot, cmd, dst)?;
        if self.to_lost(dst) {
            return Ok(Step::Done);
        }
        let signal = classify(flags, piggyback).map_err(|why| self.reject(f, slot, cmd, why))?;
        let end = src_off.checked_add(len.into());
        if end.is_none_or(|e| e > self.region.len() as u64) {
            return Err(self.reject(
                f,
                slot,
                cmd,
                format!(
                    "source range [{src_off}, {src_off}+{len}) is outside the local region of {} \
                     bytes",
                    self.region.len()
                ),
            ));
        }
        self.transport
            .validate_write(dst, src_off, dst_off, len as usize)
            .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        let (imm, stream) = self
            .write_imm(dst, signal)
            .map_err(|why| self.reject(f, slot, cmd, why))?;
        // Flow control: per-FIFO writes and per-thread bytes in flight (one
        // write larger than the byte budget may go alone), and the stream's
        // send window (module docs).
        if self.fifos[f].in_flight >= self.cfg.max_writes_in_flight_per_fifo
            || (self.bytes_in_flight > 0
                && self.bytes_in_flight + u64::from(len)
                    > self.cfg.max_bytes_in_flight_per_thread as u64)
            || stream.is_some_and(|(key, _)| self.streams[key].window_full())
        {
            return Ok(Step::Wait);
        }
        let step = self.post(f, slot, cmd, dst, src_off, dst_off, len, imm, stream)?;
        if let Step::Done = step {
            ThreadStats::bump(&self.stats.writes_posted, 1);
            ThreadStats::bump(&self.stats.bytes_posted, len.into());
        }
        Ok(step)
    }

    /// The immediate of a Write to `dst` that signals `signal`, and for a normal
    /// channel its ordered stream (key, sequence); why not where the channel or
    /// expert is out of range.
    fn write_imm(
        &self,
        dst: usize,
        signal: Signal,
    ) -> std::result::Result<(u32, Option<(usize, u16)>), String> {
        match signal {
            Signal::Normal { channel, tail_inc } => {
                let nc = self.counters.num_channels;
                if usize::from(channel) >= nc {
                    return Err(format!(
                        "channel {channel} is out of range (allowed 0..{nc})"
                    ));
                }
                let key = dst * nc + usize::from(channel);
                let seq = WriteImm::wrap_seq(self.streams[key].next);
                let imm = WriteImm {
                    // Validated at start: num_ranks * num_channels <=
                    // MAX_STREAMS (1024), so this fits the u16 and encodes.
                    stream: (self.rank * nc + usize::from(channel)) as u16,
                    seq,
                    count: tail_inc,
                }
                .encode();
                imm.map(|imm| (imm, Some((key, seq))))
                    .map_err(|e| e.to_string())
            }
            Signal::LlArrival { buffer, expert } | Signal::LlCount { buffer, expert, .. } => {
                let ne = self.counters.num_local_experts;
                if usize::from(expert) >= ne {
                    return Err(format!(
                        "local expert {expert} is out of range (allowed 0..{ne})"
                    ));
                }
                let signal = match signal {
                    Signal::LlCount { count, .. } => LlSignal::Count(count),
                    _ => LlSignal::Arrival,
                };
                let imm = LlImm {
                    buffer,
                    expert,
                    // Below MAX_RANKS (1024): `start` checked it.
                    src_rank: self.rank as u16,
                    signal,
                }
                .encode();
                imm.map(|imm| (imm, None)).map_err(|e| e.to_string())
            }
        }
    }

    fn exec_atomic(&mut self, f: usize, slot: Slot, cmd: &Command) -> Result<Step> {
        let Command::Atomic {
            dst_rank,
            dst_off,
            slot: counter,
            value,
            ..
        } = *cmd
        else {
            return Ok(Step::Wait);
        };
        let dst = usize::from(dst_rank);
        self.check_peer(f, slot, cmd, dst)?;
        if self.to_lost(dst) {
            return Ok(Step::Done);
        }
        let value = i16::try_from(value).map_err(|_| {
            self.reject(
                f,
                slot,
                cmd,
                format!(
                    "value {value} does not fit the 16-bit AtomicImm (allowed {}..={})",
                    i16::MIN,
                    i16::MAX
                ),
            )
        })?;
        let expect = self
            .counters
            .atomic(counter.into())
            .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        if dst_off != expect {
            return Err(self.reject(
                f,
                slot,
                cmd,
                format!(
                    "dst_off {dst_off} is not atomic counter slot {counter}, which is at offset \
                     {expect} (use uep_proxy::cmds::atomic)"
                ),
            ));
        }
        self.transport
            .validate_write(dst, 0, 0, 0)
            .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        let imm = AtomicImm {
            slot: counter,
            value,
        }
        .encode()
        .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        if self.fifos[f].in_flight >= self.cfg.max_writes_in_flight_per_fifo {
            return Ok(Step::Wait);
        }
        let step = self.post(f, slot, cmd, dst, 0, 0, 0, imm, None)?;
        if let Step::Done = step {
            ThreadStats::bump(&self.stats.atomics_posted, 1);
        }
        Ok(step)
    }

    /// The peers a barrier of `scope` waits for (never this rank).
    fn barrier_peers(&self, scope: BarrierScope) -> std::result::Result<Vec<usize>, String> {
        let rpn = self.cfg.ranks_per_node.unwrap_or(self.num_ranks);
        let me = self.rank;
        let keep = |r: usize| -> bool {
            r != me
                && match scope {
                    BarrierScope::AllPeers => true,
                    BarrierScope::SameRail => r % rpn == me % rpn,
                    BarrierScope::NodeLeader => r % rpn == 0,
                }
        };
        if scope == BarrierScope::NodeLeader && me % rpn != 0 {
            return Err(format!(
                "rank {me} is not a node leader ({rpn} ranks per node; leaders are multiples of \
                 {rpn}), so it cannot take part in a NodeLeader barrier"
            ));
        }
        Ok((0..self.num_ranks).filter(|&r| keep(r)).collect())
    }

    fn barrier_reached(&self, peer: usize, seq: u32) -> Result<bool> {
        let off = self.counters.barrier(peer)?;
        let ctr = self
            .region
            .atomic_u64(off as usize)
            .map_err(|e| ProxyError::Invalid(e.to_string()))?;
        Ok(ctr.load(Ordering::Acquire) >= u64::from(seq))
    }

    /// Starts the barrier of `cmd` on FIFO `f` (its peers checked and recorded), once
    /// the FIFO's earlier commands completed: they complete before the barrier message
    /// leaves, so peers that pass it may rely on them. Whether it started.
    fn start_barrier(
        &mut self,
        f: usize,
        slot: Slot,
        cmd: &Command,
        scope: BarrierScope,
    ) -> Result<bool> {
        if self.fifos[f].in_flight > 0 {
            return Ok(false);
        }
        let peers = self
            .barrier_peers(scope)
            .map_err(|why| self.reject(f, slot, cmd, why))?;
        for &p in &peers {
            self.transport
                .validate_write(p, 0, 0, 0)
                .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        }
        self.fifos[f].barrier = Some(BarrierProgress {
            slot,
            peers,
            sent: 0,
        });
        Ok(true)
    }

    fn exec_barrier(
        &mut self,
        f: usize,
        slot: Slot,
        cmd: &Command,
        scope: BarrierScope,
        seq: u32,
    ) -> Result<Step> {
        if seq == 0 {
            return Err(self.reject(f, slot, cmd, "barrier seq 0 is reserved; start at 1"));
        }
        let started = (self.fifos[f].barrier.as_ref()).is_some_and(|b| b.slot == slot);
        if !started && !self.start_barrier(f, slot, cmd, scope)? {
            return Ok(Step::Wait);
        }
        let imm = BarrierImm {
            scope,
            // Below MAX_RANKS (1024): `start` checked it.
            src_rank: self.rank as u16,
            seq: BarrierImm::wrap_seq(seq.into()),
        }
        .encode()
        .map_err(|e| self.reject(f, slot, cmd, e.to_string()))?;
        loop {
            let Some(b) = &self.fifos[f].barrier else {
                return Ok(Step::Wait);
            };
            let Some(&peer) = b.peers.get(b.sent) else {
                break;
            };
            if self.shared.is_lost(peer) {
                if let Some(b) = &mut self.fifos[f].barrier {
                    b.sent += 1;
                }
                continue;
            }
            if self.fifos[f].in_flight >= self.cfg.max_writes_in_flight_per_fifo {
                return Ok(Step::Wait);
            }
            match self.post(f, slot, cmd, peer, 0, 0, 0, imm, None)? {
                Step::Done => {
                    if let Some(b) = &mut self.fifos[f].barrier {
                        b.sent += 1;
                    }
                    ThreadStats::bump(&self.stats.barrier_imms_posted, 1);
                }
                Step::Wait => return Ok(Step::Wait),
            }
        }
        let peers = match &self.fifos[f].barrier {
            Some(b) => b.peers.clone(),
            None => Vec::new(),
        };
        // A lost peer never reaches the barrier: it no longer counts.
        for p in peers.into_iter().filter(|&p| !self.shared.is_lost(p)) {
            if !self.barrier_reached(p, seq)? {
                return Ok(Step::Wait);
            }
        }
        ThreadStats::bump(&self.stats.barriers, 1);
        Ok(Step::Done)
    }

    /// Fails a command that has waited longer than the timeout, or
    /// operations whose completions stopped coming.
    fn check_stuck(&mut self) -> Result<()> {
        let limit = self.cfg.timeout;
        let blocked = self.fifos.iter().enumerate().find_map(|(f, fs)| {
            fs.blocked
                .filter(|(_, t)| t.elapsed() > limit)
                .map(|b| (f, b))
        });
        if let Some((f, (slot, since))) = blocked {
            let what = self.describe_blocked(f, slot);
            return Err(self.timeout(since.elapsed(), what));
        }
        if self.total_in_flight > 0 && self.last_completion.elapsed() > limit {
            return Err(self.timeout(
                self.last_completion.elapsed(),
                format!("no send completion: {}", self.describe_outstanding()),
            ));
        }
        Ok(())
    }

    fn describe_outstanding(&self) -> String {
        let per_fifo: Vec<String> = self
            .fifos
            .iter()
            .enumerate()
            .filter(|(_, fs)| fs.in_flight > 0 || !fs.consumer.fifo().is_empty())
            .map(|(f, fs)| {
                format!(
                    "FIFO {f}: {} in flight, {} queued",
                    fs.in_flight,
                    fs.consumer.fifo().len()
                )
            })
            .collect();
        format!(
            "{} operations ({} bytes) in flight; {}",
            self.total_in_flight,
            self.bytes_in_flight,
            if per_fifo.is_empty() {
                "no FIFO has work".to_string()
            } else {
                per_fifo.join(", ")
            }
        )
    }

    /// For a normal Write whose stream's send window is full: which write
    /// it waits for.
    fn stream_window_note(&self, cmd: &Command) -> Option<String> {
        let Command::Write {
            flags,
            dst_rank,
            piggyback,
            ..
        } = *cmd
        else {
            return None;
        };
        let Ok(Signal::Normal { channel, .. }) = classify(flags, piggyback) else {
            return None;
        };
        if usize::from(channel) >= self.counters.num_channels {
            return None;
        }
        let key = usize::from(dst_rank) * self.counters.num_channels + usize::from(channel);
        let s = self.streams.get(key).filter(|s| s.window_full())?;
        Some(format!(
            "; the send window of (dst rank {dst_rank}, channel {channel}) is full: seq {} has \
             no send completion yet and at most {SEND_WINDOW} writes of a stream may be \
             outstanding from the oldest one",
            s.next - s.done.len() as u64
        ))
    }

    fn describe_blocked(&mut self, f: usize, slot: Slot) -> String {
        let decoded = self.fifos[f]
            .consumer
            .poll()
            .map(|(_, raw)| (raw, raw.decode()));
        let window = match &decoded {
            Some((_, Ok(c))) => self.stream_window_note(c),
            _ => None,
        };
        let (cmd, barrier_seq) = match decoded {
            Some((_, Ok(c @ Command::Barrier { seq, .. }))) => (format!("{c:?}"), Some(seq)),
            Some((_, Ok(c))) => (format!("{c:?}"), None),
            Some((raw, Err(_))) => (format!("{raw:?}"), None),
            None => ("<gone>".to_string(), None),
        };
        let fs = &self.fifos[f];
        let mut what = format!(
            "FIFO {f} slot {}: {cmd} is blocked; this FIFO has {} operations in flight (max {}), \
             the thread {} bytes (max {})",
            slot.0,
            fs.in_flight,
            self.cfg.max_writes_in_flight_per_fifo,
            self.bytes_in_flight,
            self.cfg.max_bytes_in_flight_per_thread
        );
        if let Some(note) = window {
            what += &note;
        }
        if let (Some(b), Some(seq)) = (&fs.barrier, barrier_seq) {
            let missing: Vec<String> = b
                .peers
                .iter()
                .filter(|&&p| !self.barrier_reached(p, seq).unwrap_or(false))
                .map(|&p| {
                    let v = self
                        .counters
                        .barrier(p)
                        .ok()
                        .and_then(|o| self.region.atomic_u64(o as usize).ok())
                        .map(|c| c.load(Ordering::Acquire));
                    format!("rank {p} (counter {v:?})")
                })
                .collect();
            what += &format!(
                "; barrier seq {seq}: sent to {} of {} peers, waiting for {}",
                b.sent,
                b.peers.len(),
                if missing.is_empty() {
                    "nothing".to_string()
                } else {
                    missing.join(", ")
                }
            );
        }
        what
    }
}

/// Idle back-off: spin, then yield, then park with growing sleeps (short
/// ones while work is outstanding).
struct Idle {
    since: Option<Instant>,
    park: Duration,
}

impl Idle {
    fn new() -> Idle {
        Idle {
            since: None,
            park: MIN_PARK,
        }
    }

    fn reset(&mut self) {
        self.since = None;
        self.park = MIN_PARK;
    }

    /// One idle step; `true` if it parked.
    fn wait(&mut self, cfg: &ProxyConfig, busy: bool) -> bool {
        let now = Instant::now();
        let idle_for = now - *self.since.get_or_insert(now);
        if idle_for < cfg.spin_before_park / 2 {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
            return false;
        }
        if idle_for < cfg.spin_before_park {
            std::thread::yield_now();
            return false;
        }
        let cap = if busy {
            MIN_PARK.min(cfg.max_park)
        } else {
            cfg.max_park
        };
        // Woken early by `Proxy::wake` (unpark).
        std::thread::park_timeout(self.park.min(cap));
        self.park = (self.park * 2).min(cfg.max_park);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn op_ctx_round_trips(fifo in 0..MAX_FIFOS_PER_THREAD, len in 0..=MAX_WRITE_LEN,
                              stream in proptest::option::of((0..MAX_STREAMS, 0..WRITE_SEQ_MODULUS as u16))) {
            let op = OpCtx { fifo, len, stream };
            prop_assert_eq!(OpCtx::unpack(op.pack()), op);
        }
    }

    #[test]
    fn op_ctx_extremes() {
        let op = OpCtx {
            fifo: MAX_FIFOS_PER_THREAD - 1,
            len: MAX_WRITE_LEN,
            stream: Some((MAX_STREAMS - 1, WRITE_SEQ_MODULUS as u16 - 1)),
        };
        assert_eq!(OpCtx::unpack(op.pack()), op);
        let op = OpCtx {
            fifo: 0,
            len: 0,
            stream: Some((0, 0)),
        };
        assert_ne!(op.pack(), 0, "stream 0 seq 0 differs from no stream");
        assert_eq!(OpCtx::unpack(op.pack()), op);
    }

    /// The window holds SEND_WINDOW writes from the oldest incomplete one,
    /// whatever order completions come in, across the seq wrap.
    #[test]
    fn send_window_tracks_the_oldest_incomplete_write() {
        let mut s = SendStream {
            next: 3 * u64::from(WRITE_SEQ_MODULUS) - 5,
            done: VecDeque::new(),
        };
        let first = s.next;
        for _ in 0..SEND_WINDOW {
            assert!(!s.window_full());
            s.posted();
        }
        assert!(s.window_full());
        // Everything but the oldest completes (in reverse): still full.
        for seq in (first + 1..s.next).rev() {
            assert!(s.completed(WriteImm::wrap_seq(seq)));
        }
        assert!(s.window_full());
        assert!(!s.completed(WriteImm::wrap_seq(first + 1)), "twice");
        assert!(!s.completed(WriteImm::wrap_seq(s.next)), "never posted");
        // The oldest completes: the window empties at once.
        assert!(s.completed(WriteImm::wrap_seq(first)));
        assert!(s.done.is_empty() && !s.window_full());
        s.posted();
        s.posted();
        assert!(s.completed(WriteImm::wrap_seq(s.next - 1)));
        assert_eq!(s.done.len(), 2, "the older write is still outstanding");
    }
}
