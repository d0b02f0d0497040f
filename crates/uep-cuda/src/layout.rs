//! `get_dispatch_layout` on the GPU (`kernels/layout.cu`), checked field by field
//! against `uep_ep::get_dispatch_layout` on the same routing.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use uep_ep::{get_dispatch_layout, DispatchLayout};

use crate::gpu::{driver, kernels};
use crate::inputs::routing;
use crate::{CudaError, Gpu, Measured};

/// The job's routing shape.
#[derive(Clone, Copy, Debug)]
pub struct RouteShape {
    /// Tokens of this rank.
    pub tokens: usize,
    /// Slots a token (at most 32: a warp's lanes).
    pub topk: usize,
    /// Experts over all ranks.
    pub experts: usize,
    /// Ranks.
    pub ranks: usize,
    /// Ranks a node.
    pub ranks_per_node: usize,
}

/// The kernel's outputs.
struct Out {
    per_rank: CudaSlice<i32>,
    per_node: CudaSlice<i32>,
    per_expert: CudaSlice<i32>,
    in_rank: CudaSlice<u8>,
    bad: CudaSlice<u64>,
}

/// Computes the layout of a fresh routing on the GPU and on the host, compares them,
/// then times `iters` launches.
pub fn check(gpu: &Gpu, s: RouteShape, seed: u64, iters: usize) -> Result<Measured, CudaError> {
    if s.topk == 0 || s.topk > 32 {
        return Err(CudaError::Invalid(format!(
            "topk {} must be 1 to 32",
            s.topk
        )));
    }
    let ids = routing(s.tokens, s.topk, s.experts, s.ranks, seed);
    let want = get_dispatch_layout(&ids, s.topk, s.experts, s.ranks, s.ranks_per_node)
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    let stream = gpu.stream();
    let f = gpu.function(kernels::LAYOUT, "uep_dispatch_layout")?;
    let idd = stream
        .clone_htod(&ids)
        .map_err(driver("copying topk_idx"))?;
    let nodes = s.ranks / s.ranks_per_node;
    let alloc = |n: usize| {
        stream
            .alloc_zeros::<i32>(n)
            .map_err(driver("allocating counts"))
    };
    let mut out = Out {
        per_rank: alloc(s.ranks)?,
        per_node: alloc(nodes)?,
        per_expert: alloc(s.experts)?,
        in_rank: stream
            .alloc_zeros::<u8>(s.tokens * s.ranks)
            .map_err(driver("allocating is_token_in_rank"))?,
        bad: stream
            .clone_htod(&[u64::MAX])
            .map_err(driver("allocating the error word"))?,
    };
    let dims = [s.tokens, s.topk, s.experts, s.ranks, s.ranks_per_node].map(|v| v as u32);
    let cfg = LaunchConfig {
        grid_dim: (s.tokens.div_ceil(8).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let launch = |o: &mut Out| {
        let mut l = stream.launch_builder(&f);
        l.arg(&idd);
        for d in &dims {
            l.arg(d);
        }
        l.arg(&mut o.per_rank)
            .arg(&mut o.per_node)
            .arg(&mut o.per_expert);
        l.arg(&mut o.in_rank).arg(&mut o.bad);
        // SAFETY: arguments match `uep_dispatch_layout` (ids [T, K], five u32 sizes, counts
        // [R], [N], [E], the [T, R] map and one u64), each allocated at that size.
        #[allow(unsafe_code)]
        unsafe { l.launch(cfg) }.map_err(driver("launching uep_dispatch_layout"))?;
        Ok(())
    };
    launch(&mut out)?;
    let got = read_back(gpu, s, &out)?;
    if got != want {
        return Err(CudaError::Mismatch(format!(
            "dispatch layout differs from the host's (seed {seed}): per rank {:?} vs {:?}, \
             per node {:?} vs {:?}",
            got.num_tokens_per_rank,
            want.num_tokens_per_rank,
            got.num_tokens_per_rdma_rank,
            want.num_tokens_per_rdma_rank
        )));
    }
    // The timed launches accumulate into the counts; only the first was checked.
    let time = gpu.time(iters, || launch(&mut out))?;
    let bytes = (ids.len() * 8 + s.tokens * s.ranks) as u64;
    Ok(Measured { seed, time, bytes })
}

/// The kernel's outputs as the host's type; an error if it rejected an id.
fn read_back(gpu: &Gpu, s: RouteShape, out: &Out) -> Result<DispatchLayout, CudaError> {
    let stream = gpu.stream();
    let bad = stream
        .clone_dtoh(&out.bad)
        .map_err(driver("copying the error word"))?[0];
    if bad != u64::MAX {
        return Err(CudaError::Mismatch(format!(
            "the layout kernel rejected topk_idx entry {bad}, which the host accepted"
        )));
    }
    let got = DispatchLayout {
        num_tokens: s.tokens,
        num_ranks: s.ranks,
        num_experts: s.experts,
        num_tokens_per_rank: stream
            .clone_dtoh(&out.per_rank)
            .map_err(driver("copying counts"))?,
        num_tokens_per_rdma_rank: stream
            .clone_dtoh(&out.per_node)
            .map_err(driver("copying counts"))?,
        num_tokens_per_expert: stream
            .clone_dtoh(&out.per_expert)
            .map_err(driver("copying counts"))?,
        is_token_in_rank: stream
            .clone_dtoh(&out.in_rank)
            .map_err(driver("copying is_token_in_rank"))?
            .into_iter()
            .map(|b| b != 0)
            .collect(),
    };
    Ok(got)
}
