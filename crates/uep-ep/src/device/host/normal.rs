//! The host definitions of normal mode's data-moving phases: the dispatch's notify
//! (a few words a rank, on the calling thread), its pack (CPU
//! threads store each token into its destinations and push the rows for other nodes'
//! relays as they go), the relay's forward (each relayed token into its node's ranks)
//! and the combine's send (each row back to its source's slot).

use std::ops::Range;

use half::bf16;
use uep_shm::Region;

use crate::area::{Mem, SliceRows};
use crate::device::normal::{
    Dest, NormalCombineSendPhase, NormalPackPhase, NotifyPhase, NotifySink, RelayPhase, RelayedRow,
    ReturnSink, NOT_SENT,
};
use crate::device::Device;
use crate::error::Result;
use crate::layout::localize;

/// [`Device::normal_notify`](crate::device::Device::normal_notify) on the calling
/// thread: a few hundred bytes a rank, less than a launch would cost.
pub(crate) fn normal_notify(phase: &NotifyPhase<'_>) -> Result<()> {
    let (local, head) = (phase.memory.local(), [phase.head]);
    for sink in phase.sinks {
        match *sink {
            NotifySink::Skip => {}
            NotifySink::Slot { rank, slot } => {
                let region = phase.memory.peer_region(rank)?;
                region.put(slot.counts, phase.counts)?;
                region.put(slot.head, &head)?;
                region
                    .word(slot.epoch, 0)?
                    .store(phase.seq.into(), std::sync::atomic::Ordering::Release);
            }
            NotifySink::Packet(p) => {
                local.put(p.head, &head)?;
                local.put(p.counts, phase.counts)?;
            }
        }
    }
    Ok(())
}

/// [`Device::normal_pack`](crate::device::Device::normal_pack) over `device`'s launch:
/// a lane a block of tokens, cut as [`Device::split`] cuts them (the plan's block
/// starts assume it).
pub(crate) fn normal_pack<D: Device + ?Sized>(
    device: &D,
    phase: &NormalPackPhase<'_>,
) -> Result<()> {
    let t_n = phase.tokens();
    let per = device.split(t_n).1;
    let regions = (phase.plan.sinks.iter())
        .map(|s| phase.memory.peer_region(s.rank))
        .collect::<Result<Vec<_>>>()?;
    let kernel = PackKernel {
        phase,
        regions,
        region_len: phase.memory.local().len(),
    };
    device.launch(t_n, &|range| kernel.run(range.start / per, range))
}

/// Direct rows a kernel thread has packed for one node but not pushed yet: pushed in
/// runs of whole quanta of at least a write's size, so the proxy posts them while the
/// thread packs on.
pub(crate) struct DirectRun {
    /// First row not pushed yet (a multiple of the quantum).
    next: usize,
    /// Rows a push waits for.
    batch: usize,
}

impl DirectRun {
    /// A run for a block whose first direct row to this node is `first`.
    pub(crate) fn new(first: usize, q: usize, row_bytes: usize, write_bytes: usize) -> DirectRun {
        DirectRun {
            next: first.div_ceil(q) * q,
            batch: write_bytes.div_ceil(row_bytes.max(1)).div_ceil(q) * q,
        }
    }

    /// The rows to push now that `packed` direct rows are packed (`last`: the block
    /// is done), whole quanta from the first not pushed.
    pub(crate) fn take(&mut self, packed: usize, q: usize, last: bool) -> Option<Range<usize>> {
        let end = packed / q * q;
        if end <= self.next || (!last && end - self.next < self.batch) {
            return None;
        }
        let rows = self.next..end;
        self.next = end;
        Some(rows)
    }
}

/// The pack kernel: what one launch needs, shared by its threads.
struct PackKernel<'p, 'a> {
    phase: &'p NormalPackPhase<'a>,
    /// `[dest]` the memory each destination's rows go to.
    regions: Vec<&'p Region>,
    region_len: usize,
}

