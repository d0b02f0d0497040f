//! Command handling over real libfabric: rejected and undecodable commands,
//! Quiet, Barrier and Atomic, and malformed immediates from a raw peer.

mod common;

use std::time::{Duration, Instant};

use common::*;
use uep_proxy::{cmds, Proxy, ProxyError};
use uep_transport::{Arrival, Completion, Transport, TransportError};
use uep_wire::{
    AtomicImm, BarrierImm, BarrierScope, CmdFlags, Command, LlImm, LlSignal, TransferCmd, WriteImm,
};

const REGION: usize = 256 * 1024;
const CANARY: u8 = 0xA5;

/// Starts 2 ranks, lands one good write, then pushes `bad` and another good
/// write: the bad one must fail rank 0's proxy with an error containing
/// every needle, stay unconsumed, and nothing after it may land.
fn expect_rejection(bad: TransferCmd, needles: &[&str]) -> ProxyError {
    let c = Cluster::start(2, REGION, config(1), |_, _| None);
    let r1 = c.region(1).clone();
    r1.write(DATA as usize, &vec![CANARY; REGION - DATA as usize])
        .unwrap();
    c.region(0)
        .write(DATA as usize, &pattern(1, REGION - DATA as usize))
        .unwrap();
    let fifo = c.proxies[0].fifo(0, 0).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let tail = layout(2).tail(0, 0).unwrap();
    fifo.push(
        cmds::normal_write(1, DATA, DATA, 64, 0, 1).unwrap(),
        deadline,
    )
    .unwrap();
    wait_until("the first write", || load(&r1, tail) == 1);
    let bad_slot = fifo.push(bad, deadline).unwrap();
    fifo.push(
        cmds::normal_write(1, DATA + 4096, DATA + 4096, 64, 0, 1).unwrap(),
        deadline,
    )
    .unwrap();
    c.proxies[0].wake();
    wait_until("the rejection", || c.proxies[0].check().is_err());
    let err = c.proxies[0].check().unwrap_err();
    let msg = err.to_string();
    for needle in ["rank 0", "thread 0", "FIFO 0", "slot 1"]
        .iter()
        .chain(needles)
    {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
    assert!(
        !fifo.is_consumed(bad_slot),
        "a rejected command must not be popped"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        load(&r1, tail),
        1,
        "nothing after the bad command may be counted"
    );
    assert_eq!(read(&r1, DATA, 64), pattern(1, 64));
    assert!(
        read(&r1, DATA + 64, REGION - DATA as usize - 64)
            .iter()
            .all(|&b| b == CANARY),
        "bytes landed beside the one good write"
    );
    assert_eq!(c.proxies[0].stats().rejected_commands, 1);
    for p in &c.proxies {
        p.request_stop();
    }
    let mut ps = c.proxies.into_iter();
    let e0 = ps.next().unwrap().shutdown().unwrap_err();
    assert_eq!(e0.to_string(), msg, "shutdown reports the same first error");
    ps.next().unwrap().shutdown().unwrap();
    err
}

#[test]
fn out_of_region_writes_are_rejected() {
    let end = REGION as u64;
    let e = expect_rejection(
        cmds::normal_write(1, DATA, end - 16, 64, 0, 1).unwrap(),
        &["Write", "remote range", "outside"],
    );
    assert!(matches!(e, ProxyError::Rejected { .. }), "{e:?}");
    expect_rejection(
        cmds::normal_write(1, end - 16, DATA + 8192, 64, 0, 1).unwrap(),
        &["Write", "source range", "outside the local region"],
    );
    // Offsets past u64 overflow: len added to a huge offset must not wrap.
    expect_rejection(
        cmds::normal_write(1, uep_wire::MAX_OFFSET, DATA, 32, 0, 1).unwrap(),
        &["Write", "source range"],
    );
}

#[test]
fn invalid_commands_are_rejected_with_their_reason() {
    let e = expect_rejection(
        TransferCmd {
            word0: 0x3F,
            word1: 0x1234,
        },
        &["undecodable", "0x000000000000003f", "0x0000000000001234"],
    );
    assert!(matches!(e, ProxyError::Undecodable { .. }), "{e:?}");
    expect_rejection(
        cmds::normal_write(5, DATA, DATA, 16, 0, 1).unwrap(),
        &["dst rank 5"],
    );
    expect_rejection(
        cmds::normal_write(1, DATA, DATA, 16, 7, 1).unwrap(),
        &["channel 7"],
    );
    expect_rejection(
        cmds::ll_write(1, DATA, DATA, 16, 0, 9).unwrap(),
        &["local expert 9"],
    );
    let no_piggyback = Command::Write {
        flags: CmdFlags::default(),
        dst_rank: 1,
        src_off: DATA,
        dst_off: DATA,
        len: 16,
        piggyback: None,
    };
    expect_rejection(TransferCmd::encode(&no_piggyback).unwrap(), &["piggyback"]);
    let atomic = |dst_off, value| {
        TransferCmd::encode(&Command::Atomic {
            flags: CmdFlags::default(),
            dst_rank: 1,
            dst_off,
            slot: 1,
            value,
        })
        .unwrap()
    };
    expect_rejection(atomic(0, 1), &["Atomic", "counter slot 1"]);
    let slot1 = layout(2).atomic(1).unwrap();
    expect_rejection(atomic(slot1, 40_000), &["Atomic", "16-bit"]);
}

fn pump(raw: &mut dyn Transport, arr: &mut Vec<Arrival>, done: &mut Vec<Completion>) {
    raw.poll_recv(arr).unwrap();
    raw.poll_send(done).unwrap();
}

/// Rank 0 runs a proxy; rank 1 is a raw transport the test drives, so the
/// test decides when rank 1 makes progress.
fn proxy_and_raw(
    len: usize,
    cfg: uep_proxy::ProxyConfig,
) -> (
    Proxy,
    Box<dyn Transport>,
    Vec<std::sync::Arc<uep_shm::Segment>>,
) {
    let segs = vec![segment(len), segment(len)];
    let mut ts = transports(&segs, cfg.threads, |_, _| None);
    let raw = ts[1].pop().unwrap();
    let t0 = ts.swap_remove(0);
    let p = Proxy::start(0, 2, cfg, segs[0].region().clone(), layout(2), t0).unwrap();
    (p, raw, segs)
}

#[test]
fn quiet_waits_for_earlier_writes_to_complete() {
    const BLOCK: usize = 4 << 20;
    const BLOCKS: usize = 8;
    let mut cfg = config(1);
    cfg.max_bytes_in_flight_per_thread = 64 << 20;
    let (proxy, mut raw, segs) = proxy_and_raw(DATA as usize + BLOCK * BLOCKS, cfg);
    let fifo = proxy.fifo(0, 0).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let (mut arr, mut done) = (Vec::new(), Vec::new());
    // Warm-up: the connection is set up only while both sides poll.
    fifo.push(
        cmds::normal_write(1, DATA, DATA, 16, 0, 1).unwrap(),
        deadline,
    )
    .unwrap();
    let q0 = fifo.push(cmds::quiet(), deadline).unwrap();
    let start = Instant::now();
    while !fifo.is_consumed(q0) {
        pump(raw.as_mut(), &mut arr, &mut done);
        assert!(start.elapsed() < DEADLINE, "warm-up quiet never completed");
    }
    // 32 MiB, more than loopback TCP buffers: cannot all complete while
    // rank 1 does not poll.
    let blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| pattern(i as u64 + 7, BLOCK)).collect();
    for (i, b) in blocks.iter().enumerate() {
        let off = DATA + (i * BLOCK) as u64;
        segs[0].region().write(off as usize, b).unwrap();
        fifo.push(
            cmds::normal_write(1, off, off, BLOCK as u32, 0, 1).unwrap(),
            deadline,
        )
        .unwrap();
    }
    let q1 = fifo.push(cmds::quiet(), deadline).unwrap();
    proxy.wake();
    std::thread::sleep(Duration::from_millis(300));
    let s = proxy.stats();
    assert!(
        !fifo.is_consumed(q1),
        "Quiet completed while writes could not: {s:?}"
    );
    assert!(
        s.completions < s.writes_posted || s.writes_posted < 1 + BLOCKS as u64,
        "{s:?}"
    );
    assert_eq!(s.quiets, 1);
    let start = Instant::now();
    while !fifo.is_consumed(q1) {
        pump(raw.as_mut(), &mut arr, &mut done);
        assert!(
            start.elapsed() < DEADLINE,
            "quiet never completed: {:?}",
            proxy.stats()
        );
    }
    // Consumed implies every earlier write had its send completion.
    let s = proxy.stats();
    assert_eq!(s.writes_posted, 1 + BLOCKS as u64);
    assert_eq!(s.completions, s.writes_posted, "{s:?}");
    assert_eq!(s.quiets, 2);
    let start = Instant::now();
    while arr.len() < 1 + BLOCKS {
        pump(raw.as_mut(), &mut arr, &mut done);
        assert!(start.elapsed() < DEADLINE);
    }
    for (i, b) in blocks.iter().enumerate() {
        assert!(
            read(segs[1].region(), DATA + (i * BLOCK) as u64, BLOCK) == *b,
            "block {i}"
        );
    }
    proxy.check().unwrap();
    proxy.shutdown().unwrap();
    drop(raw);
}

