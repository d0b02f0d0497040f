//! `uep bench --inputs` with one rank's inputs corrupted: every rank stops with an
//! error that says what is wrong, well within the deadline, and none hangs or panics.
//! Each corruption hits a victim rank drawn from a fixed seed (printed, so a failure
//! replays), on 4 ranks as one node and as two; under uep's own launcher, and under
//! torchrun and mpirun where they are installed (skipped with the reason elsewhere,
//! required in CI).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uep_harness::npy::{NpyArray, NpyData};
use uep_harness::workload::{generate_all, JobShape, Routing, TokenData, WorkloadSpec};

mod common;
use common::{find, mpirun_4, torchrun_4};

const RANKS: usize = 4;
const SHAPE: JobShape = JobShape {
    num_ranks: RANKS,
    ranks_per_node: RANKS,
    hidden: 256,
    topk: 4,
    num_experts: 16,
};
/// The bench's deadline (`--timeout`), seconds.
const DEADLINE: u64 = 5;

/// What is wrong with the victim's inputs, and what every rank's error must say.
#[derive(Clone, Copy, Debug)]
enum Corruption {
    /// An expert id past the last expert.
    IdPastLast,
    /// An expert id below -1.
    IdBelowMinusOne,
    /// `x` of another hidden size.
    Hidden,
    /// `x` as int64.
    Dtype,
    /// One row fewer of `topk_weights` than of `x`.
    Rows,
    /// `topk_idx.npy` cut short.
    Truncated,
    /// No `topk_weights.npy`.
    Missing,
}

impl Corruption {
    const ALL: [Corruption; 7] = [
        Corruption::IdPastLast,
        Corruption::IdBelowMinusOne,
        Corruption::Hidden,
        Corruption::Dtype,
        Corruption::Rows,
        Corruption::Truncated,
        Corruption::Missing,
    ];

    /// Words the error must contain.
    fn says(self) -> &'static [&'static str] {
        match self {
            Corruption::IdPastLast | Corruption::IdBelowMinusOne => &["topk_idx", "expert ids"],
            Corruption::Hidden => &["hidden"],
            Corruption::Dtype => &["x.npy"],
            Corruption::Rows => &["topk_weights"],
            Corruption::Truncated => &["topk_idx.npy"],
            Corruption::Missing => &["topk_weights.npy"],
        }
    }
}

/// Every rank's valid inputs in `dir`, then `victim`'s corrupted by `c`.
fn write_inputs(dir: &Path, victim: usize, c: Corruption, seed: u64) {
    let spec = WorkloadSpec {
        shape: SHAPE,
        tokens_per_rank: 32,
        routing: Routing::Mixed,
        drop_prob: 0.1,
        fp8_input: false,
        seed,
    };
    let (h, k) = (SHAPE.hidden, SHAPE.topk);
    for (r, input) in generate_all(&spec).unwrap().into_iter().enumerate() {
        let d = dir.join(format!("rank{r}"));
        std::fs::create_dir_all(&d).unwrap();
        let TokenData::Bf16(x) = input.x else {
            unreachable!("bf16 inputs")
        };
        let (t, mut idx, mut w) = (input.num_tokens, input.topk_idx, input.topk_weights);
        let mut x: NpyArray = NpyArray::new(
            vec![t, h],
            NpyData::U16(x.iter().map(|v| v.to_bits()).collect()),
        )
        .unwrap();
        let mut w_rows = t;
        if r == victim {
            match c {
                Corruption::IdPastLast => idx[t * k / 2] = SHAPE.num_experts as i64,
                Corruption::IdBelowMinusOne => idx[0] = -3,
                Corruption::Hidden => {
                    x = NpyArray::new(vec![t, h / 2], NpyData::U16(vec![0; t * h / 2])).unwrap()
                }
                Corruption::Dtype => {
                    x = NpyArray::new(vec![t, h], NpyData::I64(vec![1; t * h])).unwrap()
                }
                Corruption::Rows => {
                    w_rows = t - 1;
                    w.truncate(w_rows * k);
                }
                Corruption::Truncated | Corruption::Missing => {}
            }
        }
        x.write(&d.join("x.npy")).unwrap();
        let idx = NpyArray::new(vec![t, k], NpyData::I64(idx)).unwrap();
        idx.write(&d.join("topk_idx.npy")).unwrap();
        let w = NpyArray::new(vec![w_rows, k], NpyData::F32(w)).unwrap();
        w.write(&d.join("topk_weights.npy")).unwrap();
        if r == victim {
            match c {
                Corruption::Truncated => {
                    let path = d.join("topk_idx.npy");
                    let bytes = std::fs::read(&path).unwrap();
                    std::fs::write(&path, &bytes[..bytes.len() - 9]).unwrap();
                }
                Corruption::Missing => std::fs::remove_file(d.join("topk_weights.npy")).unwrap(),
                _ => {}
            }
        }
    }
}

