//! `get_dispatch_layout` (docs/architecture.md, "What a call does"): which ranks, nodes and experts each token goes to.
//!
//! Expert `e` lives on rank `e / (num_experts / num_ranks)`; rank `r` is on node
//! `r / ranks_per_node`. A slot holding `-1` names no expert.

use crate::area::SliceRows;
use crate::error::Result;
use crate::invalid;

/// Counts and the token-to-rank map of one rank's routing (DeepEP's `get_dispatch_layout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DispatchLayout {
    /// Tokens `T` of the routing.
    pub num_tokens: usize,
    /// Ranks `R`.
    pub num_ranks: usize,
    /// Experts `E` over all ranks.
    pub num_experts: usize,
    /// `[R]`: tokens with at least one expert on rank `r` (each such token counted once).
    pub num_tokens_per_rank: Vec<i32>,
    /// `[R / ranks_per_node]`: tokens with at least one expert on node `n` (counted once).
    pub num_tokens_per_rdma_rank: Vec<i32>,
    /// `[E]`: (token, slot) pairs naming expert `e` (a token naming `e` twice counts twice).
    pub num_tokens_per_expert: Vec<i32>,
    /// `[T * R]`, row-major: whether token `t` has at least one expert on rank `r`.
    pub is_token_in_rank: Vec<bool>,
}

impl DispatchLayout {
    /// Whether token `t` goes to rank `r`; `false` for out-of-range `t` or `r`.
    pub fn token_in_rank(&self, t: usize, r: usize) -> bool {
        t < self.num_tokens && r < self.num_ranks && self.is_token_in_rank[t * self.num_ranks + r]
    }
}

/// The arguments of [`get_dispatch_layout`] that do not depend on the ids: `entries`
/// (token, slot) pairs of `topk` slots, experts and ranks that divide as they must.
fn check_layout_args(
    entries: usize,
    topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
) -> Result<()> {
    if topk == 0 {
        return Err(invalid!("get_dispatch_layout: topk must be >= 1"));
    }
    if entries % topk != 0 {
        return Err(invalid!(
            "get_dispatch_layout: topk_idx has {} entries, not a multiple of topk = {topk}",
            entries
        ));
    }
    if i32::try_from(entries).is_err() {
        return Err(invalid!(
            "get_dispatch_layout: {} (token, slot) entries do not fit the i32 counts (max {})",
            entries,
            i32::MAX
        ));
    }
    if ranks_per_node == 0 {
        return Err(invalid!("get_dispatch_layout: ranks_per_node must be >= 1"));
    }
    if num_ranks == 0 || num_ranks % ranks_per_node != 0 {
        return Err(invalid!(
            "get_dispatch_layout: num_ranks = {num_ranks} must be a positive multiple of ranks_per_node = {ranks_per_node}"
        ));
    }
    if num_experts == 0 || num_experts % num_ranks != 0 {
        return Err(invalid!(
            "get_dispatch_layout: num_experts = {num_experts} must be a positive multiple of num_ranks = {num_ranks}"
        ));
    }
    Ok(())
}

/// Compute the dispatch layout of `topk_idx` (`[T, topk]`, row-major; `-1` = no expert).
///
/// Errors when `topk == 0`, `topk_idx.len()` is not a multiple of `topk`, an id is outside
/// `[-1, num_experts)`, `num_experts` is zero or not a multiple of `num_ranks`, `num_ranks` is
/// zero or not a multiple of `ranks_per_node`, or `ranks_per_node == 0`.
pub fn get_dispatch_layout(
    topk_idx: &[i64],
    topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
) -> Result<DispatchLayout> {
    check_layout_args(topk_idx.len(), topk, num_experts, num_ranks, ranks_per_node)?;
    let num_tokens = topk_idx.len() / topk;
    let experts_per_rank = num_experts / num_ranks;
    let num_nodes = num_ranks / ranks_per_node;

    let mut num_tokens_per_rank = vec![0i32; num_ranks];
    let mut num_tokens_per_rdma_rank = vec![0i32; num_nodes];
    let mut num_tokens_per_expert = vec![0i32; num_experts];
    let mut is_token_in_rank = vec![false; num_tokens * num_ranks];
    // Per-token scratch so a token naming several experts of one node counts once there.
    let mut in_node = vec![false; num_nodes];

    for (t, row) in topk_idx.chunks_exact(topk).enumerate() {
        in_node.fill(false);
        let in_rank = is_token_in_rank.row_mut(t, num_ranks);
        for (k, &id) in row.iter().enumerate() {
            if id == -1 {
                continue;
            }
            let e = usize::try_from(id)
                .ok()
                .filter(|&e| e < num_experts)
                .ok_or_else(|| {
                    invalid!(
                        "get_dispatch_layout: topk_idx[{t}][{k}] = {id}; expert ids must be -1 or in [0, {num_experts})"
                    )
                })?;
            num_tokens_per_expert[e] += 1;
            let r = e / experts_per_rank;
            in_rank[r] = true;
            in_node[r / ranks_per_node] = true;
        }
        for (count, &hit) in num_tokens_per_rank.iter_mut().zip(in_rank.iter()) {
            *count += i32::from(hit);
        }
        for (count, &hit) in num_tokens_per_rdma_rank.iter_mut().zip(&in_node) {
            *count += i32::from(hit);
        }
    }

    Ok(DispatchLayout {
        num_tokens,
        num_ranks,
        num_experts,
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        num_tokens_per_expert,
        is_token_in_rank,
    })
}

