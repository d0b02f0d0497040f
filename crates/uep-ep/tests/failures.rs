//! Failure handling across real rank processes (docs/architecture.md, "Failures":
//! never hang silently).
//!
//! Every test launches a small job of this very test binary: the children run the
//! ignored [`rank_process`] test, which reads `UEP_TEST_SCENARIO`, joins the job's
//! bootstrap group, builds a small [`Buffer`] and plays its part of the scenario
//! (behave, send bad input, sleep instead of entering an op, ...). Each rank writes its
//! pid, a `ready` mark and its outcome to files in `UEP_TEST_OUT`, which the parent reads
//! back and checks: who failed, with which kind of error, naming whom, how fast.
//!
//! Deadlines are short (1.5–3 s) so that a wait that should end early but instead runs
//! into its deadline fails the timing assertions, and a real hang is cut off by the
//! launcher's timeout.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use half::bf16;
use uep_bootstrap::{
    launch_local_with_grace, BootstrapError, EnvSource, Group, LaunchOutcome, LaunchSpec, WorldInfo,
};
use uep_ep::{Buffer, BufferConfig, Cast, DispatchArgs, EpError, LlDispatchArgs, Tokens};

/// Which scenario a rank process plays.
const SCENARIO_VAR: &str = "UEP_TEST_SCENARIO";
/// Directory where rank processes leave their pid, ready mark and outcome.
const OUT_VAR: &str = "UEP_TEST_OUT";
/// The rank that misbehaves (bad input, dies, lags).
const BAD_VAR: &str = "UEP_TEST_BAD_RANK";
/// Deadline of every Buffer wait, in milliseconds.
const DEADLINE_VAR: &str = "UEP_TEST_DEADLINE_MS";

// A small Buffer: 12 experts split evenly over 3 or 4 ranks.
const EXPERTS: usize = 12;
const HIDDEN: usize = 256;
const TOPK: usize = 4;
const TOKENS: usize = 64;
const LL_TOKENS: usize = 32;

/// Slack for process scheduling on a loaded 2-core CI machine.
const MARGIN: Duration = Duration::from_millis(1500);
/// How long the parent lets the ranks block before it kills the victim.
const KILL_AFTER: Duration = Duration::from_millis(300);

// ---------------------------------------------------------------------------------------
// Rank side
// ---------------------------------------------------------------------------------------

/// Entry point of the rank processes; does nothing unless launched by a test of this file.
#[test]
#[ignore = "entry point for rank processes"]
fn rank_process() {
    // Run by hand (`--include-ignored`) there is no job to join.
    let Ok(scenario) = std::env::var(SCENARIO_VAR) else {
        return;
    };
    let out = PathBuf::from(std::env::var(OUT_VAR).expect("UEP_TEST_OUT"));
    let bad: usize = env_num(BAD_VAR, 0);
    let deadline = Duration::from_millis(env_num(DEADLINE_VAR, 3000) as u64);
    let info = WorldInfo::from_env().expect("rank environment");
    let rank = info.rank;
    fs::write(
        out.join(format!("pid{rank}")),
        std::process::id().to_string(),
    )
    .unwrap();
    let group = Group::connect(&info, Duration::from_secs(30)).expect("rendezvous");
    fs::write(out.join(format!("job{rank}")), group.job_id()).unwrap();
    let rank_ctx = Rank {
        rank,
        bad,
        deadline,
        out: out.clone(),
    };
    let line = match play(&scenario, group, &rank_ctx) {
        Ok(Some(timed)) => timed.describe(),
        Ok(None) => "outcome=skipped\n".to_string(),
        Err(setup) => format!("outcome=setup-failed\nmsg={setup}\n"),
    };
    fs::write(out.join(format!("result{rank}")), line).unwrap();
}

