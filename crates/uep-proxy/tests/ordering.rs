//! Ordering emulation over real libfabric (`tcp;ofi_rxm` on loopback), with
//! and without a fault-injecting transport that reorders the sender's writes:
//! counters never run ahead of their data, and without the emulation they do.

mod common;

use std::collections::HashMap;
use std::time::Instant;

use common::*;
use uep_proxy::cmds;
use uep_transport::FaultConfig;

const CH: u8 = 2;

struct Outcome {
    /// Times a counter was observed ahead of the data it covers.
    violations: usize,
    /// Receiver's reorder-window high-water mark.
    hwm: u64,
}

/// Rank 0 streams `rows` normal-mode writes (sizes varied up to
/// `max_len`) to rank 1 on channel `CH`, each adding 1 to the tail; the
/// test thread watches rank 1's tail and checks, whenever it reaches x,
/// that the first x rows are already bit-exact.
fn normal_stream(
    fault: Option<FaultConfig>,
    emulate: bool,
    rows: usize,
    max_len: usize,
) -> Outcome {
    let mut cfg = config(1);
    cfg.emulate_ordering = emulate;
    let stride = max_len as u64;
    let region = (DATA + stride * rows as u64) as usize;
    let c = Cluster::start(
        2,
        region,
        cfg,
        |r, _| if r == 0 { fault.clone() } else { None },
    );
    let len = |i: usize| 16 * (1 + (i * 37) % (max_len / 16));
    let off = |i: usize| DATA + i as u64 * stride;
    let expect: Vec<Vec<u8>> = (0..rows).map(|i| pattern(i as u64 + 1, len(i))).collect();
    for (i, data) in expect.iter().enumerate() {
        c.region(0).write(off(i) as usize, data).unwrap();
    }
    let fifo = c.proxies[0].fifo(0, 0).unwrap();
    let deadline = Instant::now() + DEADLINE;
    for i in 0..rows {
        let cmd = cmds::normal_write(1, off(i), off(i), len(i) as u32, CH, 1).unwrap();
        fifo.push(cmd, deadline).unwrap();
    }
    c.proxies[0].wake();

    let tail_off = layout(2).tail(0, CH.into()).unwrap();
    let r1 = c.region(1).clone();
    let mut verified = 0;
    let mut violations = 0;
    let start = Instant::now();
    while verified < rows {
        let tail = load(&r1, tail_off) as usize;
        assert!(tail <= rows, "tail {tail} exceeds the {rows} rows sent");
        for (i, data) in expect.iter().enumerate().take(tail).skip(verified) {
            if &read(&r1, off(i), data.len()) != data {
                violations += 1;
            }
        }
        verified = verified.max(tail);
        if start.elapsed() > DEADLINE {
            c.check();
            panic!("tail stuck at {tail} of {rows}");
        }
        std::thread::yield_now();
    }
    // Everything lands exactly (at once with the emulation; without it a
    // row may still be on its way).
    for (i, data) in expect.iter().enumerate() {
        wait_until(&format!("row {i}"), || {
            &read(&r1, off(i), data.len()) == data
        });
    }
    c.check();
    let s1 = c.proxies[1].stats();
    assert_eq!(s1.malformed_imms, 0);
    let out = Outcome {
        violations,
        hwm: s1.reorder_window_hwm,
    };
    let s0 = c.proxies[0].stats();
    assert_eq!(s0.writes_posted, rows as u64);
    c.shutdown();
    out
}

#[test]
fn normal_tail_never_runs_ahead_of_data() {
    let plain = normal_stream(None, true, 200, 8192);
    assert_eq!(plain.violations, 0);
    let mut max_hwm = plain.hwm;
    for seed in 1..=4 {
        let o = normal_stream(Some(heavy_faults(seed)), true, 200, 8192);
        assert_eq!(o.violations, 0, "seed {seed}: tail ran ahead of data");
        max_hwm = max_hwm.max(o.hwm);
    }
    assert!(
        max_hwm > 1,
        "the fault injector never reordered anything (reorder window stayed at {max_hwm})"
    );
}

