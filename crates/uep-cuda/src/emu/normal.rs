//! Normal mode's data-moving phases as kernels on the emulated device: the combine's
//! send (`kernels/normal_combine_send.cu`), every row it follows checked first.

use uep_ep::device::{NormalCombineSendPhase, ReturnSink};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use crate::api::{addr, NormalCombineSendArgs, ReturnSinkArgs};

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
