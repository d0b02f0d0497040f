//! `uep bench --peers`: uep beside what a user would write without an EP library, in one
//! run, alternating: the Megatron-style dispatcher over Open MPI's `MPI_Alltoallv`
//! (`peers/mpi_alltoallv.c`, built by `build.rs` with `mpicc`), on the same inputs,
//! with the same byte accounting (a row per token and destination rank).
//!
//! Open MPI runs over shared memory on one node (`--mca btl vader,self`) and over its
//! TCP transport on loopback when `--nodes` emulates several (`--mca btl tcp,self`), as
//! uep's own traffic between emulated nodes crosses libfabric's TCP provider. Its
//! combined output is checked against the sum uep's reference makes.

use std::path::Path;
use std::process::Command;

use half::bf16;
use uep_bootstrap::{launch_local_with_grace, LaunchSpec, DEFAULT_GRACE};
use uep_harness::workload::{JobShape, RankInput};

use crate::args::{make_inputs, BenchArgs, Modes};

/// Where the CLI's build put the MPI peer (empty when `mpicc` was missing).
const MPI_PEER: &str = env!("UEP_MPI_PEER");

/// Environment variable telling rank 0 of a `uep bench` job to write its JSON report
/// to this file too.
pub const REPORT_VAR: &str = "UEP_BENCH_REPORT";

/// One op's time on each side, one round.
#[derive(Debug, Clone, Copy)]
struct Round {
    uep_us: [f64; 2],
    mpi_us: [f64; 2],
}

/// Runs `rounds` rounds of (uep job, MPI job) and prints both side by side.
pub fn run(args: &BenchArgs, rounds: usize) -> anyhow::Result<bool> {
    if MPI_PEER.is_empty() {
        anyhow::bail!(
            "--peers needs Open MPI: this uep was built without mpicc (apt install openmpi-bin \
             libopenmpi-dev, then rebuild)"
        );
    }
    if args.mode == Modes::Ll {
        anyhow::bail!("--peers compares normal dispatch and combine: use --mode normal or all");
    }
    let shape = JobShape {
        num_ranks: args.ranks,
        ranks_per_node: args.ranks / args.nodes,
        hidden: args.hidden,
        topk: args.topk,
        num_experts: args.experts,
    };
    let dir = tempfile::tempdir()?;
    let inputs = make_inputs(args, &shape, args.tokens, 0)?;
    write_inputs(dir.path(), &inputs)?;
    let mut results = Vec::with_capacity(rounds);
    let mut bytes = 0u64;
    for round in 0..rounds {
        let report = dir.path().join(format!("uep{round}.json"));
        let uep = run_uep(args, &report)?;
        let (mpi, mpi_bytes) = run_mpi(args, dir.path())?;
        check_mpi(dir.path(), &inputs, &shape)?;
        bytes = mpi_bytes;
        results.push(Round {
            uep_us: uep,
            mpi_us: mpi,
        });
        eprintln!(
            "uep bench --peers: round {}: uep dispatch {:.0} µs, combine {:.0} µs; MPI_Alltoallv {:.0} µs, {:.0} µs",
            round + 1,
            uep[0],
            uep[1],
            mpi[0],
            mpi[1]
        );
    }
    print(args, &results, bytes);
    Ok(true)
}

/// Each rank's x (bf16), top-k ids (i64) and weights (f32) as raw files.
fn write_inputs(dir: &Path, inputs: &[RankInput]) -> anyhow::Result<()> {
    for (r, input) in inputs.iter().enumerate() {
        let d = dir.join(format!("rank{r}"));
        std::fs::create_dir_all(&d)?;
        let x = input
            .x
            .as_bf16()
            .ok_or_else(|| anyhow::anyhow!("--peers compares bf16 inputs"))?;
        std::fs::write(d.join("x.bin"), bytemuck::cast_slice::<bf16, u8>(x))?;
        std::fs::write(
            d.join("topk_idx.bin"),
            bytemuck::cast_slice(&input.topk_idx),
        )?;
        std::fs::write(
            d.join("weights.bin"),
            bytemuck::cast_slice(&input.topk_weights),
        )?;
    }
    Ok(())
}

/// A uep job of the same flags (normal mode), reporting to `report`: (dispatch,
/// combine) average µs.
fn run_uep(args: &BenchArgs, report: &Path) -> anyhow::Result<[f64; 2]> {
    // The job itself must not start peers again, and reports as JSON into the file.
    let mut argv: Vec<std::ffi::OsString> = Vec::new();
    let mut skip_value = false;
    for a in std::env::args_os().skip(1) {
        let s = a.to_string_lossy();
        if std::mem::take(&mut skip_value) || s == "--peers" || s.starts_with("--rounds=") {
            continue;
        }
        if s == "--rounds" {
            skip_value = true;
            continue;
        }
        argv.push(a);
    }
    argv.extend(["--mode".into(), "normal".into(), "--json".into()]);
    let spec = LaunchSpec {
        ranks: args.ranks,
        nodes: args.nodes,
        program: std::env::current_exe()?,
        args: argv,
        env: vec![(REPORT_VAR.into(), report.display().to_string())],
        timeout: None,
    };
    let outcome = launch_local_with_grace(&spec, DEFAULT_GRACE)?;
    if !outcome.success() {
        anyhow::bail!("the uep job failed: {}", outcome.summary());
    }
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(report)?)?;
    let avg = |op: &str| {
        reports
            .iter()
            .find(|r| r["op"] == op && r["verified"] == true)
            .and_then(|r| r["avg_us"].as_f64())
            .ok_or_else(|| anyhow::anyhow!("the uep job reported no verified {op}"))
    };
    Ok([avg("dispatch")?, avg("combine")?])
}

