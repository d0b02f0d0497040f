//! The LL dispatch's receive as a kernel on the emulated device (`kernels/ll_unpack.cu`):
//! each landed packet's copies flattened into the kernel's tables, every index checked
//! against the areas it names, the handle's tables made where the kernel writes them.

use uep_ep::device::{LlLanded, LlUnpackPhase, LlUnpacked};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use crate::api::{addr, addr_mut, LlLandedArgs, LlUnpackArgs};

fn bad(what: String) -> EpError {
    EpError::Internal(format!("emulated ll_unpack: {what}"))
}

/// A landed packet's copies as the kernel reads them: each expert's start, and each
/// copy's row and code.
struct Flat {
    starts: Vec<u32>,
    rows: Vec<u32>,
    codes: Vec<i32>,
}

/// `l`'s copies flattened, checked against the packet (rows it has, scales and weights
/// for each) and against `counts` (each expert's copies, unless masked to 0).
fn flatten(p: &LlUnpackPhase<'_>, src: usize, l: &LlLanded, region_len: usize) -> Result<Flat> {
    let (experts, k) = (p.counts.len() / p.num_ranks.max(1), p.areas.shape.topk);
    let n = l.packet.rows.len() / p.row_bytes.max(1);
    let mut flat = Flat {
        starts: vec![0],
        rows: Vec::new(),
        codes: Vec::new(),
    };
    for le in 0..experts {
        let copies = l.by_expert.get(le).map_or(&[][..], Vec::as_slice);
        let count = p.counts[le * p.num_ranks + src] as usize;
        if count != 0 && count != copies.len() {
            return Err(bad(format!(
                "{count} rows from rank {src} for expert {le}, its packet has {}",
                copies.len()
            )));
        }
        flat.rows.extend(copies.iter().map(|&(i, _)| i));
        flat.codes.extend(copies.iter().map(|&(_, code)| code));
        flat.starts.push(flat.rows.len() as u32);
    }
    let fits = flat.rows.iter().all(|&i| (i as usize) < n)
        && flat
            .codes
            .iter()
            .all(|&c| c >= 0 && (c as usize) < p.areas.shape.max_tokens * k)
        && l.scales.len() >= n * p.scale_words
        && (!p.weighted || l.weights.len() >= n * k)
        && l.packet.rows.end() <= region_len;
    match fits {
        true => Ok(flat),
        false => Err(bad(format!(
            "rank {src}'s packet names rows, codes or scales it lacks"
        ))),
    }
}

/// Checks the counts (at most M each), the packets (one a source) and the areas the
/// kernel moves rows in (E/R * R * M rows each, inside this rank's `len` bytes).
fn check(p: &LlUnpackPhase<'_>, len: usize) -> Result<()> {
    let (areas, r_n) = (p.areas, p.num_ranks);
    let (epr, m) = (areas.shape.experts_per_rank(r_n), areas.shape.max_tokens);
    let rows = epr * r_n * m;
    let sized = areas.recv_x.len() >= rows * p.row_bytes
        && areas.out_scales.len() >= rows * p.scale_words
        && areas.recv_scales.len() >= rows * p.scale_words
        && areas.recv_src.len() >= rows
        && areas.recv_weight.len() >= rows;
    let ends = [
        areas.recv_x.end(),
        areas.out_scales.end(),
        areas.recv_scales.end(),
    ];
    let inside = (ends.into_iter())
        .chain([areas.recv_src.end(), areas.recv_weight.end()])
        .all(|end| end <= len);
    let counts_fit = p.counts.len() == epr * r_n && p.counts.iter().all(|&c| c as usize <= m);
    match sized && inside && counts_fit && p.landed.len() == r_n {
        true => Ok(()),
        false => Err(bad("counts, packets or areas of the wrong size".into())),
    }
}

/// Runs `p` as the `uep_ll_unpack` kernel on `grid`.
pub(crate) fn ll_unpack(grid: Grid, p: &LlUnpackPhase<'_>) -> Result<LlUnpacked> {
    let (areas, s, r_n) = (p.areas, p.areas.shape, p.num_ranks);
    let (epr, m, k) = (s.experts_per_rank(r_n), s.max_tokens, s.topk);
    let (base, len) = p.region()?;
    check(p, len)?;
    let flats = (p.landed.iter().enumerate())
        .map(|(src, l)| l.as_ref().map(|l| flatten(p, src, l, len)).transpose())
        .collect::<Result<Vec<_>>>()?;
    let landed: Vec<LlLandedArgs> = (p.landed.iter().zip(&flats))
        .map(|(l, f)| match (l, f) {
            (Some(l), Some(f)) => LlLandedArgs {
                present: 1,
                rows_off: l.packet.rows.offset() as u64,
                starts: addr(&f.starts),
                rows: addr(&f.rows),
                codes: addr(&f.codes),
                scales: addr(&l.scales),
                weights: addr(&l.weights),
                ..Default::default()
            },
            _ => LlLandedArgs::default(),
        })
        .collect();
    let rows = epr * r_n * m;
    let mut layout = vec![0i32; 2 * epr * r_n];
    let mut recv_count = vec![0i32; epr];
    let (mut src_info, mut src_slot) = (vec![-1i32; rows], vec![-1i32; rows]);
    let mut src_weight = vec![0f32; if p.weighted { rows } else { 0 }];
    let args = LlUnpackArgs {
        region: base as u64,
        counts: addr(p.counts),
        landed: addr(&landed),
        recv_x_off: areas.recv_x.offset() as u64,
        out_scales_off: areas.out_scales.offset() as u64,
        recv_scales_off: areas.recv_scales.offset() as u64,
        recv_src_off: areas.recv_src.offset() as u64,
        recv_weight_off: areas.recv_weight.offset() as u64,
        layout_range: addr_mut(&mut layout),
        recv_count: addr_mut(&mut recv_count),
        src_info: addr_mut(&mut src_info),
        src_slot: addr_mut(&mut src_slot),
        src_weight: if p.weighted {
            addr_mut(&mut src_weight)
        } else {
            0
        },
        experts: epr as u32,
        ranks: r_n as u32,
        max_tokens: m as u32,
        row_bytes: p.row_bytes as u32,
        scale_words: p.scale_words as u32,
        topk: k as u32,
    };
    // SAFETY: every count is at most M and every area holds its E/R * R * M rows inside
    // this rank's region (checked above), so the kernel's rows and scale columns stay in
    // it; each packet's copies name rows, codes, scales and weights it has (`flatten`);
    // the tables are sized for E/R * R * M rows. The region is this rank's own, which
    // the sources published before the wait that made this phase; all live until the
    // launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LL_UNPACK, grid, &args).map_err(bad)?;
    }
    let layout_range = layout.chunks_exact(2).map(|c| (c[0], c[1])).collect();
    LlUnpacked::new(
        (epr, r_n, r_n * m),
        layout_range,
        recv_count,
        (src_info, src_slot, src_weight),
    )
}
