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
    /// Each kernel phase on the GPU (layout, FP8 cast, combine reduction, LL send with
    /// its commands), checked bit for bit against the host device on fresh inputs, and
    /// timed.
    Check(CheckArgs),
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
    /// CPU threads draining the FIFOs (0: the machine's cores less one, at most 8; the
    /// bench adds runs with every core but one).
    #[arg(long, default_value_t = 0)]
    consumers: usize,
    /// Push -> pop round trips to time.
    #[arg(long, default_value_t = 20_000)]
    rounds: u32,
}

/// `uep gpu check` arguments.
#[derive(Args, Debug)]
struct CheckArgs {
    /// Small shapes only (for compute-sanitizer).
    #[arg(long)]
    quick: bool,
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
        GpuCommand::Check(a) => cuda::check(a),
        #[cfg(not(feature = "cuda"))]
        GpuCommand::Fifo(_) | GpuCommand::Check(_) => Err(uep_cuda::CudaError::NotBuilt.into()),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Duration;

    use uep_cuda::fifo_bench::{self, PushOpts};
    use uep_cuda::layout::{self, RouteShape};
    use uep_cuda::ll_send::{self, SendShape};
    use uep_cuda::quant::{self, Loads};
    use uep_cuda::{reduce, Gpu};

    use super::{CheckArgs, FifoArgs};

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
            "GPU FIFO bench: {} ({} SMs), {cores} CPU cores; {} slots a FIFO; every command \
             checked on arrival",
            info.name, info.sms, a.capacity
        );
        println!(
            "{:<22} {:>6} {:>10} {:>12} {:>10} {:>16}",
            "producers", "batch", "consumers", "commands", "M cmds/s", "kernel M cmds/s"
        );
        let sms = info.sms as usize;
        let all = (cores - 1).max(1);
        let runs = [
            (1, 1, 1),
            (1, 32, 1),
            (sms, 1, consumers),
            (sms, 32, consumers),
            (sms, 1, all),
            (sms, 32, all),
        ];
        for (i, &(rings, batch, drainers)) in runs.iter().enumerate() {
            if i >= 4 && all == consumers {
                continue;
            }
            let opts = PushOpts {
                rings,
                per_ring: a.commands / if rings == 1 { 1 } else { 4 },
                batch,
                capacity: a.capacity,
                consumers: drainers,
            };
            let r = fifo_bench::push(&gpu, opts)?;
            let who = format!("{rings} warp(s), 1 a block");
            println!(
                "{:<22} {:>6} {:>10} {:>12} {:>10.2} {:>16.2}",
                who,
                batch,
                drainers,
                r.commands(),
                r.rate() / 1e6,
                r.commands() as f64 / r.kernel.as_secs_f64() / 1e6
            );
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

    /// One row of the check's table.
    fn row(phase: &str, shape: &str, variant: &str, time: Duration, gbps: f64, extra: &str) {
        println!(
            "{phase:<12} {shape:<30} {variant:<12} {:>9} {:>12} {gbps:>9.1}  {extra}",
            "✓",
            us(time)
        );
    }

    pub(super) fn check(a: &CheckArgs) -> anyhow::Result<bool> {
        let gpu = Gpu::open(0)?;
        let info = gpu.info()?;
        let seed = a.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
        println!(
            "uep kernels on {} ({} SMs) against the host device, bit for bit; seed {seed}",
            info.name, info.sms
        );
        println!(
            "{:<12} {:<30} {:<12} {:>9} {:>12} {:>9}  commands",
            "phase", "shape", "variant", "bit-exact", "time", "GB/s"
        );
        let hidden = if a.quick { 512 } else { 7168 };
        let big = if a.quick { 64 } else { 4096 };
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(1);
            s
        };
        for (tokens, ranks) in [(128, 16), (big, 64)] {
            let shape = RouteShape {
                tokens,
                topk: 8,
                experts: 256,
                ranks,
                ranks_per_node: 8,
            };
            let m = layout::check(&gpu, shape, next(), a.iters)?;
            let desc = format!("{tokens} tok, top-8 of 256, {ranks} ranks");
            row("layout", &desc, "", m.time, m.bandwidth() / 1e9, "");
        }
        cast_rows(&gpu, a, hidden, &mut next)?;
        for (tokens, weighted) in [(128, true), (big, true), (big, false)] {
            let m = reduce::check(&gpu, tokens, 8, hidden, weighted, next(), a.iters)?;
            let variant = if weighted { "weighted" } else { "sum" };
            let desc = format!("{tokens} tok × top-8 × {hidden}");
            row("combine", &desc, variant, m.time, m.bandwidth() / 1e9, "");
        }
        ll_send_rows(&gpu, a, hidden, &mut next)?;
        // The emulated device's semantics (warp collectives, barriers, a resident grid)
        // against this GPU's.
        uep_cuda::selftest::check(&gpu, info.sms)?;
        row(
            "selftest",
            "collectives, barriers, spins",
            "",
            Duration::ZERO,
            0.0,
            "",
        );
        println!("every row: the GPU's output equals the host device's, bit for bit");
        Ok(true)
    }

    /// The FP8 casts (8- and 16-byte loads, UE8M0 or not) and the NVFP4 casts (both
    /// block scale formats), each checked and timed.
    fn cast_rows(
        gpu: &Gpu,
        a: &CheckArgs,
        hidden: usize,
        next: &mut impl FnMut() -> u64,
    ) -> anyhow::Result<()> {
        let casts: &[usize] = if a.quick {
            &[1, 3, 64]
        } else {
            &[1, 128, 4096, 32768]
        };
        for &tokens in casts {
            let desc = format!("{tokens} × {hidden}");
            for (loads, ue8m0) in [(Loads::X8, false), (Loads::X16, false), (Loads::X16, true)] {
                let m = quant::check(gpu, loads, tokens, hidden, ue8m0, next(), a.iters)?;
                let width = if loads == Loads::X8 { "8 B" } else { "16 B" };
                let variant = format!("{width}{}", if ue8m0 { " ue8m0" } else { "" });
                row("fp8 cast", &desc, &variant, m.time, m.bandwidth() / 1e9, "");
            }
            for ue8m0 in [false, true] {
                let m = quant::check_nvfp4(gpu, tokens, hidden, ue8m0, next(), a.iters)?;
                let variant = if ue8m0 { "ue8m0" } else { "e4m3" };
                let note = "copies in and out included";
                row(
                    "nvfp4 cast",
                    &desc,
                    variant,
                    m.time,
                    m.bandwidth() / 1e9,
                    note,
                );
            }
        }
        Ok(())
    }

    fn ll_send_rows(
        gpu: &Gpu,
        a: &CheckArgs,
        hidden: usize,
        next: &mut impl FnMut() -> u64,
    ) -> anyhow::Result<()> {
        let sms = gpu.info()?.sms as usize;
        let tokens = if a.quick { 16 } else { 128 };
        for (rings, ue8m0) in [(16, false), (16, true), (tokens.min(sms), false)] {
            let shape = SendShape {
                tokens,
                hidden,
                topk: 8,
                experts: 256,
                ranks: 16,
                round_scale: ue8m0,
                rings,
                consumers: rings.min(8),
            };
            let r = ll_send::check(gpu, shape, next(), a.iters.min(10))?;
            let staged = (tokens * shape.row_bytes()) as f64;
            let extra = format!(
                "{} cmds; launch -> last pop {}, {:.1} M cmds/s",
                r.commands,
                us(r.wall),
                r.commands as f64 / r.wall.as_secs_f64() / 1e6
            );
            let variant = format!("{rings} warps{}", if ue8m0 { " ue8m0" } else { "" });
            let desc = format!("{tokens} tok × {hidden}, top-8, 16 ranks");
            row(
                "ll send",
                &desc,
                &variant,
                r.kernel,
                staged / r.kernel.as_secs_f64() / 1e9,
                &extra,
            );
        }
        Ok(())
    }
}
