//! End-to-end: `uep bench` spawns real rank processes that map each other's memory,
//! dispatch and combine fresh random tokens, and check every output bit for bit
//! against the sequential reference. A mismatch makes the run exit non-zero.

use std::process::Command;

mod common;
use common::all_in_and_agreed;

/// Run `uep bench` with `args` (small defaults first, so later flags win) and return
/// the parsed JSON report, failing with the ranks' output on a non-zero exit.
fn bench(args: &[&str]) -> Vec<serde_json::Value> {
    common::bench_reports(&[&common::QUICK[..], args].concat())
}

fn small<'a>(ranks: &'a str, experts: &'a str) -> Vec<&'a str> {
    vec![
        "--ranks",
        ranks,
        "--experts",
        experts,
        "--tokens",
        "96",
        "--ll-tokens",
        "24",
        "--hidden",
        "256",
        "--topk",
        "8",
    ]
}

#[test]
fn two_ranks_every_routing_bf16_and_fp8() {
    for routing in ["uniform", "same-rank", "one-expert", "empty-ranks", "mixed"] {
        for fp8 in [false, true] {
            let mut args = small("2", "16");
            args.extend(["--routing", routing, "--drop-prob", "0.1", "--seed", "11"]);
            if fp8 {
                args.push("--fp8");
            }
            let reports = bench(&args);
            let ops: Vec<&str> = reports.iter().map(|r| r["op"].as_str().unwrap()).collect();
            assert_eq!(
                ops,
                ["layout", "dispatch", "combine", "ll_dispatch", "ll_combine"]
            );
        }
    }
}

#[test]
fn low_latency_nvfp4_with_both_scale_formats() {
    // e2m1 with e4m3 block scales, then UE8M0 ones, on one node and across two.
    for more in [vec!["--ranks", "2"], vec!["--ranks", "4", "--nodes", "2"]] {
        for ue8m0 in [false, true] {
            let mut args = small("4", "16");
            args.extend([
                "--mode",
                "ll",
                "--nvfp4",
                "--routing",
                "mixed",
                "--drop-prob",
                "0.1",
            ]);
            args.extend(&more);
            if ue8m0 {
                args.push("--round-scale");
            }
            let reports = bench(&args);
            assert_eq!(reports[0]["dtype"], "nvfp4", "{args:?}");
        }
    }
}

#[test]
fn three_ranks_non_power_of_two_experts() {
    // 18 experts on 3 ranks: 6 a rank, fewer than top-k 8, so same-rank routing names
    // experts twice and one token reaches a rank many times.
    for routing in ["same-rank", "mixed", "empty-ranks"] {
        let mut args = small("3", "18");
        args.extend([
            "--routing",
            routing,
            "--drop-prob",
            "0.25",
            "--seed",
            "5",
            "--fp8",
            "--round-scale",
        ]);
        bench(&args);
        let mut args = small("3", "18");
        args.extend([
            "--routing",
            routing,
            "--seed",
            "6",
            "--expert-alignment",
            "8",
        ]);
        bench(&args);
    }
}

#[test]
fn four_ranks_cached_and_padded_dispatch() {
    let mut args = small("4", "32");
    args.extend([
        "--routing",
        "mixed",
        "--mode",
        "normal",
        "--cached",
        "--num-worst-tokens",
        "384",
    ]);
    bench(&args);
    let mut args = small("4", "32");
    args.extend([
        "--routing",
        "uniform",
        "--mode",
        "normal",
        "--cached",
        "--fp8",
        "--drop-prob",
        "1",
    ]);
    // Every slot empty: no rank sends or receives anything.
    bench(&args);
}

#[test]
fn all_tokens_to_one_expert() {
    let mut args = small("4", "8");
    args.extend([
        "--routing",
        "one-expert",
        "--topk",
        "1",
        "--tokens",
        "200",
        "--ll-tokens",
        "64",
    ]);
    bench(&args);
}

#[test]
#[ignore = "long tier (./dev test runs it): the full DeepSeek-V3 shape"]
fn deepseek_v3_shape_once() {
    // The reference workload: hidden 7168, top-k 8, 256 experts, 4096 tokens a rank
    // (normal) and 128 (low-latency), on 4 ranks. Normal dispatch and combine write
    // more than STREAM_ABOVE into the other ranks here, so this verifies their
    // streaming stores bit for bit.
    let reports = bench(&["--ranks", "4", "--iters", "1", "--warmup", "0"]);
    let dispatch = reports.iter().find(|r| r["op"] == "dispatch").unwrap();
    assert_eq!(dispatch["tokens"], 4096);
    assert_eq!(dispatch["hidden"], 7168);
    let ll = reports.iter().find(|r| r["op"] == "ll_dispatch").unwrap();
    assert_eq!(ll["tokens"], 128);
}

