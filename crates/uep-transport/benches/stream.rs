//! Raw streams of one-sided libfabric writes on loopback: the most the network path
//! could reach on this machine, by message size and number of streams at once.
//!
//! `cargo bench -p uep-transport --bench stream` measures (provider from
//! `UEP_FI_PROVIDER`, default `tcp;ofi_rxm`). Run without `--bench` (as `cargo test
//! --all-targets` does), it streams a few megabytes per case and checks that every
//! write arrived.

use uep_transport::stream::transport_streams_gbps;
use uep_transport::DEFAULT_PROVIDER;

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let provider = std::env::var("UEP_FI_PROVIDER").unwrap_or_else(|_| DEFAULT_PROVIDER.into());
    let (bytes, sizes, streams): (u64, &[usize], &[usize]) = if bench {
        (256 << 20, &[4 << 10, 64 << 10, 1 << 20], &[1, 2, 4])
    } else {
        (2 << 20, &[64 << 10], &[1, 2])
    };
    println!(
        "raw write streams over {provider} on 127.0.0.1, {} MiB each",
        bytes >> 20
    );
    println!("{:>10}  {:>7}  {:>12}", "message", "streams", "GB/s/stream");
    for &msg in sizes {
        for &n in streams {
            match transport_streams_gbps(&provider, bytes, msg, n) {
                Ok(g) => {
                    assert!(g > 0.0 && g.is_finite(), "{g}");
                    println!("{:>10}  {n:>7}  {g:>12.2}", msg);
                }
                Err(e) => {
                    eprintln!("stream of {msg}-byte writes x {n}: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
}
