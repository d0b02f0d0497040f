//! The arguments of `uep bench` and the inputs they describe: shared by the bench, the
//! soak, the peers' comparison and the sweep, which import them from here (and the
//! bench dispatches to them), so that no two of them depend on each other.

use std::path::{Path, PathBuf};

use uep_harness::workload::{self, JobShape, RankInput, Routing, TokenData, WorkloadSpec};

/// Which modes to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Modes {
    /// Layout, normal and low-latency.
    All,
    /// Layout and normal dispatch/combine.
    Normal,
    /// Low-latency dispatch/combine.
    Ll,
}

/// What runs the EP layer's kernels.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    /// CPU threads (`--threads` of them a rank).
    #[default]
    Host,
    /// The emulated GPU: uep's kernels (the GPU's sources built for the host) on CPU
    /// threads for the phases that have one, the host definitions for the rest.
    Emu,
    /// GPU 0 for the compute phases (layout, FP8 and NVFP4 casts, combine reduction)
    /// and FIFOs in pinned memory it maps; needs a build with `--features cuda`.
    Cuda,
}

/// `WHO@STEP`: a rank or node, and a soak step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct At {
    /// The rank or node.
    pub who: usize,
    /// The step (from 0).
    pub step: u64,
}

impl std::str::FromStr for At {
    type Err = String;
    fn from_str(s: &str) -> Result<At, String> {
        let bad = || format!("{s:?}: expected WHO@STEP, e.g. 3@20");
        let (who, step) = s.split_once('@').ok_or_else(bad)?;
        Ok(At {
            who: who.trim().parse().map_err(|_| bad())?,
            step: step.trim().parse().map_err(|_| bad())?,
        })
    }
}

