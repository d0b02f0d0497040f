//! `uep bench --soak STEPS`: thousands of steps, fresh tokens and routing every step,
//! normal and low-latency modes alternating (or one of them, by `--mode`), every output
//! checked against the reference; at the end: steps done, mismatches, faults injected,
//! and memory at start and end.
//!
//! With `--elastic`, `--kill RANK@STEP` and `--kill-node NODE@STEP`, the victims SIGKILL
//! themselves at the start of that step; the survivors go on, each step checked
//! against the reference without the ranks masked in it, and report how long the step
//! of the kill took them (the recovery).

use std::time::{Duration, Instant};

use half::bf16;
use uep_ep::{Buffer, FirstCall, JoinPoint};
use uep_harness::check::Mismatches;
use uep_harness::step::{ll_step, normal_step, StepOpts};
use uep_harness::workload::JobShape;

use crate::args::{make_inputs, step_salt, BenchArgs, Modes};
use crate::chaos::{self, Rejoin};
use crate::rejoin::{started_as_replacement, Replacements};
use crate::report::Progress;

/// Resident and peak resident memory of this process, in KiB (`/proc/self/status`).
pub fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// What a survivor saw of the masking, and of ranks coming back.
#[derive(Debug, Default)]
struct Recovery {
    /// The first step that masked a rank, and how long it took this rank.
    first: Option<(u64, Duration)>,
    /// `--rejoin`: a replacement of each rank started, not back yet: since which step,
    /// and the longest step since.
    joining: Vec<(usize, u64, Duration)>,
    /// Ranks back: (rank, the first step it took part in, the longest step while it
    /// joined).
    back: Vec<Back>,
    /// This rank is a replacement: where and how fast it came back.
    joined: Option<Joined>,
}

/// A rank a replacement brought back, as a survivor saw it.
#[derive(Debug)]
struct Back {
    rank: usize,
    /// The first step it took part in.
    step: u64,
    /// The longest step from its replacement's start to that step, included (the
    /// replacement starts on the same cores).
    longest: Duration,
    /// That step (the first with it).
    first: Duration,
}

/// How a replacement came back.
#[derive(Debug)]
struct Joined {
    at: JoinPoint,
    /// Its process started → its Buffer is let in (returned from `Buffer::join`).
    let_in: Duration,
    /// Its process started → its first step with everyone done.
    served: Option<Duration>,
}

impl Joined {
    fn new(at: JoinPoint) -> Option<Joined> {
        let since = started_as_replacement()?.elapsed().unwrap_or_default();
        Some(Joined {
            at,
            let_in: since,
            served: None,
        })
    }
}