fn env_num(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

/// What a rank process knows about its part.
struct Rank {
    rank: usize,
    bad: usize,
    deadline: Duration,
    out: PathBuf,
}

impl Rank {
    fn is_bad(&self) -> bool {
        self.rank == self.bad
    }

    /// Tell the parent this rank is about to block (or to sleep, if it is the victim).
    fn ready(&self) {
        fs::write(self.out.join(format!("ready{}", self.rank)), "").unwrap();
    }

    fn config(&self, hidden: usize) -> BufferConfig {
        BufferConfig {
            timeout: self.deadline,
            ..BufferConfig::new(EXPERTS, hidden, TOPK, TOKENS, LL_TOKENS)
        }
    }

    fn buffer(&self, group: Group, hidden: usize) -> Result<Buffer, String> {
        Buffer::new(group, self.config(hidden)).map_err(|e| format!("Buffer::new: {e}"))
    }
}

/// The outcome of the one call a scenario is about.
struct Timed {
    result: Result<(), EpError>,
    elapsed: Duration,
    end_ms: u128,
}

impl Timed {
    fn run(f: impl FnOnce() -> Result<(), EpError>) -> Timed {
        let start = Instant::now();
        let result = f();
        Timed {
            result,
            elapsed: start.elapsed(),
            end_ms: unix_ms(),
        }
    }

    fn describe(&self) -> String {
        let timing = format!(
            "elapsed_ms={}\nend_ms={}\n",
            self.elapsed.as_millis(),
            self.end_ms
        );
        match &self.result {
            Ok(()) => format!("outcome=ok\n{timing}"),
            Err(e) => {
                let kind = e.kind();
                // One line: the parent reads the message as the rest of the file.
                let msg = e.to_string().replace('\n', " | ");
                format!("outcome=err\nkind={kind}\n{timing}msg={msg}\n")
            }
        }
    }
}

/// Deterministic inputs: `tokens` tokens of `hidden` channels, each routed to four
/// distinct experts (`t + 3s + rank mod 12`), weights 0.25.
fn inputs(rank: usize, tokens: usize, hidden: usize) -> (Vec<bf16>, Vec<i64>, Vec<f32>) {
    let x = (0..tokens * hidden)
        .map(|i| bf16::from_f32(((i % 13) as f32 - 6.0) * 0.25 + rank as f32))
        .collect();
    let idx = (0..tokens)
        .flat_map(|t| (0..TOPK).map(move |s| ((t + 3 * s + rank) % EXPERTS) as i64))
        .collect();
    (x, idx, vec![0.25; tokens * TOPK])
}

/// Sleep far past every deadline: the parent kills this process before it wakes.
fn play_dead(me: &Rank) -> Result<Option<Timed>, String> {
    me.ready();
    thread::sleep(Duration::from_secs(30));
    Err("the victim was not killed".into())
}

/// Play `scenario`; `Err` means a step before the call under test failed.
fn play(scenario: &str, group: Group, me: &Rank) -> Result<Option<Timed>, String> {
    let (x, idx, w) = inputs(me.rank, TOKENS, HIDDEN);
    let dispatch_ok = |buf: &mut Buffer| -> Result<uep_ep::NormalHandle, String> {
        buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))
            .map(|o| o.handle)
            .map_err(|e| format!("setup dispatch: {e}"))
    };
    let (llx, llidx, llw) = inputs(me.rank, LL_TOKENS, HIDDEN);
    match scenario {
        // --- 1. bad input on one rank --------------------------------------------------
        "dispatch_topk_out_of_range" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let mut idx = idx.clone();
            if me.is_bad() {
                idx[3 * TOPK + 2] = EXPERTS as i64;
            }
            Ok(Some(Timed::run(|| {
                buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))
                    .map(drop)
            })))
        }
        "dispatch_wrong_x_len" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let mut x = x.clone();
            if me.is_bad() {
                x.truncate(x.len() - 5);
            }
            Ok(Some(Timed::run(|| {
                buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))
                    .map(drop)
            })))
        }
        "dispatch_too_many_tokens" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let tokens = if me.is_bad() { TOKENS + 1 } else { TOKENS };
            let (big_x, big_idx, big_w) = inputs(me.rank, tokens, HIDDEN);
            Ok(Some(Timed::run(|| {
                let first = buf
                    .dispatch(DispatchArgs::new(Tokens::Bf16(&big_x)).topk(&big_idx, Some(&big_w)))
                    .map(drop);
                // Every rank stopped together, before any row moved: the same Buffer
                // then serves a call that fits.
                buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))?;
                first
            })))
        }
        "dispatch_fp8_hidden_200" => {
            let mut buf = me.buffer(group, 200)?;
            let (x, idx, w) = inputs(me.rank, TOKENS, 200);
            // What a caller would pass for FP8 at hidden 200: one byte a channel and
            // ceil(200/128) = 2 scales a token.
            let data = vec![0x38u8; TOKENS * 200];
            let scales = vec![1.0f32; TOKENS * 2];
            let tokens = if me.is_bad() {
                Tokens::Fp8 {
                    data: &data,
                    scales: &scales,
                }
            } else {
                Tokens::Bf16(&x)
            };
            Ok(Some(Timed::run(|| {
                buf.dispatch(DispatchArgs::new(tokens).topk(&idx, Some(&w)))
                    .map(drop)
            })))
        }
        "combine_wrong_x_len" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let handle = dispatch_ok(&mut buf)?;
            let rows = handle.num_recv_tokens + usize::from(me.is_bad());
            let y = vec![bf16::ONE; rows * HIDDEN];
            Ok(Some(Timed::run(|| {
                buf.combine(&y, None, &handle).map(drop)
            })))
        }
        "ll_dispatch_topk_out_of_range" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let mut llidx = llidx.clone();
            if me.is_bad() {
                llidx[5 * TOPK + 1] = -2;
            }
            Ok(Some(Timed::run(|| {
                buf.low_latency_dispatch(LlDispatchArgs::new(&llx, &llidx))
                    .map(drop)
            })))
        }
        "ll_combine_foreign_handle" | "ll_combine_other_topk" => {
            let foreign = scenario == "ll_combine_foreign_handle";
            let world = group.world_size();
            let mut buf = me.buffer(group, HIDDEN)?;
            let mut handle = buf
                .low_latency_dispatch(LlDispatchArgs::new(&llx, &llidx))
                .map_err(|e| format!("setup LL dispatch: {e}"))?
                .handle;
            // A low-latency dispatch is no barrier: without one, a rank could still be
            // receiving the set-up when the bad rank aborts its combine.
            buf.barrier().map_err(|e| format!("setup barrier: {e}"))?;
            let mut llidx = llidx.clone();
            if me.is_bad() && foreign {
                // A handle from a second Buffer of this process (a world of one).
                let solo = solo_group().map_err(|e| format!("solo group: {e}"))?;
                let mut other = Buffer::new(solo, me.config(HIDDEN))
                    .map_err(|e| format!("solo Buffer::new: {e}"))?;
                handle = other
                    .low_latency_dispatch(LlDispatchArgs::new(&llx, &llidx))
                    .map_err(|e| format!("solo LL dispatch: {e}"))?
                    .handle;
            } else if me.is_bad() {
                // Same shape, one slot routed elsewhere.
                llidx[2 * TOPK] = (llidx[2 * TOPK] + 1) % EXPERTS as i64;
            }
            let y = vec![bf16::ONE; (EXPERTS / world) * world * LL_TOKENS * HIDDEN];
            Ok(Some(Timed::run(|| {
                buf.low_latency_combine(&y, &llidx, &llw, &handle).map(drop)
            })))
        }
        // --- 2. configs that differ across ranks --------------------------------------
        "config_mismatch" => {
            let hidden = if me.is_bad() { 2 * HIDDEN } else { HIDDEN };
            let cfg = me.config(hidden);
            Ok(Some(Timed::run(|| Buffer::new(group, cfg).map(drop))))
        }
        "config_invalid_on_one_rank" => {
            let mut cfg = me.config(HIDDEN);
            if me.is_bad() {
                if let Some(s) = cfg.normal.as_mut() {
                    s.topk = EXPERTS + 1;
                }
            }
            Ok(Some(Timed::run(|| Buffer::new(group, cfg).map(drop))))
        }
        // --- 3. a peer dies while the others wait in an op ----------------------------
        "dead_in_dispatch" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            if me.is_bad() {
                return play_dead(me);
            }
            me.ready();
            Ok(Some(Timed::run(|| {
                buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))
                    .map(drop)
            })))
        }
        "dead_in_combine" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let handle = dispatch_ok(&mut buf)?;
            if me.is_bad() {
                return play_dead(me);
            }
            let y = vec![bf16::ONE; handle.num_recv_tokens * HIDDEN];
            me.ready();
            Ok(Some(Timed::run(|| {
                buf.combine(&y, None, &handle).map(drop)
            })))
        }
        "dead_in_barrier" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            if me.is_bad() {
                return play_dead(me);
            }
            me.ready();
            Ok(Some(Timed::run(|| buf.barrier())))
        }
        "dead_in_ll_dispatch" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            if me.is_bad() {
                return play_dead(me);
            }
            me.ready();
            Ok(Some(Timed::run(|| {
                buf.low_latency_dispatch(
                    LlDispatchArgs::new(&llx, &llidx).cast(Cast::fp8_if(true, false)),
                )
                .map(drop)
            })))
        }
        // --- 5. a live rank that never enters the op ----------------------------------
        "never_combine" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let handle = dispatch_ok(&mut buf)?;
            if me.is_bad() {
                // Alive, busy elsewhere, past everyone's deadline.
                thread::sleep(me.deadline + MARGIN);
                return Ok(None);
            }
            let y = vec![bf16::ONE; handle.num_recv_tokens * HIDDEN];
            Ok(Some(Timed::run(|| {
                buf.combine(&y, None, &handle).map(drop)
            })))
        }
        "combine_into_wrong_output" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let handle = dispatch_ok(&mut buf)?;
            let y = vec![bf16::ONE; handle.num_recv_tokens * HIDDEN];
            let tokens = if me.is_bad() { TOKENS - 1 } else { TOKENS };
            let mut out = vec![bf16::ZERO; tokens * HIDDEN];
            Ok(Some(Timed::run(|| {
                buf.combine_into(&y, uep_ep::CombineArgs::default(), &handle, &mut out, None)
            })))
        }
        "dispatch_num_worst_tokens_too_small" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let worst = if me.is_bad() { 1 } else { 0 };
            Ok(Some(Timed::run(|| {
                buf.dispatch(
                    DispatchArgs::new(Tokens::Bf16(&x))
                        .topk(&idx, Some(&w))
                        .num_worst_tokens(worst),
                )
                .map(drop)
            })))
        }
        // --- after a failure ----------------------------------------------------------
        "retry_after_bad_input" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let mut bad_idx = idx.clone();
            if me.is_bad() {
                bad_idx[0] = 99;
            }
            if buf
                .dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&bad_idx, Some(&w)))
                .is_ok()
            {
                return Err("the dispatch with bad input succeeded".into());
            }
            let timed = Timed::run(|| {
                buf.dispatch(DispatchArgs::new(Tokens::Bf16(&x)).topk(&idx, Some(&w)))
                    .map(drop)
            });
            // Stay alive until every rank is done, as a framework that catches errors would.
            let _ = buf.control_plane().barrier();
            Ok(Some(timed))
        }
        "late_combine" => {
            let mut buf = me.buffer(group, HIDDEN)?;
            let handle = dispatch_ok(&mut buf)?;
            let y = vec![bf16::ONE; handle.num_recv_tokens * HIDDEN];
            if me.is_bad() {
                // Arrives after everyone else gave up (but is still alive).
                thread::sleep(me.deadline + Duration::from_millis(300));
            }
            let timed = Timed::run(|| buf.combine(&y, None, &handle).map(drop));
            let _ = buf.control_plane().barrier();
            Ok(Some(timed))
        }
        other => Err(format!("unknown scenario {other:?}")),
    }
}

