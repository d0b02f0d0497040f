//! `uep bench`: run layout, normal and low-latency dispatch/combine on real ranks,
//! verify every result against the sequential reference, and print the numbers.
//!
//! Run without a launcher's environment, it spawns `--ranks` copies of itself (one OS
//! process per rank) and waits for them; each copy finds it has `RANK` etc. set and
//! runs as one rank. Under torchrun / mpirun / srun it runs as a rank directly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use half::bf16;
use uep_bootstrap::{EnvSource, Group, LaunchSpec, WorldInfo};
use uep_ep::device::{Device, KernelPhases};
use uep_ep::{Buffer, Cast, CombineArgs, DispatchArgs, LlCombineInput, LlDispatchArgs};
use uep_harness::case::{identity_expert, LlCase, NormalCase, ScaleLayout};
use uep_harness::check::Mismatches;
use uep_harness::workload::{JobShape, RankInput, TokenData};

use crate::args::{make_inputs, step_salt, validate};
pub use crate::args::{At, BenchArgs, Modes};
use crate::report::{gbps, render_json, render_table, OpReport, Progress, Samples};
use crate::setup::{open_buffer, Setup};
use crate::soak::Verified;

/// Run `uep bench`: as the launcher (spawning ranks) or as one rank.
pub fn run(args: &BenchArgs) -> anyhow::Result<bool> {
    if let Some(spec) = &args.sweep {
        return crate::sweep::run_sweep(spec, &crate::sweep::base_args_from_env(), &args.sweep_out);
    }
    if std::env::var_os("RANK").is_some()
        || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
        || std::env::var_os("SLURM_PROCID").is_some()
    {
        return run_rank(args);
    }
    validate(args)?;
    if args.peers {
        return crate::peers::run(args, args.rounds.max(1));
    }
    let spec = LaunchSpec {
        ranks: args.ranks,
        nodes: args.nodes,
        program: std::env::current_exe()?,
        args: std::env::args_os().skip(1).collect(),
        env: Vec::new(),
        timeout: None,
    };
    // Ranks told to die do; in elastic mode the others must go on, not be stopped by
    // the launcher's grace period after the first death.
    let victims = crate::chaos::all_victims(args);
    let grace = if args.elastic && !victims.is_empty() {
        Duration::from_secs(24 * 3600)
    } else {
        uep_bootstrap::DEFAULT_GRACE
    };
    // Victims note the moment they die here, for the survivors' death → masked times.
    let deaths = std::env::temp_dir().join(format!("uep-deaths-{}", std::process::id()));
    let mut spec = spec;
    if !victims.is_empty() {
        std::fs::create_dir_all(&deaths)?;
        let dir = deaths.to_string_lossy().into_owned();
        spec.env.push((crate::chaos::DEATHS_VAR.into(), dir));
    }
    let outcome = uep_bootstrap::launch_local_with_grace(&spec, grace);
    let _ = std::fs::remove_dir_all(&deaths);
    let outcome = outcome?;
    let mut ok = true;
    for (r, s) in outcome.statuses.iter().enumerate() {
        if victims.contains(&r) {
            eprintln!("uep bench: rank {r} {s} (a victim of --kill or --chaos)");
        } else if !s.success() {
            eprintln!("uep bench: rank {r} {s}");
            ok = false;
        }
    }
    Ok(ok)
}

struct Timer {
    samples: Samples,
    warmup: usize,
    seen: usize,
}

impl Timer {
    fn new(warmup: usize, iters: usize) -> Self {
        Timer {
            samples: Samples::with_capacity(iters),
            warmup,
            seen: 0,
        }
    }
    fn record(&mut self, d: Duration) {
        if self.seen >= self.warmup {
            self.samples.push(d);
        }
        self.seen += 1;
    }
}

/// What one rank measured for one op, gathered to rank 0.
struct Measured {
    op: &'static str,
    mode: &'static str,
    tokens: usize,
    bytes: u64,
    /// Of `bytes`, what goes to ranks on other nodes (through the proxy).
    net_bytes: u64,
    /// What this rank handed to its proxy per iteration (measured).
    wire_bytes: u64,
    /// The phases that ran as kernels on this rank's device.
    kernels: KernelPhases,
    timer: Timer,
}

