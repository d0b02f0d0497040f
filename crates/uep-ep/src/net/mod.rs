//! The network path: peers on other nodes, reached through the CPU proxy.
//!
//! Kernels never talk to the NIC. For a peer on another node, what a kernel would have
//! stored into the peer's memory goes into a *packet* instead ([`packet`]): staged in
//! this rank's registered region (or sent from where the rows already are), then
//! written by the proxy into the peer's *landing* area for this rank with one-sided
//! writes. The transport may deliver writes in any order; two emulations of
//! `uep-proxy` say when a packet has landed, as the paper does for transports without
//! ordering:
//!
//! * **Ordered stream** (normal mode, the agreement: [`NetPath::send`] /
//!   [`NetPath::recv`]): the packet is *announced* by a zero-length write whose
//!   immediate says "one more packet"; the receiving proxy applies announcements
//!   strictly in order per peer, so once the receiver's counter for a peer says `k`,
//!   `k` packets' bytes have landed. Every rank makes the same calls in the same order
//!   and each sends at most one packet to each peer on another node, so the `k`-th
//!   packet from a peer is the one the `k`-th receive expects. Rows that need no
//!   unpacking go straight to their final place at the receiver ([`Write`]s before the
//!   announcement), and may be handed to the proxy before the packet is complete
//!   ([`NetPath::stream`]): the one announcement, later in the same stream, covers them.
//! * **Partial-completion fence** (low-latency dispatch and combine:
//!   [`NetPath::send_fenced`] / [`NetPath::wait_fenced`]): each block of a packet (a
//!   combine's rows for a group of adjacent local experts; a dispatch's whole packet) is
//!   counted by the receiving proxy per (kind, LL buffer, key, source), and the block's
//!   last write carries a count signal that the proxy applies only once the block's
//!   other writes have arrived. No ordered announcement: a block is usable as soon as its
//!   own signal is in, and a low-latency receive may be deferred past later calls.
//!
//! What the EP layer uses of the proxy: one FIFO per peer, one ordered stream per peer,
//! the LL fence, `Quiet` to learn that a staging area may be reused, and the
//! `NodeLeader` barrier. Atomics emulation is not used here.

mod port;
mod rejoin;

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use uep_bootstrap::ControlPlane;
use uep_fifo::{Fifo, FifoAlloc, Slot};
use uep_proxy::{cmds, ArrivalWatch, CounterLayout, Proxy};
use uep_shm::Region;
use uep_transport::{FaultConfig, FaultyTransport, PeerAddr, Transport};
use uep_wire::BarrierScope;

use crate::area::{Area, Mem};
use crate::error::{EpError, Result};
use crate::liveness::{Gone, Liveness, Lost};
use crate::map::{fence_keys, ControlAreas, NetAreas};
use crate::topology::Topology;
use crate::wait::{Peer, Remote, Wait};

pub use crate::config::{NetConfig, DEFAULT_WRITE_BYTES};
pub use crate::packet::{Channel, CHANNELS, LL_BUFFERS};
use port::{encode, Counting, PortInit};
pub use port::{Counted, KernelPort, Port};
pub(crate) use rejoin::Joining;

/// The proxy channel of the ordered stream to each peer (normal mode and the
/// agreement); the abort message travels there too (it counts nothing).
const ORDERED_STREAM: u8 = 0;

/// A one-sided write from this rank's region to the same-layout region of a peer,
/// validated once: equal lengths, 16-byte aligned, inside the region. What
/// [`NetPath::send`] posts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Write {
    src: usize,
    dst: usize,
    len: usize,
}

impl Write {
    /// Write `src` (this rank's region) to `dst` (the peer's), in a region of
    /// `region_len` bytes.
    pub fn new(src: Area<u8>, dst: Area<u8>, region_len: usize) -> Result<Write> {
        let align = uep_wire::OFFSET_ALIGN as usize;
        if src.len() != dst.len()
            || src.offset() % align != 0
            || dst.offset() % align != 0
            || src.end() > region_len
            || dst.end() > region_len
        {
            return Err(EpError::internal(format!(
                "a one-sided write of {src:?} to {dst:?} must have equal lengths, {align}-byte aligned offsets and stay inside the {region_len}-byte region"
            )));
        }
        Ok(Write {
            src: src.offset(),
            dst: dst.offset(),
            len: src.len(),
        })
    }

    /// Bytes written.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// This write cut, in order, into writes of at most `piece` bytes (`piece > 0`).
    fn pieces(self, piece: usize) -> impl Iterator<Item = Write> {
        (0..self.len).step_by(piece).map(move |off| Write {
            src: self.src + off,
            dst: self.dst + off,
            len: piece.min(self.len - off),
        })
    }
}

/// A staging area that is free to fill (the packet last sent from it has left), and the
/// [`Port`] through which the kernels that fill it push their writes. Only
/// [`NetPath::stage`] makes one, and [`NetPath::send`] or [`NetPath::send_fenced`]
/// consumes it.
#[derive(Debug)]
pub struct Staged {
    ch: Channel,
    dst: usize,
    /// Where to write the packet.
    pub area: Area<u8>,
    /// Where the packet lands at the peer (this rank's landing area of the channel).
    landing: Area<u8>,
    /// Bytes of the registered region.
    region_len: usize,
    port: Port,
    /// This rank's region, which holds `area`.
    region: Region,
    /// `[channel][peer]`: whether a `Staged` of that area exists; this one's is set
    /// until it drops, so that no two exist at once.
    claims: Arc<[AtomicBool]>,
    claim: usize,
}

impl Drop for Staged {
    fn drop(&mut self) {
        self.claims[self.claim].store(false, Ordering::Release);
    }
}

