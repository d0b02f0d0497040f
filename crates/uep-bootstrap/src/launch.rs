//! `launch_local`: run every rank of a job as a child process on this machine.

use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::env::{LAUNCHER_LOCAL, LAUNCHER_VAR, PORT_VAR, SECRET_VAR};
use crate::error::BootstrapError;
use crate::fdpass::{self, LISTEN_FD_VAR};
use crate::proto;
use crate::store::{StoreServer, STORE_VAR};

/// How long the surviving ranks get to exit on their own after one rank failed.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How often the launcher checks on its children (a waitpid per child per poll is cheap).
const POLL: Duration = Duration::from_millis(5);

/// Variables the launcher sets itself; [`LaunchSpec::env`] may not override them.
const RESERVED: [&str; 10] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    PORT_VAR,
    SECRET_VAR,
    LAUNCHER_VAR,
    LISTEN_FD_VAR,
    STORE_VAR,
];

/// What [`launch_local`] runs: `ranks` copies of `program args`, laid out on `nodes` simulated
/// nodes of `ranks / nodes` ranks each.
#[derive(Debug, Clone, Default)]
pub struct LaunchSpec {
    /// Number of ranks (processes), at least 1.
    pub ranks: usize,
    /// Number of simulated nodes; must divide `ranks`.
    pub nodes: usize,
    /// Program every rank runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank; may not set the variables the launcher sets
    /// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `UEP_MASTER_PORT`,
    /// `UEP_SECRET`, `UEP_LAUNCHER`, `UEP_LISTEN_FD`).
    pub env: Vec<(String, String)>,
    /// Kill everything and fail if the job runs longer than this (`None`: no limit).
    pub timeout: Option<Duration>,
}

/// How each rank of a [`launch_local`] job ended.
#[derive(Debug, Clone)]
pub struct LaunchOutcome {
    /// Exit status of each rank, indexed by rank.
    pub statuses: Vec<ExitStatus>,
    /// Whether the launcher killed the rank (it was still running a grace period after another
    /// rank failed).
    pub killed: Vec<bool>,
    /// The rank whose failure the launcher observed first.
    first_failed: Option<usize>,
}

impl LaunchOutcome {
    /// Whether every rank exited with status 0.
    pub fn success(&self) -> bool {
        self.statuses.iter().all(ExitStatus::success)
    }

    /// The rank whose failure the launcher observed first (in time, not by rank number) and its
    /// status.
    ///
    /// Often the cause, but not reliably: ranks that fail because of another rank's crash can
    /// exit within microseconds of it and be observed first (the crashed process's sockets close
    /// before it becomes reapable). Each rank's own error output names the rank that failed.
    pub fn first_failure(&self) -> Option<(usize, ExitStatus)> {
        self.first_failed.map(|r| (r, self.statuses[r]))
    }

    /// A one-line summary, e.g. `4 ranks: all exited 0` or `4 ranks: rank 2 failed first
    /// (exit status: 1); rank 0: exit status: 2, ...`.
    pub fn summary(&self) -> String {
        let n = self.statuses.len();
        match self.first_failure() {
            None => format!("{n} ranks: all exited 0"),
            Some((r, s)) => {
                let others: Vec<String> = self
                    .statuses
                    .iter()
                    .enumerate()
                    .filter(|&(i, s)| i != r && !s.success())
                    .map(|(i, s)| {
                        let how = if self.killed[i] {
                            " (killed by launcher)"
                        } else {
                            ""
                        };
                        format!("rank {i}: {s}{how}")
                    })
                    .collect();
                let tail = if others.is_empty() {
                    String::new()
                } else {
                    format!("; {}", others.join(", "))
                };
                format!("{n} ranks: rank {r} failed first ({s}){tail}")
            }
        }
    }
}

/// Runs `spec.ranks` processes of `spec.program` on this machine as one job and waits for all.
///
/// Same as [`launch_local_with_grace`] with [`DEFAULT_GRACE`].
pub fn launch_local(spec: &LaunchSpec) -> Result<LaunchOutcome, BootstrapError> {
    launch_local_with_grace(spec, DEFAULT_GRACE)
}

