//! Multi-threaded and cross-process tests of the FIFO on real hardware.
#![cfg(not(loom))]

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use uep_fifo::{region_bytes, Fifo, Slot, TransferCmd};

/// A command naming its producer and sequence number; `word1` is a
/// checksum of `word0`, so a torn read (halves of two commands) shows.
fn cmd(producer: u64, seq: u64) -> TransferCmd {
    let word0 = (producer + 1) << 40 | seq;
    TransferCmd {
        word0,
        word1: checksum(word0),
    }
}

fn checksum(word0: u64) -> u64 {
    word0.rotate_left(23) ^ 0x9E37_79B9_7F4A_7C15
}

/// Checks one received command against the per-producer expectations.
fn check(next: &mut HashMap<u64, u64>, c: TransferCmd) {
    assert_eq!(c.word1, checksum(c.word0), "torn command {c:x?}");
    let producer = (c.word0 >> 40) - 1;
    let seq = c.word0 & ((1 << 40) - 1);
    let want = next.entry(producer).or_insert(0);
    assert_eq!(
        seq, *want,
        "producer {producer}: out of order or duplicated"
    );
    *want += 1;
}

/// Pops `total` commands, checking order; returns per-producer counts.
fn consume(fifo: &Fifo, total: u64, processed: &AtomicU64, deadline: Instant) -> HashMap<u64, u64> {
    let mut c = fifo.consumer().unwrap();
    let mut next = HashMap::new();
    let mut got = 0;
    while got < total {
        match c.poll() {
            Some((slot, command)) => {
                assert_eq!(slot, Slot(got));
                check(&mut next, command);
                processed.fetch_add(1, Ordering::Relaxed);
                c.pop(slot).unwrap();
                got += 1;
            }
            None => {
                assert!(
                    Instant::now() < deadline,
                    "consumer starved after {got} of {total}: {fifo:?}"
                );
                thread::yield_now();
            }
        }
    }
    assert!(c.poll().is_none(), "more commands than pushed");
    next
}

#[test]
fn threads_deliver_exactly_once_in_producer_order() {
    const PRODUCERS: u64 = 4;
    const EACH: u64 = 20_000;
    let fifo = Arc::new(Fifo::new_heap(64).unwrap().with_label("stress"));
    let processed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(30);
    let handles: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let fifo = fifo.clone();
            let processed = processed.clone();
            thread::spawn(move || {
                for i in 0..EACH {
                    let slot = fifo.push(cmd(p, i), deadline).unwrap();
                    // Every so often wait for completion, as a Quiet would:
                    // once consumed, the consumer's work on it is visible.
                    if i % 1000 == 999 {
                        while !fifo.is_consumed(slot) {
                            assert!(Instant::now() < deadline, "slot {slot} never consumed");
                            thread::yield_now();
                        }
                        assert!(processed.load(Ordering::Relaxed) > slot.0);
                    }
                }
            })
        })
        .collect();
    let next = consume(&fifo, PRODUCERS * EACH, &processed, deadline);
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(next.len() as u64, PRODUCERS);
    assert!(next.values().all(|&n| n == EACH), "{next:?}");
    assert!(fifo.is_empty());
    assert_eq!(fifo.head(), PRODUCERS * EACH);
}

#[test]
fn capacity_one_ping_pong() {
    let fifo = Arc::new(Fifo::new_heap(1).unwrap());
    let processed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs(30);
    let f = fifo.clone();
    let producer = thread::spawn(move || {
        for i in 0..5_000 {
            f.push(cmd(0, i), deadline).unwrap();
        }
    });
    let next = consume(&fifo, 5_000, &processed, deadline);
    producer.join().unwrap();
    assert_eq!(next[&0], 5_000);
}

const CHILD_ENV: &str = "UEP_FIFO_TEST_CHILD";
const CROSS_CAPACITY: usize = 32;
const CROSS_EACH: u64 = 5_000;

/// The producer side of `cross_process_producers`, run in a child process:
/// `spec` is "<path>:<producer id>".
fn child_producer(spec: &str) {
    let (path, producer) = spec.rsplit_once(':').expect("child spec is path:id");
    let producer: u64 = producer.parse().unwrap();
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    // SAFETY: the parent keeps the file alive and sized until we exit, and
    // only Fifo instances touch the mapping.
    let mut map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
    // SAFETY: `map` outlives `fifo` (dropped first, declared later) and the
    // region is only accessed through Fifos; the parent initialised it.
    let fifo =
        unsafe { Fifo::from_raw(map.as_mut_ptr(), map.len(), false, CROSS_CAPACITY) }.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 0..CROSS_EACH {
        fifo.push(cmd(producer, i), deadline).unwrap();
    }
}

fn spawn_child(path: &str, producer: u64) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "cross_process_producers",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{path}:{producer}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Two child processes push into a FIFO in a shared `/dev/shm` mapping; this
/// process consumes and checks every command once, in producer order.
#[test]
fn cross_process_producers() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child_producer(&spec);
        return;
    }
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let file = tempfile::Builder::new()
        .prefix("uep-fifo-test")
        .tempfile_in(dir)
        .unwrap();
    file.as_file()
        .set_len(region_bytes(CROSS_CAPACITY) as u64)
        .unwrap();
    // SAFETY: the temp file lives until the end of the test, after the
    // children have exited; it is only accessed through Fifos.
    let mut map = unsafe { memmap2::MmapMut::map_mut(file.as_file()) }.unwrap();
    // SAFETY: `map` outlives `fifo`; no one else uses the region during init
    // (the children start afterwards).
    let fifo = unsafe { Fifo::from_raw(map.as_mut_ptr(), map.len(), true, CROSS_CAPACITY) }
        .unwrap()
        .with_label("cross-process");
    let path = file.path().to_str().unwrap().to_owned();
    let mut children = [spawn_child(&path, 0), spawn_child(&path, 1)];
    let processed = AtomicU64::new(0);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        consume(
            &fifo,
            2 * CROSS_EACH,
            &processed,
            Instant::now() + Duration::from_secs(60),
        )
    }));
    if result.is_err() {
        for c in &mut children {
            let _ = c.kill();
        }
    }
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "producer child failed: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let next = result.unwrap_or_else(|e| std::panic::resume_unwind(e));
    assert_eq!(next.get(&0), Some(&CROSS_EACH));
    assert_eq!(next.get(&1), Some(&CROSS_EACH));
    assert!(fifo.is_empty());
}