/// A bootstrap group of one rank, for a second Buffer in this process.
fn solo_group() -> Result<Group, BootstrapError> {
    let info = WorldInfo {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        rendezvous_port: 1,
        secret: None,
        source: EnvSource::Torchrun,
    };
    Group::connect(&info, Duration::from_secs(5))
}

// ---------------------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------------------

/// A launched job: its output directory and the thread waiting for its ranks.
struct Job {
    scenario: &'static str,
    ranks: usize,
    out: OutDir,
    waiter: thread::JoinHandle<Result<LaunchOutcome, BootstrapError>>,
}

/// A fresh directory removed when the test ends.
struct OutDir(PathBuf);

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Start `ranks` rank processes playing `scenario`, with `bad` the misbehaving rank.
fn launch(scenario: &'static str, ranks: usize, bad: usize, deadline: Duration) -> Job {
    launch_on(scenario, ranks, 1, bad, deadline)
}

/// [`launch`] with the ranks split into `nodes` nodes that share no memory (the proxy
/// and libfabric `tcp;ofi_rxm` on loopback between them).
fn launch_on(
    scenario: &'static str,
    ranks: usize,
    nodes: usize,
    bad: usize,
    deadline: Duration,
) -> Job {
    static SEQ: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "uep-failures-{}-{}-{scenario}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dir).unwrap();
    // Through `sh` only to send each rank's output (the test harness's chatter, and a
    // panic message if any) to `log<rank>`, shown by `finish`; `exec` keeps the pid.
    let script = format!(
        "exec \"$0\" --exact rank_process --nocapture --test-threads=1 --include-ignored \
         >\"{dir}/log$RANK\" 2>&1",
        dir = dir.display()
    );
    let spec = LaunchSpec {
        ranks,
        nodes,
        program: "/bin/sh".into(),
        args: vec![
            OsString::from("-c"),
            OsString::from(script),
            std::env::current_exe().unwrap().into_os_string(),
        ],
        env: vec![
            (SCENARIO_VAR.into(), scenario.into()),
            (OUT_VAR.into(), dir.display().to_string()),
            (BAD_VAR.into(), bad.to_string()),
            (DEADLINE_VAR.into(), deadline.as_millis().to_string()),
            // A socket provider binds to loopback (ignored on one node).
            ("UEP_FI_NODE".into(), "127.0.0.1".into()),
        ],
        // Far beyond any deadline here: only a real hang gets this far.
        timeout: Some(Duration::from_secs(40)),
    };
    // A long grace: ranks must finish on their own, not be killed by the launcher.
    let waiter = thread::spawn(move || launch_local_with_grace(&spec, Duration::from_secs(30)));
    Job {
        scenario,
        ranks,
        out: OutDir(dir),
        waiter,
    }
}

