//! The rendezvous: rank 0 admits every other rank over TCP, then relays collectives (a star).
//!
//! Failure handling, the part that keeps ranks from hanging: rank 0 runs one reader thread per
//! peer, so it notices a crash (EOF), an abort or a departure as soon as it happens, records the
//! first failure and sends an `Abort` naming the failed rank to every peer. A peer blocked in a
//! collective reads that abort and returns [`BootstrapError::RankFailed`]; otherwise it finds it
//! at its next collective. While rank 0 is relaying a result it has fully collected, the abort is
//! deferred until that result is delivered, so a rank leaving right after the last collective
//! never turns a completed collective into an error elsewhere. Every blocking read and write has
//! a deadline derived from the group's timeout.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use crate::env::WorldInfo;
use crate::error::BootstrapError;
use crate::fdpass::{self, LISTEN_FD_VAR};
use crate::proto::{
    self, encode_gather, encode_result, max_part, read_msg, remaining, write_frame, Hello, Msg,
    Nonce, OpKind, ReadError, HANDSHAKE_MAX, MAX_FRAME, PROTOCOL_VERSION,
};

/// Longest a single joiner's handshake may take, so a stalled connection cannot hold rank 0.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(10);
/// Most handshakes rank 0 runs at once (flood protection); further connections wait in
/// the listener's queue until one ends. (Dropping them instead turned real ranks away
/// when hundreds joined at once: a 512-rank job lost a quarter of its ranks.)
const MAX_PENDING_HANDSHAKES: usize = 64;
/// A listener's queue of connections not yet accepted: room for DeepEP v2's 1024 ranks
/// connecting at once.
const LISTEN_BACKLOG: i32 = 4096;

/// Raises `listener`'s queue of connections not yet accepted to 4096
/// (the kernel caps it at `net.core.somaxconn`), for a listener every rank of a job
/// connects to at once. std listens with 128, and past a full queue Linux may complete
/// a client's connect yet drop the connection (a SYN cookie's ACK with no room): a
/// client that waits for the server to speak first then waits forever. Listening again
/// only changes the queue's length.
pub fn raise_backlog(listener: &TcpListener) -> std::io::Result<()> {
    rustix::net::listen(listener, LISTEN_BACKLOG).map_err(Into::into)
}
/// Most turned-away joiners remembered for the join-timeout message.
const MAX_REJECTIONS_KEPT: usize = 16;
/// Longest rank 0 spends pushing an abort or goodbye to one peer.
const NOTICE_WRITE_LIMIT: Duration = Duration::from_secs(1);
/// How often rank 0 polls its non-blocking listener while ranks join.
const ACCEPT_POLL: Duration = Duration::from_millis(2);

/// The first failure seen by a rank; once set, the group is unusable.
#[derive(Debug, Clone)]
struct Failure {
    rank: usize,
    reason: String,
}

impl Failure {
    fn error(&self) -> BootstrapError {
        BootstrapError::RankFailed {
            rank: self.rank,
            reason: self.reason.clone(),
        }
    }
}

/// Locks, ignoring poisoning: every guarded state stays consistent between statements.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connected rendezvous of `world_size` ranks, used for small control-plane collectives
/// (exchanging addresses and keys, barriers).
///
/// `Send + Sync`; collectives are serialised internally, and every rank must call the same
/// collectives in the same order. After any failure (a rank aborted, crashed, left or timed out)
/// every later collective returns [`BootstrapError::RankFailed`] naming the first failed rank.
/// Dropping the group tells the other ranks this rank left.
pub struct Group {
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    job_id: String,
    /// The collectives' timeout in nanoseconds (settable while collectives run).
    timeout_ns: AtomicU64,
    role: Role,
}

enum Role {
    /// A world of one: no sockets.
    Alone(Mutex<Option<Failure>>),
    Root(Root),
    Member(Member),
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("local_rank", &self.local_rank)
            .field("local_world_size", &self.local_world_size)
            .field("job_id", &self.job_id)
            .field("timeout", &self.timeout())
            .finish_non_exhaustive()
    }
}

impl Group {
    /// Joins the job described by `info` (usually from [`WorldInfo::from_env`]).
    ///
    /// Rank 0 adopts the listening socket passed by [`crate::launch_local`] (`UEP_LISTEN_FD`)
    /// if present, else binds `MASTER_ADDR` at the rendezvous port (`UEP_MASTER_PORT`, else
    /// `MASTER_PORT + 1`); it then admits the other ranks. Other
    /// ranks connect, retrying until rank 0 is up. Returns once all ranks have joined, or fails
    /// after `timeout` (which also becomes the group's timeout for every collective).
    pub fn connect(info: &WorldInfo, timeout: Duration) -> Result<Group, BootstrapError> {
        info.validate()?;
        if info.rank != 0 {
            return member_join(info, timeout, PROTOCOL_VERSION);
        }
        // Adopted even for a world of one, so the launcher's socket does not linger.
        let inherited = match std::env::var(LISTEN_FD_VAR) {
            Ok(fd) if !fd.is_empty() => Some(
                fdpass::take_inherited_listener(&fd, info.rendezvous_port).map_err(|e| {
                    BootstrapError::io("adopting the listening socket passed by the launcher", e)
                })?,
            ),
            _ => None,
        };
        if info.world_size == 1 {
            return Ok(alone(info, timeout));
        }
        let listener = match inherited {
            Some(l) => l,
            None => bind(info)?,
        };
        root_join(info, listener, timeout)
    }