/// Runs `spec.ranks` processes of `spec.program` on this machine as one job and waits for all.
///
/// Every rank gets torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
/// `LOCAL_WORLD_SIZE = ranks / nodes`, `MASTER_ADDR=127.0.0.1`, `UEP_MASTER_PORT`), a fresh random
/// `UEP_SECRET`, `UEP_LAUNCHER=local`, the address of the job's store that the launcher
/// keeps while it runs ([`crate::StoreServer`], `UEP_STORE`: as torchrun's agent keeps its
/// `TCPStore`, it outlives every rank), and `spec.env`; stdout and stderr are inherited, stdin is
/// closed. The port is chosen race-free: the launcher binds `127.0.0.1:0` and rank 0 inherits
/// that listening socket (`UEP_LISTEN_FD`), which [`crate::Group::connect`] adopts.
///
/// Every rank dies (SIGKILL) if the thread that launched it ends first, say because the
/// launcher was killed: no rank outlives its launcher.
///
/// Once a rank exits unsuccessfully (non-zero or by a signal), the others get `grace` to exit on
/// their own and are then killed. Returns the per-rank statuses; fails if a rank cannot be spawned
/// or `spec.timeout` expires (then all ranks are killed first).
pub fn launch_local_with_grace(
    spec: &LaunchSpec,
    grace: Duration,
) -> Result<LaunchOutcome, BootstrapError> {
    let local_world_size = validate(spec)?;
    let start = Instant::now();
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| BootstrapError::io("binding 127.0.0.1:0 for rank 0", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| BootstrapError::io("reading the rendezvous port", e))?
        .port();
    let secret =
        proto::random_hex::<32>().map_err(|e| BootstrapError::io("generating UEP_SECRET", e))?;
    tracing::info!(
        ranks = spec.ranks,
        nodes = spec.nodes,
        port,
        program = %spec.program.display(),
        "launching local ranks"
    );
    let store = StoreServer::bind("127.0.0.1:0")?;
    let mut listener = Some(listener);
    let mut children: Vec<Child> = Vec::with_capacity(spec.ranks);
    for rank in 0..spec.ranks {
        let mut cmd = rank_command(spec, rank, local_world_size, port, &secret);
        cmd.env(STORE_VAR, store.addr().to_string());
        if let Some(l) = &listener {
            // Only rank 0 (the first spawn) inherits the listening socket.
            let fd = l.as_raw_fd();
            cmd.env(LISTEN_FD_VAR, fd.to_string());
            fdpass::inherit_in_child(&mut cmd, fd);
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(source) => {
                kill_all(&mut children);
                let program = spec.program.display().to_string();
                return Err(BootstrapError::Spawn {
                    rank,
                    program,
                    source,
                });
            }
        }
        // Rank 0 now owns the socket; closing our copy means the port stops accepting as soon
        // as rank 0 closes it after everyone joined.
        listener = None;
    }
    watch_ranks(spec, children, start, grace)
}

/// Rank `rank`'s process: the spec's program, arguments and environment, the launcher
/// variables, no stdin, killed when the launching thread ends.
fn rank_command(
    spec: &LaunchSpec,
    rank: usize,
    local_world_size: usize,
    port: u16,
    secret: &str,
) -> Command {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", spec.ranks.to_string())
        .env("LOCAL_RANK", (rank % local_world_size).to_string())
        .env("LOCAL_WORLD_SIZE", local_world_size.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env(PORT_VAR, port.to_string())
        .env(SECRET_VAR, secret)
        .env(LAUNCHER_VAR, LAUNCHER_LOCAL)
        .env_remove(LISTEN_FD_VAR)
        .stdin(Stdio::null());
    fdpass::die_with_launcher(&mut cmd);
    cmd
}

/// Waits for every rank; once one fails, the others get `grace` and are then killed.
/// Past `spec.timeout` every rank still running is killed and the launch fails.
fn watch_ranks(
    spec: &LaunchSpec,
    mut children: Vec<Child>,
    start: Instant,
    grace: Duration,
) -> Result<LaunchOutcome, BootstrapError> {
    let n = children.len();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut killed = vec![false; n];
    let mut first_failed: Option<usize> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        for (r, child) in children.iter_mut().enumerate() {
            if statuses[r].is_some() {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    statuses[r] = Some(status);
                    if !status.success() && first_failed.is_none() {
                        tracing::warn!(rank = r, %status, ?grace, "rank failed; others get a grace period");
                        first_failed = Some(r);
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    kill_all(&mut children);
                    return Err(BootstrapError::io(format!("waiting for rank {r}"), e));
                }
            }
        }
        let running: Vec<usize> = (0..n).filter(|&r| statuses[r].is_none()).collect();
        if running.is_empty() {
            break;
        }
        if let Some(t) = spec.timeout.filter(|&t| start.elapsed() >= t) {
            tracing::warn!(?running, "launch timed out; killing the remaining ranks");
            kill_all(&mut children);
            return Err(BootstrapError::LaunchTimeout {
                timeout: t,
                running,
            });
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            tracing::warn!(?running, "grace period over; killing the remaining ranks");
            for &r in &running {
                let _ = children[r].kill();
                killed[r] = true;
            }
            // Their statuses are collected by the next round(s) of try_wait.
            kill_at = None;
        }
        thread::sleep(POLL);
    }
    Ok(LaunchOutcome {
        statuses: statuses.into_iter().flatten().collect(),
        killed,
        first_failed,
    })
}

