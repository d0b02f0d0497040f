//! What a kernel needs to push a packet's rows itself (`kernels/push.cuh`): the FIFOs
//! leased to it for the launch, and each packet's (or fence group's) chunks.

use std::sync::atomic::AtomicU64;

use uep_ep::device::{Counted, KernelPort};
use uep_ep::{EpError, Result};
use uep_fifo::{DeviceLease, Fifo};

use crate::api::ChunkedPush;

/// Writes one fence key's rows may take: a count signal counts at most 255, and the
/// rest of the packet (its header) may leave with the signal (a chunk's scale rows,
/// where there are any, are a second write).
const CHUNKS: usize = 250;

/// What a launch that pushes holds until it returns: each push's chunk counters, the
/// lease of each FIFO it pushes into (one a FIFO: several peers' packets may share
/// one; no host push enters a leased FIFO, so the kernel's are its only ones), and the
/// ports whose proxies to wake once it is done ([`Held::finish`]).
#[derive(Default)]
pub(crate) struct Held<'a> {
    chunks: Vec<Vec<u32>>,
    leases: Vec<DeviceLease<std::sync::Arc<Fifo>>>,
    ports: Vec<KernelPort<'a>>,
}

impl Held<'_> {
    /// After the launch: the FIFOs back to the host, and their proxies woken (an idle
    /// one sleeps up to a millisecond between looks).
    pub(crate) fn finish(self) {
        drop(self.leases);
        for port in &self.ports {
            port.wake();
        }
    }
}

/// The address of an atomic counter, for the kernel to add to.
fn counter(c: &AtomicU64) -> u64 {
    c.as_ptr() as u64
}

/// Rows a kernel pushes: `rows` rows of `row_bytes` bytes from `src` (this rank's
/// region) to `dst` (the peer's), and their scale rows of `scale_bytes` from and to
/// `scales` where there are any; chunks are a multiple of `quantum` rows.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rows {
    pub(crate) src: usize,
    pub(crate) dst: usize,
    pub(crate) rows: usize,
    pub(crate) row_bytes: usize,
    pub(crate) scales: Option<(usize, usize, usize)>,
    pub(crate) quantum: usize,
}

impl Rows {
    /// Rows of a staged packet pushed to where the packet lands (`port`'s bases).
    pub(crate) fn staged(port: &KernelPort<'_>, src: usize, rows: usize, row_bytes: usize) -> Rows {
        Rows {
            src,
            dst: port.dst_base + (src - port.src_base),
            rows,
            row_bytes,
            scales: None,
            quantum: 1,
        }
    }
}

/// The push of `r` through `port`, in chunks of about a write's size (whole quanta),
/// never more than a count signal counts; its FIFO leased in `held`.
pub(crate) fn chunked<'a>(
    port: KernelPort<'a>,
    r: Rows,
    held: &mut Held<'a>,
) -> Result<ChunkedPush> {
    let q = r.quantum.max(1);
    // Only a fenced packet's count signal bounds its writes.
    let fewest = match port.counted {
        Counted::Fenced(..) => r.rows.div_ceil(CHUNKS),
        Counted::Ordered(_) => 1,
    };
    let chunk_rows = (port.write_bytes / r.row_bytes.max(1))
        .max(fewest)
        .max(1)
        .div_ceil(q)
        * q;
    if chunk_rows * r.row_bytes >= uep_wire::MAX_WRITE_LEN as usize {
        return Err(EpError::Internal(format!(
            "a pushed chunk of {chunk_rows} rows of {} bytes is more than a write moves",
            r.row_bytes
        )));
    }
    let fifo: &Fifo = port.fifo;
    if !held.leases.iter().any(|l| std::ptr::eq(l.fifo(), fifo)) {
        let lease = DeviceLease::claim(port.fifo.clone())
            .map_err(|e| EpError::Internal(format!("leasing a FIFO to a kernel: {e}")))?;
        held.leases.push(lease);
    }
    let ring_base = (held.leases.iter())
        .find(|l| std::ptr::eq(l.fifo(), fifo))
        .map_or(0, |l| l.region_addr() as u64);
    held.chunks.push(vec![0u32; r.rows.div_ceil(chunk_rows)]);
    let done = held.chunks.last_mut().map_or(0, |d| d.as_mut_ptr() as u64);
    let (scales_src, scales_dst, scale_bytes) = r.scales.unwrap_or_default();
    let (ordered, key_kind, key) = match port.counted {
        Counted::Fenced(kind, key) => (0, kind.into(), key.into()),
        Counted::Ordered(channel) => (1, 0, channel.into()),
    };
    let push = ChunkedPush {
        src_off: r.src as u64,
        dst_off: r.dst as u64,
        scales_src_off: scales_src as u64,
        scales_dst_off: scales_dst as u64,
        rows: r.rows as u32,
        chunk_rows: chunk_rows as u32,
        row_bytes: r.row_bytes as u32,
        scale_bytes: scale_bytes as u32,
        chunk_done: done,
        ring_base,
        ring_capacity: port.fifo.capacity() as u64,
        writes: counter(port.writes),
        sent_bytes: counter(port.sent_bytes),
        kernel_cmds: counter(port.kernel_cmds),
        dst_rank: port.dst_rank as u32,
        ordered,
        key_kind,
        key,
    };
    held.ports.push(port);
    Ok(push)
}
