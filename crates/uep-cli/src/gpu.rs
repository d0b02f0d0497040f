//! `uep gpu`: the CUDA device's checks and benches (built with `--features cuda`).

use clap::{Args, Subcommand};

/// `uep gpu` arguments.
#[derive(Args, Debug)]
pub struct GpuArgs {
    #[command(subcommand)]
    what: GpuCommand,
}

#[derive(Subcommand, Debug)]
enum GpuCommand {
    /// Say which CUDA device this machine has, or why there is none.
    Info,
    /// Kernels push Write commands to CPU threads through FIFOs in pinned host memory:
    /// commands per second and push -> pop round trips.
    Fifo(FifoArgs),
    /// The LL dispatch's FP8 cast on the GPU, checked bit for bit against the host's.
    Quant(QuantArgs),
}

/// `uep gpu fifo` arguments.
#[derive(Args, Debug)]
struct FifoArgs {
    /// Commands each producer warp pushes.
    #[arg(long, default_value_t = 1 << 20)]
    commands: u64,
    /// Slots a FIFO has.
    #[arg(long, default_value_t = uep_fifo::DEFAULT_CAPACITY)]
    capacity: usize,
    /// CPU threads draining the FIFOs (0: the machine's cores less one, at most 8).
    #[arg(long, default_value_t = 0)]
    consumers: usize,
    /// Push -> pop round trips to time.
    #[arg(long, default_value_t = 20_000)]
    rounds: u32,
}

/// `uep gpu quant` arguments.
#[derive(Args, Debug)]
struct QuantArgs {
    /// Token counts to cast (each with and without UE8M0 scales).
    #[arg(long, value_delimiter = ',', default_value = "1,128,4096,32768")]
    tokens: Vec<usize>,
    /// Channels a token.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Input seed (default: fresh from the clock; printed for replay).
    #[arg(long)]
    seed: Option<u64>,
    /// Timed launches after the checked one.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

/// Runs `uep gpu`; `Ok(false)` when a check failed.
pub fn run(args: &GpuArgs) -> anyhow::Result<bool> {
    match &args.what {
        GpuCommand::Info => match uep_cuda::probe() {
            Ok(d) => {
                println!(
                    "{}: compute capability {}.{}, {} SMs, {:.0} GiB",
                    d.name,
                    d.capability.0,
                    d.capability.1,
                    d.sms,
                    d.memory as f64 / (1u64 << 30) as f64
                );
                Ok(true)
            }
            Err(e) => {
                println!("no CUDA device: {e}");
                Ok(false)
            }
        },
        #[cfg(feature = "cuda")]
        GpuCommand::Fifo(a) => cuda::fifo(a),
        #[cfg(feature = "cuda")]
        GpuCommand::Quant(a) => cuda::quant(a),
        #[cfg(not(feature = "cuda"))]
        GpuCommand::Fifo(_) | GpuCommand::Quant(_) => Err(uep_cuda::CudaError::NotBuilt.into()),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Duration;

    use uep_cuda::fifo_bench::{self, PushOpts};
    use uep_cuda::{quant, Gpu};

    use super::{FifoArgs, QuantArgs};

    fn us(d: Duration) -> String {
        format!("{:.2} µs", d.as_secs_f64() * 1e6)
    }

    pub(super) fn fifo(a: &FifoArgs) -> anyhow::Result<bool> {
        let gpu = Gpu::open(0)?;
        let info = gpu.info()?;
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let consumers = if a.consumers > 0 {
            a.consumers
        } else {
            (cores - 1).clamp(1, 8)
        };
        println!(
            "GPU FIFO bench: {} ({} SMs); {} CPU consumer threads; {} slots a FIFO; \
             every command checked on arrival",
            info.name, info.sms, consumers, a.capacity
        );
        println!(
            "{:<26} {:>6} {:>12} {:>12} {:>16}",
            "producers", "batch", "commands", "M cmds/s", "kernel M cmds/s"
        );
        for rings in [1, info.sms as usize] {
            for batch in [1u32, 32] {
                let opts = PushOpts {
                    rings,
                    per_ring: a.commands / if rings == 1 { 1 } else { 4 },
                    batch,
                    capacity: a.capacity,
                    consumers: consumers.min(rings),
                };
                let r = fifo_bench::push(&gpu, opts)?;
                let who = if rings == 1 {
                    "1 warp (1 block)".to_string()
                } else {
                    format!("{rings} warps (1 a block)")
                };
                println!(
                    "{:<26} {:>6} {:>12} {:>12.2} {:>16.2}",
                    who,
                    batch,
                    r.commands(),
                    r.rate() / 1e6,
                    r.commands() as f64 / r.kernel.as_secs_f64() / 1e6
                );
            }
        }
        let p = fifo_bench::ping(&gpu, a.rounds)?;
        println!(
            "push -> pop -> seen by the kernel, 1 thread, {} rounds: median {}, p99 {}, min {}",
            a.rounds,
            us(p.quantile(0.5)),
            us(p.quantile(0.99)),
            us(p.quantile(0.0))
        );
        Ok(true)
    }

    pub(super) fn quant(a: &QuantArgs) -> anyhow::Result<bool> {
        let gpu = Gpu::open(0)?;
        let seed = a.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        println!(
            "FP8 e4m3 cast on {} against uep_ep::quant, seed {seed}",
            gpu.info()?.name
        );
        println!(
            "{:>8} {:>7} {:>6} {:>10} {:>12} {:>10}",
            "tokens", "hidden", "ue8m0", "bit-exact", "time", "GB/s"
        );
        for (i, &tokens) in a.tokens.iter().enumerate() {
            for round_scale in [false, true] {
                let s = seed.wrapping_add(2 * i as u64 + u64::from(round_scale));
                let r = quant::check(&gpu, tokens, a.hidden, round_scale, s, a.iters)?;
                println!(
                    "{:>8} {:>7} {:>6} {:>10} {:>12} {:>10.1}",
                    tokens,
                    a.hidden,
                    round_scale,
                    "yes",
                    us(r.time),
                    r.bandwidth() / 1e9
                );
            }
        }
        Ok(true)
    }
}
