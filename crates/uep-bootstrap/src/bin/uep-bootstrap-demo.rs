//! Self-test rank program for `uep-bootstrap`: run it under `launch_local`, torchrun, mpirun or
//! srun. Each rank joins the group, all-gathers its rank number, checks that every rank sent its
//! own, passes a barrier and prints one line. Exits 0 on success, 2 on any error.
//!
//! Test knobs (environment): `UEP_DEMO_TIMEOUT_MS` (group timeout, default 10000);
//! `UEP_DEMO_EXIT=<rank>:<code>` makes that rank exit with `code` right after joining, without
//! leaving the group cleanly (a crash, as far as the others can tell); `UEP_DEMO_HANG=1` makes the
//! other ranks sleep after joining instead of running the collectives; `UEP_DEMO_EXPECT_LAUNCHER=1`
//! checks the variables `launch_local` promises.

use std::process::ExitCode;
use std::time::Duration;

use uep_bootstrap::{EnvSource, Group, WorldInfo, LISTEN_FD_VAR};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let rank = std::env::var("RANK").unwrap_or_else(|_| "?".into());
            eprintln!("uep-bootstrap-demo rank {rank}: error: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let info = WorldInfo::from_env()?;
    let timeout_ms: u64 = match std::env::var("UEP_DEMO_TIMEOUT_MS") {
        Ok(v) => v
            .parse()
            .map_err(|_| format!("UEP_DEMO_TIMEOUT_MS={v:?} is not a number"))?,
        Err(_) => 10_000,
    };
    if std::env::var_os("UEP_DEMO_EXPECT_LAUNCHER").is_some() {
        if info.source != EnvSource::Uep {
            return Err(
                format!("expected the uep launcher environment, got {}", info.source).into(),
            );
        }
        if info.secret.is_none() {
            return Err("launch_local did not set UEP_SECRET".into());
        }
        if (info.rank == 0) != std::env::var_os(LISTEN_FD_VAR).is_some() {
            return Err(format!("{LISTEN_FD_VAR} must be set for rank 0 and only rank 0").into());
        }
    }
    let group = Group::connect(&info, Duration::from_millis(timeout_ms))?;

    if let Ok(spec) = std::env::var("UEP_DEMO_EXIT") {
        let (rank, code) = spec
            .split_once(':')
            .and_then(|(r, c)| Some((r.parse::<usize>().ok()?, c.parse::<i32>().ok()?)))
            .ok_or_else(|| format!("UEP_DEMO_EXIT={spec:?} is not <rank>:<code>"))?;
        if rank == info.rank {
            // Exit without dropping the group: the others see a crash.
            std::process::exit(code);
        }
    }
    if std::env::var_os("UEP_DEMO_HANG").is_some() {
        std::thread::sleep(Duration::from_secs(600));
    }

    let all = group.all_gather(&(info.rank as u32).to_le_bytes())?;
    for (i, part) in all.iter().enumerate() {
        if part.as_slice() != (i as u32).to_le_bytes() {
            return Err(format!("all_gather slot {i} holds {part:?}, expected rank {i}").into());
        }
    }
    group.barrier()?;
    println!(
        "uep-bootstrap-demo: rank {}/{} (node {}/{}, local rank {}) job {} ok",
        group.rank(),
        group.world_size(),
        group.node(),
        group.num_nodes(),
        group.local_rank(),
        group.job_id()
    );
    Ok(())
}