/// Options of `uep bench` (defaults: the DeepSeek-V3 shape).
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Ranks (processes) to spawn on this machine.
    #[arg(long, default_value_t = 4)]
    pub ranks: usize,
    /// Nodes the ranks are grouped into.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Tokens per rank, normal mode.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Tokens per rank, low-latency mode.
    #[arg(long, default_value_t = 128)]
    pub ll_tokens: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub topk: usize,
    /// Experts in total.
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
    /// Send FP8 e4m3 (+ a scale per 128 channels) instead of bf16.
    #[arg(long)]
    pub fp8: bool,
    /// With --fp8: round scales up to powers of two (UE8M0) in low-latency dispatch;
    /// with --nvfp4: UE8M0 block scales instead of e4m3.
    #[arg(long)]
    pub round_scale: bool,
    /// Low-latency dispatch casts to NVFP4 (e2m1 with a scale byte per 16 channels and a
    /// global scale from every rank's largest magnitude); needs --mode ll.
    #[arg(long, conflicts_with = "fp8")]
    pub nvfp4: bool,
    /// Token routing: uniform, same-rank, one-expert, empty-ranks, mixed.
    #[arg(long, default_value = "uniform")]
    pub routing: Routing,
    /// Probability that a top-k slot is empty (-1).
    #[arg(long, default_value_t = 0.02)]
    pub drop_prob: f64,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Which modes to run.
    #[arg(long, value_enum, default_value_t = Modes::All)]
    pub mode: Modes,
    /// Timed iterations per op.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Untimed iterations per op before timing (the default touches every bank and
    /// low-latency buffer once, so first-touch page faults stay out of the numbers).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Pad normal-mode per-expert counts to a multiple of this.
    #[arg(long, default_value_t = 1)]
    pub expert_alignment: usize,
    /// Normal mode: dispatch steps after the first reuse the first step's handle (cached dispatch).
    #[arg(long)]
    pub cached: bool,
    /// Normal mode: pad outputs to this many rows: 0 (no padding) or ranks * tokens.
    #[arg(long, default_value_t = 0)]
    pub num_worst_tokens: usize,
    /// libfabric provider for ranks on other nodes (default: UEP_FI_PROVIDER or tcp;ofi_rxm).
    #[arg(long)]
    pub provider: Option<String>,
    /// Proxy threads per rank when there are several nodes (0: cores / ranks, at most 4).
    #[arg(long, default_value_t = 0)]
    pub proxy_threads: usize,
    /// Writes a proxy FIFO (one per peer on another node) keeps in flight (0: the
    /// proxy's default, 8; the paper runs 32 for low-latency traffic).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub writes_in_flight: usize,
    /// Inject faults into the network path: reorder, delay and split bursts of writes
    /// (seeded, reproducible).
    #[arg(long, value_name = "SEED")]
    pub faults: Option<u64>,
    /// TESTS ONLY: apply announcements and LL count signals as they arrive, without the
    /// ordering emulation or the partial-completion fence (shows that the emulation is
    /// what keeps results exact on unordered transports).
    #[arg(long, hide = true)]
    pub no_ordering_emulation: bool,
    /// Soak: this many steps (normal then low-latency each step, as --mode says),
    /// fresh tokens every step, every output verified; prints mismatches, faults
    /// injected and memory.
    #[arg(long, value_name = "STEPS", conflicts_with_all = ["cached", "inputs"])]
    pub soak: Option<u64>,
    /// Elastic mode (both modes): a rank found dead or unreachable is masked and the
    /// others go on; with --soak, each step is checked against the reference without
    /// the masked ranks.
    #[arg(long)]
    pub elastic: bool,
    /// With --soak: SIGKILL rank RANK at the start of step STEP (repeatable).
    #[arg(long, value_name = "RANK@STEP", requires = "soak")]
    pub kill: Vec<At>,
    /// With --soak: SIGKILL every rank of node NODE at the start of step STEP.
    #[arg(long, value_name = "NODE@STEP", requires = "soak")]
    pub kill_node: Vec<At>,
    /// With --elastic --soak: start a replacement of killed rank RANK at step STEP; it
    /// joins the running job and checks every step from there (repeatable).
    #[arg(long, value_name = "RANK@STEP", requires_all = ["soak", "elastic"])]
    pub rejoin: Vec<At>,
    /// With --elastic --soak: start a replacement of every rank of killed node NODE at
    /// step STEP (as --rejoin does for one rank).
    #[arg(long, value_name = "NODE@STEP", requires_all = ["soak", "elastic"])]
    pub rejoin_node: Vec<At>,
    /// With --elastic --soak: room for this many ranks (Mooncake's `max_group_size`);
    /// the ranks past --ranks are reserved, whole nodes of --ranks / --nodes, masked
    /// until a process joins as one (--grow). --experts must be a multiple of it.
    #[arg(long, value_name = "RANKS", requires_all = ["soak", "elastic"])]
    pub max_ranks: Option<usize>,
    /// With --max-ranks: start a process that joins as reserved rank RANK at step STEP
    /// (repeatable); from then on it checks every step as the founding ranks do.
    #[arg(long, value_name = "RANK@STEP", requires = "max_ranks")]
    pub grow: Vec<At>,
    /// With replacements: keep the job's door in shared memory on this host rather than
    /// in the launcher's store (which every host reaches, and the default).
    #[arg(long)]
    pub door_in_shm: bool,
    /// With --elastic --soak: victims, steps and moments (inside calls and agreement
    /// rounds) drawn from SEED; every survivor checks every step and reports a digest
    /// of every mask it agreed on, which must be the same on all of them.
    #[arg(long, value_name = "SEED", requires_all = ["soak", "elastic"])]
    pub chaos: Option<u64>,
    /// Run once per value of one parameter (KEY=V1,V2,..., e.g. tokens=1,8,32,128,512,4096,
    /// ranks=2,3,4, hidden=...) and write sweep-KEY.csv and sweep-KEY.svg.
    #[arg(long, value_name = "KEY=V1,V2,...")]
    pub sweep: Option<String>,
    /// Directory for --sweep's CSV and SVG.
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub sweep_out: PathBuf,
    /// Skip measuring the machine's limits (memcpy of the same bytes, a raw stream of
    /// transport writes) that the table prints next to each op.
    #[arg(long)]
    pub no_limits: bool,
    /// Largest write the proxy posts for a packet to another node (default 1 MiB; a
    /// token row's size, e.g. 14336, sends one write per row, unbatched).
    #[arg(long, value_name = "BYTES")]
    pub net_write_bytes: Option<usize>,
    /// Benchmark comparison only: every wait busy-spins (as a GPU kernel would) instead
    /// of spinning, then yielding, then sleeping.
    #[arg(long)]
    pub spin_waits: bool,
    /// Low-latency combine from rows of the caller's own, copied into the packets for
    /// other nodes, instead of from the combine buffer the experts wrote (DeepEP's
    /// `zero_copy`, the default).
    #[arg(long)]
    pub ll_combine_copy: bool,
    /// Draw new tokens and routing for every step (verifying every step), instead of
    /// repeating one set.
    #[arg(long, conflicts_with_all = ["cached", "inputs"])]
    pub fresh: bool,
    /// Kernel threads per rank (0: cores / ranks).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// What runs the kernels.
    #[arg(long, value_enum, default_value_t = DeviceKind::Host)]
    pub device: DeviceKind,
    /// Deadline of every wait, seconds (default: UEP_TIMEOUT_S or 100).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Read each rank's x, topk_idx, topk_weights from DIR/rank{r}/*.npy.
    #[arg(long, value_name = "DIR")]
    pub inputs: Option<PathBuf>,
    /// Write every output as .npy to DIR/rank{r}/.
    #[arg(long, value_name = "DIR")]
    pub dump: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also run the peer a user would write without an EP library, alternating with
    /// uep on the same inputs: the Megatron-style dispatcher over Open MPI's
    /// MPI_Alltoallv (shared memory on one node, TCP across emulated nodes).
    #[arg(long, conflicts_with_all = ["soak", "sweep", "inputs"])]
    pub peers: bool,
    /// With --peers: alternating rounds (uep, MPI, uep, ...).
    #[arg(long, default_value_t = 3, requires = "peers")]
    pub rounds: usize,
}