fn run_rank(args: &BenchArgs) -> anyhow::Result<bool> {
    let info = WorldInfo::from_env()?;
    let timeout = args
        .timeout
        .map(Duration::from_secs_f64)
        .or_else(uep_ep::timeout_from_env);
    // A replacement of a killed rank (`--rejoin`) finds the job at its door instead:
    // the rendezvous is over.
    let group = match crate::rejoin::started_as_replacement() {
        None => Some(Group::connect(
            &info,
            timeout.unwrap_or(Duration::from_secs(60)),
        )?),
        Some(_) => {
            crate::rejoin::arm_own_death(info.rank);
            None
        }
    };
    // The job's room: its ranks, and those reserved for processes that join later.
    let world = args
        .max_ranks
        .unwrap_or(info.world_size)
        .max(info.world_size);
    // uep's own launcher runs every rank on this host and says how many form a node
    // (`--nodes`); under another launcher the Buffer finds the nodes from the hosts.
    let emulated = (info.source == EnvSource::Uep).then_some(info.local_world_size);
    let mut shape = JobShape {
        num_ranks: world,
        ranks_per_node: emulated.unwrap_or(info.local_world_size),
        hidden: args.hidden,
        topk: args.topk,
        num_experts: args.experts,
    };
    let (run_normal, run_ll) = (args.mode != Modes::Ll, args.mode != Modes::Normal);
    let normal_inputs = if run_normal {
        make_inputs(args, &shape, args.tokens, 0)?
    } else {
        Vec::new()
    };
    let ll_inputs = if run_ll {
        make_inputs(args, &shape, args.ll_tokens, 0x11)?
    } else {
        Vec::new()
    };
    let max_tokens = |inputs: &[RankInput]| inputs.iter().map(|i| i.num_tokens).max().unwrap_or(0);
    let (max_normal, max_ll) = (max_tokens(&normal_inputs), max_tokens(&ll_inputs));
    // The soak's outputs first: a replacement is ready to serve when it is let in.
    let verified = (args.soak.is_some()).then(|| Verified::new(args, shape, max_ll, info.rank));
    let (mut buffer, setup, joined) =
        open_buffer(args, &info, group, emulated, timeout, max_normal, max_ll)?;
    shape.ranks_per_node = buffer.topology().ranks_per_node;
    if let (Some(steps), Some(verified)) = (args.soak, verified) {
        return crate::soak::run(&mut buffer, args, verified, steps, joined);
    }
    let rank = buffer.rank();
    let steps = (args.warmup + args.iters) as u64;
    let total = steps * (run_normal as u64 * 3 + run_ll as u64 * 2);
    let mut run = Run {
        args,
        shape,
        rank,
        steps,
        progress: Progress::new(total, "uep bench", rank == 0 && !args.json),
        bad: Mismatches::new(rank),
        token_bytes: token_bytes(args),
        device: setup.kernels.clone(),
    };
    let mut measured = Vec::new();
    if run_normal {
        measured.extend(run.normal(&mut buffer, normal_inputs)?);
    }
    if run_ll {
        measured.extend(run.ll(&mut buffer, ll_inputs, max_ll)?);
    }
    run.progress.finish();
    report(args, &buffer, &info, &setup, &measured, &run.bad)
}

/// Bytes of one dispatched token as sent: its row, with its scales and metadata where
/// it is cast.
fn token_bytes(args: &BenchArgs) -> u64 {
    let h = args.hidden;
    match (args.fp8, args.nvfp4) {
        (true, _) => (h + h / 128 * 4 + 16) as u64,
        (_, true) => (h / 2 + h / 64 * 4 + 16) as u64,
        _ => (2 * h) as u64,
    }
}

/// What a low-latency dispatch of `inputs` (every rank's) casts to: FP8, or NVFP4 with
/// the global scale a caller computes over every rank's tokens (`448 * 6 / amax`), or
/// nothing.
fn ll_cast(args: &BenchArgs, inputs: &[RankInput]) -> Option<Cast> {
    if !args.nvfp4 {
        return Cast::fp8_if(args.fp8, args.round_scale);
    }
    let amax = (inputs.iter())
        .filter_map(|i| i.x.as_bf16())
        .flatten()
        .map(|v| v.to_f32().abs())
        .filter(|v| v.is_finite())
        .fold(0f32, f32::max);
    Some(Cast::Nvfp4(uep_ep::quant::Nvfp4 {
        global_scale: 448.0 * 6.0 / amax.max(1e-12),
        ue8m0: args.round_scale,
    }))
}

