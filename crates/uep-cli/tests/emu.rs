//! `uep bench --device emu`: whole EP calls whose kernel phases run as uep's kernels
//! (the GPU's sources built for the host, `kernels/port.cuh`) on the emulated device,
//! in real rank processes over shared memory and libfabric, every output checked bit
//! for bit against the sequential reference; the JSON rows say which phases ran as
//! kernels.

use std::path::Path;
use std::process::Command;

use uep_harness::npy::{NpyArray, NpyData};

mod common;

/// `uep bench --device emu --json` with `args` (small defaults first, so later flags
/// win): the reports, every one verified and on the emulated device.
fn emu_bench(args: &[&str]) -> Vec<serde_json::Value> {
    let defaults = [&["--device", "emu"][..], &common::QUICK, &common::SMALL].concat();
    let reports = common::bench_reports(&[&defaults[..], args].concat());
    for r in &reports {
        assert_eq!(r["device"], "emu", "{r}");
    }
    reports
}

/// The phases `op` ran as kernels.
fn kernels(reports: &[serde_json::Value], op: &str) -> Vec<String> {
    let r = reports.iter().find(|r| r["op"] == op).expect(op);
    serde_json::from_value(r["kernel_phases"].clone()).unwrap()
}

#[test]
fn every_op_on_two_ranks_names_its_kernel_phases() {
    for fp8 in [false, true] {
        let mut args = vec!["--ranks", "2", "--routing", "mixed", "--drop-prob", "0.1"];
        if fp8 {
            args.extend(["--fp8", "--round-scale"]);
        }
        let reports = emu_bench(&args);
        assert_eq!(kernels(&reports, "layout"), ["layout"]);
        let sends = ["layout", "normal_notify", "normal_pack"];
        assert_eq!(kernels(&reports, "dispatch"), sends);
        assert_eq!(
            kernels(&reports, "combine"),
            ["reduce", "normal_combine_send"]
        );
        assert_eq!(kernels(&reports, "ll_combine"), ["reduce"]);
        let copy = emu_bench(&[&args[..], &["--ll-combine-copy", "--mode", "ll"]].concat());
        assert_eq!(kernels(&copy, "ll_combine"), ["reduce", "ll_combine_pack"]);
        // Only an FP8 dispatch casts.
        let sends: &[&str] = match fp8 {
            true => &["cast", "ll_place", "ll_pack", "ll_unpack"],
            false => &["ll_place", "ll_pack", "ll_unpack"],
        };
        assert_eq!(kernels(&reports, "ll_dispatch"), sends);
    }
    // The host device runs every phase on CPU threads: no kernel phases.
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args([
            "bench", "--json", "--ranks", "2", "--iters", "1", "--warmup", "0",
        ])
        .args([
            "--tokens",
            "32",
            "--ll-tokens",
            "8",
            "--hidden",
            "256",
            "--experts",
            "8",
        ])
        .output()
        .expect("run uep");
    assert!(out.status.success());
    let reports: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for r in &reports {
        assert_eq!(r["device"], "host");
        assert_eq!(r["kernel_phases"], serde_json::json!([]), "{r}");
    }
}

#[test]
fn nodes_across_libfabric_and_edge_routings() {
    // 4 ranks as 2 nodes and 8 as 4 (the proxies and libfabric between nodes).
    for (ranks, nodes) in [("4", "2"), ("8", "4")] {
        for fp8 in [false, true] {
            let mut args = vec!["--ranks", ranks, "--nodes", nodes, "--routing", "mixed"];
            if fp8 {
                args.push("--fp8");
            }
            let reports = emu_bench(&args);
            let sends = ["layout", "normal_notify", "normal_pack", "relay"];
            assert_eq!(kernels(&reports, "dispatch"), sends);
        }
    }
    // NVFP4, both block scale formats.
    for more in [&[][..], &["--round-scale"][..]] {
        let mut args = vec!["--ranks", "4", "--nodes", "2", "--mode", "ll", "--nvfp4"];
        args.extend(more);
        let reports = emu_bench(&args);
        let sends = ["cast", "ll_place", "ll_pack", "ll_unpack"];
        assert_eq!(kernels(&reports, "ll_dispatch"), sends);
    }
    // Empty ranks, every slot of a token on one rank, one expert for all, -1 slots.
    for routing in ["empty-ranks", "same-rank", "one-expert"] {
        emu_bench(&[
            "--ranks",
            "4",
            "--nodes",
            "2",
            "--routing",
            routing,
            "--drop-prob",
            "0.2",
        ]);
    }
}

