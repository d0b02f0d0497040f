//! The FIFO figure on a real GPU: kernels push `Write` commands into FIFOs in pinned
//! host memory and CPU threads drain them, as uep's proxies do (UCCL-EP reports 7-8 M
//! commands/s a GPU and 3-5 µs of added latency).
//!
//! Every command is checked on arrival: ring `r`'s `i`th command must be the 4 KiB
//! Write the kernel makes for `(r, i)` (`kernels/fifo_bench.cu`), so a lost, repeated,
//! reordered or torn command fails the bench instead of counting.

#[cfg(any(test, feature = "cuda"))]
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
#[cfg(any(test, feature = "cuda"))]
use std::time::Instant;

#[cfg(feature = "cuda")]
use cudarc::driver::LaunchConfig;
#[cfg(any(test, feature = "cuda"))]
use uep_fifo::Fifo;
use uep_fifo::TransferCmd;
use uep_wire::{Command, TransferCmd as Wire};

#[cfg(feature = "cuda")]
use crate::api::{FifoPingArgs, FifoPushArgs};
#[cfg(any(test, feature = "cuda"))]
use crate::CudaError;
#[cfg(feature = "cuda")]
use crate::{
    gpu::{driver, kernels},
    rings::DeviceRings,
    Gpu,
};

/// How long consumers wait for the commands before calling the run failed.
#[cfg(any(test, feature = "cuda"))]
const DEADLINE: Duration = Duration::from_secs(60);

/// One throughput run.
#[derive(Clone, Copy, Debug)]
pub struct PushOpts {
    /// FIFOs, one a block (one producer warp each).
    pub rings: usize,
    /// Commands each ring carries.
    pub per_ring: u64,
    /// Commands a warp publishes at once (1: one thread's pushes; 32: a warp's).
    pub batch: u32,
    /// Slots a FIFO has.
    pub capacity: usize,
    /// CPU threads draining the FIFOs (each takes every `consumers`th ring).
    pub consumers: usize,
}

/// What a throughput run measured.
#[derive(Clone, Copy, Debug)]
pub struct PushResult {
    /// The run's options.
    pub opts: PushOpts,
    /// Launch to the last pop, host clock.
    pub wall: Duration,
    /// The slowest producer warp's push loop, GPU clock.
    pub kernel: Duration,
}

impl PushResult {
    /// Commands moved.
    pub fn commands(&self) -> u64 {
        self.opts.rings as u64 * self.opts.per_ring
    }

    /// Commands a second, launch to last pop.
    pub fn rate(&self) -> f64 {
        self.commands() as f64 / self.wall.as_secs_f64()
    }
}

/// The `i`th command of ring `r`, as `kernels/fifo_bench.cu` makes it.
pub fn expected(ring: usize, i: u64) -> TransferCmd {
    let off = (i & ((1 << 26) - 1)) << 4;
    Wire::encode(&Command::Write {
        flags: Default::default(),
        dst_rank: (ring & 0xff) as u16,
        src_off: off,
        dst_off: off,
        len: 4096,
        piggyback: None,
    })
    .expect("the bench's command fits the wire format")
}

#[cfg(feature = "cuda")]
fn check(opts: &PushOpts) -> Result<(), CudaError> {
    if opts.rings == 0 || opts.per_ring == 0 || opts.consumers == 0 {
        return Err(CudaError::Invalid(
            "rings, commands and consumers must be positive".into(),
        ));
    }
    if !(1..=32).contains(&opts.batch) || opts.capacity < opts.batch as usize {
        return Err(CudaError::Invalid(format!(
            "batch {} must be 1 to 32 and at most the capacity {}",
            opts.batch, opts.capacity
        )));
    }
    Ok(())
}