/// One rank's benchmark run: the flags, the step count and what it found wrong.
/// What a step does besides running: whether it is timed, checked, the last.
#[derive(Clone, Copy, Debug)]
struct Step {
    timed: bool,
    check: bool,
    last: bool,
}

/// What a run measures over its timed steps: each op's times and the bytes it handed
/// to the proxy, and the token copies the steps move (each op moves every copy once,
/// at its own bytes a copy).
struct Tally {
    ops: Vec<OpTally>,
    /// Token copies dispatched, and of them those that cross the network.
    copies: u64,
    net_copies: u64,
}

/// One op of a [`Tally`].
struct OpTally {
    op: &'static str,
    mode: &'static str,
    timer: Timer,
    /// Bytes of one token copy.
    copy_bytes: u64,
    /// Bytes handed to the proxy.
    wire: u64,
    /// The phases that ran as kernels in the op's calls.
    kernels: KernelPhases,
}

impl Tally {
    /// `(op, mode, bytes a copy)` of each op, in order.
    fn new(args: &BenchArgs, ops: &[(&'static str, &'static str, u64)]) -> Self {
        let ops = (ops.iter())
            .map(|&(op, mode, copy_bytes)| OpTally {
                op,
                mode,
                timer: Timer::new(args.warmup, args.iters),
                copy_bytes,
                wire: 0,
                kernels: KernelPhases::default(),
            })
            .collect();
        Tally {
            ops,
            copies: 0,
            net_copies: 0,
        }
    }

    /// Counts the copies a step of `layout` moves from `rank` (a token crosses the
    /// network once per other node it goes to).
    fn count(&mut self, layout: &uep_ep::DispatchLayout, rank: usize, lws: usize) {
        self.copies += layout
            .num_tokens_per_rank
            .iter()
            .map(|&n| n as u64)
            .sum::<u64>();
        self.net_copies += (0..layout.num_ranks / lws)
            .filter(|&m| m != rank / lws)
            .map(|m| layout.num_tokens_per_rdma_rank[m] as u64)
            .sum::<u64>();
    }

    /// Op `i` took `elapsed`, the proxy was handed `wire` bytes more, and `kernels` ran
    /// as kernels.
    fn record(&mut self, i: usize, elapsed: Duration, wire: Option<u64>, kernels: KernelPhases) {
        self.ops[i].timer.record(elapsed);
        self.ops[i].wire += wire.unwrap_or(0);
        self.ops[i].kernels = self.ops[i].kernels.union(kernels);
    }

    /// Every op, per iteration.
    fn measured(self, t_n: usize, iters: usize) -> Vec<Measured> {
        let (copies, net, iters) = (self.copies, self.net_copies, iters as u64);
        (self.ops.into_iter())
            .map(|o| Measured {
                op: o.op,
                mode: o.mode,
                tokens: t_n,
                bytes: copies * o.copy_bytes / iters,
                net_bytes: net * o.copy_bytes / iters,
                wire_bytes: o.wire / iters,
                kernels: o.kernels,
                timer: o.timer,
            })
            .collect()
    }
}

/// What a normal-mode run reuses across steps: the experts' rows, the cached handle,
/// the combine's outputs.
struct NormalScratch {
    y: Vec<bf16>,
    cached: Option<uep_ep::NormalHandle>,
    combined: uep_ep::CombineOutput,
}

struct Run<'a> {
    args: &'a BenchArgs,
    shape: JobShape,
    rank: usize,
    steps: u64,
    progress: Progress,
    bad: Mismatches,
    /// Bytes of one dispatched token (with its FP8 scales and metadata).
    token_bytes: u64,
    /// The Buffer's device, which says after each op what ran as kernels.
    device: Arc<dyn Device>,
}

