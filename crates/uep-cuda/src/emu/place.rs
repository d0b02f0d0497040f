//! The LL dispatch's placement as a kernel on the emulated device (`kernels/ll_place.cu`),
//! its checks turned into the errors every device gives.

use uep_ep::device::{LlPlacePhase, LlPlacement};
use uep_ep::{EpError, Result};

use super::ffi::{self, Grid};
use crate::api::{addr, addr_mut, LlPlaceArgs};

/// Runs `p` as the `uep_ll_place` kernel on `grid`.
pub(crate) fn ll_place(grid: Grid, p: &LlPlacePhase<'_>) -> Result<LlPlacement> {
    let (t, k, e_n, r_n) = (p.tokens(), p.topk, p.num_experts, p.num_ranks);
    let fits = k > 0
        && r_n > 0
        && e_n % r_n == 0
        && p.topk_idx.len() == t * k
        && u32::try_from(t.max(k).max(e_n).max(r_n)).is_ok();
    if !fits {
        return Err(EpError::Internal(format!(
            "emulated ll_place: a routing of shape {p:?}"
        )));
    }
    let mut per_expert = vec![0u32; e_n];
    let mut pos = vec![u32::MAX; t * k];
    let mut row_of = vec![u32::MAX; r_n * t];
    let mut rows = vec![0u32; r_n];
    let (mut bad, mut fingerprint) = ([u64::MAX], [0u64]);
    let args = LlPlaceArgs {
        topk_idx: addr(p.topk_idx),
        per_expert: addr_mut(&mut per_expert),
        pos: addr_mut(&mut pos),
        row_of: addr_mut(&mut row_of),
        rows: addr_mut(&mut rows),
        first_bad: addr_mut(&mut bad),
        fingerprint: addr_mut(&mut fingerprint),
        tokens: t as u32,
        topk: k as u32,
        experts: e_n as u32,
        ranks: r_n as u32,
    };
    // SAFETY: topk_idx holds [T, K]; the outputs hold [E], [T * K], [R, T], [R] and one
    // word each (sized above); an id the kernel follows (`per_expert[e]`) is one it
    // matched against `0..E`. All live until the launch returns.
    #[allow(unsafe_code)]
    unsafe {
        ffi::launch(&ffi::LL_PLACE, grid, &args)
            .map_err(|e| EpError::Internal(format!("emulated ll_place: {e}")))?;
    }
    // The first slot in order that breaks a rule, as the host definition stops at it.
    let too_many = pos
        .iter()
        .position(|&q| q != u32::MAX && q as usize >= p.max_rows);
    match (bad[0], too_many) {
        (b, Some(i)) if (i as u64) < b => return Err(p.too_many(i)),
        (b, _) if b != u64::MAX => return Err(p.out_of_range(b as usize)),
        _ => {}
    }
    Ok(LlPlacement {
        per_expert,
        pos,
        row_of,
        rows,
        fingerprint: fingerprint[0],
    })
}
