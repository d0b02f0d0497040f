//! What the CLI's integration tests share: finding a launcher, skipping where one is
//! missing (failing in CI instead), a free port pair for a launcher's store, the
//! check of an elastic run's reports.
#![allow(dead_code)] // each test binary uses its own part of it

use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Skips a test (returns `None`) with `why`, except in CI, where it fails.
pub fn skip<T>(why: String) -> Option<T> {
    assert!(
        std::env::var_os("CI").is_none(),
        "CI must run this test: {why}"
    );
    eprintln!("skipped: {why}");
    None
}

/// A program from `$var`, else the workspace's test environment (`.venv/bin`), else
/// `PATH`.
pub fn find(program: &str, var: &str) -> Option<PathBuf> {
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin");
    std::env::var_os(var)
        .map(PathBuf::from)
        .into_iter()
        .chain(std::iter::once(venv.join(program)))
        .chain(
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join(program))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
        )
        .find(|p| p.is_file())
        .inspect(|p| eprintln!("{program}: {}", p.display()))
        .or_else(|| {
            skip(format!(
                "`{program}` not found (set {var}, or run ./dev venv)"
            ))
        })
}

/// A loopback port `p` with `p + 1` free too (the launcher's store and uep's
/// rendezvous), for jobs on this host's own namespace.
pub fn free_port_pair() -> u16 {
    loop {
        let a = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let p = a.local_addr().unwrap().port();
        if p < u16::MAX && TcpListener::bind((Ipv4Addr::LOCALHOST, p + 1)).is_ok() {
            return p;
        }
    }
}

/// `mpirun` as root needs these (Open MPI refuses root otherwise).
pub const MPI_AS_ROOT: [(&str, &str); 2] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
];

/// `torchrun` starting 4 ranks of `uep` on this host (append uep's arguments).
pub fn torchrun_4(torchrun: &Path) -> Command {
    let port = free_port_pair().to_string();
    let mut cmd = Command::new(torchrun);
    cmd.args(["--nnodes", "1", "--nproc-per-node", "4"])
        .args(["--master-addr", "127.0.0.1", "--master-port", &port])
        .args(["--no-python", env!("CARGO_BIN_EXE_uep")])
        .env("OMP_NUM_THREADS", "1");
    cmd
}

/// `mpirun` starting 4 ranks of `uep` on this host (append uep's arguments).
pub fn mpirun_4(mpirun: &Path) -> Command {
    let port = free_port_pair().to_string();
    let mut cmd = Command::new(mpirun);
    cmd.args([
        "-np",
        "4",
        "--oversubscribe",
        "-x",
        "MASTER_ADDR",
        "-x",
        "MASTER_PORT",
    ])
    .arg(env!("CARGO_BIN_EXE_uep"))
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", &port)
    .envs(MPI_AS_ROOT);
    cmd
}

/// Every rank's report: 0 mismatches, nobody masked at the end, and the same
/// agreements (count and digest of their masks) as every other rank's.
pub fn all_in_and_agreed(reports: &[serde_json::Value], ctx: &str) {
    for r in reports {
        assert_eq!(r["mismatches"], 0, "{ctx}");
        assert_eq!(r["masked"], serde_json::json!([]), "{ctx}");
        for key in ["agreements", "agreement_digest"] {
            assert_eq!(r[key], reports[0][key], "{key} differs: {ctx}");
        }
    }
}

/// `uep bench` flags for a quick run: two timed iterations after one warm-up, a
/// minute's wait at most.
pub const QUICK: [&str; 6] = ["--iters", "2", "--warmup", "1", "--timeout", "60"];

/// `uep bench` flags for a small job: 16 experts, 64 tokens a rank (16 low-latency),
/// hidden 256, top-4.
pub const SMALL: [&str; 10] = [
    "--experts",
    "16",
    "--tokens",
    "64",
    "--ll-tokens",
    "16",
    "--hidden",
    "256",
    "--topk",
    "4",
];

/// `uep bench --json` with `args`: the reports, every one verified; fails with the
/// ranks' output on a non-zero exit.
pub fn bench_reports(args: &[&str]) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_uep"))
        .args(["bench", "--json"])
        .args(args)
        .output()
        .expect("run uep");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "uep bench {args:?} failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    let reports: Vec<serde_json::Value> = serde_json::from_str(&stdout).expect("JSON report");
    assert!(!reports.is_empty());
    for r in &reports {
        assert_eq!(r["verified"], true, "{args:?}: {r}");
    }
    reports
}