/// Which of a token's top-k weights a receiving rank gets back from a dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLanes {
    /// Those of the slots whose expert is on the receiver; the others read 0 (DeepEP
    /// v1's normal dispatch).
    #[default]
    Local,
    /// Every slot's, as the source had it (DeepEP v2's `ElasticBuffer.dispatch`).
    All,
}

/// Local top-k ids and weights of a token for rank `r`: `e - r * epr` where expert `e`
/// lives on `r`, else `-1` and weight 0 (every weight as it is with
/// [`WeightLanes::All`]).
pub(crate) fn localize(
    idx: &[i64],
    (w, lanes): (Option<&[f32]>, WeightLanes),
    r: usize,
    epr: usize,
    idx_row: &mut [i64],
    w_row: &mut [f32],
) {
    for (s, &e) in idx.iter().enumerate() {
        let local = e >= 0 && e as usize / epr == r;
        idx_row[s] = if local { e - (r * epr) as i64 } else { -1 };
        w_row[s] = match w {
            Some(w) if local || lanes == WeightLanes::All => w[s],
            _ => 0.0,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn localize_keeps_the_lanes_asked_for() {
        // Experts 0..8 on 4 ranks of 2; the token picked 3, 2 (rank 1), 6 (rank 3), none.
        let (idx, w) = ([3i64, 2, 6, -1], [0.5f32, -0.25, 1.5, 7.0]);
        let (mut i, mut o) = (vec![0; 4], vec![0.0; 4]);
        localize(&idx, (Some(&w), WeightLanes::Local), 1, 2, &mut i, &mut o);
        assert_eq!(
            (i.as_slice(), o.as_slice()),
            (&[1, 0, -1, -1][..], &[0.5, -0.25, 0.0, 0.0][..])
        );
        localize(&idx, (Some(&w), WeightLanes::All), 1, 2, &mut i, &mut o);
        assert_eq!((i.as_slice(), o.as_slice()), (&[1, 0, -1, -1][..], &w[..]));
        localize(&idx, (None, WeightLanes::All), 3, 2, &mut i, &mut o);
        assert_eq!(
            (i.as_slice(), o.as_slice()),
            (&[-1, -1, 0, -1][..], &[0.0; 4][..])
        );
    }

    #[test]
    fn hand_worked_layout() {
        // 4 ranks, 2 per node, 8 experts (2 per rank), K = 3.
        let topk_idx = [
            0, 1, 5, // t0: rank 0 (twice), rank 2 -> nodes 0, 1
            -1, -1, -1, // t1: nowhere
            7, 7, -1, // t2: expert 7 twice -> rank 3 once, node 1
            2, -1, 4, // t3: rank 1, rank 2 -> nodes 0, 1
            3, 2, 3, // t4: rank 1 only (expert 3 twice)
        ];
        let l = get_dispatch_layout(&topk_idx, 3, 8, 4, 2).unwrap();
        assert_eq!(l.num_tokens, 5);
        assert_eq!(l.num_tokens_per_rank, vec![1, 2, 2, 1]);
        assert_eq!(l.num_tokens_per_rdma_rank, vec![3, 3]);
        assert_eq!(l.num_tokens_per_expert, vec![1, 1, 2, 2, 1, 1, 0, 2]);
        let want = [
            [true, false, true, false],
            [false; 4],
            [false, false, false, true],
            [false, true, true, false],
            [false, true, false, false],
        ];
        for (t, row) in want.iter().enumerate() {
            for (r, &w) in row.iter().enumerate() {
                assert_eq!(l.token_in_rank(t, r), w, "t{t} r{r}");
                assert_eq!(l.is_token_in_rank[t * 4 + r], w);
            }
        }
        assert!(!l.token_in_rank(5, 0) && !l.token_in_rank(0, 4));
    }

    #[test]
    fn empty_input() {
        let l = get_dispatch_layout(&[], 2, 4, 2, 1).unwrap();
        assert_eq!(l.num_tokens, 0);
        assert_eq!(l.num_tokens_per_rank, vec![0, 0]);
        assert_eq!(l.num_tokens_per_rdma_rank, vec![0, 0]);
        assert_eq!(l.num_tokens_per_expert, vec![0; 4]);
        assert!(l.is_token_in_rank.is_empty());
    }

    #[test]
    fn rejects_bad_arguments() {
        let err = |r: Result<DispatchLayout>| r.unwrap_err().to_string();
        assert!(err(get_dispatch_layout(&[0], 0, 4, 2, 1)).contains("topk must be >= 1"));
        assert!(err(get_dispatch_layout(&[0, 1, 2], 2, 4, 2, 1)).contains("not a multiple of topk"));
        let e = err(get_dispatch_layout(&[0, 1, 2, 4], 2, 4, 2, 1));
        assert!(
            e.contains("topk_idx[1][1] = 4") && e.contains("[0, 4)"),
            "{e}"
        );
        let e = err(get_dispatch_layout(&[0, -2], 2, 4, 2, 1));
        assert!(e.contains("topk_idx[0][1] = -2"), "{e}");
        assert!(err(get_dispatch_layout(&[0, 1], 2, 5, 2, 1)).contains("num_experts = 5"));
        assert!(err(get_dispatch_layout(&[0, 1], 2, 0, 2, 1)).contains("num_experts = 0"));
        assert!(err(get_dispatch_layout(&[0, 1], 2, 6, 3, 2)).contains("num_ranks = 3"));
        assert!(err(get_dispatch_layout(&[0, 1], 2, 4, 0, 1)).contains("num_ranks = 0"));
        assert!(err(get_dispatch_layout(&[0, 1], 2, 4, 2, 0)).contains("ranks_per_node"));
    }
}
