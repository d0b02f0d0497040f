//! The normal dispatch's pack as a kernel on the emulated device
//! (`kernels/normal_pack.cu`): the plan turned into the kernel's argument, every row
//! the kernel stores checked against its area first, and the FIFOs of the packets whose
//! direct rows it pushes leased to it for the launch.

use uep_ep::device::{Dest, NormalPackPhase, RowSink, WeightLanes};
use uep_ep::{Area, EpError, Result, Tokens};

use super::ffi::{self, Grid};
use super::push::{chunked, Held, Rows};
use crate::api::{addr, ChunkedPush, NormalPackArgs, NormalPackDest, NORMAL_PACK_RANK};

/// An error of the phase as handed to the kernel: uep's own fault.
fn bad(what: String) -> EpError {
    EpError::Internal(format!("emulated normal_pack: {what}"))
}

/// Whether `area` holds `values` values and lies in a region of `len` bytes.
fn holds<T>(area: Area<T>, values: usize, len: usize) -> bool {
    area.len() >= values && area.end() <= len
}

/// The rows and scales `p` sends, as bytes and words.
fn rows<'a>(p: &NormalPackPhase<'a>) -> (&'a [u8], &'a [f32]) {
    match p.x {
        Tokens::Bf16(x) => (bytemuck::cast_slice(x), &[]),
        Tokens::Fp8 { data, scales } => (data, scales),
    }
}

/// Checks the inputs' lengths and that the plan's block starts count the hits and
/// direct hits of each of its `blocks` blocks of `per` tokens (every row the kernel
/// stores is then below its destination's totals); returns the starts as the kernel
/// reads them.
fn starts(p: &NormalPackPhase<'_>, (blocks, per): (usize, usize)) -> Result<Vec<u32>> {
    let plan = p.plan;
    let (t_n, nd, k) = (p.tokens(), plan.dests.len(), p.shape.topk);
    let (x, scales) = rows(p);
    let groups = if plan.fp8 { plan.fmt.groups } else { 0 };
    let lens_ok = plan.hit.len() == t_n * nd
        && plan.direct.len() == t_n * nd
        && p.in_rank.len() == t_n * p.topo.num_ranks
        && x.len() == t_n * plan.fmt.row_bytes
        && scales.len() >= t_n * groups
        && p.topk_idx.map_or(!plan.with_topk, |i| i.len() == t_n * k)
        && p.topk_weights
            .map_or(!plan.with_weights, |w| w.len() == t_n * k)
        && plan.sinks.len() == nd
        && plan.block_start.len() == (blocks + 1) * nd;
    if !lens_ok {
        return Err(bad(format!(
            "{t_n} tokens with inputs of the wrong lengths"
        )));
    }
    let mut counted = vec![(0usize, 0usize); nd];
    for b in 0..=blocks {
        let at = &plan.block_start[b * nd..(b + 1) * nd];
        if at != counted.as_slice() {
            return Err(bad(format!("block {b}'s starts do not count its rows")));
        }
        for t in (b * per).min(t_n)..((b + 1) * per).min(t_n) {
            for (d, c) in counted.iter_mut().enumerate() {
                let (hit, direct) = (plan.hit[t * nd + d], plan.direct[t * nd + d]);
                if direct && !(hit && matches!(plan.dests[d], Dest::Node(..))) {
                    return Err(bad(format!("token {t} goes direct to destination {d}")));
                }
                *c = (c.0 + hit as usize, c.1 + direct as usize);
            }
        }
    }
    if counted != plan.totals || counted.iter().any(|c| c.0 > u32::MAX as usize) {
        return Err(bad("the totals do not count the rows".into()));
    }
    Ok((plan.block_start.iter())
        .flat_map(|&(n, n_direct)| [n as u32, n_direct as u32])
        .collect())
}