/// Rank `r`'s inputs of 4 ranks (16 experts, top-4, hidden 256) for `--inputs`: rank 1
/// has no tokens; rank 0's first token every slot `-1`, its second every slot one
/// expert, its third four experts of one rank; rank 2 sends expert 5 two copies of each
/// of its 8 tokens (16 rows, as many as a source may send an expert in a call); rank 3 a
/// mix with `-1` slots.
fn edge_inputs(r: usize) -> (usize, Vec<i64>) {
    match r {
        0 => {
            let mut ids = vec![-1, -1, -1, -1, 9, 9, 9, 9, 12, 13, 14, 15];
            ids.extend((0..13).flat_map(|t| [(t % 16) as i64, -1, ((t * 7 + 3) % 16) as i64, 2]));
            (16, ids)
        }
        1 => (0, Vec::new()),
        2 => (8, [5, 5, -1, -1].repeat(8)),
        _ => (
            9,
            (0..36)
                .map(|i| if i % 5 == 0 { -1 } else { (i * 3 % 16) as i64 })
                .collect(),
        ),
    }
}

fn write_edge_inputs(dir: &Path) {
    let (h, k) = (256, 4);
    for r in 0..4 {
        let (t, ids) = edge_inputs(r);
        let d = dir.join(format!("rank{r}"));
        std::fs::create_dir_all(&d).unwrap();
        // bf16 bits of small values, different on every row and rank.
        let x: Vec<u16> = (0..t * h)
            .map(|i| 0x3c00 + ((i * 7 + r * 13) % 512) as u16)
            .collect();
        let w: Vec<f32> = (0..t * k).map(|i| 0.25 + (i % 3) as f32 * 0.125).collect();
        let write = |name: &str, shape: Vec<usize>, data: NpyData| {
            NpyArray::new(shape, data)
                .unwrap()
                .write(&d.join(name))
                .unwrap();
        };
        write("x.npy", vec![t, h], NpyData::U16(x));
        write("topk_idx.npy", vec![t, k], NpyData::I64(ids));
        write("topk_weights.npy", vec![t, k], NpyData::F32(w));
    }
}

#[test]
fn edge_inputs_read_from_files() {
    let dir = std::env::temp_dir().join(format!("uep-emu-inputs-{}", std::process::id()));
    write_edge_inputs(&dir);
    let path = dir.to_string_lossy().into_owned();
    for more in [&["--nodes", "1"][..], &["--nodes", "2", "--fp8"][..]] {
        let mut args = vec!["--ranks", "4", "--inputs", &path, "--ll-tokens", "16"];
        args.extend(more);
        emu_bench(&args);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_elastic_job_goes_on_without_a_killed_rank() {
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args([
            "bench",
            "--device",
            "emu",
            "--json",
            "--elastic",
            "--soak",
            "30",
        ])
        .args([
            "--ranks", "4", "--nodes", "2", "--kill", "3@10", "--mode", "all",
        ])
        .args(["--tokens", "32", "--ll-tokens", "16", "--hidden", "256"])
        .args(["--experts", "16", "--topk", "4", "--timeout", "60"])
        .output()
        .expect("run uep");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ctx = format!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{ctx}");
    let reports: Vec<serde_json::Value> = (stdout.lines())
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 3, "{ctx}");
    for r in &reports {
        assert_eq!(r["mismatches"], 0, "{r}");
        assert_eq!(r["masked"], serde_json::json!([3]), "{r}");
    }
}

#[test]
#[ignore = "long tier (./dev test runs it): a soak over the fault injector"]
fn a_soak_over_injected_faults_stays_exact() {
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args([
            "bench", "--device", "emu", "--json", "--soak", "200", "--faults", "21",
        ])
        .args([
            "--ranks",
            "4",
            "--nodes",
            "2",
            "--routing",
            "mixed",
            "--drop-prob",
            "0.1",
        ])
        .args(["--tokens", "64", "--ll-tokens", "16", "--hidden", "256"])
        .args(["--experts", "16", "--topk", "4", "--timeout", "60"])
        .output()
        .expect("run uep");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON summary");
    assert_eq!(
        (s["steps"].as_u64(), s["mismatches"].as_u64()),
        (Some(200), Some(0)),
        "{s}"
    );
    assert!(s["faults_injected"].as_u64().unwrap() > 0, "{s}");
}