pub(crate) fn validate(args: &BenchArgs) -> anyhow::Result<()> {
    let bad = |m: String| Err(anyhow::anyhow!(m));
    if args.ranks == 0 || args.nodes == 0 || args.ranks % args.nodes != 0 {
        return bad(format!(
            "--ranks ({}) must be a positive multiple of --nodes ({})",
            args.ranks, args.nodes
        ));
    }
    let room = validate_room(args)?;
    if args.experts % room != 0 {
        return bad(format!(
            "--experts ({}) must be a multiple of --ranks ({}) and --max-ranks ({room})",
            args.experts, args.ranks
        ));
    }
    if (args.fp8 || args.nvfp4) && args.hidden % 128 != 0 {
        return bad(format!(
            "--fp8 and --nvfp4 need --hidden to be a multiple of 128, got {}",
            args.hidden
        ));
    }
    if args.nvfp4 && (args.mode != Modes::Ll || args.soak.is_some()) {
        return bad(
            "--nvfp4 is a low-latency cast, as DeepEP's: it needs --mode ll (and takes no --soak)"
                .into(),
        );
    }
    if args.num_worst_tokens > 0 && args.num_worst_tokens != args.ranks * args.tokens {
        return bad(format!(
            "--num-worst-tokens ({}) must be 0 or ranks * tokens = {} (the most a rank can receive, and the Buffer's room)",
            args.num_worst_tokens,
            args.ranks * args.tokens
        ));
    }
    if args.iters == 0 {
        return bad("--iters must be at least 1".into());
    }
    if !(0.0..=1.0).contains(&args.drop_prob) {
        return bad(format!(
            "--drop-prob must be in [0, 1], got {}",
            args.drop_prob
        ));
    }
    validate_deaths(args)
}

/// The job's room (`--max-ranks`, else `--ranks`), and the reserved ranks `--grow` names.
fn validate_room(args: &BenchArgs) -> anyhow::Result<usize> {
    let (room, per_node) = (
        args.max_ranks.unwrap_or(args.ranks),
        args.ranks / args.nodes,
    );
    if room < args.ranks || room % per_node != 0 {
        anyhow::bail!(
            "--max-ranks ({room}) must be at least --ranks ({}), in whole nodes of {per_node}",
            args.ranks
        );
    }
    if let Some(g) = args
        .grow
        .iter()
        .find(|g| !(args.ranks..room).contains(&g.who))
    {
        anyhow::bail!(
            "--grow {}@{}: the reserved ranks are {}..{room}",
            g.who,
            g.step,
            args.ranks
        );
    }
    Ok(room)
}

