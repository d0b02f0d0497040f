//! Model checks of the FIFO protocol under loom. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p uep-fifo --test loom --release`.
#![cfg(loom)]

use std::time::{Duration, Instant};

use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use uep_fifo::{Consumer, Fifo, PushError, Slot, TransferCmd};

/// Bounded preemptions (3 unless a test says otherwise) keep the whole file
/// to seconds; `LOOM_MAX_PREEMPTIONS` in the environment overrides.
fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(3);
    }
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

/// Producers `p` push `pushes[p]` commands each into a FIFO of `capacity`
/// while one consumer pops: each command arrives exactly once, untorn, in
/// its producer's order, at consecutive slots.
/// How many times a waiting thread in [`producers_and_consumer`] retries
/// before giving up. Loom's scheduler may let two waiting threads take
/// turns forever while the thread they wait on never runs (loom issue #53),
/// so unbounded waits there would never finish exploring; bounded waits
/// cut those starving schedules short, and the checks below hold whether
/// or not a thread gave up.
const RETRIES: usize = 2;

/// Producers `p` push up to `pushes[p]` commands each into a FIFO of
/// `capacity` while one consumer pops; afterwards the main thread drains
/// what is left. Every command pushed arrives exactly once, untorn, in its
/// producer's order, at consecutive slots; nothing else arrives; a push is
/// refused only when the ring is really full.
fn producers_and_consumer(capacity: usize, pushes: &'static [u64], preemptions: usize) {
    let mut b = builder();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        b.preemption_bound = Some(preemptions);
    }
    b.check(move || {
        let fifo = Arc::new(Fifo::new_heap(capacity).unwrap());
        let producers: Vec<_> = (0..pushes.len() as u64)
            .map(|p| {
                let fifo = fifo.clone();
                thread::spawn(move || {
                    let mut last = None;
                    for i in 0..pushes[p as usize] {
                        let mut tries = 0;
                        let slot = loop {
                            match fifo.try_push(cmd(p, i)) {
                                Ok(slot) => break slot,
                                Err(PushError::Full {
                                    head,
                                    tail,
                                    capacity: cap,
                                }) => {
                                    assert_eq!((head - tail, cap), (capacity as u64, capacity));
                                }
                                Err(e) => panic!("{e}"),
                            }
                            tries += 1;
                            if tries > RETRIES {
                                return i; // gave up: pushed 0..i
                            }
                            thread::yield_now();
                        };
                        assert!(last < Some(slot));
                        last = Some(slot);
                    }
                    pushes[p as usize]
                })
            })
            .collect();
        let mut consumer = fifo.consumer().unwrap();
        let mut next = vec![0u64; pushes.len()];
        let mut got = 0;
        let mut receive = |consumer: &mut Consumer<&Fifo>, slot: Slot, c: TransferCmd| {
            assert_eq!(slot, Slot(got));
            assert_eq!(c.word1, !c.word0, "torn command {c:x?}");
            let p = ((c.word0 >> 8) - 1) as usize;
            assert_eq!(c.word0 & 0xFF, next[p], "producer {p} out of order");
            next[p] += 1;
            consumer.pop(slot).unwrap();
            got += 1;
        };
        let mut idle = 0;
        while idle <= RETRIES {
            match consumer.poll() {
                Some((slot, c)) => receive(&mut consumer, slot, c),
                None => {
                    idle += 1;
                    thread::yield_now();
                }
            }
        }
        let pushed: Vec<u64> = producers.into_iter().map(|p| p.join().unwrap()).collect();
        // Joined: every successful push is published and visible.
        while let Some((slot, c)) = consumer.poll() {
            receive(&mut consumer, slot, c);
        }
        assert_eq!(next, pushed, "delivered vs pushed per producer");
        assert!(fifo.is_empty());
    });
}

/// Two producers, three commands, capacity two: a push meets back-pressure.
#[test]
fn two_producers_backpressure() {
    producers_and_consumer(2, &[2, 1], 3);
}

/// Two producers, two commands each, capacity two: both can meet
/// back-pressure, and slots are reused across laps.
#[test]
fn two_producers_two_laps() {
    // Two preemptions: three take ~40 s.
    producers_and_consumer(2, &[2, 2], 2);
}

/// Two producers racing for the single slot of a capacity-one ring.
#[test]
fn two_producers_capacity_one() {
    producers_and_consumer(1, &[1, 1], 3);
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
        assert!(
            done.load(Ordering::Relaxed),
            "consumed before completion was visible"
        );
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

/// The exclusive producer on a capacity-2 ring, four pushes: it reuses slots only after
/// the consumer freed them (its plain release store of `head` relies on the consumer's
/// Release of `tail`), and every command arrives once, in order, untorn.
#[test]
fn exclusive_producer_reuses_slots_safely() {
    builder().check(|| {
        let fifo = Arc::new(Fifo::new_heap(2).unwrap());
        let f = fifo.clone();
        let producer = thread::spawn(move || {
            let mut p = uep_fifo::Producer::claim(f).unwrap();
            for i in 0..4 {
                p.push(cmd(0, i), far()).unwrap();
            }
        });
        let mut consumer = fifo.consumer().unwrap();
        let mut got = 0;
        while got < 4 {
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
