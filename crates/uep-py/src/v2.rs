//! Host-side helpers of the Python layers of DeepEP v2's `ElasticBuffer` and
//! hybrid-ep's `HybridEPBuffer` (`python/uep/elastic_buffer.py`): the nodes a group's
//! ranks form, the bytes a shape needs, and the per-rank sum of an expanded combine.

use pyo3::prelude::*;

use crate::dlpack::{DType, In};
use crate::errors;

/// This process's host id: ranks with the same one share memory (one node).
#[pyfunction]
pub fn host_id() -> String {
    uep_bootstrap::host_id()
}

/// `(ranks_per_node, num_nodes)` of `hosts` (every rank's [`host_id`], in rank order),
/// as a Buffer over those ranks finds them; `ranks_per_node` emulates nodes of that
/// many ranks (`UEP_RANKS_PER_NODE`).
#[pyfunction]
#[pyo3(signature = (hosts, ranks_per_node=None))]
pub fn nodes(hosts: Vec<String>, ranks_per_node: Option<usize>) -> PyResult<(usize, usize)> {
    let t = uep_ep::Topology::from_hosts(0, &hosts, ranks_per_node).map_err(errors::ep_err)?;
    Ok((t.ranks_per_node, t.num_nodes))
}

/// Bytes of registered memory a rank needs for normal-mode calls of this shape, on
/// `num_ranks` ranks over `num_nodes` nodes (what a capacity must allow); `shape` is
/// `(num_experts, hidden, topk, max_tokens)`.
#[pyfunction]
pub fn normal_bytes(
    num_ranks: usize,
    num_nodes: usize,
    shape: (usize, usize, usize, usize),
) -> usize {
    let (num_experts, hidden, topk, max_tokens) = shape;
    uep_ep::BufferConfig::new(num_experts, hidden, topk, max_tokens, 0)
        .bytes_needed(num_ranks, num_nodes)
}

/// `out[i] = bf16(0.0 + x[s0] + x[s1] + ...)` over the rows of `x` that `slots[i]`
/// names (`-1`: none), in f32 in slot order, rounded once: an expanded v2 combine's sum
/// of a token's local experts on its rank. `x` and `out` are bf16 `[rows, H]` and
/// `[M, H]`, `slots` int64 `[M, K]`; runs without the GIL on up to `threads` threads.
#[pyfunction]
pub fn sum_slots(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let (x, slots, out) = (
        In::new(x, "x", DType::BF16)?,
        In::new(slots, "slots", DType::I64)?,
        In::new(out, "out", DType::BF16)?,
    );
    let (rows, h) = (x.expect_ndim(2)?.dim(0)?, x.dim(1)?);
    let (m, k) = (slots.expect_ndim(2)?.dim(0)?, slots.dim(1)?);
    if out.shape() != [m, h] {
        return Err(errors::invalid(format!(
            "out has shape {:?}, expected [{m}, {h}]",
            out.shape()
        )));
    }
    let (xs, ss) = (x.slice::<u16>(), slots.slice::<i64>());
    if let Some(bad) = ss.iter().find(|&&s| s < -1 || s >= rows as i64) {
        return Err(errors::invalid(format!(
            "slot {bad} is not a row of x ({rows} rows) or -1"
        )));
    }
    let dst = out.slice_mut::<half::bf16>(&[&x, &slots])?;
    if m == 0 || h == 0 {
        return Ok(());
    }
    let per_thread = m.div_ceil(threads.max(1));
    py.detach(|| {
        std::thread::scope(|scope| {
            for (c, block) in dst.chunks_mut(per_thread * h).enumerate() {
                scope.spawn(move || {
                    let mut parts = Vec::with_capacity(k);
                    for (j, row) in block.chunks_exact_mut(h).enumerate() {
                        let i = c * per_thread + j;
                        parts.clear();
                        parts.extend(
                            ss[i * k..(i + 1) * k]
                                .iter()
                                .filter(|&&s| s >= 0)
                                .map(|&s| (&xs[s as usize * h..(s as usize + 1) * h], 1.0f32)),
                        );
                        uep_ep::quant::reduce_rows(&parts, false, row);
                    }
                });
            }
        })
    });
    Ok(())
}
