//! `uep bench --elastic --soak STEPS --chaos SEED`: victims, the steps they die at and
//! the moments inside those steps, all drawn from SEED, so a failure replays with the
//! same command. A victim is a rank or, sometimes, every rank of a node at once; it
//! SIGKILLs itself at the start of its step, a drawn time into it (inside a call, or
//! between calls), or inside one of the step's agreement rounds after a drawn number of
//! its messages (between two sends of one round, or after its round messages and
//! before its decision). At most half of the ranks die, so the rest may go on.
//!
//! On one node, some victims are replaced: a new process takes the rank's place a few
//! steps after its death ([`rejoins`], `crate::rejoin`).
//!
//! Every victim (of `--kill` and `--kill-node` too) notes the moment it dies in the
//! directory the launcher names in `UEP_BENCH_DEATHS`, so that survivors can print
//! how long after each death they masked the rank ([`death_to_masked_ms`]).

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uep_ep::Buffer;

use crate::args::{At, BenchArgs};

/// When, inside its step, a victim dies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// As the step begins.
    Start,
    /// This long after the step began (a thread SIGKILLs the process).
    After(Duration),
    /// In one of the step's agreements, once it has sent some of its messages.
    Agreement {
        /// Which (0: the dispatch's, 1: the combine's).
        nth: u64,
        /// Messages sent before it dies.
        sends: usize,
    },
}

/// One victim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kill {
    /// The rank that dies.
    pub rank: usize,
    /// The step it dies in.
    pub step: u64,
    /// When in that step.
    pub moment: Moment,
}

/// The victims of `seed` for `ranks` ranks as `nodes` nodes over `steps` steps.
pub fn plan(seed: u64, ranks: usize, nodes: usize, steps: u64) -> Vec<Kill> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let per_node = ranks / nodes.max(1);
    let budget = rng.gen_range(1..=(ranks / 2).max(1));
    let mut kills: Vec<Kill> = Vec::new();
    while kills.len() < budget {
        let left = budget - kills.len();
        let whole_node = nodes > 1 && per_node <= left && rng.gen_bool(0.3);
        let who: Vec<usize> = match whole_node {
            true => {
                let node = rng.gen_range(0..nodes);
                (node * per_node..(node + 1) * per_node).collect()
            }
            false => vec![rng.gen_range(0..ranks)],
        };
        if who.iter().any(|r| kills.iter().any(|k| k.rank == *r)) {
            continue;
        }
        let step = rng.gen_range(2..steps.saturating_sub(2).max(3));
        let moment = match rng.gen_range(0..3) {
            0 => Moment::Start,
            1 => Moment::After(Duration::from_micros(rng.gen_range(0..5_000))),
            _ => Moment::Agreement {
                nth: rng.gen_range(0..2),
                // Each agreement sends a round message and a decision to each peer.
                sends: rng.gen_range(0..2 * (ranks - 1).max(1)),
            },
        };
        kills.extend(who.into_iter().map(|rank| Kill { rank, step, moment }));
    }
    kills
}

/// A replacement of a killed rank (`crate::rejoin`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejoin {
    /// The rank it takes the place of.
    pub rank: usize,
    /// The step it is started at.
    pub step: u64,
    /// It dies this long after it started (while it starts, asks at the door, or
    /// after it was let in), if it does.
    pub dies_after: Option<Duration>,
}

impl From<At> for Rejoin {
    fn from(at: At) -> Rejoin {
        Rejoin {
            rank: at.who,
            step: at.step,
            dies_after: None,
        }
    }
}

/// Which victims of `kills` a replacement takes the place of, at which step it is started, and whether it dies too (one in four,
/// 150 to 400 ms after it started: the process takes about 200 ms to start here), also
/// drawn from `seed` (from a stream of its own, so the victims of a seed stay what
/// they were).
pub fn rejoins(seed: u64, kills: &[Kill], steps: u64) -> Vec<Rejoin> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7265_6a6f_696e);
    kills
        .iter()
        .filter_map(|k| {
            let step = k.step + rng.gen_range(2..=6);
            let dies = rng.gen_bool(0.25);
            let after = Duration::from_millis(rng.gen_range(150..400));
            (rng.gen_bool(0.5) && step < steps).then_some(Rejoin {
                rank: k.rank,
                step,
                dies_after: dies.then_some(after),
            })
        })
        .collect()
}

/// The victims `--chaos` asks for (none without it).
pub fn from_args(args: &BenchArgs) -> Vec<Kill> {
    match (args.chaos, args.soak) {
        (Some(seed), Some(steps)) => plan(seed, args.ranks, args.nodes, steps),
        _ => Vec::new(),
    }
}

