//! End-to-end: `launch_local` spawning the `uep-bootstrap-demo` binary as real rank processes.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use uep_bootstrap::{launch_local, launch_local_with_grace, BootstrapError, LaunchSpec};

fn demo(ranks: usize, nodes: usize, env: &[(&str, &str)]) -> LaunchSpec {
    let mut env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    env.push(("UEP_DEMO_EXPECT_LAUNCHER".into(), "1".into()));
    LaunchSpec {
        ranks,
        nodes,
        program: env!("CARGO_BIN_EXE_uep-bootstrap-demo").into(),
        args: Vec::new(),
        env,
        timeout: Some(Duration::from_secs(30)),
    }
}

#[test]
fn all_ranks_join_and_gather() {
    for (ranks, nodes) in [(4, 2), (1, 1), (3, 1)] {
        let out = launch_local(&demo(ranks, nodes, &[])).unwrap();
        assert!(out.success(), "{ranks}x{nodes}: {}", out.summary());
        assert_eq!(out.statuses.len(), ranks);
        assert!(out.first_failure().is_none());
    }
}

#[test]
fn a_failing_rank_is_reported_and_the_others_fail_fast() {
    let t0 = Instant::now();
    let out = launch_local(&demo(4, 2, &[("UEP_DEMO_EXIT", "2:1")])).unwrap();
    assert!(!out.success());
    // Which failure the launcher sees first is a race (see `first_failure`), but it sees one.
    let (rank, status) = out.first_failure().unwrap();
    assert!(!status.success() && rank < 4);
    assert_eq!(out.statuses[2].code(), Some(1), "{}", out.summary());
    // The survivors learnt of the crash through the group and exited with an error themselves,
    // well within the launcher's 5 s grace period.
    for r in [0, 1, 3] {
        assert_eq!(
            out.statuses[r].code(),
            Some(2),
            "rank {r}: {}",
            out.summary()
        );
        assert!(!out.killed[r]);
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
}

#[test]
fn hanging_ranks_are_killed_after_the_grace_period() {
    let t0 = Instant::now();
    let spec = demo(3, 1, &[("UEP_DEMO_EXIT", "1:3"), ("UEP_DEMO_HANG", "1")]);
    let out = launch_local_with_grace(&spec, Duration::from_millis(300)).unwrap();
    assert_eq!(
        out.first_failure().map(|(r, s)| (r, s.code())),
        Some((1, Some(3)))
    );
    for r in [0, 2] {
        assert!(out.killed[r], "{}", out.summary());
        assert_eq!(out.statuses[r].signal(), Some(libc::SIGKILL));
    }
    assert!(
        out.summary().contains("killed by launcher"),
        "{}",
        out.summary()
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn launch_timeout_kills_everything() {
    let mut spec = demo(2, 1, &[("UEP_DEMO_HANG", "1")]);
    spec.timeout = Some(Duration::from_secs(1));
    let t0 = Instant::now();
    match launch_local(&spec) {
        Err(BootstrapError::LaunchTimeout { running, .. }) => assert_eq!(running, vec![0, 1]),
        other => panic!("expected a launch timeout, got {other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}