fn ms(d: &Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Recovery {
    /// The ranks back, and how this rank came back (if it is a replacement), for the
    /// JSON report.
    fn rejoins_json(&self) -> (serde_json::Value, serde_json::Value) {
        let back: Vec<serde_json::Value> = (self.back.iter())
            .map(|b| {
                serde_json::json!({"rank": b.rank, "back_at_step": b.step,
                    "longest_step_ms": ms(&b.longest), "first_step_with_it_ms": ms(&b.first)})
            })
            .collect();
        let joined = self.joined.as_ref().map(|j| {
            serde_json::json!({
                "at_step": j.at.step,
                "waited_at_door_ms": ms(&j.at.waited),
                "started_to_let_in_ms": ms(&j.let_in),
                "started_to_first_step_ms": j.served.as_ref().map(ms),
            })
        });
        (back.into(), joined.into())
    }

    /// The same, as text.
    fn print_rejoins(&self) {
        for b in &self.back {
            println!(
                "  rejoined:        rank {} back from step {}; longest step while it joined {:.0} \
                 ms, the first with it {:.0} ms",
                b.rank,
                b.step,
                ms(&b.longest),
                ms(&b.first)
            );
        }
        if let Some(j) = &self.joined {
            println!(
                "  joined:          at step {}: process started → let in {:.0} ms (waited at \
                 the door {:.1} ms), → first step served {:.0} ms",
                j.at.step,
                ms(&j.let_in),
                ms(&j.at.waited),
                j.served.as_ref().map_or(f64::NAN, ms)
            );
        }
    }

    /// After `step`, which took `took` and started the replacements of `started`:
    /// replacements are back once unmasked.
    fn note_step(&mut self, buffer: &Buffer, started: &[Rejoin], step: u64, took: Duration) {
        for j in started {
            self.joining.push((j.rank, step, Duration::ZERO));
        }
        let mask = buffer.low_latency_mask();
        for (r, since, longest) in std::mem::take(&mut self.joining) {
            let longest = longest.max(took);
            match mask[r] {
                true => self.joining.push((r, since, longest)),
                false => self.back.push(Back {
                    rank: r,
                    step,
                    longest,
                    first: took,
                }),
            }
        }
    }
}

/// Run the soak on this rank with `verified`'s outputs (made before the Buffer, so that
/// a replacement is ready to serve when it is let in), a replacement from where it
/// `joined`; rank 0 prints the summary. Returns whether every step matched.
pub fn run(
    buffer: &mut Buffer,
    args: &BenchArgs,
    mut verified: Verified<'_>,
    steps: u64,
    joined: Option<JoinPoint>,
) -> anyhow::Result<bool> {
    let rank = buffer.rank();
    verified.shape.ranks_per_node = buffer.topology().ranks_per_node;
    let shape = verified.shape;
    let first = joined.map_or(0, |j| j.step);
    // Let in at a low-latency dispatch: that step's normal half ran without it.
    let skip_normal = joined.is_some_and(|j| j.first == FirstCall::LowLatencyDispatch);
    let progress = Progress::new(
        steps - first.min(steps),
        "uep soak",
        rank == 0 && !args.json,
    );
    let started = Instant::now();
    let mut rss_start = 0;
    let mut recovery = Recovery {
        joined: joined.and_then(Joined::new),
        ..Recovery::default()
    };
    let kills = chaos::from_args(args);
    let mut replacements = Replacements::default();
    let plan = crate::rejoin::planned(args);
    for step in first..steps {
        die_if_victim(args, &shape, rank, step);
        chaos::arm(buffer, &kills, step)?;
        let due = crate::rejoin::due(buffer, &plan, step);
        replacements.start(buffer, &due, args)?;
        buffer.set_step(step);
        let step_start = Instant::now();
        let masked_before = buffer.low_latency_mask().iter().filter(|&&m| m).count();
        verified.step(buffer, step, !(skip_normal && step == first))?;
        let masked_now = buffer.low_latency_mask().iter().filter(|&&m| m).count();
        if masked_now > masked_before && recovery.first.is_none() {
            recovery.first = Some((step, step_start.elapsed()));
        }
        recovery.note_step(buffer, &due, step, step_start.elapsed());
        if let Some(j) = recovery.joined.as_mut().filter(|j| j.served.is_none()) {
            j.served = started_as_replacement().and_then(|t| t.elapsed().ok());
        }
        if step == 0 {
            // After the first step every buffer has been touched: growth from here is a leak.
            rss_start = rss_kib().0;
        }
        progress.inc(1);
    }
    progress.finish();
    if !plan.is_empty() {
        drain(buffer, &plan, &mut recovery, steps)?;
    }
    let bad = verified.bad;
    let summary = Summary {
        steps: steps - first.min(steps),
        mismatches: bad.count() as u64,
        faults: buffer.faults_injected(),
        rss_start,
        rss: rss_kib(),
        seconds: started.elapsed().as_secs_f64(),
    };
    bad.print();
    let replaced = replacements.wait()?;
    if buffer.is_elastic() {
        // Ranks may be gone, and the control plane with them: each survivor reports
        // for itself (and exits non-zero on a mismatch).
        report_elastic(buffer, args, &summary, &recovery);
    } else {
        report_all(buffer, args, &summary)?;
    }
    Ok(bad.count() == 0 && replaced)
}

/// One rank's verified steps: the outputs a step reuses, and the mismatches so far.
pub struct Verified<'a> {
    args: &'a BenchArgs,
    shape: JobShape,
    max_ll: usize,
    bad: Mismatches,
    y: Vec<bf16>,
    ll_y: Vec<bf16>,
}