/// One rank's outcome as it wrote it.
#[derive(Debug)]
struct Outcome {
    rank: usize,
    outcome: String,
    kind: String,
    elapsed: Duration,
    end_ms: u128,
    msg: String,
}

impl Outcome {
    fn parse(rank: usize, text: &str) -> Outcome {
        let field = |k: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_default()
                .to_string()
        };
        Outcome {
            rank,
            outcome: field("outcome"),
            kind: field("kind"),
            elapsed: Duration::from_millis(field("elapsed_ms").parse().unwrap_or(u64::MAX)),
            end_ms: field("end_ms").parse().unwrap_or(u128::MAX),
            msg: field("msg"),
        }
    }

    /// Assert this rank failed on a timeout: its own, or a peer's relayed through the
    /// abort word (the first rank to give up tells the others why), with every needle.
    fn expect_timeout(&self, needles: &[&str]) -> &Self {
        assert_eq!(
            self.outcome, "err",
            "rank {}: expected a timeout, got {self:?}",
            self.rank
        );
        assert!(
            self.kind == "timeout" || (self.kind == "peer_aborted" && self.msg.contains("timeout")),
            "rank {}: expected a timeout, got {self:?}",
            self.rank
        );
        self.expect_msg(needles)
    }

    /// Assert this rank failed with an error of `kind` whose message has every needle.
    /// `"peer"` is either peer kind: a rank that hears of a death from another rank's
    /// abort before its own watch sees it reports `peer_aborted`, naming the death.
    fn expect_err(&self, kind: &str, needles: &[&str]) -> &Self {
        let seen = match self.kind.as_str() {
            "peer_lost" | "peer_aborted" if kind == "peer" => "peer",
            k => k,
        };
        assert_eq!(
            (self.outcome.as_str(), seen),
            ("err", kind),
            "rank {}: expected a {kind} error, got {self:?}",
            self.rank
        );
        self.expect_msg(needles)
    }

    /// Assert the message has every needle.
    fn expect_msg(&self, needles: &[&str]) -> &Self {
        for n in needles {
            assert!(
                self.msg.contains(n),
                "rank {}: message lacks {n:?}: {}",
                self.rank,
                self.msg
            );
        }
        self
    }

    fn within(&self, limit: Duration) -> &Self {
        assert!(
            self.elapsed < limit,
            "rank {} took {:?} (limit {limit:?}): {}",
            self.rank,
            self.elapsed,
            self.msg
        );
        self
    }
}