/// Pushes `opts.per_ring` commands into each of `opts.rings` FIFOs from the GPU and
/// drains them on CPU threads, checking each.
#[cfg(feature = "cuda")]
pub fn push(gpu: &Gpu, opts: PushOpts) -> Result<PushResult, CudaError> {
    check(&opts)?;
    let rings = DeviceRings::new(gpu, opts.rings, opts.capacity, "gpu ring")?;
    let stream = gpu.stream();
    let f = gpu.function(kernels::FIFO_BENCH, "uep_fifo_push")?;
    let ns = stream
        .alloc_zeros::<u64>(opts.rings)
        .map_err(driver("allocating timers"))?;
    let cfg = LaunchConfig {
        grid_dim: (opts.rings as u32, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let drain = |mine: &[(usize, &Fifo)], failed: &AtomicBool| drain(mine, opts.per_ring, failed);
    let (_, wall) = rings.drained_while(opts.consumers, drain, || {
        let args = FifoPushArgs {
            rings: gpu.addr(rings.table()),
            ns: gpu.addr(&ns),
            count: opts.per_ring,
            batch: opts.batch,
            pad: 0,
        };
        // SAFETY: a Ring table in device memory of one ring a block and a timer a block;
        // the rings' memory stays pinned and leased until after the synchronize below.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(&f, cfg, &args, "launching uep_fifo_push")
        }
    })?;
    stream
        .synchronize()
        .map_err(driver("running uep_fifo_push"))?;
    let ns = stream.clone_dtoh(&ns).map_err(driver("copying timers"))?;
    let kernel = Duration::from_nanos(ns.iter().copied().max().unwrap_or(0));
    Ok(PushResult { opts, wall, kernel })
}

/// Drains `rings` until each delivered `per_ring` commands, checking every one.
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn drain(
    rings: &[(usize, &Fifo)],
    per_ring: u64,
    failed: &AtomicBool,
) -> Result<(), CudaError> {
    let mut consumers = rings
        .iter()
        .map(|(r, f)| f.consumer().map(|c| (*r, c, 0u64)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CudaError::Fifo(e.to_string()))?;
    let deadline = Instant::now() + DEADLINE;
    let mut open = consumers.len();
    while open > 0 {
        if failed.load(Ordering::Relaxed) || Instant::now() > deadline {
            let got: Vec<String> = consumers
                .iter()
                .map(|(r, _, n)| format!("ring {r}: {n}"))
                .collect();
            return Err(CudaError::Fifo(format!(
                "not every command arrived within {DEADLINE:?} ({per_ring} a ring; got {})",
                got.join(", ")
            )));
        }
        for (ring, consumer, seen) in consumers.iter_mut() {
            while *seen < per_ring {
                let Some((slot, cmd)) = consumer.poll() else {
                    break;
                };
                let want = expected(*ring, *seen);
                if cmd != want {
                    return Err(CudaError::Fifo(format!(
                        "ring {ring} command {seen}: got {cmd:x?}, expected {want:x?}"
                    )));
                }
                consumer
                    .pop(slot)
                    .map_err(|e| CudaError::Fifo(e.to_string()))?;
                *seen += 1;
                if *seen == per_ring {
                    open -= 1;
                }
            }
        }
    }
    Ok(())
}

/// Push → pop round trips of one thread's commands, GPU clock.
#[derive(Clone, Debug)]
pub struct PingResult {
    /// Every round trip, sorted.
    pub rounds: Vec<Duration>,
}

impl PingResult {
    /// The `q` quantile (0 to 1).
    pub fn quantile(&self, q: f64) -> Duration {
        let i = ((self.rounds.len() - 1) as f64 * q).round() as usize;
        self.rounds[i]
    }
}

/// One GPU thread pushes a command and waits for a CPU thread to pop it, `rounds`
/// times: the push → pop → seen-by-the-kernel round trip.
#[cfg(feature = "cuda")]
pub fn ping(gpu: &Gpu, rounds: u32) -> Result<PingResult, CudaError> {
    if rounds == 0 {
        return Err(CudaError::Invalid("ping needs at least one round".into()));
    }
    let rings = DeviceRings::new(gpu, 1, 64, "gpu ping ring")?;
    let stream = gpu.stream();
    let f = gpu.function(kernels::FIFO_BENCH, "uep_fifo_ping")?;
    let ns = stream
        .alloc_zeros::<u64>(rounds as usize)
        .map_err(driver("allocating timers"))?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    let drain =
        |mine: &[(usize, &Fifo)], failed: &AtomicBool| drain(mine, u64::from(rounds), failed);
    rings.drained_while(1, drain, || {
        let args = FifoPingArgs {
            rings: gpu.addr(rings.table()),
            ns: gpu.addr(&ns),
            rounds,
            pad: 0,
        };
        // SAFETY: a Ring table of one and `rounds` timers; the ring stays pinned and
        // leased until the synchronize below.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(&f, cfg, &args, "launching uep_fifo_ping")
        }
    })?;
    stream
        .synchronize()
        .map_err(driver("running uep_fifo_ping"))?;
    let mut rounds: Vec<Duration> = stream
        .clone_dtoh(&ns)
        .map_err(driver("copying timers"))?
        .into_iter()
        .map(Duration::from_nanos)
        .collect();
    rounds.sort();
    Ok(PingResult { rounds })
}