impl Run<'_> {
    /// What step `i` does besides running: timed past the warm-up, checked first and
    /// last (every step with `--fresh`).
    fn step(&self, i: u64) -> Step {
        Step {
            timed: i >= self.args.warmup as u64,
            check: self.args.fresh || i == 0 || i + 1 == self.steps,
            last: i + 1 == self.steps,
        }
    }

    /// Normal mode: layout, dispatch, identity experts, combine, every step; checks
    /// the first and last step (every step with `--fresh`).
    fn normal(
        &mut self,
        buffer: &mut Buffer,
        inputs: Vec<RankInput>,
    ) -> anyhow::Result<Vec<Measured>> {
        let (args, shape, rank) = (self.args, self.shape, self.rank);
        let mut case = NormalCase::new(inputs, &shape, rank, args.fp8, args.expert_alignment)?;
        let t_n = case.sent[rank].num_tokens;
        let row = 2 * args.hidden as u64;
        let ops = [
            ("layout", "layout", 0),
            ("dispatch", "normal", self.token_bytes),
            ("combine", "normal", row),
        ];
        let mut tally = Tally::new(args, &ops);
        let mut scratch = NormalScratch {
            y: Vec::new(),
            cached: None,
            // Outputs live across steps, as a framework's allocator would hand them out.
            combined: uep_ep::CombineOutput {
                combined_x: vec![bf16::ZERO; t_n * args.hidden],
                combined_topk_weights: Some(vec![0f32; t_n * args.topk]),
            },
        };
        for step in 0..self.steps {
            if args.fresh && step > 0 {
                let inputs = make_inputs(args, &shape, args.tokens, step_salt(0, step))?;
                case = NormalCase::new(inputs, &shape, rank, args.fp8, args.expert_alignment)?;
            }
            let step = self.step(step);
            if step.timed {
                tally.count(&case.layout, rank, shape.ranks_per_node);
            }
            self.normal_layout(buffer, &case, &mut tally)?;
            let (handle, w, dump) =
                self.normal_dispatch(buffer, &case, step, &mut tally, &mut scratch)?;
            let combined = (handle, w.as_deref(), dump);
            self.normal_combine(buffer, &case, step, combined, &mut tally, &mut scratch)?;
        }
        Ok(tally.measured(t_n, args.iters))
    }

    /// One timed layout, checked.
    fn normal_layout(
        &mut self,
        buffer: &mut Buffer,
        case: &NormalCase,
        tally: &mut Tally,
    ) -> anyhow::Result<()> {
        self.progress.set_message("layout");
        buffer.barrier()?;
        self.device.take_kernel_phases();
        let start = Instant::now();
        let l = buffer.get_dispatch_layout(&case.sent[self.rank].topk_idx)?;
        tally.record(0, start.elapsed(), None, self.device.take_kernel_phases());
        let want = &case.layout.is_token_in_rank;
        self.bad
            .eq("layout.is_token_in_rank", &l.is_token_in_rank, want);
        self.progress.inc(1);
        Ok(())
    }

    /// One timed dispatch (through the cached handle after the first with
    /// `--cached`), checked, and the identity experts' rows into `scratch.y`: the
    /// handle, the received weights and, on the last step with `--dump`, the dump.
    fn normal_dispatch(
        &mut self,
        buffer: &mut Buffer,
        case: &NormalCase,
        step: Step,
        tally: &mut Tally,
        scratch: &mut NormalScratch,
    ) -> anyhow::Result<(
        uep_ep::NormalHandle,
        Option<Vec<f32>>,
        Option<crate::dump::Dump>,
    )> {
        let (args, h, mine) = (self.args, self.args.hidden, &case.sent[self.rank]);
        self.progress.set_message("dispatch");
        buffer.barrier()?;
        let x = case.x(self.rank);
        let args_d = match &scratch.cached {
            Some(handle) => DispatchArgs::new(x).cached(handle),
            None => DispatchArgs::new(x)
                .topk(&mine.topk_idx, Some(&mine.topk_weights))
                .layout(&case.layout),
        }
        .expert_alignment(args.expert_alignment)
        .num_worst_tokens(args.num_worst_tokens);
        let sent = buffer.net_bytes_sent();
        self.device.take_kernel_phases();
        let start = Instant::now();
        let out = buffer.dispatch(args_d)?;
        let took = start.elapsed();
        if step.check {
            uep_harness::check::normal_dispatch(&mut self.bad, &out, &case.expected, h);
        }
        let dump = (args.dump.is_some() && step.last).then(|| crate::dump::Dump::normal(&out, h));
        let n = out.handle.num_recv_tokens;
        scratch.y.resize(n * h, bf16::ZERO);
        identity_expert(
            out.recv_x,
            0..n,
            h,
            ScaleLayout::RowMajor,
            None,
            &mut scratch.y,
        )?;
        let w = out.recv_topk_weights.map(<[f32]>::to_vec);
        let handle = out.handle;
        if args.cached && scratch.cached.is_none() {
            scratch.cached = Some(handle.clone());
        }
        tally.record(
            1,
            took,
            step.timed.then(|| buffer.net_bytes_sent() - sent),
            self.device.take_kernel_phases(),
        );
        self.progress.inc(1);
        Ok((handle, w, dump))
    }

    /// One timed combine of `scratch.y` through `handle`, checked (and dumped).
    fn normal_combine(
        &mut self,
        buffer: &mut Buffer,
        case: &NormalCase,
        step: Step,
        (handle, w, dump): (
            uep_ep::NormalHandle,
            Option<&[f32]>,
            Option<crate::dump::Dump>,
        ),
        tally: &mut Tally,
        scratch: &mut NormalScratch,
    ) -> anyhow::Result<()> {
        let args = self.args;
        self.progress.set_message("combine");
        buffer.barrier()?;
        let combined = &mut scratch.combined;
        let sent = buffer.net_bytes_sent();
        self.device.take_kernel_phases();
        let start = Instant::now();
        let out_w = (combined.combined_topk_weights.as_deref_mut()).filter(|_| w.is_some());
        let combine_args = CombineArgs {
            topk_weights: w,
            ..Default::default()
        };
        buffer.combine_into(
            &scratch.y,
            combine_args,
            &handle,
            &mut combined.combined_x,
            out_w,
        )?;
        let wire = step.timed.then(|| buffer.net_bytes_sent() - sent);
        tally.record(2, start.elapsed(), wire, self.device.take_kernel_phases());
        if step.check {
            let want = &case.expected_combine;
            self.bad
                .bits("combine.combined_x", &combined.combined_x, &want.0);
            let weights = combined
                .combined_topk_weights
                .as_ref()
                .filter(|_| w.is_some());
            if let (Some(got), Some(want)) = (weights, &want.1) {
                self.bad.bits("combine.combined_topk_weights", got, want);
            }
            if let (Some(mut dump), Some(dir)) = (dump, &args.dump) {
                let t_n = case.sent[self.rank].num_tokens;
                dump.bf16("combined_x", &[t_n, args.hidden], &combined.combined_x);
                if let Some(cw) = weights {
                    dump.f32("combined_topk_weights", &[t_n, args.topk], cw);
                }
                dump.write(dir, self.rank)?;
            }
        }
        self.progress.inc(1);
        Ok(())
    }

    /// Low-latency mode: dispatch, identity experts, combine, every step; checks the
    /// first and last step (every step with `--fresh`).
    fn ll(
        &mut self,
        buffer: &mut Buffer,
        inputs: Vec<RankInput>,
        max_ll: usize,
    ) -> anyhow::Result<Vec<Measured>> {
        let (args, shape, rank) = (self.args, self.shape, self.rank);
        let (world, lws) = (shape.num_ranks, shape.ranks_per_node);
        let cast = ll_cast(args, &inputs);
        let mut case = LlCase::new(rank, inputs, &shape, max_ll, cast)?;
        let t_n = case.inputs[rank].num_tokens;
        let epr = (args.experts / world) as i64;
        let ops = [
            ("ll_dispatch", "low_latency", self.token_bytes),
            ("ll_combine", "low_latency", 2 * args.hidden as u64),
        ];
        let mut tally = Tally::new(args, &ops);
        let mut y = vec![bf16::ZERO; args.experts / world * world * max_ll * args.hidden];
        for step in 0..self.steps {
            if args.fresh && step > 0 {
                let inputs = make_inputs(args, &shape, args.ll_tokens, step_salt(0x11, step))?;
                let cast = ll_cast(args, &inputs);
                case = LlCase::new(rank, inputs, &shape, max_ll, cast)?;
            }
            let step = self.step(step);
            if step.timed {
                let sent = case.inputs[rank].topk_idx.iter().filter(|&&e| e >= 0);
                tally.copies += sent.clone().count() as u64;
                let away = |&&e: &&i64| (e / epr) as usize / lws != rank / lws;
                tally.net_copies += sent.filter(away).count() as u64;
            }
            self.ll_step(buffer, &case, step, max_ll, &mut tally, &mut y)?;
        }
        Ok(tally.measured(t_n, args.iters))
    }

    /// One timed LL dispatch, the identity experts into the combine buffer (zero copy)
    /// or `y`, one timed LL combine; both checked (and dumped).
    fn ll_step(
        &mut self,
        buffer: &mut Buffer,
        case: &LlCase,
        step: Step,
        max_ll: usize,
        tally: &mut Tally,
        y: &mut [bf16],
    ) -> anyhow::Result<()> {
        let (args, h, mine) = (self.args, self.args.hidden, &case.inputs[self.rank]);
        let TokenData::Bf16(x) = &mine.x else {
            unreachable!("workload inputs are bf16")
        };
        self.progress.set_message("ll_dispatch");
        buffer.barrier()?;
        let sent = buffer.net_bytes_sent();
        self.device.take_kernel_phases();
        let start = Instant::now();
        let mut out =
            buffer.low_latency_dispatch(LlDispatchArgs::new(x, &mine.topk_idx).cast(case.cast))?;
        let took = start.elapsed();
        if step.check {
            uep_harness::check::ll_dispatch(&mut self.bad, &out, &case.expected, h);
        }
        let mut dump = (args.dump.is_some() && step.last).then(|| crate::dump::Dump::ll(&out, h));
        let rows_per_expert = self.shape.num_ranks * max_ll;
        // The experts write their outputs where the combine reads them: the combine
        // buffer (zero copy, as DeepEP's fast path), or rows of the caller's own.
        let zero_copy = !args.ll_combine_copy;
        let dst = match (zero_copy, out.combine_buffer.take()) {
            (true, Some(buffer)) => buffer,
            (true, None) => anyhow::bail!("no low-latency combine buffer after the dispatch"),
            (false, _) => &mut y[..],
        };
        for (le, &n) in out.recv_count.iter().enumerate() {
            let begin = le * rows_per_expert;
            let layout = ScaleLayout::ColumnMajor { rows_per_expert };
            let nvfp4 = match case.cast {
                Some(Cast::Nvfp4(n)) => Some(n),
                _ => None,
            };
            identity_expert(out.recv_x, begin..begin + n as usize, h, layout, nvfp4, dst)?;
        }
        let handle = out.handle;
        tally.record(
            0,
            took,
            step.timed.then(|| buffer.net_bytes_sent() - sent),
            self.device.take_kernel_phases(),
        );
        self.progress.inc(1);

        self.progress.set_message("ll_combine");
        buffer.barrier()?;
        let input = match zero_copy {
            true => LlCombineInput::ZeroCopy,
            false => LlCombineInput::Rows(y),
        };
        let sent = buffer.net_bytes_sent();
        self.device.take_kernel_phases();
        let start = Instant::now();
        let combined =
            buffer.low_latency_combine(input, &mine.topk_idx, &mine.topk_weights, &handle)?;
        tally.record(
            1,
            start.elapsed(),
            step.timed.then(|| buffer.net_bytes_sent() - sent),
            self.device.take_kernel_phases(),
        );
        if step.check {
            self.bad
                .bits("ll_combine.combined_x", &combined, &case.expected_combine);
            if let (Some(dump), Some(dir)) = (dump.as_mut(), &args.dump) {
                dump.bf16("ll_combined_x", &[mine.num_tokens, h], &combined);
                dump.write(dir, self.rank)?;
            }
        }
        self.progress.inc(1);
        Ok(())
    }
}

