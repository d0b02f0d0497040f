//! What a kernel needs to push a packet's rows itself (`kernels/push.cuh`): the FIFOs
//! leased to it for the launch, and each packet's (or fence group's) chunks.

use std::sync::atomic::AtomicU64;

use uep_ep::device::KernelPort;
use uep_ep::{EpError, Result};
use uep_fifo::{DeviceLease, Fifo};

use crate::api::ChunkedPush;

/// Writes one fence key's rows may take: a count signal counts at most 255, and the
/// rest of the packet (its header) may leave with the signal.
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

/// The push of `rows` rows of `row_bytes` bytes from `rows_off` (this rank's region)
/// through `port`, in chunks of about a write's size, never more than a count signal
/// counts; its FIFO leased in `held`.
pub(crate) fn chunked<'a>(
    port: KernelPort<'a>,
    (rows_off, rows, row_bytes): (usize, usize, usize),
    held: &mut Held<'a>,
) -> Result<ChunkedPush> {
    let chunk_rows = (port.write_bytes / row_bytes.max(1))
        .max(rows.div_ceil(CHUNKS))
        .max(1);
    if chunk_rows * row_bytes >= uep_wire::MAX_WRITE_LEN as usize {
        return Err(EpError::Internal(format!(
            "a pushed chunk of {chunk_rows} rows of {row_bytes} bytes is more than a write moves"
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
    held.chunks.push(vec![0u32; rows.div_ceil(chunk_rows)]);
    let done = held.chunks.last_mut().map_or(0, |d| d.as_mut_ptr() as u64);
    let push = ChunkedPush {
        rows_off: rows_off as u64,
        rows: rows as u32,
        chunk_rows: chunk_rows as u32,
        chunk_done: done,
        ring_base,
        ring_capacity: port.fifo.capacity() as u64,
        src_base: port.src_base as u64,
        dst_base: port.dst_base as u64,
        writes: counter(port.writes),
        sent_bytes: counter(port.sent_bytes),
        kernel_cmds: counter(port.kernel_cmds),
        dst_rank: port.dst_rank as u32,
        key_kind: port.key.0.into(),
        key: port.key.1.into(),
        pad: 0,
    };
    held.ports.push(port);
    Ok(push)
}
