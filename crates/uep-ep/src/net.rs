//! The network path: peers on other nodes, reached through the CPU proxy.
//!
//! Kernels never talk to the NIC. For a peer on another node a kernel writes the
//! packet it would have stored into the peer's memory into its own *staging* area
//! instead, then pushes 16-byte commands into a FIFO: writes of the packet into the
//! peer's *landing* area for this rank, and one zero-length write that announces it
//! on the operation's channel. The proxy posts them as one-sided writes with
//! immediates; the receiving proxy applies announcements strictly in order per
//! (peer, channel), so once the receiver's counter says `k` packets, `k` packets'
//! bytes have landed, whatever order the transport delivered them in.
//!
//! All commands to one peer go through one FIFO (ordering holds only within one), and a
//! `Quiet` after each packet tells this rank when its staging area may be reused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_bootstrap::Group;
use uep_fifo::Slot;
use uep_proxy::{cmds, CounterLayout, Proxy, ProxyConfig};
use uep_shm::Region;
use uep_transport::{
    FabricOptions, FaultConfig, FaultyTransport, LibfabricTransport, PeerAddr, RegionRef, Transport,
};
use uep_wire::BarrierScope;

use crate::device::{wait_at_least, Backoff, Until};
use crate::error::{EpError, Result};
use crate::invalid;
use crate::symm::{Channel, RegionMap, CHANNELS};

/// The one wire channel: every packet from a peer is announced in one ordered stream.
const WIRE_CHANNEL: u8 = 0;

/// Default largest single write of a packet: big enough to stream, small enough that
/// the proxy interleaves peers and the first bytes move while the last are staged.
pub const DEFAULT_WRITE_BYTES: usize = 1 << 20;

/// How the network path is set up.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConfig {
    /// libfabric options (provider, interface).
    pub fabric: FabricOptions,
    /// Proxy threads, FIFOs, flow control.
    pub proxy: ProxyConfig,
    /// Wrap every transport in a fault injector (tests and soak runs).
    pub faults: Option<FaultConfig>,
    /// Largest write a packet is cut into (a multiple of 16). Packets batch every token
    /// bound for a peer; a token row's size here sends one write per row instead, as an
    /// unbatched design would (`uep bench --net-write-bytes` compares them).
    pub write_bytes: usize,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            fabric: FabricOptions::from_env(),
            proxy: ProxyConfig::default(),
            faults: None,
            write_bytes: DEFAULT_WRITE_BYTES,
        }
    }
}

