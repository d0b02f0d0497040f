//! Normal-mode streams past the old 64 (ranks x channels) limit, and the
//! per-stream send window, over the in-memory network, whose completions
//! the test controls.

mod common;

use std::time::{Duration, Instant};

use common::{load, segment, wait_until, DEADLINE};
use uep_proxy::{cmds, CounterLayout, Proxy, ProxyConfig};
use uep_shm::Region;
use uep_transport::mem::MemNet;
use uep_transport::Transport;
use uep_wire::{WriteImm, WRITE_SEQ_MODULUS};

/// The per-stream send window the proxy documents: half the seq modulus.
const SEND_WINDOW: usize = WRITE_SEQ_MODULUS as usize / 2;

/// Rank `rank`'s endpoint of the in-memory network, over `region`.
fn mem(net: &MemNet, rank: usize, region: &Region) -> Box<dyn Transport> {
    Box::new(net.endpoint(rank, region.clone()))
}

fn cfg() -> ProxyConfig {
    ProxyConfig {
        threads: 1,
        fifos_per_thread: 2,
        fifo_capacity: 4096,
        // Large, so that only the send window limits a stream.
        max_writes_in_flight_per_fifo: 4096,
        timeout: Duration::from_secs(20),
        ..ProxyConfig::default()
    }
}

/// 100 ranks x 2 channels: 200 streams, tails at 0..1600.
fn layout_100x2() -> CounterLayout {
    CounterLayout {
        num_ranks: 100,
        tail_base: 0,
        num_channels: 2,
        ll_base: 0,
        num_local_experts: 0,
        barrier_base: 1600,
        atomic_base: 0,
        num_atomic_slots: 0,
    }
}

/// Ranks 70 and 0 of a 100-rank job with 2 channels each (200 streams,
/// past the old 64) signal each other; every increment lands on the
/// sender's own (source, channel) tail and nowhere else.
#[test]
fn streams_above_64_end_to_end() {
    let net = MemNet::new(100);
    let l = layout_100x2();
    let segs = [segment(4096), segment(4096)];
    let ranks = [0usize, 70];
    let proxies: Vec<Proxy> = ranks
        .iter()
        .zip(&segs)
        .map(|(&r, s)| {
            Proxy::start(
                r,
                100,
                cfg(),
                s.region().clone(),
                l.clone(),
                vec![mem(&net, r, s.region())],
            )
        })
        .collect::<Result<_, _>>()
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    let push = |p: &Proxy, cmd| p.fifo(0, 0).unwrap().push(cmd, deadline).unwrap();
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 1, 3).unwrap());
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 0, 2).unwrap());
    push(&proxies[1], cmds::normal_write(0, 0, 0, 0, 1, 255).unwrap());
    push(&proxies[0], cmds::normal_write(70, 0, 0, 0, 1, 5).unwrap());
    for p in &proxies {
        p.wake();
    }
    let (r0, r70) = (segs[0].region().clone(), segs[1].region().clone());
    wait_until("rank 0's tails of rank 70", || {
        load(&r0, l.tail(70, 1).unwrap()) == 258 && load(&r0, l.tail(70, 0).unwrap()) == 2
    });
    wait_until("rank 70's tail of rank 0", || {
        load(&r70, l.tail(0, 1).unwrap()) == 5
    });
    for p in &proxies {
        p.check().unwrap();
    }
    // The immediates named streams 141 (= 70 * 2 + 1) and 140, and 1.
    let posts = net.posts();
    let mut streams: Vec<(usize, usize, u16, u16)> = posts
        .iter()
        .map(|p| {
            let w = WriteImm::decode(p.imm).unwrap();
            (p.from, p.to, w.stream, w.seq)
        })
        .collect();
    streams.sort();
    assert_eq!(
        streams,
        [
            (0, 70, 1, 0),
            (70, 0, 140, 0),
            (70, 0, 141, 0),
            (70, 0, 141, 1)
        ]
    );
    // Nothing else moved.
    for (region, keep) in [(&r0, &[(70, 0), (70, 1)][..]), (&r70, &[(0, 1)][..])] {
        for src in 0..100 {
            for ch in 0..2 {
                if !keep.contains(&(src, ch)) {
                    assert_eq!(load(region, l.tail(src, ch).unwrap()), 0, "({src}, {ch})");
                }
            }
        }
    }
    for p in &proxies {
        p.request_stop();
    }
    for p in proxies {
        p.shutdown().unwrap();
    }
}

/// A layout past 1024 streams fails at start, saying what fits.
#[test]
fn too_many_streams_fail_at_start() {
    let net = MemNet::new(100);
    let seg = segment(1 << 16);
    let l = CounterLayout {
        num_channels: 11,
        barrier_base: 8800,
        ..layout_100x2()
    };
    let err = Proxy::start(
        0,
        100,
        cfg(),
        seg.region().clone(),
        l,
        vec![mem(&net, 0, seg.region())],
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("1100") && msg.contains("1024") && msg.contains("at most 10 channels"),
        "{msg}"
    );
}

/// While the oldest write of a stream has no send completion, the proxy
/// posts at most SEND_WINDOW writes of that stream (so the receiver can
/// never see two pending writes whose 12-bit seqs alias); other streams
/// keep going, and the rest follow once the completion comes.
#[test]
fn send_window_waits_for_the_oldest_completion() {
    let net = MemNet::new(2);
    net.hold_completions(0, 1);
    let l = CounterLayout {
        num_ranks: 2,
        num_channels: 2,
        barrier_base: 32,
        ..layout_100x2()
    };
    let seg = segment(4096);
    let proxy = Proxy::start(
        0,
        2,
        cfg(),
        seg.region().clone(),
        l,
        vec![mem(&net, 0, seg.region())],
    )
    .unwrap();
    let deadline = Instant::now() + DEADLINE;
    let n = SEND_WINDOW + 52;
    let fifo = proxy.fifo(0, 0).unwrap();
    for _ in 0..n {
        fifo.push(cmds::normal_write(1, 0, 0, 0, 0, 1).unwrap(), deadline)
            .unwrap();
    }
    proxy.wake();
    let posted = |stream: u16| {
        net.posts()
            .iter()
            .filter(|p| WriteImm::decode(p.imm).unwrap().stream == stream)
            .count()
    };
    wait_until("a full window of stream 0", || posted(0) >= SEND_WINDOW);
    // Another stream (channel 1, from the other FIFO) is not held up.
    proxy
        .fifo(0, 1)
        .unwrap()
        .push(cmds::normal_write(1, 0, 0, 0, 1, 1).unwrap(), deadline)
        .unwrap();
    proxy.wake();
    wait_until("stream 1's write", || posted(1) == 1);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(posted(0), SEND_WINDOW, "stream 0 went past its window");
    assert_eq!(proxy.stats().writes_posted, SEND_WINDOW as u64 + 1);
    proxy.check().unwrap();
    // Release the oldest completion: the rest go.
    net.release_held(0);
    proxy.wake();
    wait_until("every write of stream 0", || posted(0) == n);
    let seqs: Vec<u16> = net
        .posts()
        .iter()
        .map(|p| WriteImm::decode(p.imm).unwrap())
        .filter(|w| w.stream == 0)
        .map(|w| w.seq)
        .collect();
    assert_eq!(seqs, (0..n as u16).collect::<Vec<_>>());
    proxy.request_stop();
    proxy.shutdown().unwrap();
}
