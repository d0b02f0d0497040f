//! `get_dispatch_layout` as a kernel (`kernels/layout.cu`): the shapes it takes, and on
//! a GPU its launch, checked field by field against `uep_ep::get_dispatch_layout` on
//! the same routing.

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

impl RouteShape {
    /// The kernel's argument for this shape, its addresses still 0 (the launch names
    /// the buffers).
    pub(crate) fn args(self) -> crate::api::LayoutArgs {
        crate::api::LayoutArgs {
            tokens: self.tokens as u32,
            topk: self.topk as u32,
            experts: self.experts as u32,
            ranks: self.ranks as u32,
            ranks_per_node: self.ranks_per_node as u32,
            ..Default::default()
        }
    }
}

/// Whether the kernel takes shape `s` (a warp a token: at most 32 slots; sizes in
/// 32 bits; whole nodes and experts spread evenly): otherwise the host's definition
/// runs, and says what is wrong with it.
pub(crate) fn fits(s: RouteShape) -> bool {
    (1..=32).contains(&s.topk)
        && s.ranks_per_node > 0
        && s.ranks % s.ranks_per_node == 0
        && s.experts > 0
        && s.ranks > 0
        && s.experts % s.ranks == 0
        && u32::try_from(s.tokens * s.ranks.max(s.topk)).is_ok()
}

/// The layout phase on a device whose kernel `run` computes a routing of shape
/// [`RouteShape`] (`Ok(Err(i))`: it found entry `i` out of range): the host's definition
/// where there are no tokens or the kernel does not take the shape, and the host's error
/// for an entry the kernel rejects, so every device says what is wrong the same way.
/// The layout, and whether the kernel ran.
pub(crate) fn phase(
    p: &uep_ep::device::LayoutPhase<'_>,
    host: &uep_ep::device::HostDevice,
    run: impl FnOnce(RouteShape) -> uep_ep::Result<Result<uep_ep::DispatchLayout, u64>>,
) -> uep_ep::Result<(uep_ep::DispatchLayout, bool)> {
    use uep_ep::device::Device;
    let s = RouteShape {
        tokens: p.topk_idx.len() / p.topk.max(1),
        topk: p.topk,
        experts: p.num_experts,
        ranks: p.num_ranks,
        ranks_per_node: p.ranks_per_node,
    };
    if s.tokens == 0 || !fits(s) || p.topk_idx.len() != s.tokens * s.topk {
        return Ok((host.layout(p)?, false));
    }
    match run(s)? {
        Ok(layout) => Ok((layout, true)),
        Err(bad) => match host.layout(p) {
            Err(e) => Err(e),
            Ok(_) => Err(uep_ep::EpError::Internal(format!(
                "the layout kernel rejected topk_idx entry {bad}, which the host accepts"
            ))),
        },
    }
}

#[cfg(feature = "cuda")]
pub use run::check;
#[cfg(feature = "cuda")]
pub(crate) use run::compute;

#[cfg(feature = "cuda")]
mod run {
    use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
    use uep_ep::{get_dispatch_layout, DispatchLayout};

    use super::{fits, RouteShape};
    use crate::api::LayoutArgs;
    use crate::gpu::{driver, kernels};
    use crate::inputs::routing;
    use crate::{CudaError, Gpu, Measured};

    /// The kernel's outputs.
    struct Out {
        per_rank: CudaSlice<i32>,
        per_node: CudaSlice<i32>,
        per_expert: CudaSlice<i32>,
        in_rank: CudaSlice<u8>,
        bad: CudaSlice<u64>,
    }

    impl Out {
        /// Zeroed outputs for shape `s`.
        fn new(gpu: &Gpu, s: RouteShape) -> Result<Out, CudaError> {
            let stream = gpu.stream();
            let alloc = |n: usize| {
                stream
                    .alloc_zeros::<i32>(n)
                    .map_err(driver("allocating counts"))
            };
            Ok(Out {
                per_rank: alloc(s.ranks)?,
                per_node: alloc(s.ranks / s.ranks_per_node)?,
                per_expert: alloc(s.experts)?,
                in_rank: stream
                    .alloc_zeros::<u8>(s.tokens * s.ranks)
                    .map_err(driver("allocating is_token_in_rank"))?,
                bad: stream
                    .clone_htod(&[u64::MAX])
                    .map_err(driver("allocating the error word"))?,
            })
        }
    }