/// For each masked rank that left a death note: how long after its death this rank
/// masked it, in ms.
pub fn death_to_masked_ms(buffer: &Buffer) -> Vec<(usize, f64)> {
    let masked_at = buffer.low_latency_masked_at();
    (0..buffer.num_ranks())
        .filter_map(|r| {
            let at = masked_at[r]?;
            let note = std::fs::read_to_string(death_note(r)?).ok()?;
            let died = SystemTime::UNIX_EPOCH + Duration::from_nanos(note.trim().parse().ok()?);
            let ms = match at.duration_since(died) {
                Ok(d) => d.as_secs_f64() * 1e3,
                Err(e) => -e.duration().as_secs_f64() * 1e3,
            };
            Some((r, ms))
        })
        .collect()
}

/// Every rank told to die: by `--kill`, `--kill-node` or `--chaos`.
pub fn all_victims(args: &BenchArgs) -> Vec<usize> {
    let chaos = victims(&from_args(args));
    let per_node = args.ranks / args.nodes.max(1);
    (0..args.ranks)
        .filter(|&r| {
            args.kill.iter().any(|k| k.who == r)
                || args.kill_node.iter().any(|k| k.who == r / per_node)
                || chaos.contains(&r)
        })
        .collect()
}

/// The ranks `plan` makes victims of.
pub fn victims(kills: &[Kill]) -> Vec<usize> {
    let mut v: Vec<usize> = kills.iter().map(|k| k.rank).collect();
    v.sort_unstable();
    v
}

/// At the start of `step`: set this rank's death in motion if the plan says so.
pub fn arm(buffer: &mut Buffer, kills: &[Kill], step: u64) -> anyhow::Result<()> {
    let rank = buffer.rank();
    let Some(kill) = kills.iter().find(|k| k.rank == rank && k.step == step) else {
        return Ok(());
    };
    eprintln!(
        "uep chaos: rank {rank} dies in step {step}: {:?}",
        kill.moment
    );
    match kill.moment {
        Moment::Start => die(rank),
        Moment::After(d) => {
            std::thread::spawn(move || {
                std::thread::sleep(d);
                die(rank);
            });
        }
        Moment::Agreement { nth, sends } => {
            buffer.fault_in_agreement(nth, sends, Box::new(move || die(rank)))?
        }
    }
    Ok(())
}

/// The environment variable that names the directory of death notes.
pub const DEATHS_VAR: &str = "UEP_BENCH_DEATHS";

fn death_note(rank: usize) -> Option<PathBuf> {
    Some(PathBuf::from(std::env::var_os(DEATHS_VAR)?).join(format!("rank{rank}")))
}

/// Note the moment of death (nanoseconds since the epoch), then SIGKILL this process
/// (a real kill: no unwinding, no exit handlers).
pub fn die(rank: usize) {
    if let Some(path) = death_note(rank) {
        let ns = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let _ = std::fs::write(path, ns.to_string());
    }
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status();
    // Not reached once the signal lands.
    std::thread::sleep(Duration::from_secs(3600));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_replay_and_leave_survivors() {
        for seed in 0..500 {
            for (ranks, nodes) in [(4, 2), (8, 4), (2, 1)] {
                let p = plan(seed, ranks, nodes, 24);
                assert_eq!(p, plan(seed, ranks, nodes, 24));
                let v = victims(&p);
                assert!(!v.is_empty() && v.len() <= (ranks / 2).max(1), "{p:?}");
                assert!(
                    v.windows(2).all(|w| w[0] < w[1]),
                    "a rank dies twice: {p:?}"
                );
                assert!(p.iter().all(|k| (2..22).contains(&k.step)), "{p:?}");
            }
        }
    }

    /// The long tier's seeds (100..150 on 4 ranks as 2 nodes and 8 as 4) meet every
    /// kind of moment, whole nodes, and several victims in one run.
    #[test]
    fn the_long_tiers_seeds_cover_every_moment() {
        let (mut start, mut after, mut agreement, mut several, mut nodes) = (0, 0, 0, 0, 0);
        for seed in 100..150 {
            for (ranks, n) in [(4, 2), (8, 4)] {
                let p = plan(seed, ranks, n, 24);
                for k in &p {
                    match k.moment {
                        Moment::Start => start += 1,
                        Moment::After(_) => after += 1,
                        Moment::Agreement { .. } => agreement += 1,
                    }
                }
                several += usize::from(p.len() > 1);
                let per_node = ranks / n;
                nodes += usize::from((0..n).any(|node| {
                    (node * per_node..(node + 1) * per_node).all(|r| p.iter().any(|k| k.rank == r))
                }));
            }
        }
        eprintln!(
            "victims by moment: start {start}, after {after}, in an agreement {agreement}; \
             runs with several victims {several}, with a whole node {nodes} (of 100)"
        );
        assert!(start.min(after).min(agreement) >= 10 && several >= 20 && nodes >= 10);
    }
}
