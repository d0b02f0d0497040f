//! A kernel's end of a channel: the FIFO into which the threads that pack a packet push
//! the one-sided writes of what they packed, *while* they pack, as UCCL-EP's GPU kernels
//! push each token's command into their channel's FIFO. The proxy posts a write while
//! later tokens are still being packed; the host only opens the channel (a [`Port`] in
//! a [`super::Staged`] area) and closes it (the announcement or count signal, and a
//! Quiet) once the kernel is done.
//!
//! A `Port` is `Sync`: every kernel thread pushes into the same FIFO (the ring takes
//! many producers), so the channel's writes stay in one FIFO, which is what the ordered
//! stream and the fence need (a channel's writes and its signal meet on one proxy
//! thread).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_fifo::{Fifo, Slot};
use uep_proxy::{cmds, Waker};
use uep_wire::TransferCmd;

use super::{Write, ORDERED_STREAM};
use crate::error::{EpError, Result};
use crate::packet::Channel;

/// How a port's writes are counted at the receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Counting {
    /// Normal mode: writes of the ordered stream, covered by the announcement that
    /// follows them in the same FIFO.
    Ordered,
    /// Low-latency mode: arrivals of the fence keys `(kind, key)` of the packet's
    /// blocks, each counted by the receiving proxy against its block's count signal.
    Fenced(Vec<(u8, u16)>),
}

/// The kernels' end of the FIFO that carries one packet to one peer; see the module
/// docs. Made by `NetPath::stage`.
#[derive(Debug)]
pub struct Port {
    fifo: Arc<Fifo>,
    /// The proxy thread that owns `fifo`.
    thread: usize,
    waker: Option<Waker>,
    me: usize,
    dst: usize,
    ch: Channel,
    counting: Counting,
    /// When the call that opened the port gives up on a full FIFO.
    deadline: Instant,
    /// How long the proxy lets a command wait (for the message of a full FIFO).
    proxy_timeout: Duration,
    /// Largest single write.
    write_bytes: usize,
    /// `[block]`: writes pushed so far (for a fenced port: arrivals each block's signal
    /// must count; one entry for an ordered port).
    writes: Vec<AtomicU64>,
    /// Bytes of this rank's whole network path handed to the proxy.
    sent_bytes: Arc<AtomicU64>,
    /// Commands the kernels pushed, on this rank's whole network path.
    kernel_cmds: Arc<AtomicU64>,
}

/// How the receiver counts a kernel's writes on a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// Low-latency mode: arrivals under a fence key (the call's kind bit, the key), which
    /// the packet's count signal counts.
    Fenced(u8, u16),
    /// Normal mode: writes of an ordered stream (this channel, a tail increment of 0),
    /// which the announcement that follows them in the FIFO covers.
    Ordered(u8),
}

/// A port as a device's kernel pushes into it itself, without the host: the FIFO (to
/// lease for the launch, `uep_fifo::DeviceLease`), the fixed fields of every write's
/// command, and the counters the host reads once the kernel is done. Made by
/// [`DispatchRemote::kernel_port`](crate::device::DispatchRemote::kernel_port).
#[derive(Debug)]
pub struct KernelPort<'a> {
    /// The FIFO the writes go into.
    pub fifo: &'a Arc<Fifo>,
    /// This rank (the writes' source) and the peer they go to.
    pub me: usize,
    /// The peer the writes go to.
    pub dst_rank: usize,
    /// Where the staging area starts in this rank's region, and where it lands at the
    /// peer: a write of bytes `a..b` of the area goes from `src_base + a` to
    /// `dst_base + a`.
    pub src_base: usize,
    /// See [`KernelPort::src_base`].
    pub dst_base: usize,
    /// The largest write the path makes; a kernel may make larger ones where the fence's
    /// count needs it (every write still fits the wire's 24-bit length).
    pub write_bytes: usize,
    /// What every write carries for the receiver to count it by.
    pub counted: Counted,
    /// Writes pushed under the key: the kernel adds one for each it pushes, and the
    /// count signal that ends the packet counts them.
    pub writes: &'a AtomicU64,
    /// Bytes this rank's network path handed to the proxy: the kernel adds its writes'.
    pub sent_bytes: &'a AtomicU64,
    /// Commands kernels pushed on this rank's network path: the kernel adds its own.
    pub kernel_cmds: &'a AtomicU64,
    port: &'a Port,
}

impl KernelPort<'_> {
    /// Unpark the proxy thread that owns the FIFO, once the kernel pushed.
    pub fn wake(&self) {
        self.port.wake();
    }
}

/// Everything a [`Port`] is opened with.
pub(crate) struct PortInit {
    pub fifo: Arc<Fifo>,
    pub thread: usize,
    pub waker: Option<Waker>,
    pub me: usize,
    pub dst: usize,
    pub ch: Channel,
    pub counting: Counting,
    pub deadline: Instant,
    pub proxy_timeout: Duration,
    pub write_bytes: usize,
    pub sent_bytes: Arc<AtomicU64>,
    pub kernel_cmds: Arc<AtomicU64>,
}

impl Port {
    pub(crate) fn open(init: PortInit) -> Port {
        Port {
            fifo: init.fifo,
            thread: init.thread,
            waker: init.waker,
            me: init.me,
            dst: init.dst,
            ch: init.ch,
            writes: match &init.counting {
                Counting::Ordered => vec![AtomicU64::new(0)],
                Counting::Fenced(keys) => keys.iter().map(|_| AtomicU64::new(0)).collect(),
            },
            counting: init.counting,
            deadline: init.deadline,
            proxy_timeout: init.proxy_timeout,
            write_bytes: init.write_bytes,
            sent_bytes: init.sent_bytes,
            kernel_cmds: init.kernel_cmds,
        }
    }

