//! The LL combine's send as a kernel on the emulated device
//! (`kernels/ll_combine_pack.cu`): the phase's sinks as the kernel takes them, each
//! packet's fence groups pushed in chunks, every row the kernel follows checked first.

use uep_ep::device::{CombineRemote, LlCombinePackPhase, Sink};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use super::push::{chunked, Held, Rows};
use crate::api::{
    addr, ChunkedPush, LlCombinePackArgs, LlCombineSink, LL_PACKET, LL_PEER, LL_SKIP,
};

fn bad(what: String) -> EpError {
    EpError::Internal(format!("emulated ll_combine_pack: {what}"))
}

/// What a packet's sink points at: each expert's first row and group, each group's push.
#[derive(Default)]
struct Tables {
    first: Vec<u32>,
    group_of: Vec<u32>,
    pushes: Vec<ChunkedPush>,
}

/// A packet's tables, checked: its experts' rows inside its rows' area, each group's
/// rows one run of them.
fn packet_tables<'a>(
    r: &'a CombineRemote,
    experts: usize,
    row_bytes: usize,
    held: &mut Held<'a>,
) -> Result<Tables> {
    let rows = r.rows.len() * 2 / row_bytes.max(1);
    let fits = r.first.len() == experts
        && r.counts.len() == experts
        && r.group_of.len() == experts
        && (0..experts)
            .all(|le| r.first[le] + r.counts[le] <= rows && r.group_of[le] < r.groups.len());
    if !fits {
        return Err(bad("a packet's experts do not fit its rows".into()));
    }
    let mut t = Tables {
        first: r.first.iter().map(|&f| f as u32).collect(),
        group_of: r.group_of.iter().map(|&g| g as u32).collect(),
        pushes: Vec::with_capacity(r.groups.len()),
    };
    for (g, experts) in r.groups.iter().enumerate() {
        let first = experts.clone().next().map_or(0, |le| r.first[le]);
        let n: usize = experts.clone().map(|le| r.counts[le]).sum();
        let rows_off = r.rows.offset() + first * row_bytes;
        t.pushes.push(match n {
            0 => ChunkedPush::default(),
            n => {
                let port = r.kernel_port(g)?;
                let rows = Rows::staged(&port, rows_off, n, row_bytes);
                chunked(port, rows, held)?
            }
        });
    }
    Ok(t)
}

/// Checks the outputs, the layout and each row's source token and slot the kernel
/// follows.
fn check(p: &LlCombinePackPhase<'_>) -> Result<()> {
    let (s, r_n) = (p.areas.shape, p.num_ranks);
    let (epr, m, h, k) = (p.experts(), s.max_tokens, s.hidden, s.topk);
    let rows = epr * r_n * m;
    let blocks_fit =
        (p.layout_range.iter()).all(|&(b, n)| b >= 0 && n >= 0 && (b + n) as usize <= m * r_n);
    let sources_fit = (p.src_info.iter().zip(p.src_slot))
        .all(|(&t, &j)| t >= -1 && j >= -1 && (t.max(0) as usize) < m && (j.max(0) as usize) < k);
    let lens_fit = p.y.len() >= rows * h
        && p.layout_range.len() == epr * r_n
        && p.src_info.len() == rows
        && p.src_slot.len() == rows
        && p.sinks.len() == r_n;
    match lens_fit && blocks_fit && sources_fit {
        true => Ok(()),
        false => Err(bad("outputs, layout or sources of the wrong size".into())),
    }
}

/// Source `src`'s sink as the kernel takes it, and a packet's tables.
fn sink_args<'a>(
    p: &LlCombinePackPhase<'a>,
    (src, sink): (usize, &'a Sink<Box<CombineRemote>>),
    held: &mut Held<'a>,
) -> Result<(LlCombineSink, Tables)> {
    let s = p.areas.shape;
    let skip = LlCombineSink {
        kind: LL_SKIP,
        ..Default::default()
    };
    match sink {
        _ if src == p.rank => Ok((skip, Tables::default())),
        Sink::Skip => Ok((skip, Tables::default())),
        Sink::Peer(r) => {
            let (base, len) = p.region(*r)?;
            let rows = p.areas.combine_x;
            if rows.end() > len || rows.len() < s.max_tokens * s.topk * s.hidden {
                return Err(bad("combine rows outside a peer's memory".into()));
            }
            let sink = LlCombineSink {
                kind: LL_PEER,
                region: base as u64,
                rows_off: rows.offset() as u64,
                ..Default::default()
            };
            Ok((sink, Tables::default()))
        }
        Sink::Packet(remote) => {
            let (base, len) = p.region(p.rank)?;
            if remote.rows.end() > len {
                return Err(bad("a packet's rows outside this rank's memory".into()));
            }
            let t = packet_tables(remote, p.experts(), 2 * s.hidden, held)?;
            let sink = LlCombineSink {
                kind: LL_PACKET,
                groups: t.pushes.len() as u32,
                region: base as u64,
                rows_off: remote.rows.offset() as u64,
                ..Default::default()
            };
            Ok((sink, t))
        }
    }
}

/// Runs `p` as the `uep_ll_combine_pack` kernel on `grid`, then wakes the proxies of the
/// packets it pushed into.
pub(crate) fn ll_combine_pack(grid: Grid, p: &LlCombinePackPhase<'_>) -> Result<()> {
    check(p)?;
    let (s, r_n) = (p.areas.shape, p.num_ranks);
    let mut held = Held::default();
    let (mut sinks, tables): (Vec<LlCombineSink>, Vec<Tables>) = (p.sinks.iter().enumerate())
        .map(|sink| sink_args(p, sink, &mut held))
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .unzip();
    // The tables' addresses once they stay put.
    for (sink, t) in sinks.iter_mut().zip(&tables) {
        if sink.kind == LL_PACKET {
            (sink.first, sink.group_of, sink.pushes) =
                (addr(&t.first), addr(&t.group_of), addr(&t.pushes));
        }
    }
    let layout: Vec<i32> = p.layout_range.iter().flat_map(|&(b, n)| [b, n]).collect();
    let y: &[u16] = bytemuck::cast_slice(p.y);
    let args = LlCombinePackArgs {
        y: addr(y),
        layout_range: addr(&layout),
        src_info: addr(p.src_info),
        src_slot: addr(p.src_slot),
        sinks: addr(&sinks),
        experts: p.experts() as u32,
        ranks: r_n as u32,
        max_tokens: s.max_tokens as u32,
        hidden: s.hidden as u32,
        topk: s.topk as u32,
        rank: p.rank as u32,
    };
    // SAFETY: every block, source token and slot the kernel follows is in range and the
    // outputs hold every row (checked above); each sink's rows lie in its region (a
    // peer's combine rows, [M * K] of them; a packet's rows, each expert's block inside
    // them, `packet_tables`); `chunked` leased each FIFO the kernel pushes into, and its
    // counters are atomics the host reads after the launch. All live until it returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LL_COMBINE_PACK, grid, &args).map_err(bad)?;
    }
    held.finish();
    Ok(())
}