impl<'a> Verified<'a> {
    /// Outputs for steps of `shape` with up to `max_ll` low-latency tokens a rank.
    pub fn new(args: &'a BenchArgs, shape: JobShape, max_ll: usize, rank: usize) -> Self {
        let ll_rows = shape.experts_per_rank() * shape.num_ranks * max_ll;
        Verified {
            args,
            shape,
            max_ll,
            bad: Mismatches::new(rank),
            y: Vec::new(),
            ll_y: vec![bf16::ZERO; ll_rows * args.hidden],
        }
    }

    /// Step `step` of the modes `--mode` names (normal mode only if `normal`), each
    /// output checked against the reference.
    fn step(&mut self, buffer: &mut Buffer, step: u64, normal: bool) -> anyhow::Result<()> {
        let (args, shape) = (self.args, &self.shape);
        let opts = StepOpts {
            fp8: args.fp8,
            round_scale: args.round_scale,
            expert_alignment: args.expert_alignment,
            // Every other step the experts write into the combine buffer and the
            // combine sends from there (zero copy), so faults meet both paths.
            zero_copy: step % 2 == 1,
        };
        if args.mode != Modes::Ll && normal {
            let inputs = make_inputs(args, shape, args.tokens, step_salt(0, step))?;
            normal_step(buffer, inputs, shape, opts, &mut self.bad, &mut self.y)?;
        }
        if args.mode != Modes::Normal {
            let inputs = make_inputs(args, shape, args.ll_tokens, step_salt(0x11, step))?;
            let (bad, ll_y) = (&mut self.bad, &mut self.ll_y);
            ll_step(buffer, &inputs, shape, self.max_ll, opts, bad, ll_y)?;
        }
        Ok(())
    }
}