    /// Like [`Group::connect`] for rank 0, but listening on an already bound `listener`
    /// (tests; embedding in programs that pick the port themselves). `info.rendezvous_port` is not
    /// used for binding. The listener is closed once every rank has joined.
    pub fn connect_with_listener(
        info: &WorldInfo,
        listener: TcpListener,
        timeout: Duration,
    ) -> Result<Group, BootstrapError> {
        info.validate()?;
        if info.rank != 0 {
            return Err(BootstrapError::InconsistentWorld(format!(
                "connect_with_listener is for rank 0 only, but this is rank {}",
                info.rank
            )));
        }
        if info.world_size == 1 {
            return Ok(alone(info, timeout));
        }
        root_join(info, listener, timeout)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// This rank's index within its node.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// Ranks per node.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// This rank's node (`rank / local_world_size`).
    pub fn node(&self) -> usize {
        self.rank / self.local_world_size
    }
    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.local_world_size
    }
    /// An identifier of this job, the same on all ranks: 16 random hex characters made by rank 0.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }
    /// The timeout applied to every collective.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }
    /// Changes the timeout of later collectives (at least 1 ms).
    pub fn set_timeout(&self, d: Duration) {
        let d = d.max(Duration::from_millis(1));
        self.timeout_ns.store(nanos(d), Ordering::Relaxed);
    }

