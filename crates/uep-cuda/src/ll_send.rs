//! The low-latency dispatch's send to other nodes on the GPU (`kernels/ll_send.cu`),
//! token by token as UCCL-EP does it: each token cast to FP8 once into staging rows in
//! pinned host memory, one 16-byte Write pushed per distinct destination rank, CPU
//! threads draining the FIFOs as proxies do. Checked: the staged rows equal the host's
//! `quantize_token` bit for bit, and the commands drained are exactly the ones the
//! routing asks for (each once), whatever order the warps pushed them in.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::LaunchConfig;
use uep_fifo::{Fifo, TransferCmd};
use uep_wire::Command;

use crate::api::LlSendArgs;
use crate::gpu::{driver, kernels};
use crate::inputs::{inputs, routing};
use crate::quant::{compare, GROUP};
use crate::rings::DeviceRings;
use crate::{CudaError, Gpu, Pinned};

/// Where the staged rows sit in the sender's symmetric buffer, and the receive area in
/// every rank's (the offsets the commands carry).
const STAGED_OFF: u64 = 1 << 20;
const RECV_OFF: u64 = 1 << 30;
/// The sending rank.
const SRC_RANK: u64 = 1;
/// How long the consumers wait for the commands.
const DEADLINE: Duration = Duration::from_secs(60);

/// One send's shape.
#[derive(Clone, Copy, Debug)]
pub struct SendShape {
    /// Tokens this rank sends.
    pub tokens: usize,
    /// Channels a token (a multiple of 128).
    pub hidden: usize,
    /// Slots a token (at most 32).
    pub topk: usize,
    /// Experts over all ranks.
    pub experts: usize,
    /// Ranks.
    pub ranks: usize,
    /// UE8M0 scales.
    pub round_scale: bool,
    /// FIFOs, one a block of one warp.
    pub rings: usize,
    /// CPU threads draining them.
    pub consumers: usize,
}

impl SendShape {
    /// Bytes of a staged row: FP8 channels, then f32 scales.
    pub fn row_bytes(&self) -> usize {
        self.hidden + self.hidden / GROUP * 4
    }

    /// The kernel's argument of this shape, its addresses to fill in.
    fn args(&self) -> LlSendArgs {
        LlSendArgs {
            staged_off: STAGED_OFF,
            recv_off: RECV_OFF,
            src_rank: SRC_RANK as u32,
            max_tokens: self.tokens as u32,
            tokens: self.tokens as u32,
            topk: self.topk as u32,
            hidden: self.hidden as u32,
            experts: self.experts as u32,
            ranks: self.ranks as u32,
            round_scale: u32::from(self.round_scale),
            ..Default::default()
        }
    }

    fn check(&self) -> Result<(), CudaError> {
        let ok = self.tokens > 0
            && self.hidden > 0
            && self.hidden % GROUP == 0
            && (1..=32).contains(&self.topk)
            && self.ranks > 0
            && self.experts % self.ranks == 0
            && self.experts > 0
            && self.ranks <= uep_wire::MAX_RANKS
            && self.rings > 0
            && self.consumers > 0;
        if ok {
            Ok(())
        } else {
            Err(CudaError::Invalid(format!("bad LL send shape {self:?}")))
        }
    }
}

/// What the send measured.
#[derive(Clone, Copy, Debug)]
pub struct SendResult {
    /// The inputs' seed.
    pub seed: u64,
    /// Commands a send pushes.
    pub commands: usize,
    /// Median launch → last pop, host clock.
    pub wall: Duration,
    /// Median of the slowest warp's loop, GPU clock.
    pub kernel: Duration,
}

/// The commands the routing asks for: per token, one Write per distinct rank of its
/// valid slots.
fn expected(s: &SendShape, ids: &[i64]) -> Vec<TransferCmd> {
    let row = s.row_bytes() as u64;
    let epr = s.experts / s.ranks;
    let mut cmds = Vec::new();
    for (t, slots) in ids.chunks(s.topk).enumerate() {
        let mut ranks: Vec<usize> = slots
            .iter()
            .filter(|&&e| e >= 0)
            .map(|&e| e as usize / epr)
            .collect();
        ranks.sort_unstable();
        ranks.dedup();
        for r in ranks {
            let t = t as u64;
            let cmd = Command::Write {
                flags: Default::default(),
                dst_rank: r as u16,
                src_off: STAGED_OFF + t * row,
                dst_off: RECV_OFF + (SRC_RANK * s.tokens as u64 + t) * row,
                len: row as u32,
                piggyback: None,
            };
            cmds.push(TransferCmd::encode(&cmd).expect("the send's commands fit the wire format"));
        }
    }
    cmds.sort_by_key(|c| c.to_u128());
    cmds
}