#[test]
fn barrier_across_three_ranks_and_atomics() {
    let c = Cluster::start(3, REGION, config(1), |_, _| None);
    let l = layout(3);
    let deadline = Instant::now() + DEADLINE;
    // Emulated atomics from two ranks into rank 2's slot 3.
    let a = |r: usize, v| {
        c.proxies[r]
            .fifo(0, 0)
            .unwrap()
            .push(cmds::atomic(&l, 2, 3, v).unwrap(), deadline)
            .unwrap()
    };
    a(0, 5);
    a(0, -2);
    a(1, 10);
    let slot3 = l.atomic(3).unwrap();
    wait_until("atomics", || load(c.region(2), slot3) == 13);

    let push = |r: usize, seq| {
        let p = &c.proxies[r];
        let s = p
            .fifo(0, 1)
            .unwrap()
            .push(
                cmds::barrier(BarrierScope::AllPeers, seq).unwrap(),
                deadline,
            )
            .unwrap();
        p.wake();
        s
    };
    let done = |r: usize, s| c.proxies[r].fifo(0, 1).unwrap().is_consumed(s);
    let s0 = push(0, 1);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!done(0, s0), "rank 0 passed a barrier alone");
    let s1 = push(1, 1);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !done(0, s0) && !done(1, s1),
        "barrier passed without rank 2"
    );
    let s2 = push(2, 1);
    wait_until("barrier 1", || done(0, s0) && done(1, s1) && done(2, s2));
    // Back to back.
    let s: Vec<_> = (0..3).map(|r| push(r, 2)).collect();
    wait_until("barrier 2", || (0..3).all(|r| done(r, s[r])));
    for r in 0..3 {
        for p in 0..3 {
            let want = if p == r { 0 } else { 2 };
            assert_eq!(
                load(c.region(r), l.barrier(p).unwrap()),
                want,
                "rank {r} peer {p}"
            );
        }
        let st = c.proxies[r].stats();
        assert_eq!((st.barriers, st.barrier_imms_posted), (2, 4), "rank {r}");
    }
    c.check();
    c.shutdown();
}

