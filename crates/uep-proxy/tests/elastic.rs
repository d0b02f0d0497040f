//! Elastic proxies: a lost peer's operations are given up on, commands to it are
//! dropped and barriers leave it out, while traffic to the live peers goes on; over
//! real libfabric, with the lost rank's endpoint really closed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use uep_proxy::{cmds, Proxy, ProxyConfig};
use uep_shm::Segment;
use uep_transport::{FabricOptions, LibfabricTransport, PeerAddr, Transport};
use uep_wire::BarrierScope;

const REGION: usize = 1 << 20;
/// Where rank 0 writes into rank 2, and rank 2 into rank 0 (apart from the bytes each
/// sends from, at `DATA`).
const TO: u64 = DATA + (1 << 18);
const BACK: u64 = DATA + (1 << 19);

fn elastic() -> ProxyConfig {
    ProxyConfig {
        elastic: true,
        ..config(1)
    }
}

#[test]
fn a_lost_peer_does_not_stop_the_others() {
    let mut c = Cluster::start(3, REGION, elastic(), |_, _| None);
    c.region(0)
        .write(DATA as usize, &pattern(7, REGION - DATA as usize))
        .unwrap();
    // Rank 2 dies: its proxy and its endpoint go away.
    drop(c.proxies.remove(2));
    let p0 = &c.proxies[0];
    let fifo = p0.fifo(0, 0).unwrap();
    let deadline = Instant::now() + DEADLINE;
    // Writes to the dead rank, then to a live one, then a Quiet behind all of them.
    for i in 0..8u64 {
        fifo.push(
            cmds::normal_write(2, DATA + i * 4096, DATA, 4096, 0, 1).unwrap(),
            deadline,
        )
        .unwrap();
    }
    let tail = layout(3).tail(0, 0).unwrap();
    fifo.push(
        cmds::normal_write(1, DATA, DATA, 4096, 0, 1).unwrap(),
        deadline,
    )
    .unwrap();
    let quiet = fifo.push(cmds::quiet(), deadline).unwrap();
    p0.wake();
    // The caller learns of the death (here: now) and says so.
    p0.mark_lost(2);
    assert!(p0.is_lost(2) && !p0.is_lost(1));
    wait_until("the Quiet behind the lost peer's writes", || {
        fifo.is_consumed(quiet)
    });
    wait_until("the live peer's write", || load(c.region(1), tail) == 1);
    assert_eq!(read(c.region(1), DATA, 4096), pattern(7, 4096));
    // Later commands to the lost peer are dropped, not posted.
    let before = p0.stats().dropped_to_lost;
    let q = fifo.push(cmds::quiet(), deadline).unwrap();
    fifo.push(
        cmds::normal_write(2, DATA, DATA, 64, 0, 1).unwrap(),
        deadline,
    )
    .unwrap();
    let q2 = fifo.push(cmds::quiet(), deadline).unwrap();
    p0.wake();
    wait_until("the Quiets", || fifo.is_consumed(q) && fifo.is_consumed(q2));
    assert_eq!(p0.stats().dropped_to_lost, before + 1);
    // A barrier of every rank completes between the live ones.
    c.proxies[1].mark_lost(2);
    let slots: Vec<_> = c
        .proxies
        .iter()
        .map(|p| {
            let f = p.fifo(0, 1).unwrap();
            let s = f
                .push(cmds::barrier(BarrierScope::AllPeers, 1).unwrap(), deadline)
                .unwrap();
            p.wake();
            (f, s)
        })
        .collect();
    wait_until("the barrier without rank 2", || {
        slots.iter().all(|(f, s)| f.is_consumed(*s))
    });
    c.check();
    std::thread::sleep(Duration::from_millis(20));
    c.check();
}

/// Pushes `n` ordered writes of 4 KiB (each raising the tail by 1) from `p`'s bytes
/// at [`DATA`] to `dst`'s at `to` on channel 0, and waits until they are consumed.
fn push_writes(p: &Proxy, dst: usize, n: u64, to: u64) {
    let fifo = p.fifo(0, 0).unwrap();
    let deadline = Instant::now() + DEADLINE;
    for i in 0..n {
        let (src, to) = (DATA + i * 4096, to + i * 4096);
        fifo.push(
            cmds::normal_write(dst, src, to, 4096, 0, 1).unwrap(),
            deadline,
        )
        .unwrap();
    }
    let q = fifo.push(cmds::quiet(), deadline).unwrap();
    p.wake();
    wait_until("the writes' Quiet", || fifo.is_consumed(q));
}

