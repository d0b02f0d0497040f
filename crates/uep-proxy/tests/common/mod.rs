//! Shared helpers: ranks as `/dev/shm` segments in one process, real
//! libfabric `tcp;ofi_rxm` endpoints on 127.0.0.1, optional fault injection.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use uep_proxy::{CounterLayout, Proxy, ProxyConfig};
use uep_shm::{Region, Segment};
use uep_transport::{
    FabricOptions, FaultConfig, FaultyTransport, LibfabricTransport, RegionRef, Transport,
};

pub const PROVIDER: &str = "tcp;ofi_rxm";
pub const DEADLINE: Duration = Duration::from_secs(20);
/// Counters live below this offset; data above it.
pub const DATA: u64 = 64 * 1024;

/// The layout every test rank uses.
pub fn layout(num_ranks: usize) -> CounterLayout {
    CounterLayout {
        num_ranks,
        tail_base: 0,
        num_channels: 4,
        ll_base: 4096,
        num_local_experts: 4,
        barrier_base: 8192,
        atomic_base: 12288,
        num_atomic_slots: 16,
    }
}

/// A small config: few threads and FIFOs (the machine has 2 cores).
pub fn config(threads: usize) -> ProxyConfig {
    ProxyConfig {
        threads,
        fifos_per_thread: 2,
        fifo_capacity: 1024,
        timeout: Duration::from_secs(15),
        ..ProxyConfig::default()
    }
}

/// A fresh, already unlinked segment (nothing is left in /dev/shm).
pub fn segment(len: usize) -> Arc<Segment> {
    static N: AtomicUsize = AtomicUsize::new(0);
    let job = format!("proxytest{}", N.fetch_add(1, Ordering::Relaxed));
    let mut s = Segment::create(&uep_shm::segment_name(&job, 0, std::process::id()), len)
        .expect("create segment");
    s.unlink().expect("unlink segment");
    Arc::new(s)
}

/// The segment described for a transport.
pub fn region_ref(seg: &Arc<Segment>) -> RegionRef {
    RegionRef::from_shm(seg.region()).expect("region ref")
}

/// Opens one connected transport per (rank, thread): `[rank][thread]`.
/// `fault(rank, thread)` wraps it in a FaultyTransport when `Some`.
pub fn transports(
    segs: &[Arc<Segment>],
    threads: usize,
    fault: impl Fn(usize, usize) -> Option<FaultConfig>,
) -> Vec<Vec<Box<dyn Transport>>> {
    let mut out: Vec<Vec<Box<dyn Transport>>> = segs.iter().map(|_| Vec::new()).collect();
    for t in 0..threads {
        let mut ts: Vec<LibfabricTransport> = segs
            .iter()
            .map(|s| {
                LibfabricTransport::new(&FabricOptions::loopback(PROVIDER), region_ref(s))
                    .expect("open libfabric transport")
            })
            .collect();
        let addrs: Vec<_> = ts.iter().map(|t| t.local_addr()).collect();
        for tr in &mut ts {
            tr.connect(&addrs).expect("connect");
        }
        for (r, tr) in ts.into_iter().enumerate() {
            let boxed: Box<dyn Transport> = match fault(r, t) {
                Some(cfg) => Box::new(FaultyTransport::new(tr, cfg).expect("faulty")),
                None => Box::new(tr),
            };
            out[r].push(boxed);
        }
    }
    out
}

/// `n` ranks, each with a segment of `len` bytes and a running proxy.
pub struct Cluster {
    // Proxies first: fields drop in order, so the threads stop before the
    // test's handles on the segments go.
    pub proxies: Vec<Proxy>,
    pub segs: Vec<Arc<Segment>>,
}

impl Cluster {
    pub fn start(
        n: usize,
        len: usize,
        cfg: ProxyConfig,
        fault: impl Fn(usize, usize) -> Option<FaultConfig>,
    ) -> Cluster {
        let segs: Vec<_> = (0..n).map(|_| segment(len)).collect();
        let ts = transports(&segs, cfg.threads, fault);
        let proxies = ts
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                Proxy::start(r, n, cfg.clone(), segs[r].region().clone(), layout(n), t)
                    .expect("start proxy")
            })
            .collect();
        Cluster { segs, proxies }
    }

    pub fn region(&self, rank: usize) -> &Region {
        self.segs[rank].region()
    }

    /// Fails the test if any proxy reported a fatal error.
    pub fn check(&self) {
        for (r, p) in self.proxies.iter().enumerate() {
            if let Err(e) = p.check() {
                panic!("proxy of rank {r} failed: {e}");
            }
        }
    }

    /// Stops every proxy first, then joins each; panics on an error.
    pub fn shutdown(self) {
        for p in &self.proxies {
            p.request_stop();
        }
        for (r, p) in self.proxies.into_iter().enumerate() {
            if let Err(e) = p.shutdown() {
                panic!("shutdown of rank {r}: {e}");
            }
        }
    }
}

/// Deterministic bytes, different per `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

pub fn load(region: &Region, off: u64) -> u64 {
    region
        .atomic_u64(off as usize)
        .expect("counter in region")
        .load(Ordering::Acquire)
}

pub fn read(region: &Region, off: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    region.read(off as usize, &mut v).expect("read region");
    v
}

/// Polls `cond` (yielding) until it holds; panics at the deadline with `what`.
pub fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// A fault configuration that reorders a lot.
pub fn heavy_faults(seed: u64) -> FaultConfig {
    FaultConfig {
        seed,
        window: 32,
        delay_prob: 0.5,
        max_delay_polls: 200,
        split_prob: 0.5,
    }
}
