//! Idle proxies park: their threads use little CPU time while nothing
//! happens, and wake up promptly for new work. (Its own test binary, so no
//! other test's proxy threads run in this process.)

mod common;

use std::time::{Duration, Instant};

use common::*;
use uep_proxy::{cmds, ProxyConfig};

/// CPU time (utime + stime, in clock ticks of 1/100 s) of every thread of
/// this process whose name starts with `uep-proxy`, and how many there are.
fn proxy_cpu_ticks() -> (u64, usize) {
    let mut ticks = 0;
    let mut threads = 0;
    for task in std::fs::read_dir("/proc/self/task").expect("list threads") {
        let dir = task.expect("thread entry").path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue; // the thread exited meanwhile
        };
        if !comm.starts_with("uep-proxy") {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).expect("thread stat");
        // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
        let f: Vec<u64> = rest
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|v| v.parse().expect("tick count"))
            .collect();
        ticks += f[0] + f[1];
        threads += 1;
    }
    (ticks, threads)
}

#[test]
fn idle_threads_park_and_wake() {
    let cfg = ProxyConfig {
        threads: 2,
        fifos_per_thread: 2,
        fifo_capacity: 64,
        ..ProxyConfig::default()
    };
    let c = Cluster::start(2, 256 * 1024, cfg, |_, _| None);
    let deadline = Instant::now() + DEADLINE;
    // Some traffic on every thread, both ways, so connections are set up.
    for (src, dst) in [(0, 1), (1, 0)] {
        for t in 0..2 {
            let cmd = cmds::normal_write(dst, DATA, DATA + 64 * t as u64, 16, t as u8, 1).unwrap();
            c.proxies[src]
                .fifo(t, 0)
                .unwrap()
                .push(cmd, deadline)
                .unwrap();
        }
    }
    for (src, dst) in [(0, 1), (1, 0)] {
        for t in 0..2 {
            let tail = layout(2).tail(src, t).unwrap();
            wait_until("warm-up write", || load(c.region(dst), tail) == 1);
        }
    }
    std::thread::sleep(Duration::from_millis(100));

    let parks: u64 = c.proxies.iter().map(|p| p.stats().idle_parks).sum();
    let (before, n) = proxy_cpu_ticks();
    assert_eq!(n, 4, "expected 4 proxy threads");
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let (after, _) = proxy_cpu_ticks();
    let wall = t0.elapsed().as_secs_f64();
    let used = (after - before) as f64 / 100.0;
    // A spinning thread would use ~100% of a core (or its share of the 2
    // cores); parked ones a few percent at most.
    assert!(
        used < 0.1 * wall * n as f64,
        "{n} idle proxy threads used {used:.3} s of CPU in {wall:.3} s"
    );
    let parks_after: u64 = c.proxies.iter().map(|p| p.stats().idle_parks).sum();
    assert!(
        parks_after - parks >= 100,
        "idle threads parked only {} times in {wall:.3} s",
        parks_after - parks
    );

    // A pushed command is picked up promptly after wake().
    let cmd = cmds::normal_write(1, DATA, DATA + 1024, 16, 0, 1).unwrap();
    let t0 = Instant::now();
    c.proxies[0]
        .fifo(0, 1)
        .unwrap()
        .push(cmd, deadline)
        .unwrap();
    c.proxies[0].wake();
    let tail = layout(2).tail(0, 0).unwrap();
    wait_until("write after idle", || load(c.region(1), tail) == 2);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    c.check();
    c.shutdown();
}
