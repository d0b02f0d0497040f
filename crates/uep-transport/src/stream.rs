//! Raw streams of one-sided writes: what a transport can do at best, the yardstick
//! the network path's GB/s are compared against (`uep bench`'s limit column, and
//! `cargo bench -p uep-transport --bench stream`).
//!
//! * [`transport_stream_gbps`]: the inter-node limit. A raw stream of
//!   libfabric writes with immediates between two endpoints, as the proxies
//!   post them but without any FIFO, ordering or bookkeeping.
//! * [`transport_streams_gbps`]: the same with several such streams at
//!   once, for when the "nodes" of a run share this machine's cores: every
//!   rank then streams at the same time, and a lone stream that has the whole
//!   machine overstates what each rank can get.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::{
    Arrival, Completion, FabricOptions, HeapRegion, LibfabricTransport, RegionRef, Transport,
    TransportError, WriteOp,
};

/// Timed runs of each measurement; the best one counts (the others absorb
/// warm-up and noise from other processes).
pub const RUNS: usize = 3;
/// Writes kept in flight by [`transport_stream_gbps`] (the paper's LL figure
/// per FIFO).
pub const STREAM_WINDOW: usize = 32;
/// Largest message [`transport_stream_gbps`] accepts (bounds its buffers).
pub const MAX_STREAM_MSG: usize = 32 << 20;
/// Longest a transport stream may take before it is reported as stuck.
const STREAM_DEADLINE: Duration = Duration::from_secs(60);

/// Why a limit could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// An argument is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The transport failed while opening, connecting or streaming.
    #[error("libfabric provider {provider:?} on 127.0.0.1: {stage} failed: {source}")]
    Transport {
        /// Provider asked for.
        provider: String,
        /// What was being done (open, connect, post, poll).
        stage: &'static str,
        /// The transport's error.
        source: TransportError,
    },
    /// The stream did not finish in time.
    #[error(
        "libfabric provider {provider:?}: {arrived} of {expected} writes arrived and {completed} \
         completed within {waited:?}; the stream is stuck"
    )]
    Stuck {
        /// Provider asked for.
        provider: String,
        /// Writes whose immediate the receiver saw.
        arrived: u64,
        /// Writes completed at the sender.
        completed: u64,
        /// Writes posted in total.
        expected: u64,
        /// Time waited.
        waited: Duration,
    },
}

/// GB/s of a raw stream of libfabric writes of `msg` bytes, each with a
/// 32-bit immediate, from one endpoint to another over `provider` on
/// 127.0.0.1, keeping [`STREAM_WINDOW`] writes in flight, until `bytes`
/// (rounded up to whole messages) have arrived. The receiver polls on its
/// own thread, as a peer's proxy does; the time runs from the first timed
/// post to the receiver seeing the last immediate. Best of [`RUNS`], after
/// one untimed window that lets the provider connect.
///
/// Errors name the provider and the stage that failed: an unknown provider,
/// a `msg` larger than the provider allows, or a stream that stops moving.
pub fn transport_stream_gbps(provider: &str, bytes: u64, msg: usize) -> Result<f64, LimitError> {
    transport_streams_gbps(provider, bytes, msg, 1)
}

