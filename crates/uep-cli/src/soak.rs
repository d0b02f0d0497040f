//! `uep bench --soak STEPS`: thousands of steps, fresh tokens and routing every step,
//! normal and low-latency modes alternating, every output checked against the reference;
//! at the end: steps done, mismatches, faults injected, and memory at start and end.

use std::time::Instant;

use half::bf16;
use uep_ep::{Buffer, DispatchArgs};
use uep_harness::case::{identity_expert, LlCase, NormalCase, ScaleLayout};
use uep_harness::check::{self, Mismatches};
use uep_harness::workload::{JobShape, TokenData};

use crate::bench::{make_inputs, step_salt, BenchArgs};
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

/// Run the soak on this rank; rank 0 prints the summary. Returns whether every step matched.
pub fn run(
    buffer: &mut Buffer,
    args: &BenchArgs,
    shape: &JobShape,
    max_ll: usize,
    steps: u64,
) -> anyhow::Result<bool> {
    let (rank, world, h) = (buffer.rank(), buffer.num_ranks(), args.hidden);
    let progress = Progress::new(steps, "uep soak", rank == 0 && !args.json);
    let mut bad = Mismatches::new(rank);
    let started = Instant::now();
    let mut y: Vec<bf16> = Vec::new();
    let mut ll_y = vec![bf16::ZERO; shape.experts_per_rank() * world * max_ll * h];
    let mut rss_start = 0;
    for step in 0..steps {
        // Normal mode.
        let inputs = make_inputs(args, shape, args.tokens, step_salt(0, step))?;
        let case = NormalCase::new(inputs, shape, rank, args.fp8, args.expert_alignment)?;
        let mine = &case.sent[rank];
        let out = buffer.dispatch(
            DispatchArgs::new(case.x(rank))
                .topk(&mine.topk_idx, Some(&mine.topk_weights))
                .layout(&case.layout),
        )?;
        check::normal_dispatch(&mut bad, &out, &case.expected, h);
        let n = out.handle.num_recv_tokens;
        y.resize(n * h, bf16::ZERO);
        identity_expert(out.recv_x, 0..n, h, ScaleLayout::RowMajor, &mut y)?;
        let w = out.recv_topk_weights.map(<[f32]>::to_vec);
        let handle = out.handle;
        let combined = buffer.combine(&y, w.as_deref(), &handle)?;
        bad.bits(
            "combine.combined_x",
            &combined.combined_x,
            &case.expected_combine.0,
        );

        // Low-latency mode.
        let inputs = make_inputs(args, shape, args.ll_tokens, step_salt(0x11, step))?;
        let case = LlCase::new(rank, inputs, shape, max_ll, args.fp8, args.round_scale)?;
        let mine = &case.inputs[rank];
        let TokenData::Bf16(x) = &mine.x else {
            unreachable!("workload inputs are bf16")
        };
        let out = buffer.low_latency_dispatch(x, &mine.topk_idx, args.fp8, args.round_scale)?;
        check::ll_dispatch(&mut bad, &out, &case.expected, h);
        let rows_per_expert = world * max_ll;
        for (le, &n) in out.recv_count.iter().enumerate() {
            let begin = le * rows_per_expert;
            let layout = ScaleLayout::ColumnMajor { rows_per_expert };
            identity_expert(out.recv_x, begin..begin + n as usize, h, layout, &mut ll_y)?;
        }
        let handle = out.handle;
        let combined =
            buffer.low_latency_combine(&ll_y, &mine.topk_idx, &mine.topk_weights, &handle)?;
        bad.bits("ll_combine.combined_x", &combined, &case.expected_combine);

        if step == 0 {
            // After the first step every buffer has been touched: growth from here is a leak.
            rss_start = rss_kib().0;
        }
        progress.inc(1);
    }
    progress.finish();
    let (rss_end, rss_peak) = rss_kib();
    let mut blob = Vec::new();
    for v in [
        bad.count() as u64,
        buffer.faults_injected(),
        rss_start,
        rss_end,
        rss_peak,
    ] {
        blob.extend_from_slice(&v.to_le_bytes());
    }
    let all = buffer.control_plane().all_gather(&blob)?;
    bad.print();
    if rank == 0 {
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
        let summary = serde_json::json!({
            "steps": steps,
            "ranks": world,
            "mismatches": mismatches,
            "faults_injected": faults,
            "rss_start_kib": max(2),
            "rss_end_kib": max(3),
            "rss_peak_kib": max(4),
            "seconds": started.elapsed().as_secs_f64(),
        });
        if args.json {
            println!("{summary}");
        } else {
            println!(
                "uep soak: {steps} steps x {world} ranks in {:.1} s (normal + low-latency each step, fresh tokens)",
                started.elapsed().as_secs_f64()
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
    }
    Ok(bad.count() == 0)
}