/// Gathers every rank's samples and verdict to rank 0, which measures the machine's
/// limits for the same bytes and prints the table (or JSON). Returns whether every
/// rank's outputs matched.
fn report(
    args: &BenchArgs,
    buffer: &Buffer,
    info: &WorldInfo,
    setup: &Setup,
    measured: &[Measured],
    bad: &Mismatches,
) -> anyhow::Result<bool> {
    let Some(merged) = gather(buffer, measured, bad)? else {
        return Ok(bad.count() == 0);
    };
    // Every rank when uep's launcher emulates nodes on one machine (they then share its
    // cores and memory, and so does the limit), a node's ranks on a cluster.
    let sharing = match info.source {
        EnvSource::Uep => buffer.num_ranks(),
        _ => buffer.topology().ranks_per_node,
    };
    let limits = match args.no_limits {
        true => Default::default(),
        false => machine_limits(
            args,
            setup,
            (buffer.num_ranks(), sharing),
            measured,
            &merged,
        ),
    };
    let reports = op_reports(args, setup, buffer, measured, &merged, &limits);
    if let Some(path) = std::env::var_os(crate::peers::REPORT_VAR) {
        // A job of `--peers`: the report is for the caller, not the terminal.
        std::fs::write(path, render_json(&reports))?;
    } else if args.json {
        println!("{}", render_json(&reports));
    } else {
        print_report(args, buffer, setup, &reports, merged.total_bad);
    }
    Ok(merged.total_bad == 0)
}