/// This rank's proxy and what it has in flight.
pub(crate) struct Net {
    proxy: Proxy,
    threads: usize,
    fifos_per_thread: usize,
    num_ranks: usize,
    /// `[channel][dst]`: the Quiet that follows the last packet staged there.
    quiets: std::cell::RefCell<Vec<Option<(usize, usize, Slot)>>>,
    /// Largest single write (see [`NetConfig::write_bytes`]).
    write_bytes: usize,
    /// `[src]`: packets awaited so far (the next wait expects one more).
    expected: Vec<std::cell::Cell<u64>>,
    /// Faults the injectors of all threads have injected so far.
    faults: Arc<AtomicU64>,
    /// Packet bytes handed to the proxy so far.
    sent_bytes: std::cell::Cell<u64>,
    /// Whether this rank has told the other nodes that it failed.
    abort_sent: std::cell::Cell<bool>,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Net {
    /// Register `region`, connect one endpoint per proxy thread to the same thread of
    /// every peer (addresses exchanged through `group`), and start the proxy.
    pub(crate) fn start(
        group: &Group,
        map: &RegionMap,
        region: &Region,
        cfg: &NetConfig,
    ) -> Result<Net> {
        let (rank, num_ranks) = (group.rank(), group.world_size());
        let threads = cfg.proxy.threads.max(1);
        let faults = Arc::new(AtomicU64::new(0));
        let mut transports: Vec<Box<dyn Transport>> = Vec::with_capacity(threads);
        for t in 0..threads {
            let region_ref = region_ref(region)?;
            let mut tr: Box<dyn Transport> = Box::new(
                LibfabricTransport::new(&cfg.fabric, region_ref)
                    .map_err(|e| invalid!("libfabric: {e}"))?,
            );
            let addrs = group.all_gather(&tr.local_addr().0)?;
            let peers: Vec<PeerAddr> = addrs
                .into_iter()
                .enumerate()
                .map(|(r, a)| {
                    if r == rank {
                        PeerAddr(Vec::new())
                    } else {
                        PeerAddr(a)
                    }
                })
                .collect();
            tr.connect(&peers)
                .map_err(|e| invalid!("rank {rank}: connecting proxy thread {t}: {e}"))?;
            if let Some(f) = &cfg.faults {
                let f = FaultConfig {
                    seed: f.seed ^ ((rank * threads + t) as u64 * 0x9e37_79b9),
                    ..f.clone()
                };
                let faulty =
                    FaultyTransport::new(tr, f).map_err(|e| invalid!("fault injector: {e}"))?;
                tr = Box::new(faulty.mirror_injected(faults.clone()));
            }
            transports.push(tr);
        }
        let counters = CounterLayout {
            num_ranks,
            tail_base: map.net.tails as u64,
            num_channels: 1,
            // LL fences and native-style atomics are not used by this layer: packets
            // are ordered per peer by the tail stream alone.
            ll_base: map.net.proxy_counters as u64,
            num_local_experts: 0,
            barrier_base: map.net.proxy_counters as u64,
            atomic_base: map.net.proxy_counters as u64,
            num_atomic_slots: 0,
        };
        let proxy = Proxy::start(
            rank,
            num_ranks,
            cfg.proxy.clone(),
            *region,
            counters,
            transports,
        )
        .map_err(|e| invalid!("rank {rank}: starting the proxy: {e}"))?;
        let fifos_per_thread = cfg.proxy.fifos_per_thread.max(1);
        Ok(Net {
            proxy,
            threads,
            fifos_per_thread,
            num_ranks,
            quiets: std::cell::RefCell::new(vec![None; CHANNELS * num_ranks]),
            write_bytes: (cfg.write_bytes.max(16) / 16 * 16)
                .min(uep_wire::MAX_WRITE_LEN as usize / 16 * 16),
            expected: (0..num_ranks).map(|_| std::cell::Cell::new(0)).collect(),
            faults,
            sent_bytes: std::cell::Cell::new(0),
            abort_sent: std::cell::Cell::new(false),
        })
    }

    /// The FIFO that carries everything for `dst`.
    fn fifo_of(&self, dst: usize) -> (usize, usize) {
        (
            dst % self.threads,
            (dst / self.threads) % self.fifos_per_thread,
        )
    }

    /// Wait until the staging area of (`ch`, `dst`) is free again.
    pub(crate) fn reclaim(&self, ch: Channel, dst: usize, until: Until<'_>) -> Result<()> {
        let pending = self.quiets.borrow_mut()[ch as usize * self.num_ranks + dst].take();
        let Some((t, i, slot)) = pending else {
            return Ok(());
        };
        let fifo = self.proxy.fifo(t, i).map_err(|e| invalid!("{e}"))?;
        self.wait_consumed(fifo, slot, until, || {
            format!(
                "waiting for the proxy to finish sending a {ch:?} packet to rank {dst} (FIFO {t}.{i}, slot {})",
                slot.0
            )
        })
    }

    /// Wait until the proxy has popped `slot` of `fifo` (a Quiet or Barrier pops only
    /// once done), failing on a proxy error, on `until`'s abort word or at its deadline.
    fn wait_consumed(
        &self,
        fifo: &uep_fifo::Fifo,
        slot: Slot,
        until: Until<'_>,
        what: impl Fn() -> String,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        while !fifo.is_consumed(slot) {
            self.check()?;
            if let Some(who) = until
                .abort
                .map(|a| a.load(Ordering::Acquire))
                .filter(|&w| w != 0)
            {
                return Err(EpError::Peer(format!(
                    "{}: rank {} aborted",
                    what(),
                    who - 1
                )));
            }
            if Instant::now() >= until.deadline {
                return Err(EpError::Timeout(what()));
            }
            backoff.snooze();
        }
        Ok(())
    }

    /// Send the `len`-byte packet staged for `dst` on `ch` into `dst`'s landing area for
    /// `me`, then announce it. Each `(from, to, len)` of `direct` is written first, from
    /// this rank's region at `from` to `dst`'s at `to` (rows that need no unpacking);
    /// the announcement covers them too.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send(
        &self,
        map: &RegionMap,
        me: usize,
        ch: Channel,
        dst: usize,
        len: usize,
        direct: &[(usize, usize, usize)],
        deadline: Instant,
    ) -> Result<()> {
        let (t, i) = self.fifo_of(dst);
        let fifo = self.proxy.fifo(t, i).map_err(|e| invalid!("{e}"))?.clone();
        let (src, land) = (
            map.net.staging(ch, dst) as u64,
            map.net.landing(ch, me) as u64,
        );
        let push = |cmd| {
            fifo.push(cmd, deadline).map_err(|e| {
                EpError::Timeout(format!("rank {me}: FIFO {t}.{i} to rank {dst}: {e}"))
            })
        };
        let wire = |e: uep_proxy::ProxyError| invalid!("rank {me}: {e}");
        let mut sent = 0;
        let packet = [(src as usize, land as usize, len)];
        for &(from, to, len) in direct.iter().chain(&packet) {
            let mut off = 0;
            while off < len {
                let n = self.write_bytes.min(len - off);
                push(
                    cmds::normal_write(
                        dst,
                        (from + off) as u64,
                        (to + off) as u64,
                        n as u32,
                        WIRE_CHANNEL,
                        0,
                    )
                    .map_err(wire)?,
                )?;
                off += n;
            }
            sent += len;
        }
        push(cmds::normal_write(dst, src, land, 0, WIRE_CHANNEL, 1).map_err(wire)?)?;
        let slot = push(cmds::quiet())?;
        // An idle proxy thread sleeps up to `ProxyConfig::max_park` (1 ms) between
        // looks at its FIFOs: wake it, so the packet leaves now.
        self.proxy.wake_thread(t);
        self.sent_bytes.set(self.sent_bytes.get() + sent as u64);
        self.quiets.borrow_mut()[ch as usize * self.num_ranks + dst] = Some((t, i, slot));
        Ok(())
    }