impl Staged {
    /// `part` of the staging area, to fill in place. The area is this `Staged`'s alone:
    /// [`NetPath::stage`] made it once the packet last sent from it had left, no other
    /// `Staged` of the same area exists while it lives, the proxy reads it only after
    /// [`NetPath::send`] consumed it, and `&mut self` keeps one slice at a time.
    pub fn view_mut<T: bytemuck::Pod>(&mut self, part: Area<T>) -> Result<&mut [T]> {
        self.offset_of(part)?;
        // SAFETY: exclusive, as above; bounds and alignment are checked by `slice_mut`.
        #[allow(unsafe_code)]
        let rows = unsafe { self.region.slice_mut::<T>(part.offset(), part.len())? };
        Ok(rows)
    }

    /// Where `part` starts in the staging area, in bytes, if it lies inside it.
    fn offset_of<T>(&self, part: Area<T>) -> Result<usize> {
        match part.offset().checked_sub(self.area.offset()) {
            Some(at) if at + part.bytes() <= self.area.len() => Ok(at),
            _ => Err(EpError::internal(format!(
                "{part:?} is not inside the staging area {:?}",
                self.area
            ))),
        }
    }

    /// Make the port's writes large enough that kernels pushing `bytes` from `lanes`
    /// threads (each flushing runs of at least a write's size, so at most two pieces a
    /// run) stay within what one count signal counts, with room for the block's own.
    /// Refuses more lanes than that allows whatever the write size (126: each lane's
    /// last run is a write of its own).
    pub fn fit_fence(&mut self, bytes: usize, lanes: usize) -> Result<()> {
        let most = usize::from(uep_wire::MAX_LL_COUNT);
        if 2 * lanes + 2 > most {
            return Err(crate::invalid!(
                "low-latency mode across nodes takes at most {} kernel threads a rank \
                 ({lanes} here): a count signal counts at most {most} writes",
                (most - 2) / 2
            ));
        }
        let piece = fenced_piece(2 * bytes, self.port.write_bytes(), 2 * lanes + 2);
        self.port.set_write_bytes(piece);
        Ok(())
    }

    /// The write of `part` (a part of [`Staged::area`]) into the same place of the
    /// packet's landing area at the peer.
    pub fn write_of(&self, part: Area<u8>) -> Result<Write> {
        self.write_from(part, part)
    }

    /// The write of `src` (anywhere in this rank's region, e.g. rows a zero-copy send
    /// leaves where they are) to where `part` of [`Staged::area`] lands at the peer.
    pub fn write_from(&self, src: Area<u8>, part: Area<u8>) -> Result<Write> {
        let at = self.offset_of(part)?;
        Write::new(
            src,
            self.landing.slice(at..at + part.len())?,
            self.region_len,
        )
    }

    /// The kernels' end of the channel: writes pushed here leave while the packet is
    /// still being packed, ahead of its announcement or count signal.
    pub fn port(&self) -> &Port {
        &self.port
    }

    /// The port as a device's kernel pushes block `block`'s writes into it itself.
    pub fn kernel_port(&self, block: usize) -> Result<KernelPort<'_>> {
        let bases = (self.area.offset(), self.landing.offset());
        self.port.kernel_port(block, bases)
    }
}

/// The Quiet pushed after a packet: its FIFO, the proxy thread and the slot.
type PendingQuiet = (Arc<Fifo>, usize, Slot);

/// This rank's network path: its proxy, what it has in flight, and what it expects.
pub struct NetPath {
    proxy: Proxy,
    region: Region,
    areas: NetAreas,
    me: usize,
    num_ranks: usize,
    ranks_per_node: usize,
    /// `[rank]`: where that rank's proxy listens (its address, else its host name),
    /// to name a node that stopped answering.
    hosts: Vec<String>,
    threads: usize,
    /// `[thread]`: this rank's endpoint addresses (how a joiner reaches it).
    addrs: Vec<PeerAddr>,
    fifos_per_thread: usize,
    /// `[channel][dst]`: whether that staging area is staged now (see [`Staged`]).
    claims: Arc<[AtomicBool]>,
    /// `[channel][dst]`: the Quiet that follows the last packet staged there.
    quiets: RefCell<Vec<Option<PendingQuiet>>>,
    /// Largest single write (see [`NetConfig::write_bytes`]).
    write_bytes: usize,
    /// `[src]`: packets received so far in the ordered stream (the next
    /// [`NetPath::recv`] expects one more).
    received: Vec<Cell<u64>>,
    /// `[channel][dst]`: fenced sends so far ([`NetPath::send_fenced`]).
    fenced: Vec<Cell<u64>>,
    /// Laid out as the fence counters: signals each key has been waited for so far
    /// ([`NetPath::next_fenced`]).
    fences_expected: Vec<Cell<u64>>,
    /// Faults the injectors of all threads have injected so far.
    faults: Arc<AtomicU64>,
    /// Packet bytes handed to the proxy so far (kernels' pushes included).
    sent_bytes: Arc<AtomicU64>,
    /// Commands the kernels pushed so far, and how long the launches that may push ran.
    kernel_cmds: Arc<AtomicU64>,
    kernel_time: Cell<std::time::Duration>,
    /// Whether this rank has told the other nodes that it failed.
    abort_sent: Cell<bool>,
    /// Whether that message went to any live peer (whose writes may still be leaving).
    abort_in_flight: Cell<bool>,
    /// Who on other nodes is gone.
    liveness: Liveness,
}