/// `kill -9 pid`; whether the signal was delivered.
fn send_kill(pid: u32) -> bool {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run kill")
        .success()
}

impl Job {
    fn dir(&self) -> &Path {
        &self.out.0
    }

    /// Wait until every rank in `ranks` has written its ready mark.
    fn wait_ready(&self, ranks: impl Iterator<Item = usize> + Clone) {
        let start = Instant::now();
        while !ranks
            .clone()
            .all(|r| self.dir().join(format!("ready{r}")).exists())
        {
            assert!(
                !self.waiter.is_finished(),
                "{}: the job ended before every rank was ready",
                self.scenario
            );
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{}: ranks not ready after 30 s",
                self.scenario
            );
            thread::sleep(Duration::from_millis(5));
        }
    }

    fn pid(&self, rank: usize) -> u32 {
        let text = fs::read_to_string(self.dir().join(format!("pid{rank}"))).unwrap();
        text.trim().parse().unwrap()
    }

    /// SIGKILL `rank`; returns when it was sent (unix ms).
    fn kill(&self, rank: usize) -> u128 {
        let pid = self.pid(rank);
        assert!(send_kill(pid), "kill -9 {pid} failed");
        unix_ms()
    }

    /// SIGKILL every rank of `victims` (a whole node), the first first; returns when
    /// that was sent (unix ms). A later victim may already have ended on its own (it
    /// fails at once on its node-mate's death), so only the first must still be there.
    fn kill_all(&self, victims: &[usize]) -> u128 {
        let killed_at = self.kill(victims[0]);
        for &v in &victims[1..] {
            let pid = self.pid(v);
            // `kill` fails only when no such process exists: it already ended and was
            // reaped, which is the outcome the signal was for.
            if !send_kill(pid) {
                eprintln!("rank {v} (pid {pid}) had ended before its SIGKILL");
            }
        }
        killed_at
    }

    /// Wait for the job; return every rank's outcome (`None` where no result was
    /// written) and the launcher's record.
    fn finish(self) -> Finished {
        let Job {
            scenario,
            ranks,
            out,
            waiter,
        } = self;
        let launched = waiter.join().expect("launcher thread");
        let outcome = match launched {
            Ok(o) => o,
            Err(e) => panic!("{scenario}: the job did not finish: {e}"),
        };
        let launched_summary = outcome.summary();
        let dir = &out.0;
        let read = |name: String| fs::read_to_string(dir.join(name)).ok();
        let results: Vec<Option<Outcome>> = (0..ranks)
            .map(|r| read(format!("result{r}")).map(|t| Outcome::parse(r, &t)))
            .collect();
        // Shown when a test fails (or with --nocapture): what every rank saw.
        for (r, o) in results.iter().enumerate() {
            match o {
                Some(o) if o.outcome == "err" => eprintln!(
                    "{scenario}: rank {r}: {} error after {:?}: {}",
                    o.kind, o.elapsed, o.msg
                ),
                Some(o) => eprintln!("{scenario}: rank {r}: {} {}", o.outcome, o.msg),
                None => eprintln!("{scenario}: rank {r}: no result ({launched_summary})"),
            }
            if !outcome.statuses[r].success() || o.is_none() {
                let log = read(format!("log{r}")).unwrap_or_default();
                eprintln!("{scenario}: rank {r} output:\n{log}");
            }
        }
        let pids = (0..ranks)
            .filter_map(|r| read(format!("pid{r}")))
            .map(|p| p.trim().to_string())
            .collect();
        let jobs = (0..ranks).filter_map(|r| read(format!("job{r}"))).collect();
        Finished {
            scenario,
            launch: outcome,
            results,
            pids,
            jobs,
            _out: out,
        }
    }
}