    /// Tell every rank in `peers` (all on other nodes) that this rank failed, once: its
    /// message slot, then, after those writes completed, its abort word (staged at
    /// `abort_src`, holding `me + 1`), each written to the same offset of the peer's
    /// region. A peer's waits watch that word, so they stop now instead of at their
    /// deadline. Best effort on a failing path: gives up at `deadline`.
    pub(crate) fn send_abort(
        &self,
        map: &RegionMap,
        me: usize,
        peers: &[usize],
        deadline: Instant,
    ) -> Result<()> {
        if self.abort_sent.replace(true) {
            return Ok(());
        }
        let msg = map.abort_msg(me);
        let phases = [
            (msg, msg, crate::symm::ABORT_MSG_BYTES),
            (map.net.abort_src, map.abort, 8),
        ];
        for (src, dst_off, len) in phases {
            let mut quiets = Vec::with_capacity(peers.len());
            for &dst in peers {
                let (t, i) = self.fifo_of(dst);
                let fifo = self.proxy.fifo(t, i).map_err(|e| invalid!("{e}"))?;
                let write = cmds::normal_write(
                    dst,
                    src as u64,
                    dst_off as u64,
                    len as u32,
                    WIRE_CHANNEL,
                    0,
                )
                .map_err(|e| invalid!("rank {me}: {e}"))?;
                let push = |cmd| {
                    fifo.push(cmd, deadline).map_err(|e| {
                        EpError::Timeout(format!("rank {me}: abort to rank {dst}: {e}"))
                    })
                };
                push(write)?;
                quiets.push((fifo, push(cmds::quiet())?));
                self.proxy.wake_thread(t);
            }
            // The word must not land before the message it points to.
            let until = Until {
                deadline,
                abort: None,
                peer: None,
            };
            for (fifo, slot) in quiets {
                self.wait_consumed(fifo, slot, until, || {
                    format!("rank {me}: telling the other nodes that this rank failed")
                })?;
            }
        }
        Ok(())
    }

