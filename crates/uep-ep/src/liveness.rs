//! Liveness across nodes: knowing that a peer is gone instead of guessing it from a
//! deadline.
//!
//! On one host a wait reads the peer's process state from `/proc`. A peer on another
//! node has no such window, so every rank keeps one TCP connection to every rank on
//! other nodes and a thread (`uep-liveness`) that, every [`TICK`], writes one byte on
//! each and reads what arrived. The peer's *kernel* answers for it:
//!
//! | what happened to the peer | what the connection shows | verdict |
//! |---|---|---|
//! | its process exited or was killed (alone, or with its whole node) | its kernel closes the connection: end of stream or reset, at once | [`Gone::Died`] |
//! | its host went down, or the link to it was cut | nothing acknowledges our bytes for [`LivenessConfig::unreachable_after`] (read from `TCP_INFO`; `TCP_USER_TIMEOUT` as a backstop) | [`Gone::Unreachable`], for every rank on that host |
//! | its process is stopped, or starved of CPU | its kernel still acknowledges (the bytes wait in its receive buffer) | nothing: slow is not dead, the deadline covers it |
//! | it dropped its Buffer | it says goodbye first | nothing |
//!
//! No verdict depends on the peer's process being scheduled, nor on ours: only a
//! kernel that stops answering, or a connection its kernel closed. The cost on a
//! healthy run is one byte per peer per tick, off the data path.
//!
//! Invariant: a verdict is final for a process. [`Liveness::lost`] un-reports a rank
//! only when a new process takes its place ([`Liveness::readmit`], elastic rejoin): the
//! new one is watched over a new connection, which it listens for ([`Listening`]).

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use uep_bootstrap::ControlPlane;

pub use crate::error::{Gone, Lost};

use crate::error::{EpError, Result};
use crate::topology::Topology;

/// How often the watcher writes to and reads from every connection.
pub const TICK: Duration = Duration::from_millis(50);

/// A heartbeat byte.
const BEAT: u8 = 0x01;
/// The last byte a rank sends when it drops its Buffer: what follows is not a death.
const BYE: u8 = 0xFF;
/// How long a rank that leaves waits for its peers to close after its goodbye.
const GOODBYE_WAIT: Duration = Duration::from_millis(250);

/// How quickly peers are judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LivenessConfig {
    /// A peer whose host acknowledges nothing for this long is unreachable. Default
    /// 600 ms (`UEP_UNREACHABLE_MS`): above a few TCP retransmissions on a busy link,
    /// so that a dead node is known everywhere within a second.
    pub unreachable_after: Duration,
    /// Whether to watch at all (default true). Off only where every rank shares one
    /// process, so none can die alone: hundreds of in-process ranks would otherwise
    /// hold a connection to each of the others (`R²` sockets in one process). A Buffer
    /// refuses elastic mode without it.
    pub watch: bool,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        let ms = std::env::var("UEP_UNREACHABLE_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|&ms| ms > 0)
            .unwrap_or(600);
        LivenessConfig {
            unreachable_after: Duration::from_millis(ms),
            watch: true,
        }
    }
}

/// What the watcher and the waits share.
struct Shared {
    stop: AtomicBool,
    /// How many ranks are lost (flagged): the one load a wait makes.
    any: AtomicUsize,
    /// `[rank]`: the verdict on its process, set once (cleared when a new process
    /// takes the rank).
    lost: Vec<Mutex<Option<Lost>>>,
    /// `[rank]`: whether `lost` holds a verdict (one load for the waits).
    flagged: Vec<AtomicBool>,
    /// Connections to watch from the next tick on: to new processes of readmitted ranks.
    inbox: Mutex<Vec<Conn>>,
}

impl Shared {
    fn new(num_ranks: usize) -> Shared {
        Shared {
            stop: AtomicBool::new(false),
            any: AtomicUsize::new(0),
            lost: (0..num_ranks).map(|_| Mutex::new(None)).collect(),
            flagged: (0..num_ranks).map(|_| AtomicBool::new(false)).collect(),
            inbox: Mutex::new(Vec::new()),
        }
    }

