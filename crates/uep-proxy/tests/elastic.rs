//! Elastic proxies: a lost peer's operations are given up on, commands to it are
//! dropped and barriers leave it out, while traffic to the live peers goes on; over
//! real libfabric, with the lost rank's endpoint really closed.

mod common;

use std::time::{Duration, Instant};

use common::*;
use uep_proxy::{cmds, ProxyConfig};
use uep_wire::BarrierScope;

const REGION: usize = 1 << 20;

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