    /// Meet the other nodes' leaders: the proxy's `NodeLeader` barrier number `seq`,
    /// which pops once every leader's barrier message of that number has arrived.
    pub(crate) fn barrier(&self, me: usize, seq: u64, until: Until<'_>) -> Result<()> {
        let fifo = self.proxy.fifo(0, 0).map_err(|e| invalid!("{e}"))?;
        let what = || format!("rank {me}: barrier {seq}: waiting for the other nodes' leaders");
        // Barrier numbers wrap at 2^32 here; seq 0 is reserved, and never reached first.
        let cmd = cmds::barrier(BarrierScope::NodeLeader, (seq as u32).max(1))
            .map_err(|e| invalid!("rank {me}: {e}"))?;
        let slot = fifo
            .push(cmd, until.deadline)
            .map_err(|e| EpError::Timeout(format!("{}: FIFO 0.0: {e}", what())))?;
        // Barrier messages arrive at thread 0 too: keep it polling until it pops.
        let _watch = self.proxy.watch_arrivals(0);
        self.wait_consumed(fifo, slot, until, what)
    }

    /// Whether [`Net::send_abort`] ran.
    pub(crate) fn abort_sent(&self) -> bool {
        self.abort_sent.get()
    }

    /// Packet bytes handed to the proxy so far.
    pub(crate) fn sent_bytes(&self) -> u64 {
        self.sent_bytes.get()
    }

    /// Faults injected so far (0 without `NetConfig::faults`).
    pub(crate) fn faults_injected(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// A fatal error of a proxy thread, if any.
    pub(crate) fn check(&self) -> Result<()> {
        self.proxy
            .check()
            .map_err(|e| EpError::Peer(format!("proxy: {e}")))
    }
}

fn region_ref(region: &Region) -> Result<RegionRef> {
    // SAFETY: the region is a live mapping of this rank's segment, owned by the Buffer,
    // which drops its proxy (and so every transport) before unmapping.
    unsafe { RegionRef::from_raw(region.as_ptr(), region.len()) }
        .map_err(|e| invalid!("registering memory: {e}"))
}

/// Wait for the next packet from `src` (what the caller calls `what`).
pub(crate) fn wait_packet(
    net: &Net,
    region: &Region,
    map: &RegionMap,
    src: usize,
    until: Until<'_>,
    what: impl Fn() -> String,
) -> Result<()> {
    let target = net.expected[src].get() + 1;
    let counter = region.atomic_u64(map.net.tail(src))?;
    // Every peer sends to this rank through its proxy thread `rank % threads`, whose
    // endpoint talks to the same thread here: keep that one polling while we wait.
    let _watch = net.proxy.watch_arrivals(net.proxy.rank() % net.threads);
    // Short slices of waiting, so proxy failures surface before the deadline.
    loop {
        let slice = Until {
            deadline: until
                .deadline
                .min(Instant::now() + Duration::from_millis(20)),
            ..until
        };
        match wait_at_least(counter, target, slice, &what) {
            Ok(_) => {
                net.expected[src].set(target);
                return Ok(());
            }
            Err(EpError::Timeout(m)) if Instant::now() >= until.deadline => {
                return Err(EpError::Timeout(m))
            }
            Err(EpError::Timeout(_)) => net.check()?,
            Err(e) => return Err(e),
        }
    }
}