    /// Push the write `w`, cut into writes of at most the path's write size, and wake
    /// the proxy thread. From any kernel thread; the writes of one thread stay in the
    /// order it pushed them.
    pub fn put(&self, w: Write) -> Result<()> {
        self.put_in(0, w)
    }

    /// [`Port::put`] for block `block` of a fenced packet: its writes count towards
    /// that block's key.
    pub fn put_in(&self, block: usize, w: Write) -> Result<()> {
        let pushed = self.push_block(block, w)?;
        self.kernel_cmds.fetch_add(pushed, Ordering::Relaxed);
        self.wake();
        Ok(())
    }

    /// Push `w` (cut into pieces) without waking the proxy.
    pub(crate) fn push_write(&self, w: Write) -> Result<()> {
        self.push_block(0, w).map(drop)
    }

    /// Push `w` (cut into pieces) as part of block `block`, without waking the proxy;
    /// returns the commands pushed.
    fn push_block(&self, block: usize, w: Write) -> Result<u64> {
        let mut pushed = 0;
        let count = self.writes.get(block).ok_or_else(|| {
            EpError::internal(format!(
                "a packet to rank {} has no block {block}",
                self.dst
            ))
        })?;
        for p in w.pieces(self.write_bytes) {
            let (src, dst, len) = (p.src as u64, p.dst as u64, p.len as u32);
            let cmd = match &self.counting {
                Counting::Ordered => cmds::normal_write(self.dst, src, dst, len, ORDERED_STREAM, 0),
                Counting::Fenced(keys) => {
                    let (kind, key) = keys[block];
                    cmds::ll_write(self.dst, src, dst, len, kind, key)
                }
            };
            self.push(encode(self.me, cmd)?)?;
            count.fetch_add(1, Ordering::Relaxed);
            pushed += 1;
        }
        self.sent_bytes.fetch_add(w.len() as u64, Ordering::Relaxed);
        Ok(pushed)
    }

    /// Push one command, waiting while the FIFO is full until the call's deadline.
    pub(crate) fn push(&self, cmd: TransferCmd) -> Result<Slot> {
        self.fifo
            .push(cmd, self.deadline)
            .map_err(|e| EpError::Timeout {
                what: format!(
                    "rank {}: sending a {:?} packet to rank {}",
                    self.me, self.ch, self.dst
                ),
                detail: format!("the FIFO of proxy thread {} stayed full ({e})", self.thread),
                waited: self.proxy_timeout,
            })
    }

    /// The port of a fenced packet as a kernel pushes block `block`'s writes into it,
    /// for a staging area at `src_base` that lands at `dst_base`.
    pub(crate) fn kernel_port(
        &self,
        block: usize,
        (src_base, dst_base): (usize, usize),
    ) -> Result<KernelPort<'_>> {
        let counted = match &self.counting {
            Counting::Fenced(keys) => keys
                .get(block)
                .map(|&(kind, key)| Counted::Fenced(kind, key)),
            Counting::Ordered => Some(Counted::Ordered(ORDERED_STREAM)),
        };
        let (Some(counted), Some(writes)) = (counted, self.writes.get(block)) else {
            return Err(EpError::internal(format!(
                "a kernel pushes block {block} of a {:?} packet to rank {}, which has no such fence key",
                self.ch, self.dst
            )));
        };
        Ok(KernelPort {
            fifo: &self.fifo,
            me: self.me,
            dst_rank: self.dst,
            src_base,
            dst_base,
            write_bytes: self.write_bytes,
            counted,
            writes,
            sent_bytes: &self.sent_bytes,
            kernel_cmds: &self.kernel_cmds,
            port: self,
        })
    }

    /// Unpark the proxy thread that owns the FIFO (an idle one sleeps up to 1 ms).
    pub(crate) fn wake(&self) {
        if let Some(w) = &self.waker {
            w.wake();
        }
    }

    /// Writes pushed so far in block `block` (0 past the last block).
    pub(crate) fn writes(&self, block: usize) -> u64 {
        self.writes
            .get(block)
            .map_or(0, |w| w.load(Ordering::Relaxed))
    }

    /// Count the writes of a fenced packet of `keys.len()` blocks under `keys`, from
    /// now on (before any is pushed).
    pub(crate) fn set_blocks(&mut self, keys: Vec<(u8, u16)>) {
        self.writes = keys.iter().map(|_| AtomicU64::new(0)).collect();
        self.counting = Counting::Fenced(keys);
    }

    /// Largest single write.
    pub(crate) fn write_bytes(&self) -> usize {
        self.write_bytes
    }

    /// Cut writes into pieces of `bytes` (a multiple of 16) from now on.
    pub(crate) fn set_write_bytes(&mut self, bytes: usize) {
        self.write_bytes = bytes;
    }

    /// The FIFO and its proxy thread.
    pub(crate) fn fifo(&self) -> (&Arc<Fifo>, usize) {
        (&self.fifo, self.thread)
    }
}

/// A command built from a validated [`Write`] (it cannot fail to encode).
pub(crate) fn encode(me: usize, cmd: uep_proxy::Result<TransferCmd>) -> Result<TransferCmd> {
    cmd.map_err(|e| EpError::internal(format!("rank {me}: encoding a validated write: {e}")))
}
