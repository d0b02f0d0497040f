//! Normal mode's data-moving phases as kernels on the emulated device: the dispatch's
//! notify and relay, the combine's send (`kernels/normal_notify.cu`, `relay.cu`,
//! `normal_combine_send.cu`), every index each follows checked first.

use uep_ep::device::{
    NormalCombineSendPhase, NotifyPhase, NotifySink, RelayPhase, RelayedRow, ReturnSink,
    WeightLanes, NOT_SENT,
};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use crate::api::{
    addr, NormalCombineSendArgs, NormalNotifyArgs, NotifySinkArgs, RelayArgs, ReturnSinkArgs,
    NOTIFY_PACKET, NOTIFY_SLOT,
};

fn bad(what: String) -> EpError {
    EpError::Internal(format!("emulated normal_combine_send: {what}"))
}

/// Runs `p` as the `uep_normal_combine_send` kernel on `grid`.
pub(crate) fn normal_combine_send(grid: Grid, p: &NormalCombineSendPhase<'_>) -> Result<()> {
    let (n, h, k) = (p.rows(), p.shape.hidden, p.shape.topk);
    let mut sinks = Vec::with_capacity(p.sinks.len());
    // `[R]` rows of each sink's slot (0: the rows stay).
    let mut slot_rows = Vec::with_capacity(p.sinks.len());
    for sink in p.sinks {
        let (args, rows) = match *sink {
            ReturnSink::Stays => (ReturnSinkArgs::default(), 0),
            ReturnSink::Slot { rank, x, weights } => {
                let (base, len) = p.region(rank)?;
                let rows = x.len() / h.max(1);
                if x.end().max(weights.end()) > len || weights.len() < rows * k {
                    return Err(bad(format!("rank {rank}'s slot outside its memory")));
                }
                let args = ReturnSinkArgs {
                    region: base as u64,
                    x_off: x.offset() as u64,
                    weights_off: weights.offset() as u64,
                };
                (args, rows)
            }
        };
        sinks.push(args);
        slot_rows.push(rows);
    }
    let in_slot = |(&r, &t): (&i32, &i32)| {
        (r >= 0 && (r as usize) < sinks.len())
            && (slot_rows[r as usize] == 0 || (t >= 0 && (t as usize) < slot_rows[r as usize]))
    };
    let fits = p.x.len() == n * h
        && p.src_rank.len() == n
        && p.topk_weights.is_none_or(|w| w.len() == n * k)
        && p.src_rank.iter().zip(p.src_idx).all(in_slot);
    if !fits {
        return Err(bad("rows, weights or sources of the wrong size".into()));
    }
    let x: &[u16] = bytemuck::cast_slice(p.x);
    let args = NormalCombineSendArgs {
        x: addr(x),
        weights: p.topk_weights.map_or(0, addr),
        src_rank: addr(p.src_rank),
        src_idx: addr(p.src_idx),
        sinks: addr(&sinks),
        rows: n as u32,
        hidden: h as u32,
        topk: k as u32,
        pad: 0,
    };
    // SAFETY: every row's source names a sink, and a slot's row for its token lies in
    // that rank's memory (checked above, rows and weights); the rows and weights hold N
    // of each. All live until the launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::NORMAL_COMBINE_SEND, grid, &args).map_err(bad)
    }
}

/// Runs `p` as the `uep_normal_notify` kernel on `grid`.
pub(crate) fn normal_notify(grid: Grid, p: &NotifyPhase<'_>) -> Result<()> {
    let n = p.counts.len();
    let mut sinks = Vec::with_capacity(p.sinks.len());
    for sink in p.sinks {
        let (kind, (base, len), head, counts, epoch) = match *sink {
            NotifySink::Skip => {
                sinks.push(NotifySinkArgs::default());
                continue;
            }
            NotifySink::Slot { rank, slot } => {
                let at = p.region(rank)?;
                (NOTIFY_SLOT, at, slot.head, slot.counts, Some(slot.epoch))
            }
            NotifySink::Packet(pk) => (NOTIFY_PACKET, p.local_region(), pk.head, pk.counts, None),
        };
        let ends = [head.end(), counts.end(), epoch.map_or(0, |e| e.end())];
        if counts.len() != n
            || head.len() != 1
            || epoch.is_some_and(|e| e.is_empty())
            || ends.iter().any(|&e| e > len)
        {
            return Err(EpError::Internal(
                "emulated normal_notify: a slot or packet of the wrong size".into(),
            ));
        }
        sinks.push(NotifySinkArgs {
            kind,
            region: base as u64,
            head_off: head.offset() as u64,
            counts_off: counts.offset() as u64,
            epoch_off: epoch.map_or(0, |e| e.offset()) as u64,
            ..Default::default()
        });
    }
    let args = NormalNotifyArgs {
        counts: addr(p.counts),
        sinks: addr(&sinks),
        ranks: sinks.len() as u32,
        counts_len: n as u32,
        tokens: p.head.tokens,
        flags: p.head.flags,
        seq: p.seq.into(),
    };
    // SAFETY: each slot or packet holds the counts, the head and (a slot) its epoch word
    // inside its rank's memory (checked above). All live until the launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::NORMAL_NOTIFY, grid, &args)
            .map_err(|e| EpError::Internal(format!("emulated normal_notify: {e}")))
    }
}