/// The kernel's view of destination `d`, after checking that its rows fit its areas;
/// a packet's direct rows pushed through its port, leased in `held`.
fn dest_args<'a>(p: &NormalPackPhase<'a>, d: usize, held: &mut Held<'a>) -> Result<NormalPackDest> {
    let plan = p.plan;
    let s: &RowSink = &plan.sinks[d];
    let (base, len) = p.region(s.rank)?;
    let (n, n_direct) = plan.totals[d];
    let (rb, k) = (plan.fmt.row_bytes, p.shape.topk);
    let groups = if plan.fp8 { plan.fmt.groups } else { 0 };
    let routing = (!plan.with_topk || holds(s.topk, n * k, len))
        && (!plan.with_weights || holds(s.weights, n * k, len))
        && holds(s.src, n, len);
    let mut args = NormalPackDest {
        region: base as u64,
        rank: s.rank as u32,
        node: NORMAL_PACK_RANK,
        x_off: s.x.offset() as u64,
        scales_off: s.scales.offset() as u64,
        topk_off: s.topk.offset() as u64,
        weights_off: s.weights.offset() as u64,
        src_off: s.src.offset() as u64,
        ..Default::default()
    };
    let Dest::Node(m, _) = plan.dests[d] else {
        return match routing && holds(s.x, n * rb, len) && holds(s.scales, n * groups, len) {
            true => Ok(args),
            false => Err(bad(format!("rank {}'s rows outside its memory", s.rank))),
        };
    };
    let rpn = p.topo.ranks_per_node;
    let fits = routing
        && holds(s.x, (n - n_direct) * rb, len)
        && holds(s.scales, (n - n_direct) * groups, len)
        && holds(s.direct_x, n_direct * rb, len)
        && holds(s.direct_scales, n_direct * groups, len)
        && holds(s.mask, n, len)
        && s.relay_x.len() >= n_direct * rb
        && (m + 1) * rpn <= p.topo.num_ranks;
    if !fits {
        return Err(bad(format!("node {m}'s packet outside this rank's memory")));
    }
    args.node = m as u32;
    args.mask_off = s.mask.offset() as u64;
    args.direct_x_off = s.direct_x.offset() as u64;
    args.direct_scales_off = s.direct_scales.offset() as u64;
    args.push = match plan.kernel_port(d) {
        Some(port) if n_direct > 0 => chunked(port?, direct_rows(p, s, n_direct), held)?,
        _ => ChunkedPush::default(),
    };
    Ok(args)
}

/// A packet's `n` direct rows (and their scales), from its staging to the relay's
/// output rows, in writes of whole quanta.
fn direct_rows(p: &NormalPackPhase<'_>, s: &RowSink, n: usize) -> Rows {
    let plan = p.plan;
    let scales = plan.fp8.then(|| {
        let bytes = plan.fmt.groups * size_of::<f32>();
        (s.direct_scales.offset(), s.relay_scales.offset(), bytes)
    });
    Rows {
        src: s.direct_x.offset(),
        dst: s.relay_x.offset(),
        rows: n,
        row_bytes: plan.fmt.row_bytes,
        scales,
        quantum: plan.row_quantum(),
    }
}

/// Runs `p` as the `uep_normal_pack` kernel on `grid`, for the plan's `blocks` blocks of
/// `per` tokens (the device's split), then wakes the proxies of the packets it pushed
/// into.
pub(crate) fn normal_pack(
    grid: Grid,
    p: &NormalPackPhase<'_>,
    split: (usize, usize),
) -> Result<()> {
    let starts = starts(p, split)?;
    let plan = p.plan;
    let nd = plan.dests.len();
    let mut held = Held::default();
    let dests = (0..nd)
        .map(|d| dest_args(p, d, &mut held))
        .collect::<Result<Vec<_>>>()?;
    let (x, scales) = rows(p);
    let (r_n, k) = (p.topo.num_ranks, p.shape.topk);
    let args = NormalPackArgs {
        x: addr(x),
        scales: if plan.fp8 { addr(scales) } else { 0 },
        topk_idx: p.topk_idx.map_or(0, addr),
        weights: p.topk_weights.filter(|_| plan.with_weights).map_or(0, addr),
        hit: addr(&plan.hit),
        direct: addr(&plan.direct),
        starts: addr(&starts),
        in_rank: addr(p.in_rank),
        dests: addr(&dests),
        tokens: p.tokens() as u32,
        block_tokens: split.1 as u32,
        blocks: split.0 as u32,
        dests_n: nd as u32,
        row_bytes: plan.fmt.row_bytes as u32,
        groups: if plan.fp8 { plan.fmt.groups as u32 } else { 0 },
        topk: k as u32,
        with_topk: plan.with_topk.into(),
        with_weights: plan.with_weights.into(),
        all_weights: u32::from(plan.weight_lanes == WeightLanes::All),
        ranks: r_n as u32,
        ranks_per_node: p.topo.ranks_per_node as u32,
        experts_per_rank: p.shape.experts_per_rank(r_n) as u32,
        quantum: plan.row_quantum() as u32,
    };
    // SAFETY: `starts` checked the inputs' lengths and that each block's rows are
    // counted by the plan's starts and totals, so every row the kernel stores is below
    // its destination's totals; `dest_args` checked each destination's areas hold those
    // rows inside its rank's memory (mapped while the phase lives) and leased each FIFO
    // the kernel pushes into. All live until the launch returns.
    #[allow(unsafe_code)]
    let ran = unsafe { ffi::launch(&ffi::NORMAL_PACK, grid, &args).map_err(bad) };
    held.finish();
    ran
}
