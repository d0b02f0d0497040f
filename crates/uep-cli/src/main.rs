//! `uep`: benchmark, inspect and clean up uep on this machine.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Portable expert-parallel communication for MoE models.
#[derive(Parser, Debug)]
#[command(name = "uep", version, about, long_about = None, args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run layout, normal and low-latency dispatch/combine on local ranks, verify
    /// every result against the reference, and print GB/s and latency.
    Bench(Box<uep_cli::bench::BenchArgs>),
    /// The CUDA device: `info`, the FIFO bench from GPU kernels, the kernels' check.
    Gpu(uep_cli::gpu::GpuArgs),
    /// Keep a job's store (where an elastic job's door lives, for replacement ranks to
    /// find it from any host) until killed: what a launcher without one of its own
    /// needs (torchrun's agent and `uep bench` keep theirs). Ranks find it at
    /// `UEP_STORE=HOST:PORT`.
    Store {
        /// Where to listen (`HOST:PORT`; port 0 picks one). Prints the address it got.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
    },
    /// List the libfabric providers this machine offers and which fit uep.
    Info,
    /// Remove shared-memory segments left by uep processes that no longer exist.
    Clean,
}

fn main() -> ExitCode {
    // First, while this is the only thread: libfabric reads these at its first use, and
    // the ranks the bench starts inherit them.
    uep_transport::apply_env_defaults();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("UEP_LOG"))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => uep_cli::bench::run(&args),
        Command::Gpu(args) => uep_cli::gpu::run(&args),
        Command::Info => uep_cli::info::report().map(|r| {
            print!("{r}");
            true
        }),
        Command::Clean => uep_cli::clean(),
        Command::Store { listen } => uep_cli::serve_store(&listen),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("uep: error: {e:#}");
            ExitCode::from(2)
        }
    }
}