    /// Gathers `data` from every rank; element `i` of the result is rank `i`'s data.
    ///
    /// Payloads may differ in length between ranks (and be empty); one rank's payload may be at
    /// most `(1 GiB - 64) / world_size - 4` bytes. An oversized payload aborts the group.
    pub fn all_gather(&self, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let limit = max_part(self.world_size);
        if data.len() > limit {
            let reason = format!(
                "all_gather payload of {} bytes exceeds the limit of {limit} bytes per rank for \
                 {} ranks",
                data.len(),
                self.world_size
            );
            self.abort(&reason);
            return Err(BootstrapError::RankFailed {
                rank: self.rank,
                reason,
            });
        }
        self.collective(OpKind::AllGather, data)
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<(), BootstrapError> {
        self.collective(OpKind::Barrier, &[]).map(|_| ())
    }

    /// Tells every rank that this rank failed because of `reason`: their pending or next
    /// collective returns [`BootstrapError::RankFailed`] naming this rank and `reason`, and so do
    /// this rank's own. Best effort and bounded in time; never fails.
    pub fn abort(&self, reason: &str) {
        let failure = Failure {
            rank: self.rank,
            reason: reason.to_owned(),
        };
        tracing::warn!(rank = self.rank, reason, "aborting the bootstrap group");
        match &self.role {
            Role::Alone(f) => {
                lock(f).get_or_insert(failure);
            }
            Role::Root(r) => r.shared.fail(failure),
            Role::Member(m) => m.abort(failure),
        }
    }

    fn collective(&self, kind: OpKind, data: &[u8]) -> Result<Vec<Vec<u8>>, BootstrapError> {
        match &self.role {
            Role::Alone(f) => match &*lock(f) {
                Some(f) => Err(f.error()),
                None => Ok(match kind {
                    OpKind::AllGather => vec![data.to_vec()],
                    OpKind::Barrier => Vec::new(),
                }),
            },
            Role::Root(r) => r.collective(self, kind, data),
            Role::Member(m) => m.collective(self, kind, data),
        }
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // A panicking owner is a failure the others should hear about, not a normal departure.
        let notice = if thread::panicking() {
            Msg::Abort {
                rank: self.rank as u32,
                reason: "panicked while holding its bootstrap Group".into(),
            }
        } else {
            Msg::Goodbye
        }
        .encode();
        match &self.role {
            Role::Alone(_) => {}
            Role::Root(r) => r.close(&notice),
            Role::Member(m) => m.close(&notice),
        }
    }
}

/// How much longer than rank 0 a member waits for a collective's result.
const MEMBER_GRACE: Duration = Duration::from_millis(750);

/// "rank 2", "ranks 1, 3".
fn ranks_named(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match list.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// `d` in nanoseconds, saturating (584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(crate) fn alone(info: &WorldInfo, timeout: Duration) -> Group {
    Group {
        rank: info.rank,
        world_size: info.world_size,
        local_rank: info.local_rank,
        local_world_size: info.local_world_size,
        // A failing OS RNG only costs uniqueness of an id nobody else has to agree with.
        job_id: proto::random_hex::<8>().unwrap_or_else(|_| format!("{:016x}", std::process::id())),
        timeout_ns: AtomicU64::new(nanos(timeout)),
        role: Role::Alone(Mutex::new(None)),
    }
}

fn host_port(info: &WorldInfo) -> String {
    if info.master_addr.contains(':') && !info.master_addr.starts_with('[') {
        format!("[{}]:{}", info.master_addr, info.rendezvous_port)
    } else {
        format!("{}:{}", info.master_addr, info.rendezvous_port)
    }
}

fn bind(info: &WorldInfo) -> Result<TcpListener, BootstrapError> {
    let hp = host_port(info);
    let addrs: Vec<SocketAddr> = (info.master_addr.as_str(), info.rendezvous_port)
        .to_socket_addrs()
        .map_err(|e| BootstrapError::io(format!("resolving MASTER_ADDR {hp}"), e))?
        .collect();
    let mut last = None;
    for a in &addrs {
        // std sets SO_REUSEADDR on Unix listeners, so a previous job's TIME_WAIT does not block us.
        match TcpListener::bind(a) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((a, e)),
        }
    }
    Err(match last {
        None => {
            BootstrapError::InconsistentWorld(format!("MASTER_ADDR {hp} resolves to no address"))
        }
        Some((a, e)) => {
            let hint = match e.kind() {
                std::io::ErrorKind::AddrInUse => {
                    "; the port is taken (another job, or a previous one still running?): choose \
                     another MASTER_PORT, or set UEP_MASTER_PORT"
                }
                std::io::ErrorKind::AddrNotAvailable => {
                    "; MASTER_ADDR must be an address of the host running rank 0"
                }
                _ => "",
            };
            BootstrapError::io(
                format!("rank 0 listening on {a} (uep rendezvous {hp}: MASTER_ADDR, port UEP_MASTER_PORT or MASTER_PORT + 1){hint}"),
                e,
            )
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Rank 0: admitting joiners.
// ---------------------------------------------------------------------------------------------

/// What rank 0 requires of every joiner.
struct Expect {
    world_size: usize,
    local_world_size: usize,
    secret: Option<String>,
}

struct Joined {
    rank: usize,
    stream: TcpStream,
    addr: SocketAddr,
    client_nonce: Nonce,
    server_nonce: Nonce,
}

/// A handshake thread's verdict: admitted, or turned away (with a description for the log).
type Verdict = Result<Joined, String>;

fn root_join(
    info: &WorldInfo,
    listener: TcpListener,
    timeout: Duration,
) -> Result<Group, BootstrapError> {
    let (n, start) = (info.world_size, Instant::now());
    let mut lobby = Lobby::open(info, listener, start + timeout)?;
    tracing::debug!(listener = %lobby.local, world_size = n, "bootstrap: rank 0 waiting for ranks");
    while lobby.count < n {
        lobby.accept_pending()?;
        lobby.take_verdicts();
        if lobby.count < n && Instant::now() >= lobby.deadline {
            return Err(lobby.give_up(timeout));
        }
    }
    // Everyone is here: stop listening at once, so nothing else can join or queue up.
    let mut joined = lobby.close();
    let job_id =
        proto::random_hex::<8>().map_err(|e| BootstrapError::io("generating the job id", e))?;
    welcome(info, &mut joined, &job_id, Instant::now() + timeout)?;
    let role = start_root(joined)?;
    tracing::info!(
        job_id,
        world_size = n,
        elapsed = ?start.elapsed(),
        "bootstrap: all ranks joined"
    );
    Ok(Group {
        rank: 0,
        world_size: n,
        local_rank: 0,
        local_world_size: info.local_world_size,
        job_id,
        timeout_ns: AtomicU64::new(nanos(timeout)),
        role,
    })
}

/// Rank 0's side of the rendezvous while the ranks join: its listener, the handshake
/// threads and their verdicts, and who joined so far (rank 0 counts itself).
struct Lobby {
    listener: TcpListener,
    local: SocketAddr,
    expect: Arc<Expect>,
    vtx: mpsc::Sender<Verdict>,
    vrx: mpsc::Receiver<Verdict>,
    /// Handshakes in progress.
    active: Arc<AtomicUsize>,
    joined: Vec<Option<Joined>>,
    count: usize,
    rejections: Rejections,
    deadline: Instant,
}

impl Lobby {
    fn open(
        info: &WorldInfo,
        listener: TcpListener,
        deadline: Instant,
    ) -> Result<Lobby, BootstrapError> {
        let local = listener
            .local_addr()
            .map_err(|e| BootstrapError::io("reading the listener's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| BootstrapError::io("making the listener non-blocking", e))?;
        // Every rank connects at once, and a joiner waits for rank 0's challenge.
        raise_backlog(&listener)
            .map_err(|e| BootstrapError::io("raising the listener's backlog", e))?;
        let (vtx, vrx) = mpsc::channel::<Verdict>();
        Ok(Lobby {
            listener,
            local,
            expect: Arc::new(Expect {
                world_size: info.world_size,
                local_world_size: info.local_world_size,
                secret: info.secret.clone(),
            }),
            vtx,
            vrx,
            active: Arc::new(AtomicUsize::new(0)),
            joined: (0..info.world_size).map(|_| None).collect(),
            count: 1,
            rejections: Rejections::default(),
            deadline,
        })
    }

    /// Accepts what is pending, up to [`MAX_PENDING_HANDSHAKES`] handshakes at once; each
    /// runs on its own thread (ending by [`HANDSHAKE_LIMIT`]) so a slow or malicious
    /// connection cannot hold up the real ranks. The rest stay queued for the next poll.
    fn accept_pending(&mut self) -> Result<(), BootstrapError> {
        while self.active.load(Ordering::SeqCst) < MAX_PENDING_HANDSHAKES {
            match self.listener.accept() {
                Ok((stream, addr)) => self.handshake(stream, addr)?,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => {
                    let why = format!("rank 0 failed to accept connections: {e}");
                    abort_joined(&mut self.joined, &why);
                    let context = format!("accepting joiners on {}", self.local);
                    return Err(BootstrapError::io(context, e));
                }
            }
        }
        Ok(())
    }

    /// Starts the handshake of a new connection on a thread of its own.
    fn handshake(&mut self, stream: TcpStream, addr: SocketAddr) -> Result<(), BootstrapError> {
        self.active.fetch_add(1, Ordering::SeqCst);
        let (expect, vtx, active) = (self.expect.clone(), self.vtx.clone(), self.active.clone());
        let hs_deadline = self.deadline.min(Instant::now() + HANDSHAKE_LIMIT);
        let spawned = thread::Builder::new()
            .name("uep-bootstrap-hs".into())
            .spawn(move || {
                serve_joiner(stream, addr, &expect, hs_deadline, &vtx);
                active.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            abort_joined(&mut self.joined, "rank 0 could not start a thread");
            return Err(BootstrapError::io("spawning a handshake thread", e));
        }
        Ok(())
    }

    /// Admits the ranks whose handshakes ended (waiting a poll interval for the first),
    /// turning away a second connection that claims a rank already here.
    fn take_verdicts(&mut self) {
        let mut verdict = self.vrx.recv_timeout(ACCEPT_POLL).ok();
        while let Some(v) = verdict {
            match v {
                Ok(j) => match &self.joined[j.rank] {
                    Some(first) => {
                        let reason = format!(
                            "rank {} already joined from {}; every rank must be unique (are two \
                             jobs using the same MASTER_PORT?)",
                            j.rank, first.addr
                        );
                        let notice = Msg::Reject {
                            reason: reason.clone(),
                        };
                        let limit = Instant::now() + NOTICE_WRITE_LIMIT;
                        let _ = write_frame(&j.stream, &notice.encode(), limit);
                        self.rejections
                            .note(&self.local, format!("{}: {reason}", j.addr));
                    }
                    None => {
                        tracing::debug!(rank = j.rank, addr = %j.addr, "bootstrap: rank joined");
                        let r = j.rank;
                        self.joined[r] = Some(j);
                        self.count += 1;
                    }
                },
                Err(r) => self.rejections.note(&self.local, r),
            }
            verdict = self.vrx.try_recv().ok();
        }
    }

    /// The deadline passed before every rank joined: tells those who did, and says
    /// who is missing and who was turned away.
    fn give_up(mut self, timeout: Duration) -> BootstrapError {
        let (n, count) = (self.joined.len(), self.count);
        let missing: Vec<usize> = (1..n).filter(|&r| self.joined[r].is_none()).collect();
        abort_joined(
            &mut self.joined,
            &format!(
                "rank 0 gave up: only {count} of {n} ranks joined within {timeout:?} \
                 (missing ranks {missing:?})"
            ),
        );
        BootstrapError::JoinTimeout {
            joined: count,
            world_size: n,
            timeout,
            missing,
            rejections: self.rejections.summary(),
        }
    }

    /// Stops listening; the ranks that joined.
    fn close(self) -> Vec<Option<Joined>> {
        self.joined
    }
}

/// Sends every joined rank its welcome (the job id, and the proof of the secret where
/// there is one); a rank lost on the way fails the rendezvous for all.
fn welcome(
    info: &WorldInfo,
    joined: &mut [Option<Joined>],
    job_id: &str,
    deadline: Instant,
) -> Result<(), BootstrapError> {
    for r in 1..joined.len() {
        let Some(j) = &joined[r] else { continue };
        let proof = info
            .secret
            .as_deref()
            .map(|s| proto::welcome_proof(s, &j.client_nonce, &j.server_nonce, r as u32, job_id));
        let frame = Msg::Welcome {
            job_id: job_id.to_string(),
            proof,
        }
        .encode();
        if let Err(e) = write_frame(&j.stream, &frame, deadline) {
            let reason = format!("connection lost while completing the rendezvous: {e}");
            joined[r] = None;
            abort_joined(joined, &format!("rank {r} failed: {reason}"));
            return Err(BootstrapError::RankFailed { rank: r, reason });
        }
    }
    Ok(())
}

/// Rank 0's role once everyone joined: a writer and a reader thread per rank.
fn start_root(joined: Vec<Option<Joined>>) -> Result<Role, BootstrapError> {
    let n = joined.len();
    let (tx, rx) = mpsc::channel();
    let mut writers = Vec::with_capacity(n);
    let mut readers = Vec::with_capacity(n);
    writers.push(None);
    for (r, j) in joined.into_iter().enumerate().skip(1) {
        let Some(j) = j else { continue };
        let read_half = j
            .stream
            .try_clone()
            .map_err(|e| BootstrapError::io(format!("cloning the socket of rank {r}"), e))?;
        readers.push((r, read_half));
        writers.push(Some(Mutex::new(j.stream)));
    }
    let shared = Arc::new(RootShared {
        writers,
        state: Mutex::new(RootState::default()),
        wake: tx.clone(),
    });
    for (r, stream) in readers {
        let (shared, tx) = (shared.clone(), tx.clone());
        thread::Builder::new()
            .name(format!("uep-bootstrap-r{r}"))
            .spawn(move || root_reader(&shared, r, &stream, &tx))
            .map_err(|e| BootstrapError::io("spawning a reader thread", e))?;
    }
    Ok(Role::Root(Root {
        shared,
        coll: Mutex::new(RootColl { rx, seq: 0 }),
    }))
}

/// Joiners rank 0 turned away, kept (bounded) for the join-timeout message.
#[derive(Default)]
struct Rejections {
    kept: Vec<String>,
    total: usize,
}

impl Rejections {
    fn note(&mut self, listener: &SocketAddr, r: String) {
        tracing::warn!(%listener, "bootstrap: turned away a joiner: {r}");
        self.total += 1;
        if self.kept.len() < MAX_REJECTIONS_KEPT {
            self.kept.push(r);
        }
    }

    fn summary(mut self) -> Vec<String> {
        if self.total > self.kept.len() {
            let more = self.total - self.kept.len();
            self.kept.push(format!("and {more} more"));
        }
        self.kept
    }
}

/// Tells the already-admitted joiners that rank 0 is giving up.
fn abort_joined(joined: &mut [Option<Joined>], reason: &str) {
    let frame = Msg::Abort {
        rank: 0,
        reason: reason.to_owned(),
    }
    .encode();
    for j in joined.iter_mut().filter_map(Option::take) {
        let _ = write_frame(&j.stream, &frame, Instant::now() + NOTICE_WRITE_LIMIT);
    }
}

/// Runs one joiner's handshake on its own thread and reports the verdict.
fn serve_joiner(
    stream: TcpStream,
    addr: SocketAddr,
    expect: &Expect,
    deadline: Instant,
    verdicts: &Sender<Verdict>,
) {
    let reject = |reason: &str| {
        let notice = Msg::Reject {
            reason: reason.into(),
        };
        let _ = write_frame(&stream, &notice.encode(), deadline);
    };
    let (server_nonce, msg) = match challenge(&stream, deadline) {
        Ok(v) => v,
        Err((reason, tell)) => {
            if let Some(tell) = tell {
                reject(&tell);
            }
            let _ = verdicts.send(Err(format!("{addr}: {reason}")));
            return;
        }
    };
    match check_hello(msg, expect, &server_nonce) {
        Ok(h) => {
            let joined = Joined {
                rank: h.rank as usize,
                stream,
                addr,
                client_nonce: h.nonce,
                server_nonce,
            };
            // If rank 0 has finished (complete, or gave up), tell the latecomer why.
            if let Err(mpsc::SendError(Ok(j))) = verdicts.send(Ok(joined)) {
                let reason = "the group is already complete, or rank 0 gave up waiting".into();
                let _ = write_frame(&j.stream, &Msg::Reject { reason }.encode(), deadline);
            }
        }
        Err(reason) => {
            reject(&reason);
            let _ = verdicts.send(Err(format!("{addr}: {reason}")));
        }
    }
}

/// Sends a joiner the challenge and reads its answer: the challenge's nonce and the
/// message; or why not, and what to tell the joiner (if anything).
fn challenge(
    stream: &TcpStream,
    deadline: Instant,
) -> Result<(Nonce, Msg), (String, Option<String>)> {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_nodelay(true);
    let server_nonce: Nonce =
        proto::random().map_err(|e| (format!("no randomness for the challenge: {e}"), None))?;
    let challenge = Msg::Challenge {
        version: PROTOCOL_VERSION,
        nonce: server_nonce,
    };
    write_frame(stream, &challenge.encode(), deadline)
        .map_err(|e| (format!("could not send the challenge: {e}"), None))?;
    match read_msg(stream, Some(deadline), HANDSHAKE_MAX) {
        Ok(m) => Ok((server_nonce, m)),
        Err(ReadError::Malformed(m)) => {
            let reason = format!("malformed hello ({m}); is this a uep rank?");
            Err((reason.clone(), Some(reason)))
        }
        Err(ReadError::Timeout) => Err((
            "sent no hello in time".into(),
            Some("no hello received in time".into()),
        )),
        Err(e) => Err((format!("connection lost before its hello: {e}"), None)),
    }
}

/// Validates a hello; the error is the reason sent back to the joiner.
fn check_hello(msg: Msg, expect: &Expect, server_nonce: &Nonce) -> Result<Hello, String> {
    let h = match msg {
        Msg::Hello(h) => h,
        Msg::ForeignHello { version } => {
            return Err(format!(
                "protocol version mismatch: rank 0 speaks uep bootstrap protocol version \
                 {PROTOCOL_VERSION}, the joiner speaks version {version}; run the same uep build on \
                 every rank"
            ))
        }
        other => return Err(format!("expected a Hello message, got {}", other.name())),
    };
    // Authenticate before judging anything else, so strangers learn nothing about the job.
    match (&expect.secret, &h.mac) {
        (Some(secret), Some(tag)) => {
            if !proto::verify_hello_mac(secret, server_nonce, &h, tag) {
                return Err(format!(
                    "wrong UEP_SECRET: authentication failed for a joiner claiming rank {}; every \
                     rank of a job must have the same UEP_SECRET",
                    h.rank
                ));
            }
        }
        (Some(_), None) => {
            return Err(format!(
                "rank 0 requires UEP_SECRET but the joiner claiming rank {} has none; set the same \
                 UEP_SECRET on every rank",
                h.rank
            ))
        }
        (None, Some(_)) => {
            return Err(format!(
                "the joiner claiming rank {} has UEP_SECRET set but rank 0 has none; set the same \
                 UEP_SECRET on every rank, or on none",
                h.rank
            ))
        }
        (None, None) => {}
    }
    if h.world_size as usize != expect.world_size {
        return Err(format!(
            "world size mismatch: rank 0 has world size {}, rank {} has {}",
            expect.world_size, h.rank, h.world_size
        ));
    }
    if h.local_world_size as usize != expect.local_world_size {
        return Err(format!(
            "ranks-per-node mismatch: rank 0 has local world size {}, rank {} has {}",
            expect.local_world_size, h.rank, h.local_world_size
        ));
    }
    if h.rank == 0 || h.rank as usize >= expect.world_size {
        return Err(format!(
            "rank {} out of range: a joiner's rank must be in 1..{} (rank 0 is the one listening)",
            h.rank, expect.world_size
        ));
    }
    Ok(h)
}

// ---------------------------------------------------------------------------------------------
// Rank 0: relaying collectives.
// ---------------------------------------------------------------------------------------------

enum Event {
    Gather {
        rank: usize,
        seq: u64,
        kind: OpKind,
        data: Vec<u8>,
    },
    /// Something failed; re-check the shared state.
    Wake,
}

#[derive(Default)]
struct RootState {
    failure: Option<Failure>,
    /// The failure has been (or is being) sent to every peer.
    broadcast_done: bool,
    /// A collective is running; it sends the abort itself once its result is out.
    in_collective: bool,
    /// The group is being dropped; departures are expected now.
    closing: bool,
}

struct RootShared {
    /// Write side of each peer's socket, indexed by rank (`None` for rank 0).
    writers: Vec<Option<Mutex<TcpStream>>>,
    state: Mutex<RootState>,
    wake: Sender<Event>,
}

struct RootColl {
    rx: Receiver<Event>,
    seq: u64,
}

struct Root {
    shared: Arc<RootShared>,
    /// Serialises collectives; holds the receiving end of the readers' channel.
    coll: Mutex<RootColl>,
}

impl RootShared {
    fn failure(&self) -> Option<Failure> {
        lock(&self.state).failure.clone()
    }

    /// Records `f` unless a failure is already known; returns the first failure.
    fn record(&self, f: Failure) -> Failure {
        lock(&self.state).failure.get_or_insert(f).clone()
    }

    /// Records `f` and, unless a collective will do it, tells every peer now.
    fn fail(&self, f: Failure) {
        let to_send = {
            let mut st = lock(&self.state);
            st.failure.get_or_insert(f);
            take_broadcast(&mut st)
        };
        if let Some(f) = to_send {
            self.broadcast(&f);
        }
        let _ = self.wake.send(Event::Wake);
    }

    /// Ends a collective: sends a failure recorded meanwhile, after the result went out.
    fn finish_collective(&self) {
        let to_send = {
            let mut st = lock(&self.state);
            st.in_collective = false;
            take_broadcast(&mut st)
        };
        if let Some(f) = to_send {
            self.broadcast(&f);
        }
    }

    fn broadcast(&self, f: &Failure) {
        tracing::warn!(rank = f.rank, reason = %f.reason, "bootstrap: telling all ranks that a rank failed");
        let frame = Msg::Abort {
            rank: f.rank as u32,
            reason: f.reason.clone(),
        }
        .encode();
        // Every peer gets its own short deadline so one stuck peer cannot starve the others.
        for w in self.writers.iter().flatten() {
            let _ = write_frame(&lock(w), &frame, Instant::now() + NOTICE_WRITE_LIMIT);
        }
    }
}

/// The failure to broadcast now, if one is pending and no collective is about to send it.
fn take_broadcast(st: &mut RootState) -> Option<Failure> {
    if st.in_collective || st.broadcast_done || st.closing {
        return None;
    }
    let f = st.failure.clone()?;
    st.broadcast_done = true;
    Some(f)
}

/// Reads one peer's messages for the group's lifetime.
fn root_reader(shared: &RootShared, rank: usize, stream: &TcpStream, tx: &Sender<Event>) {
    let reason = loop {
        match read_msg(stream, None, MAX_FRAME) {
            Ok(Msg::Gather { seq, kind, data }) => {
                let ev = Event::Gather {
                    rank,
                    seq,
                    kind,
                    data,
                };
                if tx.send(ev).is_err() {
                    return;
                }
            }
            // The connection, not the message, says who failed.
            Ok(Msg::Abort { reason, .. }) => break reason,
            Ok(Msg::Goodbye) => {
                break "left the group (dropped its Group) while others still needed it".into()
            }
            Ok(other) => {
                break format!(
                    "protocol violation: sent an unexpected {} message",
                    other.name()
                )
            }
            Err(e) => {
                break format!(
                    "connection lost ({e}); the process probably crashed or exited without \
                     dropping its Group"
                )
            }
        }
    };
    if !lock(&shared.state).closing {
        shared.fail(Failure { rank, reason });
    }
}

impl Root {
    fn collective(
        &self,
        g: &Group,
        kind: OpKind,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let mut coll = lock(&self.coll);
        {
            let mut st = lock(&self.shared.state);
            if let Some(f) = &st.failure {
                return Err(f.error());
            }
            st.in_collective = true;
        }
        coll.seq += 1;
        let seq = coll.seq;
        let out = self.collect(&coll.rx, g, seq, kind, data).map(|parts| {
            let parts = match kind {
                OpKind::AllGather => parts,
                OpKind::Barrier => Vec::new(),
            };
            let frame = encode_result(seq, kind, &parts);
            let deadline = Instant::now() + g.timeout();
            for (r, w) in self.shared.writers.iter().enumerate() {
                let Some(w) = w else { continue };
                if let Err(e) = write_frame(&lock(w), &frame, deadline) {
                    // This collective is complete here; the failure surfaces at the next one.
                    self.shared.record(Failure {
                        rank: r,
                        reason: format!(
                            "could not receive the result of {} #{seq}: {e}",
                            kind.name()
                        ),
                    });
                }
            }
            parts
        });
        self.shared.finish_collective();
        out
    }

    /// Waits for every peer's contribution to collective `seq`.
    fn collect(
        &self,
        rx: &Receiver<Event>,
        g: &Group,
        seq: u64,
        kind: OpKind,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let n = g.world_size;
        let deadline = Instant::now() + g.timeout();
        let mut parts: Vec<Option<Vec<u8>>> = (0..n).map(|_| None).collect();
        parts[0] = Some(data.to_vec());
        let mut missing = n - 1;
        while missing > 0 {
            if let Some(f) = self.shared.failure() {
                return Err(f.error());
            }
            let Some(left) = remaining(deadline) else {
                let waiting: Vec<usize> = (0..n).filter(|&r| parts[r].is_none()).collect();
                let what = format!(
                    "waiting for {} to enter {} #{seq}",
                    ranks_named(&waiting),
                    kind.name()
                );
                // Named after the rank that did not come, so every other rank's error
                // says who is missing, not that rank 0 failed.
                let reason = format!(
                    "did not enter {} #{seq} within {:?} (rank 0 waited for {})",
                    kind.name(),
                    g.timeout(),
                    ranks_named(&waiting)
                );
                let first = self.shared.record(Failure {
                    rank: waiting[0],
                    reason: reason.clone(),
                });
                return Err(if first.rank == waiting[0] && first.reason == reason {
                    BootstrapError::Timeout {
                        what,
                        timeout: g.timeout(),
                    }
                } else {
                    first.error()
                });
            };
            match rx.recv_timeout(left) {
                Ok(Event::Gather {
                    rank,
                    seq: s,
                    kind: k,
                    data,
                }) => {
                    if s != seq || k != kind || parts[rank].is_some() {
                        let first = self.shared.record(Failure {
                            rank,
                            reason: format!(
                                "collective mismatch: rank {rank} called {} #{s} while rank 0 was in \
                                 {} #{seq}; every rank must call the same collectives in the same \
                                 order",
                                k.name(),
                                kind.name()
                            ),
                        });
                        return Err(first.error());
                    }
                    parts[rank] = Some(data);
                    missing -= 1;
                }
                Ok(Event::Wake) | Err(RecvTimeoutError::Timeout) => {}
                // Unreachable while `shared.wake` lives; treat like a wake-up.
                Err(RecvTimeoutError::Disconnected) => {}
            }
        }
        Ok(parts.into_iter().map(Option::unwrap_or_default).collect())
    }

    fn close(&self, notice: &[u8]) {
        let already_failed = {
            let mut st = lock(&self.shared.state);
            st.closing = true;
            st.failure.is_some()
        };
        for w in self.shared.writers.iter().flatten() {
            let s = lock(w);
            if !already_failed {
                let _ = write_frame(&s, notice, Instant::now() + NOTICE_WRITE_LIMIT);
            }
            // Wakes this peer's reader thread, which sees `closing` and exits quietly.
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ranks 1..n.
// ---------------------------------------------------------------------------------------------

struct Member {
    rank: usize,
    /// The rendezvous address, `MASTER_ADDR:port`, for messages.
    addr: String,
    read: Mutex<MemberRead>,
    write: Mutex<TcpStream>,
    failure: Mutex<Option<Failure>>,
}

struct MemberRead {
    stream: TcpStream,
    seq: u64,
}

fn connect_retry(
    info: &WorldInfo,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, BootstrapError> {
    let mut attempts = 0u32;
    let mut backoff = Duration::from_millis(10);
    let mut last = String::from("no attempt made");
    loop {
        attempts += 1;
        // Resolve every attempt: the name may only become resolvable once the job is up.
        match (info.master_addr.as_str(), info.rendezvous_port).to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    let Some(left) = remaining(deadline) else {
                        break;
                    };
                    match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(2))) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = format!("{a}: {e}"),
                    }
                }
            }
            Err(e) => last = format!("resolving {}: {e}", info.master_addr),
        }
        let Some(left) = remaining(deadline) else {
            return Err(BootstrapError::ConnectTimeout {
                addr: host_port(info),
                timeout,
                attempts,
                last,
            });
        };
        thread::sleep(backoff.min(left));
        backoff = (backoff * 2).min(Duration::from_millis(250));
    }
}

/// Joins as rank `info.rank` (> 0), announcing protocol `version` (tests use a foreign one).
fn member_join(info: &WorldInfo, timeout: Duration, version: u16) -> Result<Group, BootstrapError> {
    let deadline = Instant::now() + timeout;
    let addr = host_port(info);
    let stream = connect_retry(info, deadline, timeout)?;
    let _ = stream.set_nodelay(true);
    let hs = Handshake {
        info,
        stream: &stream,
        addr: &addr,
        deadline,
        timeout,
    };
    let server_nonce = hs.challenge()?;
    let client_nonce: Nonce =
        proto::random().map_err(|e| BootstrapError::io("generating a nonce", e))?;
    hs.hello(version, &client_nonce, &server_nonce)?;
    let job_id = hs.welcome(&client_nonce, &server_nonce)?;
    let write = stream
        .try_clone()
        .map_err(|e| BootstrapError::io("cloning the socket to rank 0", e))?;
    tracing::debug!(rank = info.rank, job_id, "bootstrap: joined");
    Ok(Group {
        rank: info.rank,
        world_size: info.world_size,
        local_rank: info.local_rank,
        local_world_size: info.local_world_size,
        job_id,
        timeout_ns: AtomicU64::new(nanos(timeout)),
        role: Role::Member(Member {
            rank: info.rank,
            addr,
            read: Mutex::new(MemberRead { stream, seq: 0 }),
            write: Mutex::new(write),
            failure: Mutex::new(None),
        }),
    })
}

/// A joining rank's handshake with rank 0: challenge, hello, welcome.
struct Handshake<'a> {
    info: &'a WorldInfo,
    stream: &'a TcpStream,
    addr: &'a str,
    deadline: Instant,
    timeout: Duration,
}

impl Handshake<'_> {
    /// A protocol error of rank 0's side.
    fn perr(&self, detail: String) -> BootstrapError {
        BootstrapError::Protocol {
            peer: format!("rank 0 at {}", self.addr),
            detail,
        }
    }

    /// Rank 0's challenge: its nonce.
    fn challenge(&self) -> Result<Nonce, BootstrapError> {
        match read_msg(self.stream, Some(self.deadline), HANDSHAKE_MAX) {
            Ok(Msg::Challenge { nonce, .. }) => Ok(nonce),
            Ok(other) => Err(self.perr(format!("expected a Challenge, got {}", other.name()))),
            Err(ReadError::Malformed(m)) => Err(self.perr(format!(
                "the process listening there is not a uep rank 0 ({m})"
            ))),
            Err(ReadError::Timeout) => Err(BootstrapError::Timeout {
                what: format!("waiting for rank 0 at {} to start the handshake", self.addr),
                timeout: self.timeout,
            }),
            Err(e) => Err(self.perr(format!(
                "connection closed during the handshake ({e}); the group may already be \
                 complete, or another job uses this MASTER_PORT"
            ))),
        }
    }

    /// This rank's hello (with the secret's MAC where there is one), or, to test rank
    /// 0's answer to another protocol version, a foreign one.
    fn hello(&self, version: u16, client: &Nonce, server: &Nonce) -> Result<(), BootstrapError> {
        let info = self.info;
        let hello = if version == PROTOCOL_VERSION {
            let mut h = Hello {
                version,
                rank: info.rank as u32,
                world_size: info.world_size as u32,
                local_world_size: info.local_world_size as u32,
                nonce: *client,
                mac: None,
            };
            h.mac = (info.secret.as_deref()).map(|s| proto::hello_mac(s, server, &h));
            Msg::Hello(h)
        } else {
            Msg::ForeignHello { version }
        };
        write_frame(self.stream, &hello.encode(), self.deadline)
            .map_err(|e| self.perr(format!("could not send the hello: {e}")))
    }

    /// Rank 0's welcome once every rank joined (its proof of the secret checked): the
    /// job id; or why it turned this rank away.
    fn welcome(&self, client: &Nonce, server: &Nonce) -> Result<String, BootstrapError> {
        let (info, addr) = (self.info, self.addr);
        match read_msg(self.stream, Some(self.deadline), HANDSHAKE_MAX) {
            Ok(Msg::Welcome { job_id, proof }) => {
                let rank = info.rank as u32;
                let proven = match (&info.secret, &proof) {
                    (Some(s), Some(p)) => {
                        proto::verify_welcome_proof(s, client, server, rank, &job_id, p)
                    }
                    (None, None) => true,
                    _ => false,
                };
                match proven {
                    true => Ok(job_id),
                    false => Err(self.perr(
                        "rank 0 did not prove it knows UEP_SECRET; refusing to join an \
                         unauthenticated rank 0"
                            .into(),
                    )),
                }
            }
            Ok(Msg::Reject { reason }) => Err(BootstrapError::Rejected {
                addr: addr.to_string(),
                rank: info.rank,
                reason,
            }),
            Ok(Msg::Abort { rank, reason }) => Err(BootstrapError::RankFailed {
                rank: rank as usize,
                reason,
            }),
            Ok(other) => Err(self.perr(format!("expected a Welcome, got {}", other.name()))),
            Err(ReadError::Timeout) => Err(BootstrapError::Timeout {
                what: format!(
                    "waiting at {addr} for all {} ranks to join (this rank was accepted; the \
                     group forms once every rank has joined)",
                    info.world_size
                ),
                timeout: self.timeout,
            }),
            Err(e) => Err(self.perr(format!("connection lost while waiting to be admitted: {e}"))),
        }
    }
}

impl Member {
    fn record(&self, f: Failure) -> Failure {
        lock(&self.failure).get_or_insert(f).clone()
    }

    fn collective(
        &self,
        g: &Group,
        kind: OpKind,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, BootstrapError> {
        let mut rd = lock(&self.read);
        if let Some(f) = &*lock(&self.failure) {
            return Err(f.error());
        }
        rd.seq += 1;
        let seq = rd.seq;
        let op = format!("{} #{seq}", kind.name());
        // A little past rank 0's own deadline: when a rank is missing, rank 0's verdict
        // (naming it) arrives before this rank would give up on rank 0.
        let deadline = Instant::now() + g.timeout() + MEMBER_GRACE;
        let sent = write_frame(
            &lock(&self.write),
            &encode_gather(seq, kind, data),
            deadline,
        );
        if let Err(e) = sent {
            let f = self.record(Failure {
                rank: 0,
                reason: format!("could not send {op} to rank 0 at {}: {e}", self.addr),
            });
            return Err(f.error());
        }
        let want = match kind {
            OpKind::AllGather => g.world_size,
            OpKind::Barrier => 0,
        };
        let failure = match read_msg(&rd.stream, Some(deadline), MAX_FRAME) {
            Ok(Msg::Result {
                seq: s,
                kind: k,
                parts,
            }) if s == seq && k == kind && parts.len() == want => return Ok(parts),
            Err(ReadError::Timeout) => return Err(self.timed_out(g, &op)),
            other => Self::failure_of(other, &op, want),
        };
        // A local abort() may have woken this read; its failure then comes first.
        Err(self.record(failure).error())
    }

    /// What rank 0 answered instead of the result of `op` (of `want` parts).
    fn failure_of(read: Result<Msg, ReadError>, op: &str, want: usize) -> Failure {
        let from_root = |reason: String| Failure { rank: 0, reason };
        match read {
            Ok(Msg::Result {
                seq: s,
                kind: k,
                parts,
            }) => from_root(format!(
                "protocol violation: expected the result of {op} with {want} parts, got \
                 the result of {} #{s} with {} parts",
                k.name(),
                parts.len()
            )),
            Ok(Msg::Abort { rank, reason }) => Failure {
                rank: rank as usize,
                reason,
            },
            Ok(Msg::Goodbye) => {
                from_root("left the group (dropped its Group) while others still needed it".into())
            }
            Ok(other) => from_root(format!(
                "protocol violation: sent an unexpected {} message",
                other.name()
            )),
            Err(e) => from_root(format!(
                "connection to rank 0 lost ({e}); rank 0 probably crashed or exited without \
                 dropping its Group"
            )),
        }
    }

    /// Rank 0 did not complete `op` in time: this rank's timeout, told to the others
    /// (rather than let each of them wait out its own), unless a failure came first.
    fn timed_out(&self, g: &Group, op: &str) -> BootstrapError {
        let what = format!("waiting for rank 0 to complete {op}");
        let mine = Failure {
            rank: self.rank,
            reason: format!("timed out after {:?} {what}", g.timeout() + MEMBER_GRACE),
        };
        let first = self.record(mine.clone());
        if first.reason != mine.reason {
            return first.error();
        }
        self.send_abort(&first);
        BootstrapError::Timeout {
            what,
            timeout: g.timeout() + MEMBER_GRACE,
        }
    }

    fn send_abort(&self, f: &Failure) {
        let frame = Msg::Abort {
            rank: f.rank as u32,
            reason: f.reason.clone(),
        }
        .encode();
        let _ = write_frame(
            &lock(&self.write),
            &frame,
            Instant::now() + NOTICE_WRITE_LIMIT,
        );
    }

    fn abort(&self, f: Failure) {
        let first = self.record(f.clone());
        if first.rank == f.rank && first.reason == f.reason {
            self.send_abort(&first);
        }
        // Wake a collective of ours blocked on reading; it then reports this abort.
        let _ = lock(&self.write).shutdown(Shutdown::Read);
    }

    fn close(&self, notice: &[u8]) {
        let w = lock(&self.write);
        if lock(&self.failure).is_none() {
            let _ = write_frame(&w, notice, Instant::now() + NOTICE_WRITE_LIMIT);
        }
        let _ = w.shutdown(Shutdown::Both);
    }
}

/// Test hook: join announcing another protocol version.
#[cfg(test)]
pub(crate) fn join_with_version(
    info: &WorldInfo,
    timeout: Duration,
    version: u16,
) -> Result<Group, BootstrapError> {
    member_join(info, timeout, version)
}

/// Test hook: makes `g` vanish the way a crashed process does: its sockets close with no
/// goodbye and none of its threads reacts any more.
#[cfg(test)]
pub(crate) fn simulate_crash(g: Group) {
    match &g.role {
        Role::Member(m) => {
            let _ = lock(&m.write).shutdown(Shutdown::Both);
        }
        Role::Root(r) => {
            // `closing` silences the reader threads, which a real crash would have killed.
            lock(&r.shared.state).closing = true;
            for w in r.shared.writers.iter().flatten() {
                let _ = lock(w).shutdown(Shutdown::Both);
            }
        }
        Role::Alone(_) => {}
    }
    std::mem::forget(g);
}
