//! `uep bench --elastic --soak N --kill R@S --rejoin R@S2` (or `--kill-node N@S
//! --rejoin-node N@S2`): a killed rank (every rank of a killed node) comes back.
//!
//! At the start of step `S2`, the lowest rank that is no victim starts a replacement:
//! this program again, with the victim's rank and [`REJOIN_VAR`] set to the moment it
//! was started. The replacement opens the job's door ([`door_name`], in the launcher's
//! store, [`job_store`], unless `--door-in-shm`), is let in by the
//! survivors at the first step boundary after they all mapped its memory, and from then
//! on runs and checks every step as they do. `--chaos` draws replacements
//! too ([`crate::chaos::rejoins`]). The survivor that started it waits for it and fails
//! if it failed; at the end, survivors hold barriers until every replacement started is
//! back (`soak`'s drain), so that none is left at the door.

use std::process::{Child, Command};
use std::time::{Duration, SystemTime};

use uep_bootstrap::{TcpStore, WorldInfo, LISTEN_FD_VAR, STORE_VAR};
use uep_ep::{Buffer, JobStore};

use crate::args::BenchArgs;
use crate::chaos::{self, Rejoin};

/// Every replacement this run starts: `--rejoin`'s and `--chaos`'s.
pub fn planned(args: &BenchArgs) -> Vec<Rejoin> {
    let mut all: Vec<Rejoin> = (args.rejoin.iter().chain(&args.grow))
        .map(|&at| at.into())
        .collect();
    let per_node = args.ranks / args.nodes.max(1);
    for at in &args.rejoin_node {
        let ranks = at.who * per_node..(at.who + 1) * per_node;
        all.extend(ranks.map(|who| Rejoin::from(crate::args::At { who, step: at.step })));
    }
    if let (Some(seed), Some(steps)) = (args.chaos, args.soak) {
        all.extend(chaos::rejoins(seed, &chaos::from_args(args), steps));
    }
    all
}

/// The rank that starts replacements: the lowest one told to die by nothing.
fn starter(args: &BenchArgs) -> Option<usize> {
    let victims = chaos::all_victims(args);
    (0..args.ranks).find(|r| !victims.contains(r))
}

/// Set in a replacement's environment: when it was started (ms since the epoch).
pub const REJOIN_VAR: &str = "UEP_BENCH_REJOIN_MS";
/// Set in a replacement's environment if it is to die: this many ms after it started.
pub const DIES_VAR: &str = "UEP_BENCH_REJOIN_DIES_MS";

/// The door of the job `info` describes: the same name on every rank and on a
/// replacement started with the same environment (the rendezvous address and secret).
pub fn door_name(info: &WorldInfo) -> String {
    uep_ep::door_name(&format!(
        "{}:{}:{}",
        info.master_addr,
        info.rendezvous_port,
        info.secret.as_deref().unwrap_or("")
    ))
}

/// The job's store, where its launcher keeps one (`UEP_STORE`, which `uep bench`'s
/// sets): the door is kept there, where every host reaches it.
pub fn job_store(timeout: Duration) -> anyhow::Result<Option<JobStore>> {
    let Ok(addr) = std::env::var(STORE_VAR) else {
        return Ok(None);
    };
    let store = TcpStore::connect(&addr, timeout)?;
    Ok(Some(JobStore(std::sync::Arc::new(store))))
}

/// When this process was started as a replacement (`None`: it is a founding rank).
pub fn started_as_replacement() -> Option<SystemTime> {
    let ms: u64 = std::env::var(REJOIN_VAR).ok()?.parse().ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
}

/// This process is a replacement that is to die (`--chaos`): SIGKILL it then.
pub fn arm_own_death(rank: usize) {
    let Some(ms) = std::env::var(DIES_VAR)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    let since = started_as_replacement()
        .and_then(|t| t.elapsed().ok())
        .unwrap_or_default();
    let left = Duration::from_millis(ms).saturating_sub(since);
    std::thread::spawn(move || {
        std::thread::sleep(left);
        eprintln!("uep chaos: the replacement of rank {rank} dies {ms} ms after it started");
        chaos::die(rank);
    });
}

/// The replacements this rank started, waited for at the end.
#[derive(Debug, Default)]
pub struct Replacements {
    children: Vec<(Rejoin, Child)>,
}

impl Replacements {
    /// Start the replacements `due` ([`due`]), if this rank starts them.
    pub fn start(
        &mut self,
        buffer: &Buffer,
        due: &[Rejoin],
        args: &BenchArgs,
    ) -> anyhow::Result<()> {
        if starter(args) != Some(buffer.rank()) {
            return Ok(());
        }
        let world = buffer.num_ranks();
        for &j in due {
            self.children.push((j, spawn(j, world)?));
        }
        Ok(())
    }

    /// Wait for every replacement; `false` if one failed (other than by the death
    /// `--chaos` planned for it).
    pub fn wait(self) -> anyhow::Result<bool> {
        let mut ok = true;
        for (j, mut child) in self.children {
            let status = child.wait()?;
            let planned = j.dies_after.is_some() && status.code().is_none();
            if !status.success() && !planned {
                eprintln!("uep soak: the replacement of rank {} {status}", j.rank);
                ok = false;
            }
        }
        Ok(ok)
    }
}

/// The replacements that start at `step`: due then, of ranks masked (a victim may
/// outlive its kill: one set in an agreement round that sends fewer messages than
/// drawn). The same on every survivor: their masks agree.
pub fn due(buffer: &Buffer, plan: &[Rejoin], step: u64) -> Vec<Rejoin> {
    let mask = buffer.low_latency_mask();
    (plan.iter())
        .filter(|j| j.step == step && mask[j.rank])
        .copied()
        .collect()
}

/// Start this program again as `j`'s rank of `world` (the job's room, reserved ranks
/// included), with this process's arguments and environment (so the same rendezvous
/// and door), output to the same places.
fn spawn(j: Rejoin, world: usize) -> anyhow::Result<Child> {
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH)?;
    eprintln!("uep soak: starting a process for rank {}", j.rank);
    // The victim's place among the launcher's ranks of its node, as the launcher
    // numbered it.
    let local_world_size: usize = (std::env::var("LOCAL_WORLD_SIZE").ok())
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1);
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1))
        .env("RANK", j.rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", (j.rank % local_world_size).to_string())
        .env(REJOIN_VAR, now.as_millis().to_string())
        .env_remove(LISTEN_FD_VAR);
    if let Some(d) = j.dies_after {
        cmd.env(DIES_VAR, d.as_millis().to_string());
    }
    Ok(cmd.spawn()?)
}
