//! The LL dispatch's pack as a kernel on the emulated device (`kernels/ll_pack.cu`): the
//! phase's descriptor turned into the kernel's argument, every index the kernel follows
//! checked first, and the packets' FIFOs leased to the kernel for the launch.

use uep_ep::device::{DispatchRemote, LlAreas, LlPackPhase, Sink};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use super::push::{chunked, Held, Rows};
use crate::api::{addr, LlPackArgs, LlPackSink, LL_PACKET, LL_PEER, LL_SKIP};

/// An error of the phase as handed to the kernel: uep's own fault.
fn bad(what: String) -> EpError {
    EpError::Internal(format!("emulated ll_pack: {what}"))
}

/// Checks that every copy of `p` lands inside the areas the kernel writes: ids of
/// existing experts, rows inside their expert's block, packet rows inside the packet.
fn check(p: &LlPackPhase<'_>) -> Result<()> {
    let (t, k, s) = (p.tokens(), p.areas.shape.topk, p.areas.shape);
    let t_k = t * k;
    let lens_ok = p.tokens.bytes.len() == t * p.tokens.row_bytes
        && p.tokens.scales.len() == t * p.tokens.scale_words
        && p.topk_idx.len() == t_k
        && p.pos.len() == t_k
        && p.topk_weights.is_none_or(|w| w.len() == t_k)
        && p.sinks.len() == p.num_ranks
        && t <= s.max_tokens;
    if !lens_ok {
        return Err(bad(format!("{t} tokens with inputs of the wrong lengths")));
    }
    let within = |(&e, &pos): (&i64, &u32)| {
        e == -1 || (e >= 0 && (e as usize) < s.num_experts && (pos as usize) < s.max_tokens)
    };
    if !p.topk_idx.iter().zip(p.pos).all(within) {
        return Err(bad("an expert id or a row out of range".into()));
    }
    Ok(())
}

/// The kernel's view of `sink`, rank `r`'s: its kind, the memory it writes and, for a
/// packet, where its rows go and how they are pushed.
fn sink_args<'a>(
    p: &LlPackPhase<'a>,
    sink: &'a Sink<Box<DispatchRemote>>,
    held: &mut Held<'a>,
) -> Result<LlPackSink> {
    let areas: &LlAreas = p.areas;
    let row_bytes = p.tokens.row_bytes;
    let (base, len) = match sink {
        Sink::Skip => {
            return Ok(LlPackSink {
                kind: LL_SKIP,
                ..Default::default()
            })
        }
        Sink::Peer(r) => p.region(*r)?,
        Sink::Packet(_) => p.region(p.rank)?,
    };
    let Sink::Packet(remote) = sink else {
        // The receive areas are at the same offsets in every region.
        let ends = [
            areas.recv_x.end(),
            areas.recv_scales.end(),
            areas.recv_src.end(),
        ];
        if ends
            .into_iter()
            .chain([areas.recv_weight.end()])
            .any(|end| end > len)
        {
            return Err(bad("receive areas outside a peer's memory".into()));
        }
        return Ok(LlPackSink {
            kind: LL_PEER,
            region: base as u64,
            ..Default::default()
        });
    };
    let pk = &remote.packet;
    let rows = remote.rows();
    if remote.row_of.len() != p.tokens()
        || remote
            .row_of
            .iter()
            .any(|&r| r != u32::MAX && r as usize >= rows)
        || [
            pk.ids.end(),
            pk.slots.end(),
            pk.weights.end(),
            pk.scales.end(),
        ]
        .into_iter()
        .chain([pk.rows.end()])
        .any(|end| end > len)
        || pk.rows.len() != rows * row_bytes
    {
        return Err(bad("a packet's rows do not fit its area".into()));
    }
    let mut out = LlPackSink {
        kind: LL_PACKET,
        packet_rows: rows as u32,
        region: base as u64,
        row_of: addr(&remote.row_of),
        rows_off: pk.rows.offset() as u64,
        scales_off: pk.scales.offset() as u64,
        ids_off: pk.ids.offset() as u64,
        slots_off: pk.slots.offset() as u64,
        weights_off: pk.weights.offset() as u64,
        ..Default::default()
    };
    if !DispatchRemote::pushes_rows(row_bytes) || rows == 0 {
        return Ok(out);
    }
    let port = remote.kernel_port()?;
    let r = Rows::staged(&port, pk.rows.offset(), rows, row_bytes);
    out.push = chunked(port, r, held)?;
    Ok(out)
}

/// Runs `p` as the `uep_ll_pack` kernel on `grid`, then wakes the proxies of the
/// packets it pushed into.
pub(crate) fn ll_pack(grid: Grid, p: &LlPackPhase<'_>) -> Result<()> {
    check(p)?;
    let mut held = Held::default();
    let sinks = (p.sinks.iter())
        .map(|s| sink_args(p, s, &mut held))
        .collect::<Result<Vec<_>>>()?;
    let (areas, s) = (p.areas, p.areas.shape);
    let args = LlPackArgs {
        x: addr(p.tokens.bytes),
        scales: if p.tokens.scale_words > 0 {
            addr(p.tokens.scales)
        } else {
            0
        },
        topk_idx: addr(p.topk_idx),
        weights: p.topk_weights.map_or(0, addr),
        pos: addr(p.pos),
        sinks: addr(&sinks),
        recv_x_off: areas.recv_x.offset() as u64,
        recv_scales_off: areas.recv_scales.offset() as u64,
        recv_src_off: areas.recv_src.offset() as u64,
        recv_weight_off: areas.recv_weight.offset() as u64,
        tokens: p.tokens() as u32,
        row_bytes: p.tokens.row_bytes as u32,
        scale_words: p.tokens.scale_words as u32,
        topk: s.topk as u32,
        rank: p.rank as u32,
        ranks: p.num_ranks as u32,
        experts_per_rank: s.experts_per_rank(p.num_ranks) as u32,
        max_tokens: s.max_tokens as u32,
    };
    // SAFETY: `check` bounds every expert id, row and length the kernel follows;
    // `sink_args` checked each sink's areas against its region (mapped while the phase
    // lives) and its rows against its packet; `chunked` leased each FIFO the kernel
    // pushes into (no other producer until the leases drop, after the launch), and the
    // counters are atomics the host reads only after it. All live until it returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LL_PACK, grid, &args).map_err(bad)?;
    }
    held.finish();
    Ok(())
}