/// The bench flags of these runs (shape as written, a short deadline).
fn flags(dir: &Path) -> Vec<String> {
    let mut f: Vec<String> = ["bench", "--hidden", "256", "--topk", "4", "--experts", "16"]
        .map(String::from)
        .to_vec();
    f.extend(["--iters", "1", "--warmup", "0", "--no-limits"].map(String::from));
    f.extend(["--timeout".into(), DEADLINE.to_string()]);
    f.extend(["--inputs".into(), dir.display().to_string()]);
    f
}

/// Runs `cmd`, killing it past the deadline plus slack: its output and the time it took.
fn run(cmd: &mut Command) -> (bool, String, Duration) {
    let started = Instant::now();
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start uep");
    let limit = Duration::from_secs(DEADLINE + 20);
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text, started.elapsed())
}

/// Every corruption, its victim drawn from `seed`, through `launch` (which adds the
/// launcher's own arguments before the bench's).
fn every_corruption(seed: u64, launch: impl Fn(&[String]) -> Command) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for c in Corruption::ALL {
        let victim = rng.gen_range(0..RANKS);
        let dir = tempfile::tempdir().unwrap();
        write_inputs(dir.path(), victim, c, seed);
        let (ok, text, took) = run(&mut launch(&flags(dir.path())));
        let case = format!("seed {seed}, {c:?} on rank {victim}");
        assert!(!ok, "{case}: the bench succeeded:\n{text}");
        assert!(
            took < Duration::from_secs(DEADLINE + 10),
            "{case}: took {took:?}:\n{text}"
        );
        assert!(
            !text.contains("panicked"),
            "{case}: a rank panicked:\n{text}"
        );
        for word in c.says() {
            assert!(text.contains(word), "{case}: no {word:?} in:\n{text}");
        }
        let named = format!("rank {victim}");
        assert!(
            text.contains(&named),
            "{case}: the error does not name {named}:\n{text}"
        );
        println!("{case}: every rank stopped in {took:.1?}");
    }
}

#[test]
fn corrupted_inputs_of_one_rank_stop_every_rank_with_the_reason() {
    for (seed, nodes) in [(20261205, "1"), (20261206, "2")] {
        every_corruption(seed, |bench| {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_uep"));
            cmd.args(bench).args(["--ranks", "4", "--nodes", nodes]);
            cmd
        });
    }
}

#[test]
fn under_torchrun_too() {
    let Some(torchrun) = find("torchrun", "UEP_TORCHRUN") else {
        return;
    };
    every_corruption(20261207, |bench| {
        let mut cmd = torchrun_4(&torchrun);
        cmd.args(bench);
        cmd
    });
}

#[test]
fn under_mpirun_too() {
    let Some(mpirun) = find("mpirun", "UEP_MPIRUN") else {
        return;
    };
    every_corruption(20261208, |bench| {
        let mut cmd = mpirun_4(&mpirun);
        cmd.args(bench);
        cmd
    });
}