    fn verdict(&self, rank: usize) -> Option<MutexGuard<'_, Option<Lost>>> {
        self.lost.get(rank).map(lock)
    }

    /// Record the verdict on `rank` (the first one stays).
    fn report(&self, lost: Lost) {
        let rank = lost.rank;
        if let Some(mut v) = self.verdict(rank) {
            v.get_or_insert(lost);
            if !self.flagged[rank].swap(true, Ordering::AcqRel) {
                self.any.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    /// Forget the verdict on `rank` (a new process took it).
    fn forget(&self, rank: usize) {
        if let Some(mut v) = self.verdict(rank) {
            *v = None;
            if self.flagged[rank].swap(false, Ordering::AcqRel) {
                self.any.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// One rank's liveness watch over the ranks on other nodes; see the module docs.
pub struct Liveness {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    cfg: LivenessConfig,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("lost", &self.lost_ranks())
            .finish_non_exhaustive()
    }
}

/// One watched connection.
struct Conn {
    rank: usize,
    node: usize,
    host: String,
    stream: TcpStream,
    /// The peer said goodbye: its end of stream is not a death.
    left: bool,
}

impl Conn {
    /// The connection to `rank` (on `node`, `host`), set up for watching: a kernel
    /// timeout for unacknowledged bytes, no batching of beats, non-blocking.
    fn new(
        me: usize,
        rank: usize,
        node: usize,
        host: &str,
        stream: TcpStream,
        cfg: LivenessConfig,
    ) -> Result<Conn> {
        let sock = socket2::SockRef::from(&stream);
        sock.set_tcp_user_timeout(Some(cfg.unreachable_after))
            .and_then(|()| sock.set_nodelay(true))
            .and_then(|()| stream.set_nonblocking(true))
            .map_err(io_err(
                me,
                format!("configuring the connection to rank {rank}"),
            ))?;
        Ok(Conn {
            rank,
            node,
            host: host.to_owned(),
            stream,
            left: false,
        })
    }
}

impl Liveness {
    /// Connects this rank to every rank on another node and starts the watcher.
    /// Collective. `host` is the address to listen on and advertise (this rank's
    /// address on the network the job uses); `hosts[r]` names rank `r`'s host in
    /// messages. Ranks past the control plane's are reserved (no process yet): a
    /// joiner of one is watched from its let-in ([`Liveness::readmit`]).
    pub fn start(
        cp: &dyn ControlPlane,
        topo: &Topology,
        host: &str,
        hosts: &[String],
        cfg: LivenessConfig,
        timeout: Duration,
    ) -> Result<Liveness> {
        let me = topo.rank;
        if !cfg.watch {
            return Ok(Liveness {
                shared: Arc::new(Shared::new(topo.num_ranks)),
                thread: None,
                cfg,
            });
        }
        let listening = Listening::new(me, host)?;
        let adverts = exchange(cp, &listening.advert)?;
        let remote = |r: &usize| topo.node_of(*r) != topo.node && *r < adverts.len();
        let deadline = Instant::now() + timeout;
        // Connect to the higher ranks (their listeners exist: they were bound before
        // the exchange), then accept the lower ones: nobody waits on a connect.
        let mut streams = Vec::new();
        for r in (me + 1..topo.num_ranks).filter(remote) {
            streams.push((r, connect(me, r, &adverts[r], deadline)?));
        }
        let lower: Vec<usize> = (0..me).filter(remote).collect();
        let Listening { listener, advert } = listening;
        streams.extend(accept(
            &listener,
            me,
            advert.nonce,
            &lower,
            deadline,
            timeout,
        )?);
        Liveness::watch_streams(topo, streams, hosts, cfg)
    }

    /// Watch `streams` (a connection to each rank on another node, `(rank, stream)`).
    fn watch_streams(
        topo: &Topology,
        streams: Vec<(usize, TcpStream)>,
        hosts: &[String],
        cfg: LivenessConfig,
    ) -> Result<Liveness> {
        let me = topo.rank;
        let shared = Arc::new(Shared::new(topo.num_ranks));
        let conns = (streams.into_iter())
            .map(|(rank, stream)| {
                Conn::new(me, rank, topo.node_of(rank), &hosts[rank], stream, cfg)
            })
            .collect::<Result<Vec<_>>>()?;
        let thread = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("uep-liveness".into())
                .spawn(move || watch(&shared, conns, cfg))
                .map_err(io_err(me, "starting the watcher".into()))?
        };
        Ok(Liveness {
            shared,
            thread: Some(thread),
            cfg,
        })
    }

    /// A new process took rank `rank` (on `node`, host `host`) and listens at `advert`:
    /// forget the old process's verdict, connect to it and watch it from the next tick;
    /// where it cannot be reached, it died since it asked and is lost at once.
    pub(crate) fn readmit(
        &self,
        me: usize,
        (rank, node, host): (usize, usize, &str),
        advert: &Advert,
        deadline: Instant,
    ) -> Result<()> {
        self.shared.forget(rank);
        if self.thread.is_none() {
            return Ok(());
        }
        let conn = connect(me, rank, advert, deadline)
            .and_then(|stream| Conn::new(me, rank, node, host, stream, self.cfg));
        match conn {
            Ok(conn) => lock(&self.shared.inbox).push(conn),
            // The new process died since it asked (its watch's listener went with it):
            // lost, as if its connection had closed, so the waits on it fail over and
            // the agreement masks it again, rather than this rank failing.
            Err(e) => self.lose((rank, node, host), e.to_string()),
        }
        Ok(())
    }

    /// Rank `rank` (on `node`, host `host`) is known dead by other means than its
    /// connection (`detail` says how): lost from now, as a closed connection would be.
    pub(crate) fn lose(&self, (rank, node, host): (usize, usize, &str), detail: String) {
        self.shared.report(Lost {
            rank,
            node,
            host: host.to_owned(),
            how: Gone::Died { detail },
            at: Instant::now(),
        });
    }

    /// Whether any rank is lost (one relaxed load; for the waits' hot loop).
    pub fn any_lost(&self) -> bool {
        self.shared.any.load(Ordering::Acquire) > 0
    }

    /// The verdict on `rank`, if it is lost.
    pub fn lost(&self, rank: usize) -> Option<Lost> {
        let flagged = self.shared.flagged.get(rank)?.load(Ordering::Acquire);
        flagged
            .then(|| self.shared.verdict(rank)?.clone())
            .flatten()
    }

    /// The first rank found lost (earliest verdict), if any.
    pub fn first_lost(&self) -> Option<Lost> {
        (0..self.shared.lost.len())
            .filter_map(|r| self.lost(r))
            .min_by_key(|l| l.at)
    }

    /// Every lost rank, in rank order.
    pub fn lost_ranks(&self) -> Vec<usize> {
        (0..self.shared.lost.len())
            .filter(|&r| self.lost(r).is_some())
            .collect()
    }
}

/// Where a rank's watch listens, and the nonce a connecting peer must say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Advert {
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) nonce: u64,
}

/// A watch's listener, before its connections are made: a founding rank's until the
/// others connected, a joiner's until the survivors did ([`Listening::accept`]).
pub(crate) struct Listening {
    listener: TcpListener,
    pub(crate) advert: Advert,
}

impl Listening {
    /// Listen on `host` (this rank's address on the job's network) with a fresh nonce.
    pub(crate) fn new(me: usize, host: &str) -> Result<Listening> {
        let bind_ip: IpAddr = host.parse().unwrap_or(Ipv4Addr::UNSPECIFIED.into());
        let listener = listen(bind_ip).map_err(io_err(me, format!("listening on {bind_ip}")))?;
        let port = listener
            .local_addr()
            .map_err(io_err(me, "reading the port".into()))?
            .port();
        let advert = Advert {
            host: host.to_owned(),
            port,
            nonce: rand::random::<u64>(),
        };
        Ok(Listening { listener, advert })
    }

    /// A joiner's watch: accept the connection of each rank of `from` (the live ranks
    /// on other nodes, which connect when they let it in) and watch them.
    pub(crate) fn accept(
        self,
        topo: &Topology,
        from: &[usize],
        hosts: &[String],
        (cfg, timeout): (LivenessConfig, Duration),
    ) -> Result<Liveness> {
        let deadline = Instant::now() + timeout;
        let streams = accept(
            &self.listener,
            topo.rank,
            self.advert.nonce,
            from,
            deadline,
            timeout,
        )?;
        Liveness::watch_streams(topo, streams, hosts, cfg)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A listener on an ephemeral port of `ip` whose queue holds every peer: up to 1023
/// ranks of other nodes connect to the highest rank at once.
fn listen(ip: IpAddr) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind((ip, 0))?;
    uep_bootstrap::raise_backlog(&listener)?;
    Ok(listener)
}

fn io_err(me: usize, what: String) -> impl Fn(std::io::Error) -> EpError {
    move |source| EpError::Io {
        context: format!("rank {me}: liveness: {what}"),
        source,
    }
}

/// Every rank's [`Advert`], over the control plane. Collective.
fn exchange(cp: &dyn ControlPlane, mine: &Advert) -> Result<Vec<Advert>> {
    let record = (mine.host.clone(), (u64::from(mine.port), mine.nonce));
    crate::exchange::all_gather(cp, "liveness advert", &record)?
        .into_iter()
        .enumerate()
        .map(|(r, (host, (port, nonce)))| {
            let port = u16::try_from(port).map_err(|_| {
                crate::protocol!("rank {r} advertised liveness port {port}, past 65535")
            })?;
            Ok(Advert { host, port, nonce })
        })
        .collect()
}

/// Connects to rank `r` and says who this is (with `r`'s nonce).
fn connect(me: usize, r: usize, to: &Advert, deadline: Instant) -> Result<TcpStream> {
    let addr = (to.host.as_str(), to.port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            EpError::internal(format!(
                "rank {me}: liveness: rank {r}'s host {:?} does not resolve",
                to.host
            ))
        })?;
    let left = deadline.saturating_duration_since(Instant::now());
    let mut s = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
        .map_err(io_err(me, format!("connecting to rank {r} at {addr}")))?;
    let mut hello = [0u8; 16];
    hello[..8].copy_from_slice(&(me as u64).to_le_bytes());
    hello[8..].copy_from_slice(&to.nonce.to_le_bytes());
    s.write_all(&hello)
        .map_err(io_err(me, format!("greeting rank {r}")))?;
    Ok(s)
}

/// Accepts one connection from each rank of `expected`, refusing any other (a wrong
/// nonce, an unexpected or repeated rank).
fn accept(
    listener: &TcpListener,
    me: usize,
    nonce: u64,
    expected: &[usize],
    deadline: Instant,
    timeout: Duration,
) -> Result<Vec<(usize, TcpStream)>> {
    let mut got: Vec<(usize, TcpStream)> = Vec::with_capacity(expected.len());
    listener
        .set_nonblocking(true)
        .map_err(io_err(me, "listener".into()))?;
    while got.len() < expected.len() {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false)
                    .and_then(|()| s.set_read_timeout(Some(Duration::from_secs(5))))
                    .map_err(io_err(me, "accepting".into()))?;
                let mut hello = [0u8; 16];
                let ok = s.read_exact(&mut hello).is_ok();
                let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or_default());
                let (r, n) = (word(&hello[..8]) as usize, word(&hello[8..]));
                if !ok || n != nonce || !expected.contains(&r) || got.iter().any(|(g, _)| *g == r) {
                    tracing::warn!(rank = me, %from, "liveness: refused a connection that is not a peer's");
                    continue;
                }
                got.push((r, s));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let have: Vec<usize> = got.iter().map(|(r, _)| *r).collect();
                    return Err(EpError::Timeout {
                        what: format!(
                            "rank {me}: liveness: accepting ranks {expected:?} of other nodes"
                        ),
                        detail: format!("connected so far: {have:?}"),
                        waited: timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(io_err(me, "accepting".into())(e)),
        }
    }
    Ok(got)
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The watcher: a beat on every connection each tick, and a verdict on any that fails.
fn watch(shared: &Shared, mut conns: Vec<Conn>, cfg: LivenessConfig) {
    let mut buf = [0u8; 256];
    let report = |c: &Conn, how: Gone| {
        let lost = Lost {
            rank: c.rank,
            node: c.node,
            host: c.host.clone(),
            how,
            at: Instant::now(),
        };
        tracing::warn!("{lost}");
        shared.report(lost);
    };
    while !shared.stop.load(Ordering::Acquire) {
        conns.append(&mut lock(&shared.inbox));
        // Nodes found unreachable this tick, with the verdict.
        let mut unreachable: Vec<(usize, Gone)> = Vec::new();
        conns.retain_mut(|c| {
            let verdict = beat(c, &mut buf, cfg);
            if let Some(how) = verdict.clone() {
                if matches!(how, Gone::Unreachable { .. }) {
                    unreachable.push((c.node, how.clone()));
                }
                report(c, how);
            }
            verdict.is_none() && !c.left
        });
        // The rest of an unreachable node goes with it: its kernel answers for all
        // of them, and each connection's own timer may run later (a retransmission
        // backs off) than the one that already fired.
        for (node, how) in unreachable {
            conns.retain(|c| {
                let gone = c.node == node && !c.left;
                if gone {
                    report(c, how.clone());
                }
                c.node != node
            });
        }
        std::thread::sleep(TICK);
    }
    // Goodbye, so that the peers do not take our closing for a death; then wait (a
    // few ticks at most) until they close too. Closing with their beats unread would
    // reset the connection, and a reset can discard the goodbye before they read it.
    for c in &mut conns {
        let _ = c.stream.write(&[BYE]);
        let _ = c.stream.shutdown(std::net::Shutdown::Write);
    }
    let until = Instant::now() + GOODBYE_WAIT;
    while !conns.is_empty() && Instant::now() < until {
        conns.retain_mut(|c| match c.stream.read(&mut buf) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted,
        });
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One tick on one connection: `Some` once the peer is found gone.
fn beat(c: &mut Conn, buf: &mut [u8], cfg: LivenessConfig) -> Option<Gone> {
    let died = |detail: &str| {
        Some(Gone::Died {
            detail: detail.into(),
        })
    };
    // `TCP_USER_TIMEOUT` fails the socket with ETIMEDOUT (a non-blocking socket has
    // no other timeout); a route that vanished reports the host or network unreachable.
    let judge = |e: std::io::Error| match e.kind() {
        ErrorKind::TimedOut | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => {
            Some(Gone::Unreachable {
                silent_for: cfg.unreachable_after,
                via: c.rank,
            })
        }
        _ => died(&e.to_string()),
    };
    // Judged before this tick's beat goes out, so only bytes sent a tick ago or more
    // count. The kernel's own `TCP_USER_TIMEOUT` is checked only when a retransmission
    // fires, and on a busy host the retransmission timeout grows with the measured
    // round-trip variance (cuts seen at 3.4-4.3 s instead of 0.6 s), so the silence is
    // read directly: bytes unacknowledged, and no acknowledgement of any kind for
    // `unreachable_after`. Acknowledging is the peer kernel's work, not its process's:
    // a stopped peer still acknowledges (or closes its window, so nothing is in
    // flight), and a starved watcher here does not delay what the kernel receives.
    if let Some(silent_for) = unacknowledged_for(&c.stream) {
        if silent_for >= cfg.unreachable_after && !c.left {
            return Some(Gone::Unreachable {
                silent_for,
                via: c.rank,
            });
        }
    }
    match c.stream.write(&[BEAT]) {
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        Err(_) if c.left => return None,
        Err(e) => return judge(e),
    }
    loop {
        match c.stream.read(buf) {
            Ok(0) if c.left => return None,
            Ok(0) => return died("end of stream"),
            Ok(n) => {
                if buf[..n].contains(&BYE) {
                    c.left = true;
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) if c.left => return None,
            Err(e) => return judge(e),
        }
    }
}

/// How long the kernel has gone without any acknowledgement on `s` while some of our
/// bytes are unacknowledged; `None` while everything sent is acknowledged (or
/// `TCP_INFO` cannot be read).
#[allow(unsafe_code)]
fn unacknowledged_for(s: &TcpStream) -> Option<Duration> {
    use std::os::fd::AsRawFd;
    // SAFETY: `tcp_info` is a plain C struct of integers, for which all zeroes is a
    // valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: the descriptor is open for the call (borrowed from `s`), and the kernel
    // writes at most `len` bytes, the size of `info`, into it.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&raw mut info).cast(),
            &mut len,
        )
    };
    (rc == 0 && info.tcpi_unacked > 0)
        .then(|| Duration::from_millis(info.tcpi_last_ack_recv.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_reads_as_a_sentence() {
        let l = Lost {
            rank: 3,
            node: 1,
            host: "10.77.0.2".into(),
            how: Gone::Unreachable {
                silent_for: Duration::from_millis(600),
                via: 3,
            },
            at: Instant::now(),
        };
        let m = l.to_string();
        assert!(
            m.contains("node 1 (10.77.0.2) is unreachable") && m.contains("600ms"),
            "{m}"
        );
    }

    /// Two "ranks" on two "nodes" in one process, over loopback: a live peer stays
    /// live, a closed one dies, a goodbye is no death.
    #[test]
    fn a_dropped_peer_is_no_death_but_a_closed_one_is() {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        let cfg = LivenessConfig::default();
        let conn = |s: TcpStream| {
            s.set_nonblocking(true).unwrap();
            Conn {
                rank: 1,
                node: 1,
                host: "h".into(),
                stream: s,
                left: false,
            }
        };
        let (mut a, mut b) = (conn(a), conn(b));
        let mut buf = [0u8; 16];
        assert_eq!(beat(&mut a, &mut buf, cfg), None);
        assert_eq!(beat(&mut b, &mut buf, cfg), None);
        // b closes without a goodbye: a finds it dead.
        drop(b);
        std::thread::sleep(Duration::from_millis(20));
        let v = beat(&mut a, &mut buf, cfg).or_else(|| beat(&mut a, &mut buf, cfg));
        assert!(matches!(v, Some(Gone::Died { .. })), "{v:?}");

        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let mut a = conn(a);
        b.write_all(&[BEAT, BYE]).unwrap();
        drop(b);
        std::thread::sleep(Duration::from_millis(20));
        for _ in 0..3 {
            assert_eq!(beat(&mut a, &mut buf, cfg), None);
        }
        assert!(a.left);
    }

    /// A rank's new process that died before it was let in (its watch's listener
    /// gone) is lost at once, not an error of the rank letting it in; one that
    /// listens is watched, its old verdict forgotten.
    #[test]
    fn a_joiner_that_died_since_it_asked_is_lost_at_once() {
        let topo = Topology::new(0, 2, 1).unwrap();
        let hosts = vec!["127.0.0.1".to_string(); 2];
        let live = Liveness::watch_streams(&topo, Vec::new(), &hosts, LivenessConfig::default());
        let live = live.unwrap();
        let closed = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let advert = |port| Advert {
            host: "127.0.0.1".into(),
            port,
            nonce: 7,
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        live.readmit(0, (1, 1, "127.0.0.1"), &advert(port), deadline)
            .unwrap();
        let lost = live.lost(1).expect("a joiner whose watch is gone is lost");
        assert!(matches!(lost.how, Gone::Died { .. }), "{lost}");

        let listening = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = listening.local_addr().unwrap().port();
        live.readmit(0, (1, 1, "127.0.0.1"), &advert(port), deadline)
            .unwrap();
        assert_eq!(live.lost(1), None);
        assert!(!live.any_lost());
    }
}