/// Casts fresh tokens and pushes their commands on the GPU `1 + iters` times; checks
/// the rows once and the commands every time; times the last `iters`.
pub fn check(gpu: &Gpu, s: SendShape, seed: u64, iters: usize) -> Result<SendResult, CudaError> {
    s.check()?;
    let x = inputs(s.tokens, s.hidden, seed);
    let ids = routing(s.tokens, s.topk, s.experts, s.ranks, seed);
    let want = expected(&s, &ids);
    let stream = gpu.stream();
    let f = gpu.function(kernels::LL_SEND, "uep_ll_send")?;
    let bits: Vec<u16> = x.iter().map(|v| v.to_bits()).collect();
    let xd = stream.clone_htod(&bits).map_err(driver("copying tokens"))?;
    let idd = stream
        .clone_htod(&ids)
        .map_err(driver("copying topk_idx"))?;
    let staged = Pinned::new(gpu, s.tokens * s.row_bytes())?;
    staged.fill(0xA5);
    let rings = DeviceRings::new(gpu, s.rings, uep_fifo::DEFAULT_CAPACITY, "ll send ring")?;
    let ns = stream
        .alloc_zeros::<u64>(s.rings)
        .map_err(driver("allocating timers"))?;
    let cfg = LaunchConfig {
        grid_dim: (s.rings as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (mut walls, mut kernels) = (Vec::new(), Vec::new());
    for i in 0..=iters {
        let popped = AtomicUsize::new(0);
        let total = want.len();
        let drain =
            |mine: &[(usize, &Fifo)], failed: &AtomicBool| collect(mine, total, &popped, failed);
        let (got, wall) = rings.drained_while(s.consumers, drain, || {
            let args = LlSendArgs {
                x: gpu.addr(&xd),
                topk_idx: gpu.addr(&idd),
                rings: gpu.addr(rings.table()),
                ns: gpu.addr(&ns),
                staged: staged.device_addr(),
                ..s.args()
            };
            // SAFETY: tokens [T, hidden] and ids [T, K] on the device, the ring table and
            // a timer a block, the staging rows ([T, row_bytes]) in pinned memory; all
            // stay allocated, pinned and leased until the synchronize below.
            #[allow(unsafe_code)]
            unsafe {
                gpu.launch(&f, cfg, &args, "launching uep_ll_send")
            }
        })?;
        stream
            .synchronize()
            .map_err(driver("running uep_ll_send"))?;
        let mut got: Vec<TransferCmd> = got.into_iter().flatten().collect();
        got.sort_by_key(|c| c.to_u128());
        if got != want {
            return Err(CudaError::Mismatch(format!(
                "run {i}: the kernels pushed {} commands, the routing asks for {} (or they differ)",
                got.len(),
                want.len()
            )));
        }
        let t = stream.clone_dtoh(&ns).map_err(driver("copying timers"))?;
        walls.push(wall);
        kernels.push(Duration::from_nanos(t.into_iter().max().unwrap_or(0)));
        if i == 0 {
            check_rows(&s, &x, &staged)?;
        }
    }
    Ok(SendResult {
        seed,
        commands: want.len(),
        wall: warm_median(walls),
        kernel: warm_median(kernels),
    })
}

/// The median of `times` without the first (cold) run.
fn warm_median(mut times: Vec<Duration>) -> Duration {
    times.remove(0);
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}

/// The staged rows against the host's cast of the same tokens.
fn check_rows(s: &SendShape, x: &[half::bf16], staged: &Pinned) -> Result<(), CudaError> {
    let (q, scales) = uep_ep::quant::quantize(x, s.hidden, s.round_scale)
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    let rows = staged.read(s.tokens * s.row_bytes());
    let mut got_q = Vec::with_capacity(q.len());
    let mut got_s = Vec::with_capacity(scales.len());
    for row in rows.chunks(s.row_bytes()) {
        got_q.extend_from_slice(&row[..s.hidden]);
        got_s.extend(
            row[s.hidden..]
                .chunks(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        );
    }
    compare((&q, &scales), (&got_q, &got_s), s.hidden)
}

/// Drains `rings` into a list until `total` commands were popped over all consumers.
fn collect(
    rings: &[(usize, &Fifo)],
    total: usize,
    popped: &AtomicUsize,
    failed: &AtomicBool,
) -> Result<Vec<TransferCmd>, CudaError> {
    let mut consumers = rings
        .iter()
        .map(|(_, f)| f.consumer())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CudaError::Fifo(e.to_string()))?;
    let deadline = Instant::now() + DEADLINE;
    let mut got = Vec::new();
    while popped.load(Ordering::Relaxed) < total {
        if failed.load(Ordering::Relaxed) || Instant::now() > deadline {
            return Err(CudaError::Fifo(format!(
                "{} of {total} commands arrived within {DEADLINE:?}",
                popped.load(Ordering::Relaxed)
            )));
        }
        for c in consumers.iter_mut() {
            while let Some((slot, cmd)) = c.poll() {
                got.push(cmd);
                c.pop(slot).map_err(|e| CudaError::Fifo(e.to_string()))?;
                popped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    Ok(got)
}