/// A finished job.
struct Finished {
    scenario: &'static str,
    launch: LaunchOutcome,
    results: Vec<Option<Outcome>>,
    pids: Vec<String>,
    jobs: Vec<String>,
    _out: OutDir,
}

impl Finished {
    fn rank(&self, r: usize) -> &Outcome {
        assert!(
            self.launch.statuses[r].success(),
            "{}: rank {r} exited with {} ({})",
            self.scenario,
            self.launch.statuses[r],
            self.launch.summary()
        );
        self.results[r]
            .as_ref()
            .unwrap_or_else(|| panic!("{}: rank {r} wrote no result", self.scenario))
    }

    /// No `uep-*` segment of this job, or of any of its processes, is left in /dev/shm.
    fn assert_no_segments_left(&self) {
        let left: Vec<String> = fs::read_dir(uep_shm::SHM_DIR)
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.starts_with(uep_shm::NAME_PREFIX))
            .filter(|n| {
                self.jobs.iter().any(|j| n.contains(j.as_str()))
                    || self.pids.iter().any(|p| n.ends_with(&format!("-p{p}")))
            })
            .collect();
        assert!(
            left.is_empty(),
            "{}: segments left behind: {left:?}",
            self.scenario
        );
    }
}

/// Bad input on `bad`: it fails with an invalid-argument error that has `bad_needles`,
/// and every other rank fails at once with a peer error naming `bad` and its reason.
fn bad_input(scenario: &'static str, ranks: usize, bad: usize, bad_needles: &[&str]) {
    bad_input_on(scenario, ranks, 1, bad, bad_needles);
}

/// [`bad_input`] on `nodes` nodes: ranks on other nodes than `bad` share no memory with
/// it and hear of the failure through the proxy, still long before their deadline.
fn bad_input_on(
    scenario: &'static str,
    ranks: usize,
    nodes: usize,
    bad: usize,
    bad_needles: &[&str],
) {
    let deadline = Duration::from_secs(3);
    let done = launch_on(scenario, ranks, nodes, bad, deadline).finish();
    done.rank(bad)
        .expect_err("invalid", bad_needles)
        .within(deadline);
    // A peer either was waiting when the abort came ("rank {bad} aborted") or entered
    // the call afterwards ("unusable after rank {bad} failed"); both name it and why.
    let named = format!("rank {bad}");
    let reason = format!("rank {bad}: invalid argument");
    for r in (0..ranks).filter(|&r| r != bad) {
        // The abort word ends the wait, long before the deadline.
        done.rank(r)
            .expect_err(
                "peer_aborted",
                &[&format!("rank {r}"), &named, &reason, bad_needles[0]],
            )
            .within(deadline);
    }
    done.assert_no_segments_left();
}

#[test]
fn dispatch_topk_out_of_range_fails_everywhere() {
    bad_input(
        "dispatch_topk_out_of_range",
        3,
        1,
        &["topk_idx[3][2] = 12", "[0, 12)"],
    );
}

#[test]
fn bad_input_on_one_node_fails_the_other_node_at_once() {
    bad_input_on(
        "dispatch_topk_out_of_range",
        4,
        2,
        1,
        &["topk_idx[3][2] = 12", "[0, 12)"],
    );
    bad_input_on(
        "ll_dispatch_topk_out_of_range",
        4,
        4,
        2,
        &["topk_idx[5][1] = -2"],
    );
}

#[test]
fn dispatch_wrong_x_length_fails_everywhere() {
    bad_input(
        "dispatch_wrong_x_len",
        3,
        2,
        &[
            &format!("{} bf16 values", TOKENS * HIDDEN - 5),
            "not a multiple of hidden = 256",
        ],
    );
}

#[test]
fn dispatch_too_many_tokens_is_a_capacity_error_everywhere_and_the_buffer_stays_usable() {
    // Every rank learns the others' token counts in the notify step, so all of them stop
    // there together with the same error, and the next call that fits runs (the
    // scenario retries and reports the first error only if the retry worked).
    let deadline = Duration::from_secs(3);
    let done = launch("dispatch_too_many_tokens", 4, 0, deadline).finish();
    for r in 0..4 {
        done.rank(r)
            .expect_err(
                "capacity",
                &[
                    "rank 0 dispatches 65 tokens",
                    "num_max_dispatch_tokens_per_rank = 64",
                    &format!("seen by rank {r}"),
                ],
            )
            .within(deadline);
    }
    done.assert_no_segments_left();
}

#[test]
fn fp8_dispatch_with_hidden_200_fails_everywhere() {
    bad_input(
        "dispatch_fp8_hidden_200",
        3,
        1,
        &["multiple of 128", "got 200"],
    );
}

