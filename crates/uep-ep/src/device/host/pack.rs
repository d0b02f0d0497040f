//! The host definition of the data-moving phases: CPU threads store rows into mapped
//! memory and push writes through the staged packets' ports.

use std::ops::Range;

use half::bf16;

use crate::area::{Area, Mem, SliceRows};
use crate::device::pack::{
    kernel_pushes_rows, on_rank, slots_on, CombineRemote, LlCombinePackPhase, LlPackPhase, LlSink,
    Sink,
};
use crate::device::Device;
use crate::error::Result;

/// Push the packet rows each rank's run holds, once they make a write's size (all of
/// them when `last`), through the packet's port.
fn push_runs(
    sinks: &[LlSink],
    runs: &mut [Option<Range<usize>>],
    row_bytes: usize,
    last: bool,
) -> Result<()> {
    for (r, run) in runs.iter_mut().enumerate() {
        let Some(Sink::Packet(remote)) = sinks.get(r) else {
            continue;
        };
        let (packet, staged) = (&remote.packet, &remote.staged);
        let port = staged.port();
        match run {
            Some(rows) if last || rows.len() * row_bytes >= port.write_bytes() => {
                port.put(staged.write_of(packet.rows.rows(rows.clone(), row_bytes)?)?)?;
                *run = None;
            }
            _ => {}
        }
    }
    Ok(())
}

/// [`Device::ll_pack`](crate::device::Device::ll_pack) over `device`'s launch, in
/// parallel over tokens.
pub(crate) fn ll_pack<D: Device + ?Sized>(device: &D, phase: &LlPackPhase<'_>) -> Result<()> {
    let (areas, tokens) = (phase.areas, phase.tokens);
    let s = areas.shape;
    let (r_n, me) = (phase.num_ranks, phase.rank);
    let (epr, m, k) = (s.experts_per_rank(r_n), s.max_tokens, s.topk);
    let (row_bytes, words) = (tokens.row_bytes, tokens.scale_words);
    let weight = |i: usize| phase.topk_weights.map_or(0.0, |w| w[i]);
    let local = phase.memory.local();
    let push_rows = kernel_pushes_rows(row_bytes);
    device.launch(tokens.len(), &|range| {
        let (mut slots, mut weights) = (vec![-1i32; k], vec![0f32; k]);
        // `[rank]`: packet rows packed but not pushed yet (a thread's are adjacent).
        let mut runs: Vec<Option<Range<usize>>> = vec![None; r_n];
        for t in range {
            let chosen = phase.topk_idx.row(t, k);
            for (slot, &e) in chosen.iter().enumerate() {
                if e < 0 {
                    continue;
                }
                let (r, le) = (e as usize / epr, e as usize % epr);
                match &phase.sinks[r] {
                    Sink::Skip => {}
                    Sink::Peer(r) => {
                        let region = phase.memory.peer_region(*r)?;
                        let row = le * r_n * m + me * m + phase.pos[t * k + slot] as usize;
                        region.put(areas.recv_x.row(row, row_bytes)?, tokens.row(t))?;
                        if let Some(scales) = tokens.scales(t) {
                            region.put(areas.recv_scales.row(row, words)?, scales)?;
                        }
                        region.put(areas.recv_src.row(row, 1)?, &[(t * k + slot) as i32])?;
                        if phase.topk_weights.is_some() {
                            let w = [weight(t * k + slot)];
                            region.put(areas.recv_weight.row(row, 1)?, &w)?;
                        }
                    }
                    // The first slot naming this rank carries the token there.
                    Sink::Packet(remote) if !chosen[..slot].iter().any(|&f| on_rank(f, r, epr)) => {
                        let (p, i) = (&remote.packet, remote.row_of[t] as usize);
                        slots_on(chosen, r, epr, &mut slots);
                        local.put(p.rows.row(i, row_bytes)?, tokens.row(t))?;
                        if let Some(scales) = tokens.scales(t) {
                            local.put(p.scales.row(i, words)?, scales)?;
                        }
                        local.put(p.ids.row(i, 1)?, &[t as i32])?;
                        local.put(p.slots.row(i, k)?, &slots)?;
                        for (j, w) in weights.iter_mut().enumerate() {
                            *w = weight(t * k + j);
                        }
                        local.put(p.weights.row(i, k)?, &weights)?;
                        let run = runs[r].get_or_insert(i..i);
                        run.end = i + 1;
                    }
                    Sink::Packet(_) => {}
                }
            }
            if push_rows {
                push_runs(phase.sinks, &mut runs, row_bytes, false)?;
            }
        }
        if push_rows {
            push_runs(phase.sinks, &mut runs, row_bytes, true)?;
        }
        Ok(())
    })
}

