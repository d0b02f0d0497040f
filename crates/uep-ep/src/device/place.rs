//! The placement phase of a low-latency dispatch: from `topk_idx` alone, where every
//! copy goes and what the host needs to open the call's sinks (a few counts), checked,
//! with the routing's fingerprint, so that a device computes it where `topk_idx` lives
//! and an LL call on a GPU never copies `topk_idx` to the host.

use crate::area::SliceRows;
use crate::error::{EpError, Result};

/// The placement phase's descriptor: a `[T, K]` routing over `num_experts` experts on
/// `num_ranks` ranks, each (expert, source) pair taking at most `max_rows` rows.
#[derive(Clone, Copy, Debug)]
pub struct LlPlacePhase<'a> {
    /// `[T, K]` expert ids, `-1` for an empty slot.
    pub topk_idx: &'a [i64],
    /// Slots a token.
    pub topk: usize,
    /// Experts over all ranks.
    pub num_experts: usize,
    /// Ranks of the job.
    pub num_ranks: usize,
    /// Rows one source may send one expert in a call (`M`).
    pub max_rows: usize,
    /// This rank (for messages).
    pub rank: usize,
}

impl LlPlacePhase<'_> {
    /// Tokens routed.
    pub fn tokens(&self) -> usize {
        self.topk_idx.len() / self.topk.max(1)
    }

    /// The error of slot `i`, an id outside `[-1, E)`: what every device says.
    pub fn out_of_range(&self, i: usize) -> EpError {
        let (k, e) = (self.topk.max(1), self.topk_idx[i]);
        crate::invalid!(
            "topk_idx[{}][{}] = {e} is outside [-1, {})",
            i / k,
            i % k,
            self.num_experts
        )
    }

    /// The error of slot `i`, the first copy past `max_rows` for its expert.
    pub fn too_many(&self, i: usize) -> EpError {
        let (e, m) = (self.topk_idx[i], self.max_rows);
        crate::invalid!(
            "expert {e} gets more than {m} rows from rank {} (a token names it in several slots); \
             low-latency mode has {m} rows per (expert, source)",
            self.rank
        )
    }
}

/// Where every copy of a low-latency dispatch goes, as [`Device::ll_place`](
/// super::Device::ll_place) makes it: copies numbered per expert in (token, slot) order,
/// and for each rank the tokens that go to it numbered in token order (its packet's rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlPlacement {
    /// `[E]` copies each expert gets.
    pub per_expert: Vec<u32>,
    /// `[T * K]` each copy's row in its expert's block (`u32::MAX` for a `-1` slot).
    pub pos: Vec<u32>,
    /// `[R, T]` each token's row among those going to each rank (`u32::MAX`: none).
    pub row_of: Vec<u32>,
    /// `[R]` tokens going to each rank.
    pub rows: Vec<u32>,
    /// The routing's FNV-1a (its words as `u64`, in order): what a combine's routing must
    /// match.
    pub fingerprint: u64,
}

impl LlPlacement {
    /// Rank `r`'s `epr` experts' counts.
    pub fn counts_of(&self, r: usize, epr: usize) -> &[u32] {
        self.per_expert.row(r, epr)
    }

    /// Rank `r`'s row of each token (`u32::MAX`: the token does not go there).
    pub fn row_of(&self, r: usize) -> &[u32] {
        let t = self.row_of.len() / self.rows.len().max(1);
        self.row_of.row(r, t)
    }
}

/// The FNV-1a of a routing, as [`LlPlacement::fingerprint`] is.
pub(crate) fn fingerprint(topk_idx: &[i64]) -> u64 {
    crate::fnv::hash(topk_idx.iter().map(|&v| v as u64))
}

/// The host definition of [`Device::ll_place`](super::Device::ll_place): a pass over
/// the slots in order.
pub(crate) fn host_place(p: &LlPlacePhase<'_>) -> Result<LlPlacement> {
    let (e_n, r_n, k, t_n) = (p.num_experts, p.num_ranks, p.topk.max(1), p.tokens());
    let epr = e_n / r_n.max(1);
    let mut per_expert = vec![0u32; e_n];
    let mut pos = vec![u32::MAX; p.topk_idx.len()];
    for (i, &e) in p.topk_idx.iter().enumerate() {
        if e < -1 || e >= e_n as i64 {
            return Err(p.out_of_range(i));
        }
        if e >= 0 {
            let n = &mut per_expert[e as usize];
            if *n as usize >= p.max_rows {
                return Err(p.too_many(i));
            }
            pos[i] = *n;
            *n += 1;
        }
    }
    let (mut row_of, mut rows) = (vec![u32::MAX; r_n * t_n], vec![0u32; r_n]);
    for (t, chosen) in p.topk_idx.chunks(k).enumerate() {
        for (r, n) in rows.iter_mut().enumerate() {
            if chosen.iter().any(|&e| e >= 0 && e as usize / epr == r) {
                row_of[r * t_n + t] = *n;
                *n += 1;
            }
        }
    }
    Ok(LlPlacement {
        per_expert,
        pos,
        row_of,
        rows,
        fingerprint: fingerprint(p.topk_idx),
    })
}