#[test]
fn a_rank_readmitted_with_a_new_process_starts_from_zero() {
    // Rank 2 exchanges ordered writes with rank 0, dies, and a new process takes its
    // rank: the survivors readmit it (new endpoints, streams and counters from zero),
    // and writes flow both ways again, in order, with tails counted from zero.
    let cfg = ProxyConfig {
        elastic: true,
        ..config(2)
    };
    let (n, threads) = (3, cfg.threads);
    let segs: Vec<_> = (0..n).map(|_| segment(REGION)).collect();
    let ts = transports(&segs, threads, |_, _| None);
    // `[thread][rank]`: the endpoints' addresses, which a replacement connects to.
    let addrs: Vec<Vec<PeerAddr>> = (0..threads)
        .map(|t| ts.iter().map(|r| r[t].local_addr()).collect())
        .collect();
    let start = |r: usize, seg: &Segment, t: Vec<Box<dyn Transport>>| {
        Proxy::start(r, n, cfg.clone(), seg.region().clone(), layout(n), t).unwrap()
    };
    let mut proxies: Vec<_> = (ts.into_iter().enumerate())
        .map(|(r, t)| start(r, &segs[r], t))
        .collect();
    let data = pattern(1, 3 * 4096);
    segs[0].region().write(DATA as usize, &data).unwrap();
    push_writes(&proxies[0], 2, 3, TO);
    push_writes(&proxies[2], 0, 2, BACK);
    let l = layout(n);
    let (tail_at_2, tail_at_0) = (l.tail(0, 0).unwrap(), l.tail(2, 0).unwrap());
    wait_until("the first writes", || {
        load(segs[2].region(), tail_at_2) == 3 && load(segs[0].region(), tail_at_0) == 2
    });
    assert!(read(segs[2].region(), TO, 3 * 4096) == data);
    // Rank 2 dies; the others find it gone.
    drop(proxies.pop());
    for p in &proxies {
        p.mark_lost(2);
    }
    // Its replacement: a new segment and new endpoints, connected to the others'.
    let seg = segment(REGION);
    let mut fresh: Vec<Box<dyn Transport>> = Vec::new();
    for peers in &addrs {
        let opts = FabricOptions::loopback(PROVIDER);
        let mut tr = LibfabricTransport::new(&opts, region_ref(&seg)).unwrap();
        let mut peers = peers.clone();
        peers[2] = PeerAddr(Vec::new());
        tr.connect(&peers).unwrap();
        fresh.push(Box::new(tr));
    }
    let theirs: Vec<PeerAddr> = fresh.iter().map(|t| t.local_addr()).collect();
    let err = proxies[0].readmit(2, &theirs[..1]).unwrap_err();
    assert!(err.to_string().contains("addresses"), "{err}");
    for p in &proxies {
        p.readmit(2, &theirs).unwrap();
        assert!(!p.is_lost(2));
    }
    assert_eq!(
        load(segs[0].region(), tail_at_0),
        0,
        "rank 2's tail restarts"
    );
    proxies.push(start(2, &seg, fresh));
    // Both directions again, the tails counted from zero on both sides.
    push_writes(&proxies[0], 2, 2, TO);
    seg.region()
        .write(DATA as usize, &pattern(2, 4096))
        .unwrap();
    push_writes(&proxies[2], 0, 1, BACK);
    wait_until("the writes after the readmission", || {
        load(seg.region(), tail_at_2) == 2 && load(segs[0].region(), tail_at_0) == 1
    });
    assert!(read(seg.region(), TO, 2 * 4096) == data[..2 * 4096]);
    assert!(read(segs[0].region(), BACK, 4096) == pattern(2, 4096));
    // And a barrier of all three.
    let deadline = Instant::now() + DEADLINE;
    let slots: Vec<_> = (proxies.iter())
        .map(|p| {
            let f = p.fifo(0, 1).unwrap();
            let scope = BarrierScope::AllPeers;
            let s = f.push(cmds::barrier(scope, 1).unwrap(), deadline).unwrap();
            p.wake();
            (f, s)
        })
        .collect();
    wait_until("the barrier with the replacement", || {
        slots.iter().all(|(f, s)| f.is_consumed(*s))
    });
    for (r, p) in proxies.iter().enumerate() {
        p.check().unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}