#[test]
fn combine_wrong_x_length_fails_everywhere() {
    bad_input(
        "combine_wrong_x_len",
        3,
        2,
        &["combine x has", "expected [rows = ", "hidden = 256]"],
    );
}

#[test]
fn ll_dispatch_topk_out_of_range_fails_everywhere() {
    bad_input(
        "ll_dispatch_topk_out_of_range",
        3,
        0,
        &["topk_idx[5][1] = -2", "outside [-1, 12)"],
    );
}

#[test]
fn ll_combine_with_a_foreign_handle_fails_everywhere() {
    bad_input(
        "ll_combine_foreign_handle",
        4,
        3,
        &["handle was made by another Buffer"],
    );
}

#[test]
fn ll_combine_with_other_topk_idx_fails_everywhere() {
    bad_input(
        "ll_combine_other_topk",
        3,
        1,
        &["topk_idx differs from the one dispatched"],
    );
}

#[test]
fn mismatched_configs_fail_on_every_rank() {
    let deadline = Duration::from_secs(3);
    let done = launch("config_mismatch", 3, 2, deadline).finish();
    for r in 0..3 {
        let other = if r == 2 { "rank 0" } else { "rank 2" };
        done.rank(r)
            .expect_err(
                "invalid",
                &[&format!("rank {r}"), other, "different Buffer configs"],
            )
            .within(deadline);
    }
    // The two configs are both shown, so the user sees what differs.
    assert!(done.rank(0).msg.contains("hidden 512") && done.rank(0).msg.contains("hidden 256"));
    done.assert_no_segments_left();
}

#[test]
fn a_config_invalid_on_one_rank_fails_every_rank() {
    let deadline = Duration::from_secs(3);
    let done = launch("config_invalid_on_one_rank", 3, 1, deadline).finish();
    done.rank(1)
        .expect_err("invalid", &["topk (13) must be in 1..=12"])
        .within(deadline);
    for r in [0, 2] {
        done.rank(r)
            .expect_err("peer_aborted", &["rank 1", "topk (13)"])
            .within(deadline);
    }
    done.assert_no_segments_left();
}