/// The rows of `p`'s output areas every index must stay below: x, scales, routing and
/// source index rows, whichever hold fewest.
fn relay_rows(p: &RelayPhase<'_>) -> usize {
    let (b, f, k) = (p.bank, p.fmt, p.shape.topk.max(1));
    let mut rows = (b.recv_x.len() / f.row_bytes.max(1)).min(p.recv_src_idx.len());
    if let Some(n) = b.recv_scales.len().checked_div(f.groups) {
        rows = rows.min(n);
    }
    if f.topk > 0 {
        rows = rows
            .min(b.recv_topk_idx.len() / k)
            .min(b.recv_topk_weights.len() / k);
    }
    rows
}

/// Checks every index `p`'s kernel follows: the packet's rows, the output rows, the
/// routing and token arrays; returns each token's source row (`u32::MAX`: its own).
fn relay_from(p: &RelayPhase<'_>) -> Result<Vec<u32>> {
    let (n, rpn, f, k) = (p.tokens(), p.topo.ranks_per_node, p.fmt, p.shape.topk);
    let out_rows = relay_rows(p);
    let scale_rows = p.packet.scales.len().checked_div(f.groups);
    let packet_rows = (p.packet.x.len() / f.row_bytes.max(1)).min(scale_rows.unwrap_or(usize::MAX));
    let from: Vec<u32> = (p.from.iter())
        .map(|r| match *r {
            RelayedRow::Packet(i) => i,
            RelayedRow::Own => u32::MAX,
        })
        .collect();
    let rows_fit = p.rows.len() == n * rpn
        && p.rows
            .iter()
            .all(|&r| r == NOT_SENT || (r as usize) < out_rows)
        && (0..n).all(|j| match from[j] {
            u32::MAX => p.rows[j * rpn + p.topo.local] != NOT_SENT,
            i => (i as usize) < packet_rows,
        });
    let arrays_fit = p.tokens.len() == n
        && (f.topk == 0 || p.idx.len() == n * k)
        && (f.weights == 0 || p.weights.len() == n * k);
    match rows_fit && arrays_fit {
        true => Ok(from),
        false => Err(EpError::Internal(
            "emulated relay: rows or routing of the wrong size".into(),
        )),
    }
}

/// Runs `p` as the `uep_relay` kernel on `grid`.
pub(crate) fn relay(grid: Grid, p: &RelayPhase<'_>) -> Result<()> {
    let from = relay_from(p)?;
    let (topo, f, b) = (p.topo, p.fmt, p.bank);
    let (local, local_len) = p.region(topo.rank)?;
    let ends = [b.recv_x.end(), b.recv_scales.end(), b.recv_topk_idx.end()];
    let ends = ends
        .into_iter()
        .chain([b.recv_topk_weights.end(), p.recv_src_idx.end()]);
    let end = ends.max().unwrap_or(0);
    let regions = (topo.node_ranks(topo.node))
        .map(|r| match p.region(r)? {
            (base, len) if len >= end => Ok(base as u64),
            _ => Err(EpError::Internal(format!(
                "emulated relay: rank {r}'s memory is short"
            ))),
        })
        .collect::<Result<Vec<u64>>>()?;
    if p.packet.x.end().max(p.packet.scales.end()) > local_len {
        return Err(EpError::Internal(
            "emulated relay: the packet outside this rank's memory".into(),
        ));
    }
    let args = RelayArgs {
        local: local as u64,
        regions: addr(&regions),
        packet_x_off: p.packet.x.offset() as u64,
        packet_scales_off: p.packet.scales.offset() as u64,
        recv_x_off: b.recv_x.offset() as u64,
        recv_scales_off: b.recv_scales.offset() as u64,
        recv_topk_idx_off: b.recv_topk_idx.offset() as u64,
        recv_topk_weights_off: b.recv_topk_weights.offset() as u64,
        recv_src_off: p.recv_src_idx.offset() as u64,
        idx: if f.topk > 0 { addr(p.idx) } else { 0 },
        weights: if f.weights > 0 { addr(p.weights) } else { 0 },
        tokens: addr(p.tokens),
        from: addr(&from),
        rows: addr(p.rows),
        n: from.len() as u32,
        ranks_per_node: topo.ranks_per_node as u32,
        local_rank: topo.local as u32,
        node: topo.node as u32,
        row_bytes: f.row_bytes as u32,
        groups: f.groups as u32,
        topk: p.shape.topk as u32,
        experts_per_rank: p.shape.experts_per_rank(topo.num_ranks) as u32,
        all_weights: u32::from(p.lanes == WeightLanes::All),
        pad: 0,
    };
    // SAFETY: every output row is below the rows each output area holds and every
    // source row below the packet's (`relay_from`); the areas lie inside each node
    // rank's memory and the packet inside this rank's (checked above); the routing and
    // token arrays hold n rows. All live until the launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::RELAY, grid, &args)
            .map_err(|e| EpError::Internal(format!("emulated relay: {e}")))
    }
}