#[test]
fn bad_flags_are_rejected_with_a_reason() {
    for (args, needle) in [
        (
            vec!["--ranks", "3", "--experts", "16"],
            "multiple of --ranks",
        ),
        (vec!["--fp8", "--hidden", "200"], "multiple of 128"),
        (vec!["--nvfp4"], "needs --mode ll"),
        (
            vec!["--nvfp4", "--fp8", "--mode", "ll"],
            "cannot be used with",
        ),
        (vec!["--ranks", "4", "--nodes", "3"], "multiple of --nodes"),
        (vec!["--routing", "sideways"], "uniform"),
        (
            vec![
                "--elastic",
                "--soak",
                "5",
                "--ranks",
                "4",
                "--max-ranks",
                "5",
            ],
            "in whole nodes of 4",
        ),
        (
            vec![
                "--elastic",
                "--soak",
                "5",
                "--ranks",
                "4",
                "--max-ranks",
                "2",
            ],
            "at least --ranks (4)",
        ),
        (
            vec![
                "--elastic",
                "--soak",
                "5",
                "--max-ranks",
                "8",
                "--grow",
                "2@3",
            ],
            "the reserved ranks are 4..8",
        ),
        // The proxy's fence has 1024 keys: 3 LL buffers of at most 341 local experts.
        (
            vec![
                "--ranks",
                "2",
                "--nodes",
                "2",
                "--mode",
                "ll",
                "--experts",
                "684",
                "--ll-tokens",
                "2",
                "--hidden",
                "128",
                "--topk",
                "1",
            ],
            "at most 341 experts per rank",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_uep"))
            .arg("bench")
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Run `uep bench` and return whether it verified, and its combined output.
fn bench_outcome(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args(["bench", "--timeout", "60"])
        .args(args)
        .output()
        .expect("run uep");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn net_small<'a>(ranks: &'a str, nodes: &'a str) -> Vec<&'a str> {
    let job = ["--ranks", ranks, "--nodes", nodes];
    let routing = ["--routing", "mixed", "--drop-prob", "0.1"];
    [&job[..], &common::SMALL, &routing].concat()
}

#[test]
fn multi_node_through_libfabric_tcp() {
    // 4 ranks as 2 nodes of 2 (shared memory inside a node, the proxy across) and as 4
    // nodes of 1 (everything through the proxy), bf16 and FP8, cached dispatch too.
    for nodes in ["2", "4"] {
        let reports = bench(&net_small("4", nodes));
        let dispatch = reports.iter().find(|r| r["op"] == "dispatch").unwrap();
        assert_eq!(dispatch["nodes"].as_u64().unwrap().to_string(), nodes);
        assert!(
            dispatch["net_bytes_per_rank"].as_u64().unwrap() > 0,
            "{dispatch}"
        );
        // LL combine sends from the combine buffer (zero copy) by default; from the
        // caller's rows, copied into the packets, here.
        let mut args = net_small("4", nodes);
        args.extend(["--fp8", "--round-scale", "--ll-combine-copy"]);
        bench(&args);
        let mut args = net_small("4", nodes);
        args.extend(["--mode", "normal", "--cached", "--num-worst-tokens", "256"]);
        bench(&args);
    }
    // 2 nodes of 3 with top-8: a node's partial sum of 3 rows rounds to bf16 before it
    // crosses, which changes results (a flat-sum reference fails this run).
    let mut args = net_small("6", "2");
    args.extend(["--experts", "24", "--topk", "8", "--routing", "uniform"]);
    bench(&args);
    let mut args = net_small("3", "3");
    args.extend(["--experts", "18", "--routing", "empty-ranks"]);
    bench(&args);
    // The same path over libfabric's shared-memory provider.
    let mut args = net_small("4", "2");
    args.extend(["--provider", "shm"]);
    bench(&args);
    // Packets cut into row-sized writes (the unbatched comparison) stay exact too, also
    // with one write in flight per peer (every fenced block then waits on its own).
    let mut args = net_small("4", "2");
    args.extend(["--net-write-bytes", "512", "--fp8"]);
    bench(&args);
    args.extend(["--writes-in-flight", "1", "--iters", "2"]);
    bench(&args);
    for nodes in ["2", "4"] {
        for routing in ["uniform", "same-rank", "one-expert", "empty-ranks"] {
            let mut args = net_small("4", nodes);
            args.extend(["--routing", routing, "--iters", "1", "--warmup", "0"]);
            bench(&args);
        }
        // Every slot -1: empty packets still cross, and nothing is relayed.
        let mut args = net_small("4", nodes);
        args.extend(["--drop-prob", "1", "--iters", "1", "--warmup", "0"]);
        bench(&args);
    }
}

#[test]
fn multi_node_kernels_push_rows_while_packing() {
    // The dispatch kernel pushes the writes of its direct rows while it packs: the
    // announcement at the end must cover rows sent well before it, also when the fault
    // injector reorders and delays every write.
    for nodes in ["2", "4"] {
        for extra in [
            &[][..],
            &["--fp8"][..],
            &["--faults", "4", "--fresh"][..],
            // Tokens split among kernel threads, unevenly.
            &["--threads", "3"][..],
            // Many runs a thread, each whole quanta of 2 rows (FP8 scales of 8 bytes),
            // and the rows around each thread's boundary sent at publish.
            &["--threads", "3", "--fp8", "--net-write-bytes", "4096"][..],
        ] {
            let mut args = net_small("4", nodes);
            args.extend([
                "--tokens", "1300", "--mode", "normal", "--iters", "2", "--warmup", "0",
            ]);
            args.extend(extra);
            bench(&args);
        }
    }
}

#[test]
fn normal_mode_crosses_the_network_once_per_node() {
    // Every token to all 4 experts, one a rank: each token goes to both ranks of the other
    // node. Sent once to the relaying rank there (and its combine partial once back), the
    // bytes that cross are one copy per token; rank by rank it would be two.
    let reports = bench(&[
        "--ranks",
        "4",
        "--nodes",
        "2",
        "--experts",
        "4",
        "--topk",
        "4",
        "--tokens",
        "64",
        "--hidden",
        "256",
        "--drop-prob",
        "0",
        "--mode",
        "normal",
    ]);
    for op in ["dispatch", "combine"] {
        let r = reports.iter().find(|r| r["op"] == op).unwrap();
        let (all, net, wire) = (
            r["bytes_per_rank"].as_u64().unwrap(),
            r["net_bytes_per_rank"].as_u64().unwrap(),
            r["net_wire_bytes_per_rank"].as_u64().unwrap(),
        );
        assert_eq!(all, 64 * 256 * 2 * 4, "{r}");
        assert_eq!(net, all / 4, "{r}");
        // Measured: the rows once, plus top-k ids, weights, source index and mask.
        assert!(net <= wire && wire < net * 3 / 2, "{r}");
    }
}

#[test]
#[ignore = "long tier (./dev test runs it): 64 processes"]
fn sixty_four_processes_as_eight_nodes() {
    // As many rank processes as two cores serve in well under a minute (128 verify in
    // about 2 min 20 s): each rank watches the 56 on other nodes and reaches them
    // through its proxy. The 512-rank check runs in one process (uep-ep's scale.rs).
    let args = [
        "--ranks",
        "64",
        "--nodes",
        "8",
        "--experts",
        "128",
        "--tokens",
        "16",
        "--ll-tokens",
        "8",
        "--hidden",
        "128",
        "--topk",
        "2",
        "--proxy-threads",
        "1",
        "--threads",
        "1",
        "--timeout",
        "120",
    ];
    let reports = bench(&args);
    let shape = |r: &serde_json::Value| r["ranks"] == 64 && r["nodes"] == 8;
    assert!(reports.iter().all(shape), "{reports:?}");
}

#[test]
#[ignore = "long tier (./dev test runs it): a fault sweep"]
fn multi_node_exact_under_injected_faults() {
    // Reordered, delayed and split bursts of writes, fresh tokens every step.
    for seed in ["1", "2", "3"] {
        let mut args = net_small("4", "4");
        args.extend(["--faults", seed, "--fresh", "--iters", "8", "--warmup", "0"]);
        bench(&args);
        let mut args = net_small("4", "2");
        args.extend([
            "--faults",
            seed,
            "--fresh",
            "--iters",
            "6",
            "--warmup",
            "0",
            "--fp8",
            "--ll-combine-copy",
        ]);
        bench(&args);
    }
}

/// Seeds a load-bearing test tries before it gives up.
const SEEDS_TO_BREAK: u32 = 32;

/// The first seed whose `run` fails, a failure `expected` must recognise. Which seeds
/// break a step depends on timing: on an idle 2-core machine about one in three does
/// (seeds 3, 4, 10 and 11 of 1..=12 without the ordering emulation), but a run beside a
/// compile went through 8 unbroken, and one in CI's long tier through 12. So the test
/// tries many, and if none breaks it says the load average it ran under.
fn first_breaking_seed(
    what: &str,
    run: impl Fn(&str) -> (bool, String),
    expected: impl Fn(&str) -> bool,
) -> String {
    for seed in 1..=SEEDS_TO_BREAK {
        let seed = seed.to_string();
        let (ok, text) = run(&seed);
        if !ok {
            assert!(
                expected(&text),
                "seed {seed} failed {what}, but not as expected:\n{text}"
            );
            return seed;
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    panic!(
        "no seed in 1..={SEEDS_TO_BREAK} broke a step {what} (load average {})",
        load.trim()
    );
}

#[test]
#[ignore = "long tier (./dev test runs it): a fault sweep"]
fn ordering_emulation_is_load_bearing() {
    // Without the receiver's in-order application of announcements, the fault injector
    // makes some step read a packet before its bytes have landed: the outputs differ from
    // the reference, or the receiver finds the packet disagrees with itself (a relay's
    // stale header or mask against its counts, an LL packet's tokens against its
    // per-expert counts) and fails the job.
    fn faulted(seed: &str, emulate: bool) -> Vec<&str> {
        let mut args = net_small("4", "4");
        args.extend([
            "--faults", seed, "--fresh", "--iters", "12", "--warmup", "0",
        ]);
        if !emulate {
            args.push("--no-ordering-emulation");
        }
        args
    }
    let seed = first_breaking_seed(
        "without the ordering emulation",
        |seed| bench_outcome(&faulted(seed, false)),
        |text| {
            text.contains("MISMATCH")
                || text.contains("counts announced")
                || text.contains("'s LL packet for rank")
        },
    );
    // The same faults with the emulation on stay exact.
    bench(&faulted(&seed, true));
}

#[test]
#[ignore = "long tier (./dev test runs it): a fault sweep"]
fn ll_fence_is_load_bearing() {
    // Low-latency calls across nodes rely on the proxy's partial-completion fence alone
    // (no ordered announcement). With writes cut small (several per block) and count
    // signals applied on arrival, some step reads rows that have not landed.
    let ll = |seed: &str, emulate: bool| {
        let mut args = net_small("4", "2");
        args.extend([
            "--mode",
            "ll",
            "--ll-tokens",
            "64",
            "--hidden",
            "1024",
            "--net-write-bytes",
            "256",
            "--faults",
            seed,
            "--fresh",
            "--iters",
            "12",
            "--warmup",
            "0",
        ]);
        if !emulate {
            args.push("--no-ordering-emulation");
        }
        bench_outcome(&args)
    };
    let seed = first_breaking_seed(
        "without the LL fence",
        |seed| ll(seed, false),
        |text| text.contains("MISMATCH ll_") || text.contains("'s LL packet for rank"),
    );
    let (ok, text) = ll(&seed, true);
    assert!(ok, "seed {seed} with the fence:\n{text}");
}

#[test]
#[ignore = "long tier (./dev test runs it): a soak"]
fn soak_over_faults_stays_exact_with_stable_memory() {
    let mut args = net_small("4", "2");
    args.extend(["--faults", "21", "--soak", "400", "--json"]);
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args(["bench", "--timeout", "60"])
        .args(&args)
        .output()
        .expect("run uep");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_str(stdout.trim()).expect("JSON summary");
    assert_eq!(s["steps"], 400);
    assert_eq!(s["mismatches"], 0);
    assert!(s["faults_injected"].as_u64().unwrap() > 0, "{s}");
    let (start, end) = (
        s["rss_start_kib"].as_u64().unwrap(),
        s["rss_end_kib"].as_u64().unwrap(),
    );
    // Every buffer is touched by step 1; what grows after that is a leak.
    assert!(
        end <= start + 8 * 1024,
        "RSS grew from {start} KiB to {end} KiB over the soak"
    );
}

/// `uep bench --json --elastic --soak STEPS` on a small shape with `more` flags (low-
/// latency mode unless they say otherwise): must succeed; returns the survivors'
/// reports and the output, for messages.
fn elastic_run(steps: u64, more: &[&str]) -> (Vec<serde_json::Value>, String) {
    let steps = steps.to_string();
    let mode = match more.contains(&"--mode") {
        true => vec![],
        false => vec!["--mode", "ll"],
    };
    let mut args = vec![
        "bench",
        "--json",
        "--tokens",
        "64",
        "--elastic",
        "--soak",
        &steps,
        "--experts",
        "16",
        "--ll-tokens",
        "24",
        "--hidden",
        "256",
        "--topk",
        "4",
    ];
    args.extend(mode);
    args.extend(more);
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args(&args)
        .output()
        .expect("run uep");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let ctx = format!("uep {}\n{stdout}\n{stderr}", args.join(" "));
    assert!(out.status.success(), "{}: {ctx}", out.status);
    let reports = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    (reports, ctx)
}

/// An elastic soak with victims: every survivor reports 0 mismatches, the victims'
/// ranks masked, and a recovery (the step of the kill) under a second.
fn elastic_soak(nodes: &str, victims: &[&str], masked: &[u64], extra: &[&str]) {
    let mut more = vec!["--ranks", "4", "--nodes", nodes, "--timeout", "60"];
    more.extend(victims);
    more.extend(extra);
    let (reports, ctx) = elastic_run(40, &more);
    assert_eq!(reports.len(), 4 - masked.len(), "{ctx}");
    for r in &reports {
        assert_eq!(r["mismatches"], 0, "{r}");
        assert_eq!(r["steps"], 40, "{r}");
        let got: Vec<u64> = serde_json::from_value(r["masked"].clone()).unwrap();
        assert_eq!(got, masked, "{r}");
        let ms = r["recovered_ms"].as_f64().expect("a recovery time");
        assert!(ms < 1000.0, "recovery took {ms} ms: {r}");
    }
}

#[test]
fn elastic_ll_goes_on_without_a_killed_rank_on_one_node() {
    elastic_soak("1", &["--kill", "2@12"], &[2], &[]);
}

#[test]
fn elastic_ll_goes_on_without_a_killed_rank_across_nodes() {
    elastic_soak("2", &["--kill", "3@12"], &[3], &[]);
}

#[test]
fn elastic_ll_goes_on_without_a_killed_node_and_with_faults() {
    elastic_soak("2", &["--kill-node", "1@12"], &[2, 3], &["--faults", "5"]);
}

#[test]
fn elastic_ll_goes_on_without_rank_0() {
    // Rank 0 also hosts the bootstrap rendezvous: the data path must not need it.
    elastic_soak("4", &["--kill", "0@12"], &[0], &[]);
}

#[test]
fn elastic_normal_goes_on_without_a_killed_rank_on_one_node() {
    elastic_soak("1", &["--kill", "2@12"], &[2], &["--mode", "normal"]);
}

/// Rank 2 relays rank 0's tokens into node 1: rank 3 stands in for it.
#[test]
fn elastic_normal_goes_on_without_a_killed_relay_across_nodes() {
    elastic_soak("2", &["--kill", "2@12"], &[2], &["--mode", "normal"]);
}

#[test]
fn elastic_normal_goes_on_without_a_killed_node_and_with_faults() {
    elastic_soak(
        "2",
        &["--kill-node", "1@12"],
        &[2, 3],
        &["--mode", "normal", "--faults", "5"],
    );
}

/// Victims are SIGKILLed at step 5 and replacement processes started at step 8 take
/// their places (`kill`, `rejoin`: the flags saying so): every rank (the survivors and
/// the replacements) checks every step it ran against the reference for that step's
/// mask with 0 mismatches, all agreed on the same masks (digests), nobody is masked at
/// the end, and the times are printed: the replacements' waits at the door and the
/// survivors' longest step while one joined.
fn elastic_rejoin(mode: &str, nodes: &str, (kill, rejoin): ([&str; 2], [&str; 2]), extra: &[&str]) {
    let mut more = vec![
        "--ranks",
        "4",
        "--nodes",
        nodes,
        "--timeout",
        "60",
        "--mode",
        mode,
    ];
    more.extend(kill.iter().chain(&rejoin).chain(extra));
    let (reports, ctx) = elastic_run(300, &more);
    assert_eq!(reports.len(), 4, "{ctx}");
    let joiners: Vec<_> = reports.iter().filter(|r| !r["joined"].is_null()).collect();
    assert!(!joiners.is_empty(), "{ctx}");
    all_in_and_agreed(&reports, &ctx);
    for j in &joiners {
        let waited = j["joined"]["waited_at_door_ms"].as_f64().expect(&ctx);
        assert!(waited < 1000.0, "waited {waited} ms at the door: {ctx}");
    }
    for r in reports.iter().filter(|r| r["joined"].is_null()) {
        let back = r["rejoined"].as_array().expect(&ctx);
        assert_eq!(back.len(), joiners.len(), "{ctx}");
        assert!(
            back.iter().all(|b| b["back_at_step"].as_u64() >= Some(8)),
            "{ctx}"
        );
        assert_eq!(r["steps"], 300, "{ctx}");
    }
    let longest: Vec<f64> = (reports.iter())
        .filter_map(|r| r["rejoined"][0]["longest_step_ms"].as_f64())
        .collect();
    let j = &joiners[0]["joined"];
    eprintln!(
        "{mode}, {nodes} node(s): rank {} back at step {}: started → let in {:.0} ms, waited \
         at the door {:.1} ms; survivors' longest step meanwhile {longest:.1?} ms",
        joiners[0]["rank"], j["at_step"], j["started_to_let_in_ms"], j["waited_at_door_ms"]
    );
}

const KILL_2: [&str; 2] = ["--kill", "2@5"];
const REJOIN_2: [&str; 2] = ["--rejoin", "2@8"];

#[test]
fn elastic_ll_killed_rank_rejoins_on_one_node() {
    elastic_rejoin("ll", "1", (KILL_2, REJOIN_2), &[]);
}

#[test]
fn elastic_normal_killed_rank_rejoins_on_one_node() {
    elastic_rejoin("normal", "1", (KILL_2, REJOIN_2), &[]);
}

/// With the door in shared memory on this host rather than in the launcher's store.
#[test]
fn elastic_both_modes_killed_rank_rejoins_on_one_node_door_in_shm() {
    elastic_rejoin("all", "1", (KILL_2, REJOIN_2), &["--door-in-shm"]);
}

/// Across nodes: rank 2 relays rank 0's tokens into node 1 (normal mode); its
/// replacement reaches the other node through new endpoints, learns the job's barrier
/// and agreement counts, and is watched again.
#[test]
fn elastic_both_modes_killed_relay_rejoins_across_nodes() {
    elastic_rejoin("all", "2", (KILL_2, REJOIN_2), &[]);
}

/// A whole node dies and comes back: its two replacements are let in one at a time,
/// the second by the first among the others.
#[test]
fn elastic_both_modes_killed_node_rejoins() {
    let (kill, rejoin) = (["--kill-node", "1@5"], ["--rejoin-node", "1@8"]);
    elastic_rejoin("all", "2", (kill, rejoin), &[]);
}

/// A job made with room for more ranks than it starts with (`--max-ranks`) grows into
/// them: a process started for each reserved rank (`--grow`) joins at a step boundary
/// while the founding ranks serve, and from then on every rank checks every step
/// against the reference for that step's mask: 0 mismatches, the same agreements on
/// all, nobody masked at the end. `nodes` founding nodes, `room` ranks in all.
fn elastic_grows(ranks: &str, nodes: &str, room: &str, grow: &[&str]) {
    let mut more = vec!["--ranks", ranks, "--nodes", nodes, "--max-ranks", room];
    more.extend(["--mode", "all", "--timeout", "60", "--experts", "24"]);
    for g in grow {
        more.extend(["--grow", g]);
    }
    // Long enough that the founding ranks still serve when the newcomers are let in
    // (~350 ms after they start; one node of two runs 300 steps in about as long).
    let (reports, ctx) = elastic_run(1000, &more);
    let room: usize = room.parse().unwrap();
    assert_eq!(reports.len(), room, "{ctx}");
    let joined: Vec<_> = reports.iter().filter(|r| !r["joined"].is_null()).collect();
    assert_eq!(joined.len(), grow.len(), "{ctx}");
    all_in_and_agreed(&reports, &ctx);
    for j in &joined {
        assert!(
            j["steps"].as_u64() > Some(0),
            "a grown rank served no step: {ctx}"
        );
    }
    let j = &joined[0]["joined"];
    eprintln!(
        "{nodes} node(s) of {ranks} ranks grown to {room}: in at step {}, started → let in {:.0} ms",
        j["at_step"],
        j["started_to_let_in_ms"].as_f64().unwrap_or(f64::NAN)
    );
}

/// Two nodes of two ranks grow by a node.
#[test]
fn elastic_job_grows_by_a_node() {
    elastic_grows("4", "2", "6", &["4@5", "5@5"]);
}

/// One node grows into a second: the founding ranks start a network path to a node
/// nobody is on yet.
#[test]
fn elastic_job_on_one_node_grows_into_a_second() {
    elastic_grows("2", "1", "4", &["2@5", "3@9"]);
}

/// What one chaos run measured: the replacements' waits at the door, and every
/// founding survivor's death → masked times (ms).
#[derive(Default)]
struct Chaos {
    waited: Vec<f64>,
    noticed: Vec<f64>,
}

impl Chaos {
    fn add(&mut self, other: Chaos) {
        self.waited.extend(other.waited);
        self.noticed.extend(other.noticed);
    }

    /// The two distributions, for the long tier's log.
    fn print(mut self, what: &str) {
        for v in [&mut self.waited, &mut self.noticed] {
            v.sort_by(f64::total_cmp);
        }
        let at = |v: &[f64], q: f64| {
            let i = ((v.len().max(1) - 1) as f64 * q) as usize;
            v.get(i).copied().unwrap_or(f64::NAN)
        };
        eprintln!(
            "{what}: {} replacements let in, waited at the door: median {:.1} ms, max {:.1} \
             ms; death → masked over {} (survivor, victim) pairs: median {:.0} ms, p90 {:.0} \
             ms, max {:.0} ms",
            self.waited.len(),
            at(&self.waited, 0.5),
            at(&self.waited, 1.0),
            self.noticed.len(),
            at(&self.noticed, 0.5),
            at(&self.noticed, 0.9),
            at(&self.noticed, 1.0)
        );
    }
}

/// `uep bench --chaos SEED` on `ranks` ranks as `nodes` nodes, both modes every step,
/// `steps` steps: victims, the steps and moments they die at (inside calls and
/// agreement rounds), and replacements of some of them a few steps later (some of
/// which die too) drawn from the seed. Every rank that reports (survivors and
/// replacements) checks every step it ran bit for bit against the reference for that
/// step's mask, and all of them agreed on the same masks in the same agreements (the
/// digests) and end with the same mask; every rank that did not report is masked, and
/// was masked by every founding survivor within a second of its death.
fn elastic_chaos(ranks: usize, nodes: usize, seed: u64, steps: u64) -> Chaos {
    let (ranks_s, nodes_s, seed_s) = (ranks.to_string(), nodes.to_string(), seed.to_string());
    let more = [
        "--ranks",
        &ranks_s,
        "--nodes",
        &nodes_s,
        "--mode",
        "all",
        "--timeout",
        "30",
        "--chaos",
        &seed_s,
    ];
    let (reports, ctx) = elastic_run(steps, &more);
    assert!(!reports.is_empty(), "no survivor: {ctx}");
    let first = &reports[0];
    for r in &reports {
        assert_eq!(r["mismatches"], 0, "{ctx}");
        for key in ["agreements", "agreement_digest", "masked"] {
            assert_eq!(r[key], first[key], "{key} differs between ranks: {ctx}");
        }
    }
    let masked: Vec<u64> = serde_json::from_value(first["masked"].clone()).unwrap();
    for rank in 0..ranks as u64 {
        let reported = reports.iter().any(|r| r["rank"] == rank);
        assert!(
            reported != masked.contains(&rank),
            "rank {rank} reported and masked, or neither: {ctx}"
        );
    }
    let mut chaos = Chaos::default();
    for r in &reports {
        if let Some(ms) = r["joined"]["waited_at_door_ms"].as_f64() {
            chaos.waited.push(ms);
            continue;
        }
        assert_eq!(r["steps"].as_u64(), Some(steps), "{ctx}");
        // A replacement that died is masked since its predecessor's death.
        let replaced = |rank: u64| ctx.contains(&format!("replacement of rank {rank} dies"));
        for rank in masked.iter().filter(|&&m| !replaced(m)) {
            let ms = r["death_to_masked_ms"][rank.to_string()].as_f64();
            let ms = ms.unwrap_or_else(|| panic!("no death → masked time for rank {rank}: {ctx}"));
            assert!(
                (0.0..1000.0).contains(&ms),
                "rank {rank} masked {ms} ms after its death: {ctx}"
            );
            chaos.noticed.push(ms);
        }
    }
    chaos
}

#[test]
fn elastic_chaos_quick() {
    for seed in 0..2 {
        elastic_chaos(4, 1, seed + 1, 200);
        elastic_chaos(4, 2, seed, 100);
        elastic_chaos(8, 4, seed, 100);
    }
}

/// The soak: 50 seeds each on 4 ranks as 2 nodes and 8 ranks as 4 nodes, and
/// 10 on one node (where the same rejoin has no network path to reset; the quick tier
/// runs two more).
#[test]
#[ignore = "long tier: ~5 minutes"]
fn elastic_chaos_fifty_seeds() {
    let mut all = Chaos::default();
    for seed in 100..150 {
        all.add(elastic_chaos(4, 2, seed, 100));
        all.add(elastic_chaos(8, 4, seed, 100));
    }
    for seed in 200..210 {
        all.add(elastic_chaos(4, 1, seed, 200));
    }
    all.print("chaos, 110 runs");
}

/// Normal mode on an elastic Buffer across nodes, between low-latency calls: each
/// call settles the last agreement's streams first (nobody dies here; every rank
/// reports).
#[test]
fn elastic_buffer_runs_normal_mode_between_agreements() {
    let more = [
        "--ranks",
        "4",
        "--nodes",
        "2",
        "--mode",
        "all",
        "--timeout",
        "30",
    ];
    let (reports, ctx) = elastic_run(8, &more);
    assert_eq!(reports.len(), 4, "{ctx}");
    for r in &reports {
        assert_eq!(r["mismatches"], 0, "{ctx}");
        // Four a step: after each call of both modes.
        assert_eq!(r["agreements"], 32, "{ctx}");
    }
}

/// The ranks of `uep bench` die with it: SIGKILL the launcher mid-run, and every rank
/// it started is gone within a second, instead of running on alone.
#[test]
fn ranks_die_with_their_launcher() {
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args([
            "bench",
            "--ranks",
            "2",
            "--experts",
            "16",
            "--hidden",
            "256",
            "--topk",
            "4",
        ])
        .args(["--tokens", "64", "--ll-tokens", "16", "--soak", "100000000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let children = |pid: u32| -> Vec<u32> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten();
        tasks
            .flatten()
            .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
            .flat_map(|c| {
                c.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect()
    };
    let start = std::time::Instant::now();
    let ranks = loop {
        let c = children(launcher.id());
        if c.len() == 2 {
            break c;
        }
        assert!(start.elapsed().as_secs() < 30, "the ranks did not start");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    // Let them get going, then kill the launcher.
    std::thread::sleep(std::time::Duration::from_millis(500));
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let alive = |pid: &u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            !s.rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X']))
        })
    };
    let killed = std::time::Instant::now();
    while ranks.iter().any(alive) {
        assert!(
            killed.elapsed().as_secs() < 1,
            "ranks {ranks:?} outlived their launcher"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `uep bench --peers` runs the MPI_Alltoallv dispatcher beside uep on the same inputs
/// (its combine checked against the same sum) and reports both, on one node and across
/// emulated nodes (Open MPI's TCP transport).
#[test]
fn peers_run_mpi_alltoallv_beside_uep() {
    if env!("UEP_MPI_PEER").is_empty() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must build the MPI peer (mpicc)"
        );
        eprintln!("skipped: uep was built without mpicc");
        return;
    }
    for nodes in ["1", "2"] {
        let out = Command::new(env!("CARGO_BIN_EXE_uep"))
            .args([
                "bench", "--peers", "--rounds", "1", "--json", "--ranks", "4",
            ])
            .args(["--nodes", nodes, "--tokens", "64", "--hidden", "256"])
            .args([
                "--experts",
                "16",
                "--topk",
                "4",
                "--iters",
                "2",
                "--warmup",
                "1",
            ])
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{}\n{stdout}\n{stderr}", out.status);
        let v: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("JSON");
        assert_eq!(v.len(), 2, "{stdout}");
        for r in &v {
            assert!(r["speedup"].as_f64().is_some_and(|s| s > 0.0), "{r}");
            assert!(r["uep_avg_us"].as_f64().is_some_and(|s| s > 0.0), "{r}");
            assert_eq!(r["nodes"].as_u64(), nodes.parse().ok(), "{r}");
        }
    }
}
