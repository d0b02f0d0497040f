//! Model checks of the FIFO protocol under loom. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p uep-fifo --test loom --release`.
#![cfg(loom)]

use std::time::{Duration, Instant};

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use uep_fifo::{Fifo, Slot, TransferCmd};

/// Bounded preemptions keep the exploration to seconds; `LOOM_MAX_PREEMPTIONS`
/// in the environment overrides.
fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    // Waiting (a full ring, an empty poll) is a yield loop; each turn is a
    // few branches, more than loom's default 1000 allow in one execution.
    b.max_branches = b.max_branches.max(100_000);
    b
}

/// Never reached: loom explores interleavings, not time.
fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

fn cmd(producer: u64, seq: u64) -> TransferCmd {
    let word0 = (producer + 1) << 8 | seq;
    TransferCmd {
        word0,
        word1: !word0,
    }
}

/// Two producers push three commands (producer 0 two, producer 1 one: more
/// than capacity two, so a push meets back-pressure) while one consumer
/// pops: each command arrives exactly once, untorn, in its producer's
/// order, at consecutive slots.
/// Commands each producer pushes.
const PUSHES: [u64; 2] = [2, 1];

#[test]
fn two_producers_backpressure() {
    builder().check(|| {
        let fifo = Arc::new(Fifo::new_heap(2).unwrap());
        let producers: Vec<_> = (0..2)
            .map(|p| {
                let fifo = fifo.clone();
                thread::spawn(move || {
                    let mut last = None;
                    for i in 0..PUSHES[p as usize] {
                        let slot = fifo.push(cmd(p, i), far()).unwrap();
                        assert!(last < Some(slot));
                        last = Some(slot);
                    }
                })
            })
            .collect();
        let mut consumer = fifo.consumer().unwrap();
        let mut next = [0u64; 2];
        let mut got = 0;
        while got < PUSHES.iter().sum::<u64>() {
            match consumer.poll() {
                Some((slot, c)) => {
                    assert_eq!(slot, Slot(got));
                    assert_eq!(c.word1, !c.word0, "torn command {c:x?}");
                    let p = ((c.word0 >> 8) - 1) as usize;
                    assert_eq!(c.word0 & 0xFF, next[p], "producer {p} out of order");
                    next[p] += 1;
                    consumer.pop(slot).unwrap();
                    got += 1;
                }
                None => thread::yield_now(),
            }
        }
        for p in producers {
            p.join().unwrap();
        }
        assert_eq!(next, PUSHES);
        assert!(consumer.poll().is_none());
        assert!(fifo.is_empty());
    });
}

/// A producer that sees its slot consumed also sees what the consumer did
/// before popping it (the Quiet/Barrier completion signal), and a slot is
/// never reported consumed before it is popped.
#[test]
fn is_consumed_publishes_completion() {
    builder().check(|| {
        let fifo = Arc::new(Fifo::new_heap(2).unwrap());
        let done = Arc::new(AtomicBool::new(false));
        let (f, d) = (fifo.clone(), done.clone());
        let consumer = thread::spawn(move || {
            let mut c = f.consumer().unwrap();
            loop {
                if let Some((slot, _)) = c.poll() {
                    d.store(true, Ordering::Relaxed);
                    c.pop(slot).unwrap();
                    return;
                }
                thread::yield_now();
            }
        });
        let slot = fifo.push(cmd(0, 0), far()).unwrap();
        while !fifo.is_consumed(slot) {
            thread::yield_now();
        }
        assert!(done.load(Ordering::Relaxed), "consumed before completion was visible");
        consumer.join().unwrap();
    });
}

/// Capacity one, one producer pushing three commands: every push after the
/// first must wait for the pop that frees the only slot, and the reused slot
/// never shows a stale or zeroed-half command.
#[test]
fn capacity_one_slot_reuse() {
    builder().check(|| {
        let fifo = Arc::new(Fifo::new_heap(1).unwrap());
        let f = fifo.clone();
        let producer = thread::spawn(move || {
            for i in 0..3 {
                f.push(cmd(0, i), far()).unwrap();
            }
        });
        let mut consumer = fifo.consumer().unwrap();
        let mut got = 0;
        while got < 3 {
            match consumer.poll() {
                Some((slot, c)) => {
                    assert_eq!((slot, c), (Slot(got), cmd(0, got)));
                    consumer.pop(slot).unwrap();
                    got += 1;
                }
                None => thread::yield_now(),
            }
        }
        producer.join().unwrap();
    });
}