/// The victims (`--kill`, `--kill-node`) and their replacements (`--rejoin`,
/// `--rejoin-node`): ranks and nodes that exist, each replacement after its death.
fn validate_deaths(args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(k) = args.kill.iter().find(|k| k.who >= args.ranks) {
        anyhow::bail!(
            "--kill {}@{}: there are {} ranks",
            k.who,
            k.step,
            args.ranks
        );
    }
    if let Some(k) = args.kill_node.iter().find(|k| k.who >= args.nodes) {
        anyhow::bail!(
            "--kill-node {}@{}: there are {} nodes",
            k.who,
            k.step,
            args.nodes
        );
    }
    let before = |kills: &[At], j: &At| kills.iter().any(|k| k.who == j.who && k.step < j.step);
    if let Some(j) = args.rejoin.iter().find(|j| !before(&args.kill, j)) {
        anyhow::bail!(
            "--rejoin {}@{}: rank {} is not killed (--kill) before step {}",
            j.who,
            j.step,
            j.who,
            j.step
        );
    }
    if let Some(j) = args
        .rejoin_node
        .iter()
        .find(|j| !before(&args.kill_node, j))
    {
        anyhow::bail!(
            "--rejoin-node {}@{}: node {} is not killed (--kill-node) before step {}",
            j.who,
            j.step,
            j.who,
            j.step
        );
    }
    Ok(())
}

/// Inputs of every rank for one mode (each rank rebuilds all of them: the reference
/// needs every sender's tokens).
pub(crate) fn make_inputs(
    args: &BenchArgs,
    shape: &JobShape,
    tokens: usize,
    salt: u64,
) -> anyhow::Result<Vec<RankInput>> {
    if let Some(dir) = &args.inputs {
        return (0..shape.num_ranks)
            .map(|r| read_inputs(dir, r, shape))
            .collect();
    }
    let spec = WorkloadSpec {
        shape: *shape,
        tokens_per_rank: tokens,
        routing: args.routing,
        drop_prob: args.drop_prob,
        fp8_input: false,
        seed: args.seed ^ salt,
    };
    Ok(workload::generate_all(&spec)?)
}

/// Rank `rank`'s inputs from `dir/rank{rank}/` (`x.npy`, `topk_idx.npy`,
/// `topk_weights.npy`); an error names the file and what is wrong with it.
fn read_inputs(dir: &Path, rank: usize, shape: &JobShape) -> anyhow::Result<RankInput> {
    use anyhow::Context;
    use uep_harness::npy::NpyArray;
    let d = dir.join(format!("rank{rank}"));
    // The npy errors name the file; the path in front of the others.
    let context = |path: &Path| format!("rank {rank}'s inputs: {}", path.display());
    let read = |name: &str| -> anyhow::Result<(NpyArray, PathBuf)> {
        let path = d.join(name);
        let array = NpyArray::read(&path).with_context(|| format!("rank {rank}'s inputs"))?;
        Ok((array, path))
    };
    let (x, path) = read("x.npy")?;
    let hidden = x.shape.last().copied().unwrap_or(0);
    if hidden != shape.hidden {
        return Err(anyhow::anyhow!(
            "{}: hidden is {hidden}, but --hidden is {}",
            context(&path),
            shape.hidden
        ));
    }
    let x = x.into_bf16().with_context(|| context(&path))?;
    let (topk_idx, path) = read("topk_idx.npy")?;
    let topk_idx = topk_idx.into_i64().with_context(|| context(&path))?;
    let (topk_weights, path) = read("topk_weights.npy")?;
    let topk_weights = topk_weights.into_f32().with_context(|| context(&path))?;
    let t = x.len() / shape.hidden;
    if topk_idx.len() != t * shape.topk || topk_weights.len() != t * shape.topk {
        return Err(anyhow::anyhow!(
            "rank {rank}'s inputs: {}: topk_idx/topk_weights must be [{t}, {}] (tokens of x.npy, --topk)",
            d.display(),
            shape.topk
        ));
    }
    Ok(RankInput {
        num_tokens: t,
        x: TokenData::Bf16(x),
        topk_idx,
        topk_weights,
    })
}

/// Salt of step `step`'s inputs: step 0 uses the base seed; `--fresh` steps draw anew.
pub(crate) fn step_salt(mode_salt: u64, step: u64) -> u64 {
    mode_salt ^ step.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}