/// Every rank's samples and verdict, merged on rank 0.
struct Merged {
    /// Mismatching outputs over all ranks.
    total_bad: u64,
    /// Per op, over every rank.
    ops: Vec<MergedOp>,
}

/// One op over every rank: the samples, the sums of the bytes, network bytes and bytes
/// handed to the proxy, and the phases that ran as kernels on any rank.
#[derive(Default)]
struct MergedOp {
    samples: Samples,
    bytes: u64,
    net: u64,
    wire: u64,
    kernels: KernelPhases,
}

/// Sends this rank's verdict and samples to rank 0 (every rank prints its own
/// mismatches); rank 0 gets them all merged, the others `None`.
fn gather(
    buffer: &Buffer,
    measured: &[Measured],
    bad: &Mismatches,
) -> anyhow::Result<Option<Merged>> {
    let mut blob = Vec::new();
    blob.extend_from_slice(&(bad.count() as u64).to_le_bytes());
    for m in measured {
        blob.extend_from_slice(&m.bytes.to_le_bytes());
        blob.extend_from_slice(&m.net_bytes.to_le_bytes());
        blob.extend_from_slice(&m.wire_bytes.to_le_bytes());
        blob.extend_from_slice(&u64::from(m.kernels.bits()).to_le_bytes());
        blob.extend_from_slice(&(m.timer.samples.len() as u64).to_le_bytes());
        for d in m.timer.samples.durations() {
            blob.extend_from_slice(&(d.as_nanos() as u64).to_le_bytes());
        }
    }
    let all = buffer.control_plane().all_gather(&blob)?;
    bad.print();
    if buffer.rank() != 0 {
        return Ok(None);
    }
    let mut merged = Merged {
        total_bad: 0,
        ops: (measured.iter())
            .map(|_| MergedOp {
                samples: Samples::new(),
                ..Default::default()
            })
            .collect(),
    };
    for b in &all {
        let mut words = b
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        merged.total_bad += words.next().unwrap_or(1);
        for op in merged.ops.iter_mut() {
            op.bytes += words.next().unwrap_or(0);
            op.net += words.next().unwrap_or(0);
            op.wire += words.next().unwrap_or(0);
            let ran = KernelPhases::from_bits(words.next().unwrap_or(0) as u32);
            op.kernels = op.kernels.union(ran);
            let n = words.next().unwrap_or(0);
            for _ in 0..n {
                op.samples
                    .push(Duration::from_nanos(words.next().unwrap_or(0)));
            }
        }
    }
    Ok(Some(merged))
}

