//! What this machine can do at best when moving the bytes `uep bench` moves, within a
//! node: the yardstick its intra-node GB/s are compared against (the network's is
//! `uep_transport::stream`).

use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Timed runs of each measurement; the best one counts (the others absorb warm-up and
/// noise from other processes).
pub const RUNS: usize = 3;

/// GB/s (1e9 bytes/s) per rank that plain memory copies reach when
/// `ranks_sharing` ranks at once each copy `bytes_per_rank` bytes in rows of
/// `chunk` bytes, each rank with `threads` threads splitting its rows.
///
/// Every rank has its own source and destination buffers, written before
/// timing so page faults are not counted; all threads start together and a
/// run lasts until the last one is done. Best of [`RUNS`] runs. This is the
/// most the shared-memory path of dispatch/combine could reach for the same
/// bytes on this machine.
///
/// Zero `chunk`, `threads` or `ranks_sharing` count as 1; zero bytes give 0.
pub fn memcpy_gbps(bytes_per_rank: u64, chunk: usize, threads: usize, ranks_sharing: usize) -> f64 {
    let (chunk, threads, ranks) = (chunk.max(1), threads.max(1), ranks_sharing.max(1));
    let Ok(bytes) = usize::try_from(bytes_per_rank) else {
        return 0.0;
    };
    if bytes == 0 {
        return 0.0;
    }
    // Each thread gets whole rows; one thread's share of a rank's bytes.
    let rows = bytes.div_ceil(chunk);
    let per_thread: Vec<usize> = (0..threads)
        .map(|i| (rows / threads + usize::from(i < rows % threads)) * chunk)
        .collect();
    // Non-zero fills touch (fault in) every page; a zeroed Vec could stay unmapped.
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..ranks * threads)
        .map(|i| {
            (
                vec![0x5A; per_thread[i % threads]],
                vec![0xA5; per_thread[i % threads]],
            )
        })
        .collect();
    let mut best = Duration::MAX;
    for _ in 0..RUNS {
        let start = Barrier::new(bufs.len() + 1);
        let elapsed = std::thread::scope(|s| {
            for (src, dst) in bufs.iter_mut() {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    for (d, s) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                        d.copy_from_slice(s);
                    }
                });
            }
            // The clock starts before the copiers are released (on a busy machine the
            // main thread may run last), and leaving the scope joins them all.
            let t0 = Instant::now();
            start.wait();
            t0
        })
        .elapsed();
        best = best.min(elapsed);
    }
    // The bytes really copied (whole rows) over the best time.
    let copied: usize = per_thread.iter().sum();
    copied as f64 / best.as_secs_f64().max(1e-9) / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcpy_is_positive_and_degenerate_inputs_do_not_panic() {
        let g = memcpy_gbps(4 << 20, 14336, 2, 2);
        assert!(g > 0.0 && g.is_finite(), "{g}");
        // A row larger than the bytes, and zero counts, still measure something.
        assert!(memcpy_gbps(1000, 1 << 20, 0, 0) > 0.0);
        assert_eq!(memcpy_gbps(0, 16, 1, 1), 0.0);
    }
}