/// The MPI job: ((dispatch, combine) average µs, bytes a rank sends).
fn run_mpi(args: &BenchArgs, dir: &Path) -> anyhow::Result<([f64; 2], u64)> {
    let btl = if args.nodes > 1 {
        "tcp,self"
    } else {
        "vader,self"
    };
    let out = Command::new("mpirun")
        .args([
            "-np",
            &args.ranks.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["--mca", "pml", "ob1", "--mca", "btl", btl])
        .args(["--mca", "btl_tcp_if_include", "lo"])
        .arg(MPI_PEER)
        .arg(dir)
        .args(
            [
                args.iters,
                args.warmup,
                args.hidden,
                args.topk,
                args.experts,
            ]
            .map(|v| v.to_string()),
        )
        // Open MPI refuses root without these; harmless otherwise.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .map_err(|e| anyhow::anyhow!("running mpirun: {e} (apt install openmpi-bin)"))?;
    if !out.status.success() {
        anyhow::bail!(
            "the MPI job failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("the MPI job printed no report: {text}"))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let num = |k: &str| {
        v[k].as_f64()
            .ok_or_else(|| anyhow::anyhow!("the MPI report lacks {k}: {line}"))
    };
    Ok((
        [num("dispatch_us")?, num("combine_us")?],
        num("bytes_per_rank")? as u64,
    ))
}

/// The MPI job's combine must be what uep's reference makes on one node: each token
/// summed over the ranks it went to, in f32, rounded once.
fn check_mpi(dir: &Path, inputs: &[RankInput], shape: &JobShape) -> anyhow::Result<()> {
    let (h, k) = (shape.hidden, shape.topk);
    let epr = shape.experts_per_rank().max(1);
    for (r, input) in inputs.iter().enumerate() {
        let got = std::fs::read(dir.join(format!("rank{r}/combined.bin")))?;
        let got: &[bf16] = bytemuck::try_cast_slice(&got)
            .map_err(|e| anyhow::anyhow!("rank {r}'s MPI output: {e}"))?;
        let x = input.x.as_bf16().unwrap_or_default();
        for t in 0..input.num_tokens {
            let mut ranks: Vec<usize> = input.topk_idx[t * k..(t + 1) * k]
                .iter()
                .filter(|&&e| e >= 0)
                .map(|&e| e as usize / epr)
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            for c in 0..h {
                let v = x[t * h + c].to_f32();
                let sum = ranks.iter().fold(0f32, |acc, _| acc + v);
                let want = bf16::from_f32(sum);
                if got[t * h + c].to_bits() != want.to_bits() {
                    anyhow::bail!(
                        "the MPI baseline's combine is wrong at rank {r}, token {t}, channel {c}: {} instead of {}",
                        got[t * h + c],
                        want
                    );
                }
            }
        }
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn print(args: &BenchArgs, rounds: &[Round], bytes: u64) {
    let btl = if args.nodes > 1 {
        "TCP (btl tcp)"
    } else {
        "shared memory (btl vader)"
    };
    let mut rows = Vec::new();
    for (i, op) in ["dispatch", "combine"].into_iter().enumerate() {
        let uep = median(rounds.iter().map(|r| r.uep_us[i]).collect());
        let mpi = median(rounds.iter().map(|r| r.mpi_us[i]).collect());
        let ratios: Vec<f64> = rounds.iter().map(|r| r.mpi_us[i] / r.uep_us[i]).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0f64, f64::max);
        rows.push((op, uep, mpi, median(ratios), lo, hi));
    }
    if args.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|&(op, uep, mpi, ratio, lo, hi)| {
                serde_json::json!({
                    "op": op,
                    "ranks": args.ranks,
                    "nodes": args.nodes,
                    "tokens": args.tokens,
                    "hidden": args.hidden,
                    "bytes_per_rank": bytes,
                    "uep_avg_us": uep,
                    "mpi_alltoallv_avg_us": mpi,
                    "speedup": ratio,
                    "speedup_min": lo,
                    "speedup_max": hi,
                    "rounds": rounds.len(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!(
        "uep bench --peers: {} ranks x {} node(s), {} tokens x {} hidden, top-{}, {} experts; \
         MPI_Alltoallv over Open MPI {btl}; median of {} alternating rounds",
        args.ranks,
        args.nodes,
        args.tokens,
        args.hidden,
        args.topk,
        args.experts,
        rounds.len()
    );
    println!(
        "{:<9} {:>11} {:>10} {:>13} {:>10} {:>9}  speedup (MPI time / uep time)",
        "op", "bytes/rank", "uep µs", "uep GB/s", "MPI µs", "MPI GB/s"
    );
    for (op, uep, mpi, ratio, lo, hi) in rows {
        let gb = |us: f64| bytes as f64 / (us * 1e3);
        println!(
            "{op:<9} {:>11} {uep:>10.0} {:>13.2} {mpi:>10.0} {:>9.2}  {ratio:.2}x (rounds {lo:.2}-{hi:.2})",
            crate::report::human_bytes(bytes),
            gb(uep),
            gb(mpi)
        );
    }
    println!("verified: uep bit for bit against its reference; MPI's combine against the same sum");
}