/// Ranks 0 and 1 send LL data writes to rank 2 for (buffer, expert), then a
/// count signal; several rounds over both buffers. As soon as rank 2's
/// counter shows the round's (k, N), the N rows must be there. With `carry`,
/// the signal carries the last row itself (and counts the others).
fn ll_rounds(seed: Option<u64>, emulate: bool, carry: bool, rounds: usize, n_max: usize) -> usize {
    let row = 4096;
    let mut cfg = config(1);
    cfg.emulate_ordering = emulate;
    cfg.max_writes_in_flight_per_fifo = 32;
    let slots = rounds * 2 * n_max;
    let region = DATA as usize + slots * row;
    let fault = |r: usize, _| {
        seed.filter(|_| r < 2)
            .map(|s| heavy_faults(s * 10 + r as u64))
    };
    let c = Cluster::start(3, region, cfg, fault);
    let l = layout(3);
    let off =
        |round: usize, src: usize, i: usize| DATA + (((round * 2 + src) * n_max + i) * row) as u64;
    let mut k: HashMap<(usize, usize, usize), u64> = HashMap::new();
    let mut violations = 0;
    let r2 = c.region(2).clone();
    for round in 0..rounds {
        let (buffer, expert) = (round % 2, (round / 2) % l.num_local_experts);
        let n = |src: usize| (round * 7 + src * 3) % (n_max + 1);
        let deadline = Instant::now() + DEADLINE;
        let mut expect = Vec::new();
        for src in 0..2 {
            let fifo = c.proxies[src].fifo(0, 0).unwrap();
            let mut rows = Vec::new();
            let (b, e) = (buffer as u8, expert as u16);
            for i in 0..n(src) {
                let data = pattern((round * 1000 + src * 100 + i) as u64, row);
                let o = off(round, src, i);
                c.region(src).write(o as usize, &data).unwrap();
                let cmd = if carry && i + 1 == n(src) {
                    cmds::ll_write_count(2, o, o, row as u32, b, e, i as u16)
                } else {
                    cmds::ll_write(2, o, o, row as u32, b, e)
                };
                fifo.push(cmd.unwrap(), deadline).unwrap();
                rows.push((o, data));
            }
            if !carry || n(src) == 0 {
                let cmd = cmds::ll_count(2, b, e, n(src) as u16).unwrap();
                fifo.push(cmd, deadline).unwrap();
            }
            c.proxies[src].wake();
            let kk = k.entry((buffer, expert, src)).or_insert(0);
            *kk += 1;
            let counted = if carry {
                n(src).saturating_sub(1)
            } else {
                n(src)
            };
            let want = *kk << 32 | counted as u64;
            expect.push((l.ll_signal(buffer, expert, src).unwrap(), want, rows));
        }
        let start = Instant::now();
        let mut done = [false; 2];
        while !done.iter().all(|&d| d) {
            for (src, (ctr, want, rows)) in expect.iter().enumerate() {
                if done[src] || load(&r2, *ctr) != *want {
                    continue;
                }
                done[src] = true;
                violations += rows
                    .iter()
                    .filter(|(o, data)| &read(&r2, *o, data.len()) != data)
                    .count();
            }
            if start.elapsed() > DEADLINE {
                c.check();
                panic!("round {round}: LL counters never reached {expect:?}");
            }
            std::thread::yield_now();
        }
        // All of the round's rows land (without the emulation a row may
        // still be on its way) before the next round reuses the fences.
        for (_, _, rows) in &expect {
            for (o, data) in rows {
                wait_until("LL row", || &read(&r2, *o, data.len()) == data);
            }
        }
    }
    c.check();
    assert_eq!(c.proxies[2].stats().malformed_imms, 0);
    assert_eq!(c.proxies[2].stats().pending_signals, 0);
    c.shutdown();
    violations
}

#[test]
fn ll_count_signal_waits_for_its_data() {
    for carry in [false, true] {
        assert_eq!(ll_rounds(None, true, carry, 6, 12), 0);
        for seed in 1..=4 {
            assert_eq!(
                ll_rounds(Some(seed), true, carry, 6, 12),
                0,
                "seed {seed}: an LL counter appeared before its data (signal carries data: {carry})"
            );
        }
    }
}

/// The switch `emulate_ordering = false` (tests only) applies counters on
/// arrival: under the same workloads and faults as the two tests above, some
/// seed must then show a counter ahead of its data, for tails and for LL
/// signals. This is what proves those tests would catch a broken emulation.
#[test]
fn without_emulation_counters_run_ahead() {
    let tail_seed = (1..=10)
        .find(|&seed| normal_stream(Some(heavy_faults(seed)), false, 200, 8192).violations > 0);
    assert!(
        tail_seed.is_some(),
        "no seed in 1..=10 showed a tail ahead of its data without emulation"
    );
    for carry in [false, true] {
        let ll_seed = (1..=10).find(|&seed| ll_rounds(Some(seed), false, carry, 6, 12) > 0);
        assert!(
            ll_seed.is_some(),
            "no seed in 1..=10 showed an LL counter ahead of its data without emulation \
             (signal carries data: {carry})"
        );
    }
}