/// The machine's limit (GB/s) for each op's bytes a rank (of `world`), measured here
/// while the other ranks wait, with `sharing` copies and raw transport streams at once (as many
/// as this machine runs ranks); `None` where the op moves nothing.
fn machine_limits(
    args: &BenchArgs,
    setup: &Setup,
    (world, sharing): (usize, usize),
    measured: &[Measured],
    merged: &Merged,
) -> std::collections::HashMap<&'static str, Option<f64>> {
    let world = world as u64;
    let mut limits = std::collections::HashMap::new();
    for (m, op) in measured.iter().zip(&merged.ops) {
        let (bytes, net) = (op.bytes / world, op.net / world);
        if bytes == 0 {
            continue;
        }
        let intra = bytes - net;
        let mut seconds = 0.0;
        if intra > 0 {
            let gbps =
                uep_harness::limits::memcpy_gbps(intra, 2 * args.hidden, setup.threads, sharing);
            seconds += intra as f64 / (gbps * 1e9);
        }
        if net > 0 {
            let msg = (net as usize).min(1 << 20);
            match uep_transport::stream::transport_streams_gbps(&setup.provider, net, msg, sharing)
            {
                Ok(gbps) => seconds += net as f64 / (gbps * 1e9),
                Err(e) => {
                    eprintln!("uep bench: no transport limit for {}: {e}", m.op);
                    continue;
                }
            }
        }
        limits.insert(m.op, (seconds > 0.0).then(|| bytes as f64 / seconds / 1e9));
    }
    limits
}

