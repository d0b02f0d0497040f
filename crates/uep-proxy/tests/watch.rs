//! A waiter's `ArrivalWatch` keeps the proxy thread it names polling
//! closely. (Its own test binary, so that its park counts are not disturbed
//! by other tests' proxies.)

mod common;

use std::time::Duration;

use common::*;
use uep_proxy::ProxyConfig;

/// While an `ArrivalWatch` lives, the idle thread it names sleeps at most
/// 50 µs at a time (a receiver with manual progress moves bytes only while
/// it polls); once it drops, the thread goes back to long sleeps.
#[test]
fn a_watched_thread_polls_closely_until_the_watch_drops() {
    let cfg = ProxyConfig {
        threads: 1,
        fifos_per_thread: 1,
        fifo_capacity: 64,
        max_park: Duration::from_millis(5),
        ..ProxyConfig::default()
    };
    let c = Cluster::start(2, 256 * 1024, cfg, |_, _| None);
    let p = &c.proxies[0];
    let parks_in = |ms: u64| {
        let before = p.stats().idle_parks;
        std::thread::sleep(Duration::from_millis(ms));
        p.stats().idle_parks - before
    };
    // Settle into the longest sleeps first.
    std::thread::sleep(Duration::from_millis(100));
    let idle = parks_in(300);
    let watch = p.watch_arrivals(0);
    // An unknown thread is ignored (no panic, no effect).
    let none = p.watch_arrivals(7);
    let watched = parks_in(300);
    drop((watch, none));
    std::thread::sleep(Duration::from_millis(50));
    let after = parks_in(300);
    // Unwatched: one sleep per 5 ms (~60 in 300 ms); watched: one per
    // 50 µs plus timer slack (~1000+). Generous margins for a busy machine.
    assert!(
        watched > 5 * idle.max(1),
        "watched thread parked {watched} times in 300 ms, unwatched {idle}"
    );
    assert!(
        after * 3 < watched,
        "after the watch dropped: {after} parks in 300 ms (watched: {watched})"
    );
    c.check();
    c.shutdown();
}