/// `victim` sleeps where the others enter an op; the parent SIGKILLs it, and every
/// survivor must fail soon after, naming it, long before the deadline. Returns the
/// finished job and the victim's pid.
fn dead_peer(scenario: &'static str, ranks: usize, victim: usize) -> (Finished, u32) {
    let deadline = Duration::from_secs(3);
    let job = launch(scenario, ranks, victim, deadline);
    job.wait_ready(0..ranks);
    thread::sleep(KILL_AFTER);
    let killed_at = job.kill(victim);
    let pid = job.pid(victim);
    let done = job.finish();
    assert!(
        !done.launch.statuses[victim].success() && done.results[victim].is_none(),
        "{scenario}: the victim was not killed: {}",
        done.launch.summary()
    );
    for r in (0..ranks).filter(|&r| r != victim) {
        let o = done.rank(r);
        o.expect_err(
            "peer",
            &[
                &format!("rank {r}"),
                &format!("rank {victim} (pid {pid}) has died"),
            ],
        )
        .within(deadline);
        // Noticed by the liveness check, not by running into the deadline.
        let after_kill = o.end_ms.saturating_sub(killed_at);
        assert!(
            after_kill < MARGIN.as_millis(),
            "{scenario}: rank {r} failed {after_kill} ms after the kill: {}",
            o.msg
        );
    }
    done.assert_no_segments_left();
    (done, pid)
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_peer_killed_during_dispatch_fails_the_others() {
    dead_peer("dead_in_dispatch", 3, 2);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_peer_killed_during_combine_fails_the_others() {
    dead_peer("dead_in_combine", 3, 1);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_peer_killed_during_barrier_fails_the_others() {
    // Rank 0 also hosts the bootstrap rendezvous: the data path must not depend on it.
    dead_peer("dead_in_barrier", 4, 0);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_peer_killed_during_ll_dispatch_fails_the_others() {
    dead_peer("dead_in_ll_dispatch", 3, 2);
}

/// Across nodes, with a 60 s deadline: `victims` (one rank, or every rank of a node)
/// are SIGKILLed while the others wait in `scenario`'s op; every survivor must fail
/// within two seconds, naming a victim as dead. Ranks on other nodes learn it from the
/// liveness watch (the victim's host closed the connection), its own node's ranks from
/// its process state or the abort of the first rank that knew.
fn dead_across_nodes(scenario: &'static str, ranks: usize, nodes: usize, victims: &[usize]) {
    let deadline = Duration::from_secs(60);
    let job = launch_on(scenario, ranks, nodes, victims[0], deadline);
    job.wait_ready(0..ranks);
    thread::sleep(KILL_AFTER);
    let killed_at = job.kill_all(victims);
    let done = job.finish();
    let named: Vec<String> = victims.iter().map(|v| format!("rank {v}")).collect();
    for r in (0..ranks).filter(|r| !victims.contains(r)) {
        let o = done.rank(r);
        o.expect_err("peer", &[&format!("rank {r}"), "died"]);
        assert!(
            named.iter().any(|n| o.msg.contains(n.as_str())),
            "{scenario}: rank {r} does not name any of {named:?}: {}",
            o.msg
        );
        let after_kill = o.end_ms.saturating_sub(killed_at);
        assert!(
            after_kill < 2000,
            "{scenario}: rank {r} failed {after_kill} ms after the kill: {}",
            o.msg
        );
    }
    done.assert_no_segments_left();
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_rank_killed_during_dispatch_fails_the_other_node_at_once() {
    dead_across_nodes("dead_in_dispatch", 4, 2, &[3]);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_node_killed_during_combine_fails_the_other_node_at_once() {
    dead_across_nodes("dead_in_combine", 4, 2, &[2, 3]);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_rank_killed_during_barrier_fails_the_other_nodes_at_once() {
    // Rank 0 also hosts the bootstrap rendezvous: the data path must not depend on it.
    dead_across_nodes("dead_in_barrier", 4, 4, &[0]);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_node_killed_during_ll_dispatch_fails_the_other_nodes_at_once() {
    dead_across_nodes("dead_in_ll_dispatch", 4, 4, &[2]);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_rank_killed_during_ll_dispatch_fails_both_nodes_at_once() {
    dead_across_nodes("dead_in_ll_dispatch", 4, 2, &[1]);
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_wait_that_never_finishes_times_out_with_a_message() {
    let deadline = Duration::from_millis(1500);
    let done = launch("never_combine", 4, 3, deadline).finish();
    assert_eq!(done.rank(3).outcome, "skipped", "{:?}", done.results[3]);
    for r in 0..3 {
        let o = done.rank(r);
        o.expect_timeout(&[
            &format!("rank {r}: combine 1"),
            "waiting for rank 3",
            "expected >= 1",
            "saw 0",
        ])
        .within(deadline + MARGIN);
        // The first rank to give up ends the others' waits a moment early.
        assert!(
            o.elapsed >= deadline - Duration::from_millis(50),
            "rank {r} gave up after {:?}, before its deadline {deadline:?}: {}",
            o.elapsed,
            o.msg
        );
    }
    done.assert_no_segments_left();
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_dead_peer_error_ends_with_its_cause() {
    let (done, pid) = dead_peer("dead_in_combine", 3, 1);
    for r in [0, 2] {
        let msg = &done.rank(r).msg;
        assert!(
            msg.ends_with(&format!("rank 1 (pid {pid}) has died")),
            "rank {r}: {msg:?}"
        );
    }
}

#[test]
fn num_worst_tokens_too_small_on_one_rank_fails_everywhere() {
    // Found after the counts exchange (the rank learns what it receives only then), so
    // the peers are already past the first wait when the abort reaches them.
    bad_input(
        "dispatch_num_worst_tokens_too_small",
        3,
        1,
        &["receives 192 tokens", "more than num_worst_tokens = 1"],
    );
}

#[test]
fn combine_into_with_a_wrong_output_size_fails_everywhere() {
    bad_input(
        "combine_into_wrong_output",
        3,
        1,
        &["16128", "tokens = 64", "hidden = 256"],
    );
}

#[test]
fn after_a_failed_dispatch_every_later_call_fails_at_once() {
    // Rank 1 rejects its input; then every rank retries with good input. The first call
    // must have failed everywhere (the scenario reports a setup failure otherwise), and
    // the retry must fail at once everywhere, naming rank 1, instead of pairing calls of
    // different steps or waiting for a deadline.
    let deadline = Duration::from_secs(3);
    let done = launch("retry_after_bad_input", 3, 1, deadline).finish();
    for r in 0..3 {
        let o = done.rank(r);
        assert_eq!(o.outcome, "err", "rank {r}: the retry should fail: {o:?}");
        assert!(o.msg.contains("rank 1"), "rank {r}: {}", o.msg);
        o.within(MARGIN);
    }
}

#[test]
#[ignore = "long tier (./dev test runs it, one test at a time): timing-sensitive"]
fn a_rank_arriving_after_its_peers_gave_up_fails_at_once() {
    let deadline = Duration::from_millis(1500);
    let done = launch("late_combine", 3, 2, deadline).finish();
    for r in [0, 1] {
        done.rank(r)
            .expect_timeout(&["waiting for rank 2", "expected >= 1, saw 0"])
            .within(deadline + MARGIN);
    }
    let late = done.rank(2);
    assert_eq!(
        late.outcome, "err",
        "rank 2 completed a combine its peers had given up on: {late:?}"
    );
    assert!(late.msg.contains("timeout"), "{}", late.msg);
    late.within(MARGIN);
}