#[test]
fn node_leader_barrier_from_a_non_leader_is_rejected() {
    let mut cfg = config(1);
    cfg.ranks_per_node = Some(2);
    let c = Cluster::start(4, REGION, cfg, |_, _| None);
    c.proxies[1]
        .fifo(0, 0)
        .unwrap()
        .push(
            cmds::barrier(BarrierScope::NodeLeader, 1).unwrap(),
            Instant::now() + DEADLINE,
        )
        .unwrap();
    wait_until("the rejection", || c.proxies[1].check().is_err());
    let msg = c.proxies[1].check().unwrap_err().to_string();
    assert!(msg.contains("not a node leader"), "{msg}");
    // Leaders 0 and 2 meet; ranks 1 and 3 are not involved.
    let s: Vec<_> = [0, 2]
        .iter()
        .map(|&r| {
            c.proxies[r]
                .fifo(0, 0)
                .unwrap()
                .push(
                    cmds::barrier(BarrierScope::NodeLeader, 1).unwrap(),
                    Instant::now() + DEADLINE,
                )
                .unwrap()
        })
        .collect();
    wait_until("leader barrier", || {
        c.proxies[0].fifo(0, 0).unwrap().is_consumed(s[0])
            && c.proxies[2].fifo(0, 0).unwrap().is_consumed(s[1])
    });
    for p in &c.proxies {
        p.request_stop();
    }
    for (r, p) in c.proxies.into_iter().enumerate() {
        assert_eq!(p.shutdown().is_err(), r == 1);
    }
}