/// A row of the table for each op: per rank bytes, rates, the limit, the times.
fn op_reports(
    args: &BenchArgs,
    setup: &Setup,
    buffer: &Buffer,
    measured: &[Measured],
    merged: &Merged,
    limits: &std::collections::HashMap<&'static str, Option<f64>>,
) -> Vec<OpReport> {
    let world = buffer.num_ranks();
    let dtype = match (args.fp8, args.nvfp4) {
        (true, _) => "fp8",
        (_, true) => "nvfp4",
        _ => "bf16",
    };
    let device = &setup.device;
    let mut reports = Vec::new();
    for (m, op) in measured.iter().zip(&merged.ops) {
        let (samples, wire) = (&op.samples, op.wire);
        let s = samples.summary().expect("iters >= 1");
        let (bytes, net) = (op.bytes / world as u64, op.net / world as u64);
        reports.push(OpReport {
            op: m.op.into(),
            mode: m.mode.into(),
            ranks: world,
            nodes: buffer.topology().num_nodes,
            tokens: m.tokens,
            hidden: args.hidden,
            dtype: match m.op {
                "layout" => "-",
                op if op.ends_with("combine") => "bf16",
                _ => dtype,
            }
            .into(),
            bytes_per_rank: bytes,
            net_bytes_per_rank: net,
            net_wire_bytes_per_rank: wire / world as u64,
            gbps: gbps(bytes, s.avg_us),
            net_gbps: gbps(net, s.avg_us),
            limit_gbps: limits.get(&m.op).copied().flatten(),
            avg_us: s.avg_us,
            min_us: s.min_us,
            max_us: s.max_us,
            p50_us: s.p50_us,
            p99_us: s.p99_us,
            iters: samples.len() / world,
            verified: merged.total_bad == 0,
            device: device.to_string(),
            kernel_phases: op.kernels.names().into_iter().map(String::from).collect(),
        });
    }
    reports
}

/// The table, with the job's shape above it and the kernels' pushed commands and the
/// verdict below.
fn print_report(
    args: &BenchArgs,
    buffer: &Buffer,
    setup: &Setup,
    reports: &[OpReport],
    total_bad: u64,
) {
    println!(
        "uep bench: {} ranks x {} node(s), hidden {}, top-k {}, {} experts, routing {}, device {}, {} kernel thread(s)/rank",
        buffer.num_ranks(),
        buffer.topology().num_nodes,
        args.hidden,
        args.topk,
        args.experts,
        args.routing,
        setup.device,
        setup.threads
    );
    let mut ran = reports
        .iter()
        .flat_map(|r| r.kernel_phases.iter())
        .collect::<Vec<_>>();
    ran.sort_by_key(|p| {
        uep_ep::device::Phase::ALL
            .iter()
            .position(|q| q.name() == p.as_str())
    });
    ran.dedup();
    if !ran.is_empty() {
        let ran: Vec<&str> = ran.iter().map(|p| p.as_str()).collect();
        println!(
            "kernel phases on device {}: {} (the others on CPU threads)",
            setup.device,
            ran.join(", ")
        );
    }
    print!("{}", render_table(reports));
    let (cmds, kernel_time) = buffer.kernel_pushes();
    if cmds > 0 {
        // Commands pushed by the kernels of rank 0 while they packed (one per
        // network write of up to --net-write-bytes), over the time those launches ran.
        println!(
            "kernel-pushed commands (rank 0): {cmds} in {:.1} ms of packing kernels ({:.0} commands/s, one per write of up to {} bytes)",
            kernel_time.as_secs_f64() * 1e3,
            cmds as f64 / kernel_time.as_secs_f64().max(1e-9),
            args.net_write_bytes.unwrap_or(uep_ep::DEFAULT_WRITE_BYTES)
        );
    }
    if total_bad == 0 {
        println!("verified: every output matches the sequential reference bit for bit");
    } else {
        println!("VERIFICATION FAILED: {total_bad} mismatching outputs (see rank messages above)");
    }
}