/// After the last step: barriers (agreements, where replacements are let in) until the
/// ranks of every replacement planned (and not planned to die) are unmasked, or the
/// Buffer's timeout. The survivors leave together: they read the same mask after each
/// barrier. A replacement let in here made its first call a barrier, and drains with
/// them after it.
fn drain(
    buffer: &mut Buffer,
    plan: &[Rejoin],
    recovery: &mut Recovery,
    steps: u64,
) -> anyhow::Result<()> {
    buffer.set_step(steps);
    if recovery
        .joined
        .as_ref()
        .is_some_and(|j| j.at.first == FirstCall::Barrier)
    {
        buffer.barrier()?;
    }
    let deadline = Instant::now() + buffer.config().timeout;
    let waiting = |b: &Buffer| {
        let mask = b.low_latency_mask();
        plan.iter().any(|j| j.dies_after.is_none() && mask[j.rank])
    };
    while waiting(buffer) && Instant::now() < deadline {
        let start = Instant::now();
        buffer.barrier()?;
        recovery.note_step(buffer, &[], steps, start.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// SIGKILLs this process at the start of `step` if `--kill` or `--kill-node` says so.
fn die_if_victim(args: &BenchArgs, shape: &JobShape, rank: usize, step: u64) {
    let node = rank / shape.ranks_per_node.max(1);
    let me = args.kill.iter().any(|k| k.who == rank && k.step == step)
        || args
            .kill_node
            .iter()
            .any(|k| k.who == node && k.step == step);
    if !me {
        return;
    }
    eprintln!(
        "uep soak: rank {rank} (node {node}) SIGKILLs itself at step {step} ({} ms since the epoch)",
        unix_ms()
    );
    chaos::die(rank);
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// One rank's totals.
struct Summary {
    steps: u64,
    mismatches: u64,
    faults: u64,
    rss_start: u64,
    /// (now, peak), KiB.
    rss: (u64, u64),
    seconds: f64,
}

/// Gathers every rank's totals over the control plane; rank 0 prints them.
fn report_all(buffer: &Buffer, args: &BenchArgs, s: &Summary) -> anyhow::Result<()> {
    let (rank, world) = (buffer.rank(), buffer.num_ranks());
    let mut blob = Vec::new();
    for v in [s.mismatches, s.faults, s.rss_start, s.rss.0, s.rss.1] {
        blob.extend_from_slice(&v.to_le_bytes());
    }
    let all = buffer.control_plane().all_gather(&blob)?;
    if rank != 0 {
        return Ok(());
    }
    let rows: Vec<[u64; 5]> = all
        .iter()
        .map(|b| {
            let mut v = [0u64; 5];
            for (o, c) in v.iter_mut().zip(b.chunks_exact(8)) {
                *o = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
            v
        })
        .collect();
    let mismatches: u64 = rows.iter().map(|r| r[0]).sum();
    let faults: u64 = rows.iter().map(|r| r[1]).sum();
    let max = |i: usize| rows.iter().map(|r| r[i]).max().unwrap_or(0);
    let steps = s.steps;
    if args.json {
        let summary = serde_json::json!({
            "steps": steps,
            "ranks": world,
            "mismatches": mismatches,
            "faults_injected": faults,
            "rss_start_kib": max(2),
            "rss_end_kib": max(3),
            "rss_peak_kib": max(4),
            "seconds": s.seconds,
        });
        println!("{summary}");
    } else {
        println!(
            "uep soak: {steps} steps x {world} ranks in {:.1} s ({}, fresh tokens)",
            s.seconds,
            modes(args)
        );
        println!("  mismatches:      {mismatches}");
        println!("  faults injected: {faults}");
        println!(
            "  RSS per rank:    {} KiB after step 1, {} KiB at the end, peak {} KiB (largest rank)",
            max(2),
            max(3),
            max(4)
        );
    }
    Ok(())
}

/// Each survivor's own report (elastic mode).
fn report_elastic(buffer: &Buffer, args: &BenchArgs, s: &Summary, recovery: &Recovery) {
    let (rank, world) = (buffer.rank(), buffer.num_ranks());
    let masked: Vec<usize> = (0..world)
        .filter(|&r| buffer.low_latency_mask()[r])
        .collect();
    let recovered_ms = recovery.first.map(|(_, d)| d.as_secs_f64() * 1e3);
    let (agreements, digest) = buffer.low_latency_agreements();
    let noticed = chaos::death_to_masked_ms(buffer);
    if args.json {
        let (back, joined) = recovery.rejoins_json();
        let summary = serde_json::json!({
            "rank": rank,
            "steps": s.steps,
            "ranks": world,
            "mismatches": s.mismatches,
            "faults_injected": s.faults,
            "masked": masked,
            "masked_at_step": recovery.first.map(|(step, _)| step),
            "recovered_ms": recovered_ms,
            "agreements": agreements,
            "death_to_masked_ms": noticed.iter().map(|(r, ms)| (r.to_string(), serde_json::json!(ms))).collect::<serde_json::Map<_, _>>(),
            "agreement_digest": format!("{digest:016x}"),
            "rejoined": back,
            "joined": joined,
            "rss_start_kib": s.rss_start,
            "rss_end_kib": s.rss.0,
            "seconds": s.seconds,
        });
        println!("{summary}");
        return;
    }
    let recovered = match recovery.first {
        Some((step, d)) => format!(
            "ranks {masked:?} masked at step {step}: recovered in {:.0} ms",
            d.as_secs_f64() * 1e3
        ),
        None => "no rank masked".into(),
    };
    println!(
        "uep soak (elastic), rank {rank}: {} steps of {world} ranks in {:.1} s ({})\n  \
         mismatches:      {}\n  faults injected: {}\n  {recovered}\n  \
         agreements:      {agreements} (digest of the masks decided: {digest:016x})",
        s.steps,
        s.seconds,
        modes(args),
        s.mismatches,
        s.faults
    );
    for (r, ms) in &noticed {
        println!("  death → masked:  rank {r} in {ms:.0} ms");
    }
    recovery.print_rejoins();
    for (r, why) in buffer.low_latency_mask_reasons().into_iter().enumerate() {
        if let Some(why) = why {
            println!("  rank {r}: {why}");
        }
    }
}

fn modes(args: &BenchArgs) -> &'static str {
    match args.mode {
        Modes::All => "normal + low-latency each step",
        Modes::Normal => "normal mode",
        Modes::Ll => "low-latency mode",
    }
}
