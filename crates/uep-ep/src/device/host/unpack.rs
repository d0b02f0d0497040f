//! The host definition of a low-latency dispatch's receive: pack every expert's rows
//! to the front of its block.

use std::ops::Range;

use uep_shm::Region;

use crate::area::Mem;
use crate::device::pack::{LlLanded, LlUnpackPhase, LlUnpacked};
use crate::error::Result;
use crate::map::LlAreas;

/// [`Device::ll_unpack`](crate::device::Device::ll_unpack) on the calling thread:
/// expert by expert, each source's block in turn.
pub(crate) fn ll_unpack(phase: &LlUnpackPhase<'_>) -> Result<LlUnpacked> {
    let (areas, counts, landed) = (phase.areas, phase.counts, phase.landed);
    let s = areas.shape;
    let r_n = phase.num_ranks;
    let (epr, m) = (s.experts_per_rank(r_n), s.max_tokens);
    let g = BlockShape {
        row_bytes: phase.row_bytes,
        groups: phase.scale_words,
        k: s.topk,
        weighted: phase.weighted,
    };
    let k = g.k as i32;
    let local = phase.memory.local();
    let rows_per_expert = r_n * m;
    let mut out = LlUnpacked {
        layout_range: vec![(0i32, 0i32); epr * r_n],
        recv_count: vec![0i32; epr],
        src_info: vec![-1i32; epr * rows_per_expert],
        src_slot: vec![-1i32; epr * rows_per_expert],
        // Only a weighted dispatch's receive reads the weights.
        src_weight: match g.weighted {
            true => vec![0f32; epr * rows_per_expert],
            false => Vec::new(),
        },
    };
    let (mut block, mut column) = (Block::default(), Vec::new());
    for le in 0..epr {
        let mut base = 0usize;
        for src in 0..r_n {
            let n = counts[le * r_n + src] as usize;
            let (from, to) = (le * rows_per_expert + src * m, le * rows_per_expert + base);
            block.clear();
            match &landed[src] {
                _ if n == 0 => {}
                Some(l) => block.unpack(local, areas, l, le, to, g)?,
                None => block.move_down(local, areas, from..from + n, to, g)?,
            }
            if g.groups > 0 && n > 0 {
                let at = (le, base, n, rows_per_expert, g.groups);
                put_scale_columns(local, areas, at, &block.scales, &mut column)?;
            }
            for (i, &code) in block.codes.iter().enumerate() {
                out.src_info[to + i] = code / k;
                out.src_slot[to + i] = code % k;
            }
            if g.weighted {
                out.src_weight[to..to + block.weights.len()].copy_from_slice(&block.weights);
            }
            out.layout_range[le * r_n + src] = (base as i32, n as i32);
            base += n;
        }
        out.recv_count[le] = base as i32;
    }
    Ok(out)
}

/// The sizes of an LL receive's packed rows.
#[derive(Clone, Copy)]
struct BlockShape {
    row_bytes: usize,
    /// Scale words a row.
    groups: usize,
    k: usize,
    /// Whether the dispatch carried gate weights.
    weighted: bool,
}

/// One (expert, source) block as the receive packs it to the front: each row's
/// `token * K + slot`, its weight (weighted dispatches) and its scale words.
#[derive(Default)]
struct Block {
    codes: Vec<i32>,
    weights: Vec<f32>,
    scales: Vec<f32>,
}

impl Block {
    fn clear(&mut self) {
        self.codes.clear();
        self.weights.clear();
        self.scales.clear();
    }

    /// Expert `le`'s copies from a packet `l` that landed: each row to `to..` of the
    /// expert's rows, its metadata and scales into the block.
    fn unpack(
        &mut self,
        local: &Region,
        areas: &LlAreas,
        l: &LlLanded,
        le: usize,
        to: usize,
        g: BlockShape,
    ) -> Result<()> {
        for (j, &(i, code)) in l.by_expert[le].iter().enumerate() {
            let row = l.packet.rows.row(i as usize, g.row_bytes)?;
            local.copy(areas.recv_x.row(to + j, g.row_bytes)?, local, row)?;
            let i = i as usize;
            let scales = l.scales.get(i * g.groups..(i + 1) * g.groups);
            self.scales.extend_from_slice(scales.unwrap_or(&[]));
            self.codes.push(code);
            if g.weighted {
                self.weights.push(l.weights[i * g.k + code as usize % g.k]);
            }
        }
        Ok(())
    }

    /// A same-node source's rows `from`, written in place by the source, moved down to
    /// `to..` (moves only go down), with their metadata and scales.
    fn move_down(
        &mut self,
        local: &Region,
        areas: &LlAreas,
        from: Range<usize>,
        to: usize,
        g: BlockShape,
    ) -> Result<()> {
        let n = from.len();
        if from.start != to {
            let dst = areas.recv_x.rows(to..to + n, g.row_bytes)?;
            local.copy(dst, local, areas.recv_x.rows(from.clone(), g.row_bytes)?)?;
        }
        if g.groups > 0 {
            self.scales.resize(n * g.groups, 0f32);
            local.get(
                areas.recv_scales.rows(from.clone(), g.groups)?,
                &mut self.scales,
            )?;
        }
        self.codes = local.get_vec(areas.recv_src.slice(from.clone())?)?;
        if g.weighted {
            self.weights = local.get_vec(areas.recv_weight.slice(from)?)?;
        }
        Ok(())
    }
}

/// Writes `n` rows of scale words (`block`, row-major, `groups` a row) as rows
/// `base..base + n` of local expert `le`'s column-major scales (`rows` rows an expert);
/// `column` is scratch.
fn put_scale_columns(
    local: &Region,
    areas: &LlAreas,
    (le, base, n, rows, groups): (usize, usize, usize, usize, usize),
    block: &[f32],
    column: &mut Vec<f32>,
) -> Result<()> {
    for g in 0..groups {
        column.clear();
        column.extend((0..n).map(|i| block[i * groups + g]));
        let at = (le * groups + g) * rows + base;
        local.put(areas.out_scales.slice(at..at + n)?, column)?;
    }
    Ok(())
}