impl PackKernel<'_, '_> {
    /// Block `b` (tokens `range`): store each token into each destination it goes to,
    /// pushing direct rows to other nodes in runs.
    fn run(&self, b: usize, range: Range<usize>) -> Result<()> {
        let plan = self.phase.plan;
        let nd = plan.dests.len();
        let q = plan.row_quantum();
        let mut pos = plan.block_start.row(b, nd).to_vec();
        let mut runs: Vec<Option<DirectRun>> = (0..nd)
            .map(|d| {
                let port = plan.staged[d].as_ref()?.port();
                Some(DirectRun::new(
                    pos[d].1,
                    q,
                    plan.fmt.row_bytes,
                    port.write_bytes(),
                ))
            })
            .collect();
        let mut rows = TokenRows::new(self.phase.shape.topk);
        for t in range {
            for (d, pos) in pos.iter_mut().enumerate() {
                if plan.hit[t * nd + d] {
                    self.store(t, d, pos, &mut rows)?;
                }
            }
            self.push_runs(&mut runs, &pos, q, false)?;
        }
        self.push_runs(&mut runs, &pos, q, true)
    }

    /// Push the direct rows each node's run has ready (all of them when `last`).
    fn push_runs(
        &self,
        runs: &mut [Option<DirectRun>],
        pos: &[(usize, usize)],
        q: usize,
        last: bool,
    ) -> Result<()> {
        for (d, run) in runs.iter_mut().enumerate() {
            let plan = self.phase.plan;
            let (Some(run), Some(staged)) = (run, &plan.staged[d]) else {
                continue;
            };
            if let Some(rows) = run.take(pos[d].1, q, last) {
                let sink = &plan.sinks[d];
                for w in sink.direct_writes(rows, plan.fmt, self.region_len)? {
                    staged.port().put(w)?;
                }
            }
        }
        Ok(())
    }

    /// Store token `t` into destination `d`, at the row `pos` says, and advance it.
    fn store(
        &self,
        t: usize,
        d: usize,
        pos: &mut (usize, usize),
        rows: &mut TokenRows,
    ) -> Result<()> {
        let phase = self.phase;
        let (plan, x) = (phase.plan, phase.x);
        let (h, k) = (phase.shape.hidden, phase.shape.topk);
        let (rb, groups) = (plan.fmt.row_bytes, plan.fmt.groups);
        let nd = plan.dests.len();
        let (dest, sink, region) = (plan.dests[d], &plan.sinks[d], self.regions[d]);
        let (j, j_direct) = *pos;
        // The row's place: among the direct rows, among the rest of a packet, or its own
        // row in a same-node rank's output.
        let (x_at, scales_at) = if plan.direct[t * nd + d] {
            pos.1 += 1;
            (
                sink.direct_x.row(j_direct, rb)?,
                sink.direct_scales.row(j_direct, groups)?,
            )
        } else if matches!(dest, Dest::Node(..)) {
            (
                sink.x.row(j - j_direct, rb)?,
                sink.scales.row(j - j_direct, groups)?,
            )
        } else {
            (sink.x.row(j, rb)?, sink.scales.row(j, groups)?)
        };
        pos.0 += 1;
        if plan.streaming && matches!(dest, Dest::Rank(_)) {
            region.put_streaming(x_at, x.row(t, h))?;
        } else {
            region.put(x_at, x.row(t, h))?;
        }
        if plan.fp8 {
            region.put(scales_at, x.row_scales(t, h))?;
        }
        let idx: &[i64] = match phase.topk_idx {
            Some(all) if plan.with_topk => all.row(t, k),
            _ => &[],
        };
        let w = phase.topk_weights.map(|w| w.row(t, k));
        match dest {
            Dest::Rank(r) if plan.with_topk => {
                let epr = phase.shape.experts_per_rank(phase.topo.num_ranks);
                localize(
                    idx,
                    (w, plan.weight_lanes),
                    r,
                    epr,
                    &mut rows.idx,
                    &mut rows.w,
                );
                region.put(sink.topk.row(j, k)?, &rows.idx)?;
                if plan.with_weights {
                    region.put(sink.weights.row(j, k)?, &rows.w)?;
                }
            }
            Dest::Rank(_) => {}
            Dest::Node(m, _) => {
                // Global ids and all weights: the relaying rank localises them.
                if plan.with_topk {
                    region.put(sink.topk.row(j, k)?, idx)?;
                }
                if let (true, Some(w)) = (plan.with_weights, w) {
                    region.put(sink.weights.row(j, k)?, w)?;
                }
                let r_n = phase.topo.num_ranks;
                let mask = phase.topo.local_bits(m, |r| phase.in_rank[t * r_n + r]);
                region.put(sink.mask.row(j, 1)?, &[mask])?;
            }
        }
        region.put(sink.src.row(j, 1)?, &[t as i32])
    }
}

/// A kernel thread's scratch rows: a token's local top-k ids and weights.
struct TokenRows {
    idx: Vec<i64>,
    w: Vec<f32>,
}