#[test]
fn malformed_immediates_are_counted_not_applied() {
    let (proxy, mut raw, segs) = proxy_and_raw(REGION, config(1));
    let l = layout(2);
    let w = |stream, seq, count| WriteImm { stream, seq, count }.encode().unwrap();
    let ll = |expert, src_rank, signal| {
        LlImm {
            buffer: 1,
            expert,
            src_rank,
            signal,
        }
        .encode()
        .unwrap()
    };
    // Valid: rank 1 channel 0 seq 0 adds 1; an early count signal waits.
    let valid = [w(4, 0, 1), ll(0, 1, LlSignal::Count(5))];
    let garbage = [
        w(4, 0, 1),                                         // replay of an applied seq
        w(8, 0, 1),                                         // stream 8 = rank 2 of 2
        w(5, 3000, 1),                                      // far ahead of the window
        ll(4, 1, LlSignal::Arrival),                        // expert 4 of 4
        ll(0, 2, LlSignal::Count(1)),                       // source rank 2 of 2
        AtomicImm { slot: 16, value: 1 }.encode().unwrap(), // slot 16 of 16
        BarrierImm {
            scope: BarrierScope::AllPeers,
            src_rank: 9,
            seq: 1,
        }
        .encode()
        .unwrap(),
        3 << 30 | 3 << 28, // barrier scope 3: undecodable
        1 << 30 | 7,       // LL arrival with count bits: undecodable
    ];
    let sentinel = AtomicImm { slot: 0, value: 7 }.encode().unwrap();
    let all: Vec<u32> = valid
        .iter()
        .chain(&garbage)
        .chain([&sentinel])
        .copied()
        .collect();
    let (mut arr, mut done) = (Vec::new(), Vec::new());
    let start = Instant::now();
    for (i, &imm) in all.iter().enumerate() {
        loop {
            match raw.post_imm(0, imm, i as u64) {
                Ok(()) => break,
                Err(TransportError::WouldBlock) => pump(raw.as_mut(), &mut arr, &mut done),
                Err(e) => panic!("{e}"),
            }
            assert!(start.elapsed() < DEADLINE, "raw post stayed blocked");
        }
    }
    let r0 = segs[0].region().clone();
    let slot0 = l.atomic(0).unwrap();
    while proxy.stats().imms_received < all.len() as u64 || load(&r0, slot0) != 7 {
        pump(raw.as_mut(), &mut arr, &mut done);
        assert!(start.elapsed() < DEADLINE, "{:?}", proxy.stats());
    }
    let s = proxy.stats();
    assert_eq!(s.malformed_imms, garbage.len() as u64, "{s:?}");
    assert_eq!(
        (s.tails_applied, s.pending_signals, s.atomics_applied),
        (1, 1, 1)
    );
    // Only the valid tail and the sentinel changed; the early signal waits.
    for off in (0..DATA).step_by(8) {
        let want = if off == l.tail(1, 0).unwrap() {
            1
        } else if off == slot0 {
            7
        } else {
            0
        };
        assert_eq!(load(&r0, off), want, "counter at offset {off}");
    }
    proxy.check().expect("malformed immediates are not fatal");
    proxy.shutdown().unwrap();
    drop(raw);
}

#[test]
fn work_after_an_idle_spell_longer_than_the_timeout_is_fine() {
    let mut cfg = config(1);
    cfg.timeout = Duration::from_millis(200);
    let c = Cluster::start(2, REGION, cfg, |_, _| None);
    let tail = layout(2).tail(0, 1).unwrap();
    for n in 1..=2 {
        let cmd = cmds::normal_write(1, DATA, DATA, 16, 1, 1).unwrap();
        c.proxies[0]
            .fifo(0, 0)
            .unwrap()
            .push(cmd, Instant::now() + DEADLINE)
            .unwrap();
        c.proxies[0].wake();
        wait_until("write", || load(c.region(1), tail) == n);
        // Idle for longer than the timeout: that is not a stuck command.
        std::thread::sleep(Duration::from_millis(400));
        c.check();
    }
    c.shutdown();
}

#[test]
fn a_barrier_nobody_joins_times_out_with_a_clear_message() {
    let mut cfg = config(1);
    cfg.timeout = Duration::from_millis(300);
    let c = Cluster::start(2, REGION, cfg, |_, _| None);
    let slot = c.proxies[0]
        .fifo(0, 1)
        .unwrap()
        .push(
            cmds::barrier(BarrierScope::AllPeers, 1).unwrap(),
            Instant::now() + DEADLINE,
        )
        .unwrap();
    wait_until("the timeout", || c.proxies[0].check().is_err());
    let e = c.proxies[0].check().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ProxyError::Timeout { .. }), "{e:?}");
    for needle in [
        "rank 0",
        "FIFO 1 slot 0",
        "Barrier",
        "seq 1",
        "waiting for rank 1 (counter Some(0))",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
    assert!(!c.proxies[0].fifo(0, 1).unwrap().is_consumed(slot));
    c.proxies[1].check().unwrap();
    // Dropping (not shutting down) must not wait for a drain.
    let t0 = Instant::now();
    drop(c);
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}