/// Add `block` (an expert's group and packet rows; `None` at a lane's end) to `run`, the
/// rows packed for `remote` and not pushed yet, and push the run when the block belongs
/// to another group, the run reached a write's size, or the lane ended: the proxy posts
/// them while the lane packs on, as few and as large writes as the fence groups allow.
fn push_run(
    remote: &CombineRemote,
    h: usize,
    run: &mut Option<(usize, Range<usize>)>,
    block: Option<(usize, Range<usize>)>,
) -> Result<()> {
    let port = remote.staged.port();
    let flush = |(g, span): (usize, Range<usize>)| -> Result<()> {
        let write = remote.staged.write_of(remote.rows.rows(span, h)?.cast())?;
        port.put_in(g, write)
    };
    match (run.take(), block) {
        (Some((g, span)), Some((bg, next))) if g == bg && span.end == next.start => {
            *run = Some((g, span.start..next.end));
        }
        (prev, next) => {
            if let Some(prev) = prev {
                flush(prev)?;
            }
            *run = next;
        }
    }
    if let Some((g, span)) = run.as_ref() {
        if span.len() * h * 2 >= port.write_bytes() {
            flush((*g, span.clone()))?;
            *run = None;
        }
    }
    Ok(())
}

/// [`Device::ll_combine_pack`](crate::device::Device::ll_combine_pack) over `device`'s
/// launch, in parallel over local experts.
pub(crate) fn ll_combine_pack<D: Device + ?Sized>(
    device: &D,
    phase: &LlCombinePackPhase<'_>,
) -> Result<()> {
    let s = phase.areas.shape;
    let (r_n, me) = (phase.num_ranks, phase.rank);
    let (m, k, h) = (s.max_tokens, s.topk, s.hidden);
    let local = phase.memory.local();
    device.launch(phase.experts(), &|experts| {
        // `[src]`: rows packed for a packet but not pushed yet (a group, and the
        // packet rows it covers), so adjacent experts of a group leave as one write.
        let mut runs: Vec<Option<(usize, Range<usize>)>> = vec![None; r_n];
        for le in experts {
            for (src, sink) in phase.sinks.iter().enumerate() {
                // Our own rows are read straight from `y` by the reduction.
                let (region, rows, remote): (_, Area<u16>, _) = match sink {
                    _ if src == me => continue,
                    Sink::Skip => continue,
                    Sink::Peer(r) => (phase.memory.peer_region(*r)?, phase.areas.combine_x, None),
                    Sink::Packet(remote) => (local, remote.rows, Some(&**remote)),
                };
                let (begin, n) = phase.layout_range[le * r_n + src];
                for j in begin as usize..(begin + n) as usize {
                    let row = le * r_n * m + j;
                    let at = match remote {
                        None => phase.src_info[row] as usize * k + phase.src_slot[row] as usize,
                        Some(remote) => remote.first[le] + j - begin as usize,
                    };
                    region.put(rows.row(at, h)?.cast::<bf16>(), phase.y.row(row, h))?;
                }
                if let (Some(remote), true) = (remote, n > 0) {
                    let block = (
                        remote.group_of[le],
                        remote.first[le]..remote.first[le] + n as usize,
                    );
                    push_run(remote, h, &mut runs[src], Some(block))?;
                }
            }
        }
        // The lane's last runs.
        for (src, sink) in phase.sinks.iter().enumerate() {
            if let Sink::Packet(remote) = sink {
                push_run(remote, h, &mut runs[src], None)?;
            }
        }
        Ok(())
    })
}