impl TokenRows {
    fn new(k: usize) -> TokenRows {
        TokenRows {
            idx: vec![0; k],
            w: vec![0.0; k],
        }
    }
}

/// [`Device::normal_combine_send`](crate::device::Device::normal_combine_send) over
/// `device`'s launch, in parallel over rows.
pub(crate) fn normal_combine_send<D: Device + ?Sized>(
    device: &D,
    phase: &NormalCombineSendPhase<'_>,
) -> Result<()> {
    let (h, k) = (phase.shape.hidden, phase.shape.topk);
    let regions = (phase.sinks.iter())
        .map(|s| match *s {
            ReturnSink::Stays => Ok(None),
            ReturnSink::Slot { rank, .. } => phase.memory.peer_region(rank).map(Some),
        })
        .collect::<Result<Vec<_>>>()?;
    device.launch(phase.rows(), &|range| {
        for i in range {
            let (s, t) = (phase.src_rank[i] as usize, phase.src_idx[i] as usize);
            let (ReturnSink::Slot { x, weights, .. }, Some(region)) = (phase.sinks[s], regions[s])
            else {
                continue;
            };
            let (row, src) = (x.row(t, h)?.cast::<bf16>(), phase.x.row(i, h));
            if phase.streaming {
                region.put_streaming(row, src)?;
            } else {
                region.put(row, src)?;
            }
            if let Some(w) = phase.topk_weights {
                region.put(weights.row(t, k)?, w.row(i, k))?;
            }
        }
        Ok(())
    })
}

/// [`Device::relay`](crate::device::Device::relay) over `device`'s launch, in parallel
/// over the packet's tokens (the host placed every row before).
pub(crate) fn relay<D: Device + ?Sized>(device: &D, phase: &RelayPhase<'_>) -> Result<()> {
    let topo = phase.topo;
    let regions = (topo.node_ranks(topo.node))
        .map(|r| phase.memory.peer_region(r))
        .collect::<Result<Vec<_>>>()?;
    device.launch(phase.tokens(), &|range| {
        let mut rows = TokenRows::new(phase.shape.topk);
        for j in range {
            relay_token(phase, &regions, j, &mut rows)?;
        }
        Ok(())
    })
}

/// Token `j` of a relay phase into each rank of this node it goes to.
fn relay_token(
    phase: &RelayPhase<'_>,
    regions: &[&Region],
    j: usize,
    scratch: &mut TokenRows,
) -> Result<()> {
    let (topo, fmt, bank, p) = (phase.topo, phase.fmt, phase.bank, phase.packet);
    let local = phase.memory.local();
    let rpn = topo.ranks_per_node;
    let at = phase.rows.row(j, rpn);
    let (x, scales) = match phase.from[j] {
        RelayedRow::Packet(i) => (
            p.x.row(i as usize, fmt.row_bytes)?,
            p.scales.row(i as usize, fmt.groups)?,
        ),
        RelayedRow::Own => {
            let own = at[topo.local] as usize;
            (
                bank.recv_x.row(own, fmt.row_bytes)?,
                bank.recv_scales.row(own, fmt.groups)?,
            )
        }
    };
    let (k, epr) = (
        phase.shape.topk,
        phase.shape.experts_per_rank(topo.num_ranks),
    );
    for (l, (&row, region)) in at.iter().zip(regions).enumerate() {
        if row == NOT_SENT {
            continue;
        }
        let (row, r) = (row as usize, topo.node * rpn + l);
        // This rank's own row, sent straight here, is in place already.
        if !(l == topo.local && phase.from[j] == RelayedRow::Own) {
            region.copy(bank.recv_x.row(row, fmt.row_bytes)?, local, x)?;
            if fmt.groups > 0 {
                region.copy(bank.recv_scales.row(row, fmt.groups)?, local, scales)?;
            }
        }
        if fmt.topk > 0 {
            let w = (fmt.weights > 0).then(|| phase.weights.row(j, k));
            let (ids, ws) = (&mut scratch.idx, &mut scratch.w);
            localize(phase.idx.row(j, k), (w, phase.lanes), r, epr, ids, ws);
            region.put(bank.recv_topk_idx.row(row, k)?, ids)?;
            if fmt.weights > 0 {
                region.put(bank.recv_topk_weights.row(row, k)?, ws)?;
            }
        }
        region.put(phase.recv_src_idx.row(row, 1)?, &phase.tokens[j..j + 1])?;
    }
    Ok(())
}