/// GB/s of each of `streams` raw streams run at once, every one as in
/// [`transport_stream_gbps`] (its own pair of endpoints, `bytes` each): the
/// bytes of one stream over the time from the common start until the last
/// stream's last immediate arrived. Best of [`RUNS`].
///
/// This is the inter-node yardstick when the ranks of several "nodes" share
/// one machine and all of them stream at the same time, as `uep bench
/// --nodes N` runs them: then the streams share the cores that copy their
/// bytes through the kernel. With several streams an idle poller yields its
/// core (as a proxy's idle loop does), so that streams do not starve each
/// other by spinning; a single stream spins, exactly as before.
///
/// Zero `streams` counts as 1. Errors as [`transport_stream_gbps`]'s.
pub fn transport_streams_gbps(
    provider: &str,
    bytes: u64,
    msg: usize,
    streams: usize,
) -> Result<f64, LimitError> {
    if msg == 0 || bytes == 0 {
        return Err(LimitError::Invalid(format!(
            "transport stream: bytes ({bytes}) and msg ({msg}) must both be positive"
        )));
    }
    if msg > MAX_STREAM_MSG {
        return Err(LimitError::Invalid(format!(
            "transport stream: msg {msg} bytes is too large; at most {MAX_STREAM_MSG} bytes \
             ({STREAM_WINDOW} of them are in flight at once)"
        )));
    }
    let mut pairs = (0..streams.max(1))
        .map(|_| Pair::open(provider, msg))
        .collect::<Result<Vec<_>, _>>()?;
    let count = bytes.div_ceil(msg as u64);
    let polite = pairs.len() > 1;
    let mut best = Duration::MAX;
    for run in 0..=RUNS {
        // Run 0 is the untimed warm-up window.
        let n = if run == 0 {
            STREAM_WINDOW as u64
        } else {
            count
        };
        let go = Barrier::new(pairs.len());
        let results: Vec<Result<Pair, LimitError>> = std::thread::scope(|s| {
            let handles: Vec<_> = pairs
                .drain(..)
                .map(|p| {
                    let go = &go;
                    s.spawn(move || {
                        go.wait();
                        p.run(provider, n, msg, polite)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(LimitError::Invalid(
                            "transport stream thread panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        // All streams start together; the slowest one ends the run.
        let mut slowest = Duration::ZERO;
        for r in results {
            let p = r?;
            slowest = slowest.max(p.last);
            pairs.push(p);
        }
        if run > 0 {
            best = best.min(slowest);
        }
    }
    Ok((count * msg as u64) as f64 / best.as_secs_f64().max(1e-9) / 1e9)
}

/// Wraps a transport error of `stage` of a stream over `provider`.
fn at_stage(provider: &str, stage: &'static str) -> impl FnOnce(TransportError) -> LimitError {
    let provider = provider.to_string();
    move |source| LimitError::Transport {
        provider,
        stage,
        source,
    }
}

/// One stream's two endpoints and the time of its last run.
struct Pair {
    tx: LibfabricTransport,
    rx: LibfabricTransport,
    last: Duration,
}

impl Pair {
    /// Opens and connects a sender and a receiver for `msg`-byte writes.
    fn open(provider: &str, msg: usize) -> Result<Pair, LimitError> {
        let fail = |stage| at_stage(provider, stage);
        let opts = FabricOptions::loopback(provider);
        // Every write reads the same source bytes (they are never modified); each
        // write in flight lands in its own destination slot.
        let src = HeapRegion::new(msg);
        let mut tx = LibfabricTransport::new(&opts, RegionRef::from_heap(&src))
            .map_err(fail("open sender"))?;
        let max = tx.caps().max_write_bytes;
        if msg > max {
            return Err(LimitError::Invalid(format!(
                "transport stream: msg {msg} bytes exceeds provider {provider:?}'s largest write of {max} bytes"
            )));
        }
        let dst = HeapRegion::new(msg * STREAM_WINDOW);
        let mut rx = LibfabricTransport::new(&opts, RegionRef::from_heap(&dst))
            .map_err(fail("open receiver"))?;
        let addrs = [tx.local_addr(), rx.local_addr()];
        tx.connect(&addrs).map_err(fail("connect sender"))?;
        rx.connect(&addrs).map_err(fail("connect receiver"))?;
        Ok(Pair {
            tx,
            rx,
            last: Duration::ZERO,
        })
    }

    /// Streams `n` writes; `last` becomes the time until the last arrival.
    fn run(self, provider: &str, n: u64, msg: usize, polite: bool) -> Result<Pair, LimitError> {
        let (last, tx, rx) = stream(provider, self.tx, self.rx, n, msg, polite)?;
        Ok(Pair { tx, rx, last })
    }
}

/// Time of a stream and both endpoints, handed back for the next run.
type Streamed = (Duration, LibfabricTransport, LibfabricTransport);

/// Streams `n` writes of `msg` bytes from `tx` to `rx` (polled on its own
/// thread); returns the time until the last arrival and both endpoints back.
/// `polite` pollers yield the core when a poll finds nothing (for streams
/// that share the cores with other streams); otherwise they spin, as a lone
/// stream with the machine to itself may.
fn stream(
    provider: &str,
    mut tx: LibfabricTransport,
    rx: LibfabricTransport,
    n: u64,
    msg: usize,
    polite: bool,
) -> Result<Streamed, LimitError> {
    let fail = |stage| at_stage(provider, stage);
    let start = Arc::new(Barrier::new(2));
    // Set when the sender gives up, so the receiver stops waiting at once.
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let deadline = t0 + STREAM_DEADLINE;
    let receiver = {
        let (start, stop) = (start.clone(), stop.clone());
        std::thread::spawn(move || receive(rx, n, polite, deadline, &start, &stop))
    };
    start.wait();
    let t_start = Instant::now();
    let sent = send(&mut tx, n, msg, polite, deadline);
    let completed = sent.as_ref().map_or(0, |&c| c);
    stop.store(sent.is_err() || completed < n, Ordering::Relaxed);
    let (result, rx) = receiver
        .join()
        .map_err(|_| LimitError::Invalid("transport stream receiver thread panicked".into()))?;
    if let Err((stage, e)) = sent {
        return Err(fail(stage)(e));
    }
    let (t_end, seen) = match result {
        Ok(v) => v,
        Err(e) => return Err(fail("poll receive queue")(e)),
    };
    if seen < n || completed < n {
        return Err(LimitError::Stuck {
            provider: provider.to_string(),
            arrived: seen,
            completed,
            expected: n,
            waited: t0.elapsed(),
        });
    }
    Ok((t_end.saturating_duration_since(t_start), tx, rx))
}

/// What the receiving side of a stream saw (when the last write arrived and how many
/// did), and its endpoint back.
type Received = (Result<(Instant, u64), TransportError>, LibfabricTransport);

/// The receiving side of a stream: polls until `n` writes arrived, the deadline
/// passed or the sender gave up.
fn receive(
    mut rx: LibfabricTransport,
    n: u64,
    polite: bool,
    deadline: Instant,
    start: &Barrier,
    stop: &AtomicBool,
) -> Received {
    let mut arrivals: Vec<Arrival> = Vec::with_capacity(STREAM_WINDOW * 2);
    let mut sent: Vec<Completion> = Vec::new();
    let mut seen = 0u64;
    start.wait();
    while seen < n && Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
        arrivals.clear();
        let r = rx.poll_recv(&mut arrivals).map(|k| seen += k as u64);
        // The receiver posts nothing, but manual-progress providers
        // move data only while both queues are polled.
        let s = rx.poll_send(&mut sent);
        if let Err(e) = r.and(s.map(|_| ())) {
            return (Err(e), rx);
        }
        if polite && arrivals.is_empty() {
            // Nothing landed: let another stream's thread have the core.
            std::thread::yield_now();
        }
    }
    (Ok((Instant::now(), seen)), rx)
}

/// The sending side: `n` writes of `msg` bytes, at most a window in flight, until all
/// completed or the deadline passed; how many completed, or the stage that failed.
fn send(
    tx: &mut LibfabricTransport,
    n: u64,
    msg: usize,
    polite: bool,
    deadline: Instant,
) -> Result<u64, (&'static str, TransportError)> {
    let mut done: Vec<Completion> = Vec::with_capacity(STREAM_WINDOW * 2);
    let (mut posted, mut completed) = (0u64, 0u64);
    let mut arrivals = Vec::new();
    while completed < n && Instant::now() < deadline {
        while posted < n && posted - completed < STREAM_WINDOW as u64 {
            let slot = (posted % STREAM_WINDOW as u64) * msg as u64;
            // The immediate names the message, as a proxy's carries a sequence.
            match tx.post_write(WriteOp {
                peer: 1,
                local_off: 0,
                remote_off: slot,
                len: msg,
                imm: posted as u32,
                ctx: posted,
            }) {
                Ok(()) => posted += 1,
                Err(TransportError::WouldBlock) => break,
                Err(e) => return Err(("post write", e)),
            }
        }
        done.clear();
        match tx.poll_send(&mut done) {
            Ok(0) if polite => std::thread::yield_now(),
            Ok(k) => completed += k as u64,
            Err(e) => return Err(("poll send completions", e)),
        }
        // The sender's endpoint also needs its receive side polled for progress.
        arrivals.clear();
        tx.poll_recv(&mut arrivals)
            .map_err(|e| ("poll sender receive queue", e))?;
    }
    Ok(completed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_stream_moves_bytes_over_tcp() {
        let g = transport_stream_gbps("tcp;ofi_rxm", 4 << 20, 64 << 10).unwrap();
        assert!(g > 0.0 && g.is_finite(), "{g}");
        // A message count that is not a multiple of the window, and odd sizes.
        let g = transport_stream_gbps("tcp;ofi_rxm", 100_000, 4000).unwrap();
        assert!(g > 0.0, "{g}");
    }

    #[test]
    fn concurrent_streams_each_move_their_bytes() {
        // Every stream must see all its writes arrive, or this errors (Stuck).
        let g = transport_streams_gbps("tcp;ofi_rxm", 2 << 20, 64 << 10, 3).unwrap();
        assert!(g > 0.0 && g.is_finite(), "{g}");
        // Zero streams is one.
        let g = transport_streams_gbps("tcp;ofi_rxm", 1 << 20, 64 << 10, 0).unwrap();
        assert!(g > 0.0, "{g}");
        let m = transport_streams_gbps("no-such-provider", 1 << 20, 4096, 2)
            .unwrap_err()
            .to_string();
        assert!(m.contains("no-such-provider"), "{m}");
    }

    #[test]
    fn transport_errors_are_clear() {
        let e = transport_stream_gbps("no-such-provider", 1 << 20, 4096).unwrap_err();
        let m = e.to_string();
        assert!(
            m.contains("no-such-provider") && m.contains("open sender"),
            "{m}"
        );
        let m = transport_stream_gbps("tcp;ofi_rxm", 1 << 20, 0)
            .unwrap_err()
            .to_string();
        assert!(m.contains("must both be positive"), "{m}");
        let m = transport_stream_gbps("tcp;ofi_rxm", 1 << 30, 1 << 31)
            .unwrap_err()
            .to_string();
        assert!(m.contains("too large") && m.contains("at most"), "{m}");
    }
}