impl std::fmt::Debug for NetPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetPath")
            .field("me", &self.me)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl NetPath {
    /// Register `region`, connect one endpoint per proxy thread to the same thread of
    /// every peer (addresses exchanged over the control plane), and start the proxy.
    /// Collective. Ranks of `topo` past the control plane's are reserved: no process
    /// has them yet, so they are given up on until one joins (`NetPath::readmit`).
    ///
    /// The proxy's FIFOs are made by `fifos`: memory the device's kernels push into.
    pub fn start(
        cp: &dyn ControlPlane,
        topo: Topology,
        region: &Region,
        areas: NetAreas,
        cfg: &NetConfig,
        fifos: &dyn FifoAlloc,
    ) -> Result<NetPath> {
        let me = topo.rank;
        let host = own_host(cfg);
        let (founding, num_ranks) = (cp.world_size(), topo.num_ranks);
        let mut hosts = crate::exchange::all_gather(cp, "host", &host)?;
        let liveness = Liveness::start(cp, &topo, &host, &hosts, cfg.liveness, cfg.proxy.timeout)?;
        hosts.resize(num_ranks, String::new());
        let endpoints = open_endpoints(me, region, cfg)?;
        let mut peers = Vec::with_capacity(endpoints.len());
        for tr in &endpoints {
            let mut addrs: Vec<PeerAddr> = (cp.all_gather(&tr.local_addr().0)?)
                .into_iter()
                .map(PeerAddr)
                .collect();
            addrs.resize(num_ranks, PeerAddr(Vec::new()));
            peers.push(addrs);
        }
        let faults = Arc::new(AtomicU64::new(0));
        let transports = connect_endpoints(me, endpoints, &peers, cfg, &faults)?;
        let parts = Parts {
            hosts,
            liveness,
            faults,
            transports,
        };
        let net = NetPath::assemble(topo, region, areas, cfg, fifos, parts)?;
        for r in founding..num_ranks {
            net.mark_lost(r);
        }
        Ok(net)
    }

    /// Start the proxy over `parts` and make the path.
    fn assemble(
        topo: Topology,
        region: &Region,
        areas: NetAreas,
        cfg: &NetConfig,
        fifos: &dyn FifoAlloc,
        parts: Parts,
    ) -> Result<NetPath> {
        let (me, num_ranks) = (topo.rank, topo.num_ranks);
        let Parts {
            hosts,
            liveness,
            faults,
            transports,
        } = parts;
        let threads = transports.len();
        let addrs = transports.iter().map(|t| t.local_addr()).collect();
        let counters = counter_layout(&areas, num_ranks)?;
        let mut proxy_cfg = cfg.proxy.clone();
        proxy_cfg.threads = threads;
        // The leader barrier needs to know who leads each node.
        proxy_cfg.ranks_per_node = Some(topo.ranks_per_node);
        let proxy = Proxy::start_in(
            me,
            num_ranks,
            proxy_cfg,
            region.clone(),
            counters,
            transports,
            fifos,
        )
        .map_err(|source| EpError::Proxy {
            rank: me,
            source: Box::new(source),
        })?;
        Ok(NetPath {
            proxy,
            region: region.clone(),
            areas,
            me,
            num_ranks,
            ranks_per_node: topo.ranks_per_node,
            hosts,
            threads,
            addrs,
            fifos_per_thread: cfg.proxy.fifos_per_thread.max(1),
            quiets: RefCell::new(vec![None; CHANNELS * num_ranks]),
            claims: (0..CHANNELS * num_ranks)
                .map(|_| AtomicBool::new(false))
                .collect(),
            write_bytes: (cfg.write_bytes.max(16) / 16 * 16)
                .min(uep_wire::MAX_WRITE_LEN as usize / 16 * 16),
            received: (0..num_ranks).map(|_| Cell::new(0)).collect(),
            fenced: (0..num_ranks * CHANNELS).map(|_| Cell::new(0)).collect(),
            fences_expected: (0..areas.fences.len()).map(|_| Cell::new(0)).collect(),
            faults,
            sent_bytes: Arc::new(AtomicU64::new(0)),
            kernel_cmds: Arc::new(AtomicU64::new(0)),
            kernel_time: Cell::new(std::time::Duration::ZERO),
            abort_sent: Cell::new(false),
            abort_in_flight: Cell::new(false),
            liveness,
        })
    }

    /// The areas this path owns.
    pub fn areas(&self) -> &NetAreas {
        &self.areas
    }

    /// The FIFO that carries everything for `dst` (one, so that it stays ordered).
    fn fifo_of(&self, dst: usize) -> Result<(usize, Arc<Fifo>)> {
        let (t, i) = (
            dst % self.threads,
            (dst / self.threads) % self.fifos_per_thread,
        );
        let fifo = self
            .proxy
            .fifo(t, i)
            .map_err(|source| EpError::Proxy {
                rank: self.me,
                source: Box::new(source),
            })?
            .clone();
        Ok((t, fifo))
    }

    /// The staging area of (`ch`, `dst`), once the packet last sent from it has left.
    pub fn stage(&self, ch: Channel, dst: usize, wait: &Wait<'_>) -> Result<Staged> {
        let area = self.areas.staging(ch, dst)?;
        let landing = self.areas.landing(ch, self.me)?;
        let claim = ch.index() * self.num_ranks + dst;
        if self.claims[claim].swap(true, Ordering::AcqRel) {
            return Err(EpError::internal(format!(
                "rank {}: the {ch:?} staging area for rank {dst} is staged twice",
                self.me
            )));
        }
        // Released again if the wait fails (the Staged below is not made).
        let unclaim = |e| {
            self.claims[claim].store(false, Ordering::Release);
            e
        };
        self.wait_sent(ch, dst, wait).map_err(unclaim)?;
        let (thread, fifo) = self.fifo_of(dst).map_err(unclaim)?;
        // A fenced packet has one block until the caller says otherwise
        // (`NetPath::fence_blocks`).
        let counting = match ch.is_fenced() {
            true => Counting::Fenced(vec![self.fence_key(ch, 0).map_err(unclaim)?]),
            false => Counting::Ordered,
        };
        let port = Port::open(PortInit {
            fifo,
            thread,
            waker: self.proxy.waker(thread),
            me: self.me,
            dst,
            ch,
            counting,
            deadline: wait.deadline,
            proxy_timeout: self.proxy.config().timeout,
            write_bytes: self.write_bytes,
            sent_bytes: self.sent_bytes.clone(),
            kernel_cmds: self.kernel_cmds.clone(),
        });
        Ok(Staged {
            ch,
            dst,
            area,
            landing,
            region_len: self.region.len(),
            port,
            region: self.region.clone(),
            claims: self.claims.clone(),
            claim,
        })
    }

    /// Wait until the last packet sent on `ch` to `dst`, and every write before it
    /// (its staging area, and the direct writes' sources), has left this rank's memory.
    pub fn wait_sent(&self, ch: Channel, dst: usize, wait: &Wait<'_>) -> Result<()> {
        let pending = self.quiets.borrow_mut()[ch.index() * self.num_ranks + dst].take();
        if let Some((fifo, i, slot)) = pending {
            let what = || {
                format!(
                    "rank {}: waiting for the proxy to finish sending a {ch:?} packet to rank {dst} (FIFO of thread {i}, slot {})",
                    self.me, slot.0
                )
            };
            // Our own proxy's progress: a peer's abort does not end it early, but the
            // packet to a peer found gone would never finish.
            if let Some(lost) =
                self.wait_consumed(&fifo, slot, &wait.ignoring_peers(), &what, &[dst])?
            {
                return Err(EpError::PeerLost {
                    what: what(),
                    lost: Box::new(lost),
                });
            }
        }
        Ok(())
    }

    /// Wait until the proxy has popped `slot` of `fifo` (a Quiet or Barrier pops only
    /// once done), or until one of `for_peers`, whose operations are queued before it,
    /// is found gone: then it may never pop, and that peer is returned.
    fn wait_consumed(
        &self,
        fifo: &Fifo,
        slot: Slot,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
        for_peers: &[usize],
    ) -> Result<Option<Lost>> {
        wait.until(None, what, &|| "the command is still queued".into(), || {
            if fifo.is_consumed(slot) {
                return Some(None);
            }
            for_peers.iter().find_map(|&p| self.lost(p)).map(Some)
        })
    }

    /// Send the first `len` bytes of `staged` into the peer's landing area for this
    /// rank, after the `direct` writes, and announce all of it (with whatever the
    /// kernels pushed through [`Staged::port`] before) in the ordered stream. Returns at
    /// once; the next [`NetPath::stage`] of the same area waits for the bytes to leave.
    pub fn send(&self, staged: Staged, len: usize, direct: &[Write]) -> Result<()> {
        let packet = staged.write_of(staged.area.prefix(len)?)?;
        for &w in direct.iter().chain([&packet]) {
            staged.port.push_write(w)?;
        }
        let announce = encode(
            self.me,
            cmds::normal_write(
                staged.dst,
                packet.src as u64,
                packet.dst as u64,
                0,
                ORDERED_STREAM,
                1,
            ),
        )?;
        staged.port.push(announce)?;
        self.finish(staged)
    }

    /// End a send from `staged`: a Quiet that pops once its writes have left (the next
    /// [`NetPath::stage`] waits for it), and wake the proxy thread, since an idle one
    /// sleeps up to `ProxyConfig::max_park` (1 ms) between looks at its FIFOs.
    fn finish(&self, staged: Staged) -> Result<()> {
        let slot = staged.port.push(cmds::quiet())?;
        staged.port.wake();
        let (fifo, t) = staged.port.fifo();
        self.quiets.borrow_mut()[staged.ch.index() * self.num_ranks + staged.dst] =
            Some((fifo.clone(), t, slot));
        Ok(())
    }

    /// The proxy's fence key of local expert `le` on the LL channel `ch`: its "buffer"
    /// bit is the kind of call (0 dispatch, 1 combine), its "expert" the pair (LL
    /// buffer, local expert), so no two calls that may be in flight together share a
    /// key (a buffer is written again only once its last call was received).
    fn fence_key(&self, ch: Channel, le: usize) -> Result<(u8, u16)> {
        let (kind, b) = match ch {
            Channel::LlDispatch(b) => (0, b),
            Channel::LlCombine(b) => (1, b),
            // The key after every LL buffer's (`map::fence_keys`).
            Channel::Decided if le == 0 => {
                return Ok((1, (fence_keys(self.areas.fence_experts) - 1) as u16))
            }
            _ => return Err(EpError::internal(format!("{ch:?} has no fence key {le}"))),
        };
        let experts = self.areas.fence_experts;
        if le >= experts {
            return Err(EpError::internal(format!(
                "fence key for local expert {le} of {experts}"
            )));
        }
        // At most `MAX_LOCAL_EXPERTS` keys: checked when the path started.
        Ok((kind, (usize::from(b) * experts + le) as u16))
    }

    /// The index of the fence counter of (`ch`, `le`) for packets from `src`.
    fn fence_index(&self, ch: Channel, le: usize, src: usize) -> Result<usize> {
        let (kind, key) = self.fence_key(ch, le)?;
        let keys = fence_keys(self.areas.fence_experts);
        Ok((usize::from(kind) * keys + usize::from(key)) * self.num_ranks + src)
    }

    /// The fence counter of (`ch`, `le`) for packets from `src`.
    fn fence_word(&self, ch: Channel, le: usize, src: usize) -> Result<&AtomicU64> {
        self.region
            .word(self.areas.fences, self.fence_index(ch, le, src)?)
    }

    /// Send the LL packet of `staged` as blocks, one per fence key `g` of `blocks`, with
    /// no ordered announcement: the writes of `blocks[g]` (adjacent ones merged) are cut
    /// into pieces, each counted as one arrival of (`g`, this rank) at the peer but the
    /// last, which carries the count signal (a zero-length signal for a block with no
    /// bytes). Block 0's signal also counts the writes the kernels pushed through
    /// [`Staged::port`]. The peer's proxy applies a signal only once its writes have all
    /// arrived, in whatever order the transport delivered them: the paper's
    /// partial-completion fence. Both sides must agree on how many blocks each call has
    /// (key 0 is in every call, so its signals number the calls). Returns at once with
    /// the send's number for (`ch`, peer); the next [`NetPath::stage`] of the same area
    /// waits for the writes to leave.
    pub fn send_fenced(&self, staged: Staged, blocks: &[Vec<Write>]) -> Result<u64> {
        if blocks.is_empty() || blocks.len() > self.areas.fence_experts.max(1) {
            return Err(EpError::internal(format!(
                "a fenced send has {} blocks for {} keys",
                blocks.len(),
                self.areas.fence_experts
            )));
        }
        for (g, block) in blocks.iter().enumerate() {
            let pushed = staged.port.writes(g) as usize;
            self.send_block(&staged, g, &coalesce(block), pushed)?;
        }
        let sent = &self.fenced[staged.ch.index() * self.num_ranks + staged.dst];
        sent.set(sent.get() + 1);
        self.finish(staged)?;
        Ok(sent.get())
    }

    /// The writes of block `g` of a fenced send and its count signal, which also counts
    /// `pushed` writes already in the FIFO under the same key.
    fn send_block(&self, staged: &Staged, g: usize, writes: &[Write], pushed: usize) -> Result<()> {
        let (kind, key) = self.fence_key(staged.ch, g)?;
        let most = usize::from(uep_wire::MAX_LL_COUNT);
        let total: usize = writes.iter().map(Write::len).sum();
        if pushed + writes.len().saturating_sub(1) > most {
            return Err(EpError::internal(format!(
                "a fenced block of {} writes after {pushed} pushed by the kernels: a count signal counts at most {most}",
                writes.len()
            )));
        }
        if total == 0 {
            let signal = cmds::ll_count(staged.dst, kind, key, pushed as u16);
            staged.port.push(encode(self.me, signal)?)?;
            return Ok(());
        }
        let piece = fenced_piece(total, self.write_bytes, writes.len() + pushed);
        let pieces: Vec<Write> = writes.iter().flat_map(|w| w.pieces(piece)).collect();
        for (i, w) in pieces.iter().enumerate() {
            let (src, dst, n) = (w.src as u64, w.dst as u64, w.len as u32);
            // The last piece carries the signal; at most `MAX_LL_COUNT` others
            // (`fenced_piece`).
            let cmd = match pieces.len() - 1 + pushed {
                others if i == pieces.len() - 1 => {
                    cmds::ll_write_count(staged.dst, src, dst, n, kind, key, others as u16)
                }
                _ => cmds::ll_write(staged.dst, src, dst, n, kind, key),
            };
            staged.port.push(encode(self.me, cmd)?)?;
        }
        self.sent_bytes.fetch_add(total as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Make `staged`'s packet one of `blocks` fenced blocks, so that kernels may push
    /// each block's writes ([`Port::put_in`]) before [`NetPath::send_fenced`] signals
    /// them.
    pub fn fence_blocks(&self, staged: &mut Staged, blocks: usize) -> Result<()> {
        let keys = (0..blocks.max(1))
            .map(|g| self.fence_key(staged.ch, g))
            .collect::<Result<_>>()?;
        staged.port.set_blocks(keys);
        Ok(())
    }

    /// The number of signals to wait for on key `g` of `ch` from `src` in the call being
    /// received: one more than the last call that had that key (calls of one LL buffer
    /// are received in order, and both sides know which keys each call has).
    pub fn next_fenced(&self, ch: Channel, src: usize, g: usize) -> Result<u64> {
        let seen = &self.fences_expected[self.fence_index(ch, g, src)?];
        seen.set(seen.get() + 1);
        Ok(seen.get())
    }

    /// The number of the last fenced send on `ch` to `dst` (0: none yet).
    pub fn last_fenced(&self, ch: Channel, dst: usize) -> u64 {
        self.fenced[ch.index() * self.num_ranks + dst].get()
    }

    /// Wait until fenced send number `n` on `ch` from `src` has landed for local expert
    /// `le`: its count signal, and every one before it, applied. The rows are in the
    /// landing area of (`ch`, `src`).
    pub fn wait_fenced(
        &self,
        ch: Channel,
        src: usize,
        le: usize,
        n: u64,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        // The counter holds (signals applied << 32) | writes the last one counted; the
        // proxy numbers signals in 32 bits, which a key would outgrow only after 2^32
        // calls of its buffer.
        self.wait_landed(self.fence_word(ch, le, src)?, n << 32, src, wait, what)
    }

    /// Keep this rank's receiving proxy thread polling until the guard drops: for a
    /// call that expects packets, from before it packs its own, so that peers' streamed
    /// rows keep landing meanwhile (`tcp;ofi_rxm` moves bytes only while the receiver
    /// polls) instead of stalling in full socket buffers.
    pub fn watch_arrivals(&self) -> ArrivalWatch<'_> {
        // Every peer sends to this rank through its proxy thread `rank % threads`, whose
        // endpoint talks to the same thread here.
        self.proxy.watch_arrivals(self.me % self.threads)
    }

    /// Wait for the next packet from `src` in the stream of `ch` and return the
    /// landing area of `ch` it is in. `what()` names who waits for what.
    pub fn recv(
        &self,
        ch: Channel,
        src: usize,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<Area<u8>> {
        if let Some(landing) = self.try_recv(ch, src)? {
            return Ok(landing);
        }
        let tail = self.region.word(self.areas.tails, src)?;
        self.wait_landed(tail, self.received[src].get() + 1, src, wait, what)?;
        self.try_recv(ch, src)?
            .ok_or_else(|| EpError::internal(format!("rank {src}'s packet landed and is gone")))
    }

    /// The next packet from `src` in the stream of `ch`, if it has landed (as
    /// [`NetPath::recv`], without waiting).
    pub fn try_recv(&self, ch: Channel, src: usize) -> Result<Option<Area<u8>>> {
        if ch.is_fenced() {
            return Err(EpError::internal(format!("{ch:?} is fenced, not streamed")));
        }
        let received = &self.received[src];
        let tail = self.region.word(self.areas.tails, src)?;
        if tail.load(Ordering::Acquire) <= received.get() {
            return Ok(None);
        }
        received.set(received.get() + 1);
        self.areas.landing(ch, src).map(Some)
    }

    /// Count `packets` of `src`'s stream as received without reading them (packets a
    /// peer sent that no receive here is for: see `elastic`), and wait until they have
    /// landed, so that the peer's proxy is done with them.
    pub fn skip(
        &self,
        src: usize,
        packets: u64,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let received = &self.received[src];
        received.set(received.get() + packets);
        let tail = self.region.word(self.areas.tails, src)?;
        self.wait_landed(tail, received.get(), src, wait, what)
    }

    /// Whether fenced send number `n` on `ch` from `src` has landed (block 0's signal):
    /// [`NetPath::wait_fenced`] without waiting.
    pub fn fenced_landed(&self, ch: Channel, src: usize, n: u64) -> Result<bool> {
        Ok(self.fence_word(ch, 0, src)?.load(Ordering::Acquire) >= n << 32)
    }

    /// The landing area of `ch` for packets from `src`.
    pub fn landing(&self, ch: Channel, src: usize) -> Result<Area<u8>> {
        self.areas.landing(ch, src)
    }

    /// Wait until the counter `word`, which `src`'s writes raise through this rank's
    /// proxy, reaches `target`, keeping the receiving proxy thread polling meanwhile.
    fn wait_landed(
        &self,
        word: &AtomicU64,
        target: u64,
        src: usize,
        wait: &Wait<'_>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        if word.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let _watch = self.watch_arrivals();
        let peer = Peer {
            rank: src,
            region: None,
        };
        wait.at_least(word, target, Some(peer), what)?;
        Ok(())
    }

    /// Meet the other nodes' leaders: the proxy's `NodeLeader` barrier number `seq`,
    /// which pops once every leader's barrier message of that number has arrived.
    pub fn barrier(&self, seq: u64, wait: &Wait<'_>) -> Result<()> {
        let me = self.me;
        let fifo = self.proxy.fifo(0, 0).map_err(|source| EpError::Proxy {
            rank: me,
            source: Box::new(source),
        })?;
        let what = || format!("rank {me}: barrier {seq}: waiting for the other nodes' leaders");
        // Barrier numbers wrap at 2^32 here; seq 0 is reserved, and never reached first.
        let cmd = cmds::barrier(BarrierScope::NodeLeader, (seq as u32).max(1))
            .map_err(|e| EpError::internal(format!("rank {me}: {e}")))?;
        let slot = fifo
            .push(cmd, wait.deadline)
            .map_err(|e| EpError::Timeout {
                what: what(),
                detail: format!("FIFO 0.0 stayed full: {e}"),
                waited: self.proxy.config().timeout,
            })?;
        // Barrier messages arrive at thread 0 too: keep it polling until it pops.
        let _watch = self.proxy.watch_arrivals(0);
        self.proxy.wake_thread(0);
        self.wait_consumed(fifo, slot, wait, &what, &[]).map(drop)
    }

    /// Tell every rank in `peers` (all on other nodes) that this rank failed, once: its
    /// message slot, then, after those writes completed, its abort word (staged at
    /// `abort_src`, holding `me + 1`), each written to the same place of the peer's
    /// region. A peer's waits watch that word, so they stop now instead of at their
    /// deadline. Best effort on a failing path: gives up at `wait`'s deadline.
    pub fn send_abort(
        &self,
        control: &ControlAreas,
        peers: &[usize],
        wait: &Wait<'_>,
    ) -> Result<()> {
        if self.abort_sent.replace(true) {
            return Ok(());
        }
        let me = self.me;
        self.region
            .word(self.areas.abort_src, 0)?
            .store(me as u64 + 1, Ordering::Release);
        let msg = control.abort_msg_of(me)?;
        let phases = [
            Write::new(msg, msg, self.region.len())?,
            Write::new(
                self.areas.abort_src.cast(),
                control.abort.prefix(1)?.cast(),
                self.region.len(),
            )?,
        ];
        let wait = wait.ignoring_peers();
        // A peer found gone would never complete the writes, and holds up the Quiet
        // the others wait behind.
        let peers: Vec<usize> = peers
            .iter()
            .copied()
            .filter(|&p| self.liveness.lost(p).is_none())
            .collect();
        self.abort_in_flight.set(!peers.is_empty());
        for w in phases {
            let mut quiets = Vec::with_capacity(peers.len());
            for &dst in &peers {
                let (t, fifo) = self.fifo_of(dst)?;
                let cmd = cmds::normal_write(
                    dst,
                    w.src as u64,
                    w.dst as u64,
                    w.len as u32,
                    ORDERED_STREAM,
                    0,
                )
                .map_err(|e| EpError::internal(format!("rank {me}: {e}")))?;
                let push = |cmd| {
                    fifo.push(cmd, wait.deadline).map_err(|e| {
                        EpError::internal(format!("rank {me}: abort to rank {dst}: {e}"))
                    })
                };
                push(cmd)?;
                quiets.push((fifo.clone(), push(cmds::quiet())?));
                self.proxy.wake_thread(t);
            }
            // The word must not land before the message it points to. A peer found
            // gone meanwhile never completes its writes, and the Quiets behind them
            // never pop: stop waiting then (the others learn of it from their watch).
            let what = || format!("rank {me}: telling the other nodes that this rank failed");
            for (fifo, slot) in quiets {
                if self
                    .wait_consumed(&fifo, slot, &wait, &what, &peers)?
                    .is_some()
                {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Stops the proxy after it has sent everything queued (bounded by the proxy's
    /// timeout; lost peers' operations are given up on), then the liveness watch, which
    /// says goodbye: a rank that leaves after its last call must not take that call's
    /// last packets with it.
    pub fn shutdown(self) {
        let me = self.me;
        if let Err(e) = self.proxy.shutdown() {
            tracing::warn!(rank = me, "proxy shutdown: {e}");
        }
    }

    /// Whether [`NetPath::send_abort`] ran.
    pub fn abort_sent(&self) -> bool {
        self.abort_sent.get()
    }

    /// Whether [`NetPath::send_abort`] wrote to any peer: their send completions say
    /// only that the bytes left, so the connections should outlive them a moment.
    pub fn abort_in_flight(&self) -> bool {
        self.abort_in_flight.get()
    }

    /// Packet bytes handed to the proxy so far.
    pub fn sent_bytes(&self) -> u64 {
        self.sent_bytes.load(Ordering::Relaxed)
    }

    /// Commands the kernels pushed so far, and how long the launches that may push them
    /// ran (see [`NetPath::time_kernel`]).
    pub fn kernel_pushes(&self) -> (u64, std::time::Duration) {
        (
            self.kernel_cmds.load(Ordering::Relaxed),
            self.kernel_time.get(),
        )
    }

    /// Count `elapsed`, the run of a kernel launch that pushed commands, towards
    /// [`NetPath::kernel_pushes`].
    pub fn time_kernel(&self, elapsed: std::time::Duration) {
        self.kernel_time.set(self.kernel_time.get() + elapsed);
    }

    /// Faults injected so far (0 without `NetConfig::faults`).
    pub fn faults_injected(&self) -> u64 {
        self.faults.load(Ordering::Relaxed)
    }

    /// Stop sending to `rank` (masked in elastic mode): its proxy operations in flight
    /// are given up on, later ones dropped.
    pub fn mark_lost(&self, rank: usize) {
        self.proxy.mark_lost(rank);
    }

    /// The watch over the ranks on other nodes.
    pub(crate) fn liveness(&self) -> &Liveness {
        &self.liveness
    }
}

impl Remote for NetPath {
    /// A fatal error of a proxy thread, if any.
    fn check(&self) -> Result<()> {
        self.proxy.check().map_err(|source| EpError::Proxy {
            rank: self.me,
            source: Box::new(source),
        })
    }

    /// Whether `rank` is gone, and how that was known: the liveness watch's verdict,
    /// or (with `ProxyConfig::elastic`) an operation to it that failed.
    fn lost(&self, rank: usize) -> Option<Lost> {
        // Nothing of this path goes to a rank of this node (its process is watched
        // through the memory it shares), so it has nothing to say about one; a flag
        // left from a process it replaced must not mask it.
        if rank / self.ranks_per_node == self.me / self.ranks_per_node {
            return None;
        }
        if let Some(l) = self.liveness.lost(rank) {
            return Some(l);
        }
        self.proxy.is_lost(rank).then(|| Lost {
            rank,
            node: rank / self.ranks_per_node,
            host: self.hosts.get(rank).cloned().unwrap_or_default(),
            how: Gone::Died {
                detail: "an operation to it failed".into(),
            },
            at: Instant::now(),
        })
    }

    fn first_lost(&self) -> Option<Lost> {
        // One load on the hot path: the watch over other nodes says someone is gone.
        match self.liveness.any_lost() {
            true => self.liveness.first_lost(),
            false => None,
        }
    }

    fn lost_behind_failure(&self) -> Option<Lost> {
        // The watch reads every connection each tick; a dead process's closes at once.
        let until = Instant::now() + 4 * crate::liveness::TICK;
        loop {
            if let Some(lost) = self.first_lost() {
                return Some(lost);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// For a rank on another node: which node and host it is on, and that only the
    /// network connects us, for the message of a wait on it that timed out. `None`
    /// for a rank on this node.
    fn remote_note(&self, rank: usize) -> Option<String> {
        let node = rank / self.ranks_per_node;
        if node == self.me / self.ranks_per_node {
            return None;
        }
        let host = self.hosts.get(rank).map_or("", String::as_str);
        Some(format!(
            "rank {rank} is on node {node} (host {host}), reached only over the network: that \
             node, the link to it, or its processes stopped answering"
        ))
    }
}

/// Where the receive-side counters the proxy raises live in the region: the ordered
/// streams' tails, the LL fence counters (its "buffer" bit is the kind of LL call, its
/// "expert" the (LL buffer, local expert) pair: see `NetPath::fence_key`) and the
/// barrier counters. Refuses more fence keys than the wire can name.
fn counter_layout(areas: &NetAreas, num_ranks: usize) -> Result<CounterLayout> {
    let keys = fence_keys(areas.fence_experts);
    if keys > uep_wire::MAX_LOCAL_EXPERTS {
        return Err(crate::invalid!(
        "low-latency mode across nodes supports at most {} experts per rank (the proxy's fence names {} keys, one per (LL buffer, local expert) and one more); this Buffer has {}",
        (uep_wire::MAX_LOCAL_EXPERTS - 1) / LL_BUFFERS,
        uep_wire::MAX_LOCAL_EXPERTS,
        areas.fence_experts
        ));
    }
    Ok(CounterLayout {
        num_ranks,
        tail_base: areas.tails.offset() as u64,
        num_channels: 1,
        ll_base: areas.fences.offset() as u64,
        num_local_experts: keys,
        barrier_base: areas.barriers.offset() as u64,
        // Atomics are not used by this layer.
        atomic_base: areas.barriers.offset() as u64,
        num_atomic_slots: 0,
    })
}

/// A path's pieces before its proxy starts: the ranks' hosts (for messages), the
/// liveness watch, the fault counter and one connected transport per proxy thread.
struct Parts {
    hosts: Vec<String>,
    liveness: Liveness,
    faults: Arc<AtomicU64>,
    transports: Vec<Box<dyn Transport>>,
}

/// The address this rank's proxy and watch use (`cfg`'s node, else the host name).
fn own_host(cfg: &NetConfig) -> String {
    cfg.fabric.node.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_default()
    })
}

fn transport_err(context: String) -> impl Fn(uep_transport::TransportError) -> EpError {
    move |source| EpError::Transport {
        context: context.clone(),
        source: Box::new(source),
    }
}

/// This rank's endpoints, one per proxy thread (`cfg`'s connector), not connected yet.
fn open_endpoints(me: usize, region: &Region, cfg: &NetConfig) -> Result<Vec<Box<dyn Transport>>> {
    let connector = cfg.connector();
    (0..cfg.proxy.threads.max(1))
        .map(|t| {
            let context = format!("rank {me}: opening the transport of proxy thread {t}");
            connector
                .open(me, t, region)
                .map_err(transport_err(context))
        })
        .collect()
}

/// Connect each endpoint `t` to `peers[t]` (every rank's endpoint of thread `t`; this
/// rank's own is left out), each behind a fault injector whose injections count into
/// `faults` when `cfg.faults` says so.
fn connect_endpoints(
    me: usize,
    endpoints: Vec<Box<dyn Transport>>,
    peers: &[Vec<PeerAddr>],
    cfg: &NetConfig,
    faults: &Arc<AtomicU64>,
) -> Result<Vec<Box<dyn Transport>>> {
    let threads = endpoints.len();
    let mut transports: Vec<Box<dyn Transport>> = Vec::with_capacity(threads);
    for (t, (mut tr, peers)) in endpoints.into_iter().zip(peers).enumerate() {
        let peers: Vec<PeerAddr> = (peers.iter().enumerate())
            .map(|(r, a)| PeerAddr(if r == me { Vec::new() } else { a.0.clone() }))
            .collect();
        tr.connect(&peers).map_err(transport_err(format!(
            "rank {me}: connecting proxy thread {t}"
        )))?;
        if let Some(f) = &cfg.faults {
            let f = FaultConfig {
                seed: f.seed ^ ((me * threads + t) as u64 * 0x9e37_79b9),
                ..f.clone()
            };
            let faulty = FaultyTransport::new(tr, f)
                .map_err(transport_err(format!("rank {me}: fault injector")))?;
            tr = Box::new(faulty.mirror_injected(faults.clone()));
        }
        transports.push(tr);
    }
    Ok(transports)
}

/// The size of the pieces a fenced block of `len` bytes in `writes` separate writes is
/// cut into: `write_bytes` (a multiple of 16), or larger if that would take more pieces
/// than a count signal can announce besides its own ([`uep_wire::MAX_LL_COUNT`] + 1 in
/// all; each write ends in a piece of its own).
fn fenced_piece(len: usize, write_bytes: usize, writes: usize) -> usize {
    let most = (usize::from(uep_wire::MAX_LL_COUNT) + 1)
        .saturating_sub(writes)
        .max(1);
    write_bytes.max(len.div_ceil(most).div_ceil(16) * 16)
}

/// `writes` without empty ones, each merged into the one before when both its source
/// and its destination continue it.
fn coalesce(writes: &[Write]) -> Vec<Write> {
    let mut out: Vec<Write> = Vec::with_capacity(writes.len());
    for w in writes.iter().filter(|w| !w.is_empty()) {
        match out.last_mut() {
            Some(p) if p.src + p.len == w.src && p.dst + p.len == w.dst => p.len += w.len,
            _ => out.push(*w),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_fenced_block_fits_one_count_signal(
            lens in proptest::collection::vec(1usize..1 << 30, 1..=usize::from(uep_wire::MAX_LL_COUNT) + 1),
            w in 1usize..1 << 22,
        ) {
            let write_bytes = w.div_ceil(16) * 16;
            let total: usize = lens.iter().sum();
            let piece = fenced_piece(total, write_bytes, lens.len());
            prop_assert_eq!(piece % 16, 0);
            prop_assert!(piece >= write_bytes);
            let pieces: usize = lens.iter().map(|l| l.div_ceil(piece)).sum();
            prop_assert!(pieces - 1 <= usize::from(uep_wire::MAX_LL_COUNT), "{pieces} pieces");
        }
    }

    #[test]
    fn adjacent_writes_merge() {
        let w = |src, dst, len| Write { src, dst, len };
        let merged = coalesce(&[w(0, 100, 16), w(16, 116, 32), w(0, 0, 0), w(48, 200, 16)]);
        assert_eq!(merged, vec![w(0, 100, 48), w(48, 200, 16)]);
    }
}