    /// Adds the layout of `idd` (`[tokens, topk]` expert ids on the device) into `o`.
    fn launch(
        gpu: &Gpu,
        f: &CudaFunction,
        idd: &CudaSlice<i64>,
        s: RouteShape,
        o: &mut Out,
    ) -> Result<(), CudaError> {
        let cfg = LaunchConfig {
            grid_dim: (s.tokens.div_ceil(8).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = LayoutArgs {
            topk_idx: gpu.addr(idd),
            per_rank: gpu.addr(&o.per_rank),
            per_node: gpu.addr(&o.per_node),
            per_expert: gpu.addr(&o.per_expert),
            in_rank: gpu.addr(&o.in_rank),
            first_bad: gpu.addr(&o.bad),
            ..s.args()
        };
        // SAFETY: ids [T, K], counts [R], [N], [E], the [T, R] map and one u64, each
        // allocated at that size by `Out::new` for `s` (which `fits` bounds) and alive
        // until the caller synchronises.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(f, cfg, &args, "launching uep_dispatch_layout")
        }
    }

    /// The layout of `ids` on the GPU: `Ok(Err(i))` where the kernel rejected entry `i`.
    /// `s` must [`fits`].
    pub(crate) fn compute(
        gpu: &Gpu,
        f: &CudaFunction,
        ids: &[i64],
        s: RouteShape,
    ) -> Result<Result<DispatchLayout, u64>, CudaError> {
        let idd = gpu
            .stream()
            .clone_htod(ids)
            .map_err(driver("copying topk_idx"))?;
        let mut out = Out::new(gpu, s)?;
        launch(gpu, f, &idd, s, &mut out)?;
        read_back(gpu, s, &out)
    }

    /// Computes the layout of a fresh routing on the GPU and on the host, compares them,
    /// then times `iters` launches.
    pub fn check(gpu: &Gpu, s: RouteShape, seed: u64, iters: usize) -> Result<Measured, CudaError> {
        if !fits(s) {
            return Err(CudaError::Invalid(format!(
                "{s:?}: topk must be 1 to 32, ranks whole nodes and experts a multiple of ranks"
            )));
        }
        let ids = routing(s.tokens, s.topk, s.experts, s.ranks, seed);
        let want = get_dispatch_layout(&ids, s.topk, s.experts, s.ranks, s.ranks_per_node)
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
        let f = gpu.function(kernels::LAYOUT, "uep_dispatch_layout")?;
        let got = compute(gpu, &f, &ids, s)?.map_err(|bad| {
            CudaError::Mismatch(format!(
                "the layout kernel rejected topk_idx entry {bad}, which the host accepted"
            ))
        })?;
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
        let idd = gpu
            .stream()
            .clone_htod(&ids)
            .map_err(driver("copying topk_idx"))?;
        let mut out = Out::new(gpu, s)?;
        let time = gpu.time(iters, || launch(gpu, &f, &idd, s, &mut out))?;
        let bytes = (ids.len() * 8 + s.tokens * s.ranks) as u64;
        Ok(Measured { seed, time, bytes })
    }

    /// The kernel's outputs as the host's type; `Err(i)` if it rejected entry `i`.
    fn read_back(
        gpu: &Gpu,
        s: RouteShape,
        out: &Out,
    ) -> Result<Result<DispatchLayout, u64>, CudaError> {
        let stream = gpu.stream();
        let bad = stream
            .clone_dtoh(&out.bad)
            .map_err(driver("copying the error word"))?[0];
        if bad != u64::MAX {
            return Ok(Err(bad));
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
        Ok(Ok(got))
    }
}