/// Checks the spec; returns the number of ranks per node.
fn validate(spec: &LaunchSpec) -> Result<usize, BootstrapError> {
    let bad = |m: String| Err(BootstrapError::InvalidLaunch(m));
    if spec.ranks == 0 || spec.nodes == 0 {
        return bad(format!(
            "ranks ({}) and nodes ({}) must both be at least 1",
            spec.ranks, spec.nodes
        ));
    }
    if spec.ranks % spec.nodes != 0 {
        return bad(format!(
            "{} ranks cannot be split evenly over {} nodes; ranks must be a multiple of nodes",
            spec.ranks, spec.nodes
        ));
    }
    if spec.program.as_os_str().is_empty() {
        return bad("no program given".into());
    }
    if let Some((k, _)) = spec
        .env
        .iter()
        .find(|(k, _)| RESERVED.contains(&k.as_str()))
    {
        return bad(format!(
            "env may not set {k}: the launcher sets {} itself",
            RESERVED.join(", ")
        ));
    }
    Ok(spec.ranks / spec.nodes)
}

/// Kills and reaps every child that is still running.
fn kill_all(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ranks: usize, nodes: usize) -> LaunchSpec {
        LaunchSpec {
            ranks,
            nodes,
            program: "/bin/true".into(),
            ..Default::default()
        }
    }

    #[test]
    fn rejects_bad_specs() {
        for (s, needle) in [
            (spec(3, 2), "multiple of nodes"),
            (spec(0, 1), "at least 1"),
            (spec(2, 0), "at least 1"),
            (
                LaunchSpec {
                    program: PathBuf::new(),
                    ..spec(2, 1)
                },
                "no program",
            ),
            (
                LaunchSpec {
                    env: vec![(PORT_VAR.into(), "1".into())],
                    ..spec(2, 1)
                },
                "may not set UEP_MASTER_PORT",
            ),
        ] {
            let e = launch_local(&s).unwrap_err();
            assert!(matches!(e, BootstrapError::InvalidLaunch(_)), "{e}");
            assert!(e.to_string().contains(needle), "{e}");
        }
    }

    #[test]
    fn spawn_failure_names_rank_and_program() {
        let s = LaunchSpec {
            program: "/nonexistent/uep-no-such-program".into(),
            ..spec(2, 1)
        };
        let e = launch_local(&s).unwrap_err();
        assert!(matches!(e, BootstrapError::Spawn { rank: 0, .. }), "{e}");
        assert!(e.to_string().contains("uep-no-such-program"), "{e}");
    }

    #[test]
    fn plain_programs_report_statuses() {
        let ok = launch_local(&spec(3, 1)).unwrap();
        assert!(
            ok.success() && ok.first_failure().is_none(),
            "{}",
            ok.summary()
        );
        assert_eq!(ok.statuses.len(), 3);
        let bad = launch_local(&LaunchSpec {
            program: "/bin/false".into(),
            ..spec(2, 2)
        })
        .unwrap();
        assert!(!bad.success());
        let (_, status) = bad.first_failure().unwrap();
        assert_eq!(status.code(), Some(1));
        assert!(bad.summary().contains("failed first"), "{}", bad.summary());
    }
}
