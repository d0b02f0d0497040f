//! Single-threaded model check: any sequence of FIFO operations agrees with
//! a `VecDeque` of the same capacity.
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::time::Instant;

use proptest::prelude::*;
use uep_fifo::{Fifo, FifoError, PushError, Slot, TransferCmd};

#[derive(Clone, Debug)]
enum Op {
    Push(u64, u64),
    PushZero,
    PushBlocking(u64),
    Poll,
    Pop,
    PopAhead(u64),
    IsConsumed(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=u64::MAX, any::<u64>()).prop_map(|(w0, w1)| Op::Push(w0, w1)),
        1 => Just(Op::PushZero),
        1 => (1..=u64::MAX).prop_map(Op::PushBlocking),
        3 => Just(Op::Poll),
        3 => Just(Op::Pop),
        1 => (1..4u64).prop_map(Op::PopAhead),
        1 => (0..40u64).prop_map(Op::IsConsumed),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fifo_agrees_with_vecdeque(
        cap_log in 0u32..4,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let cap = 1usize << cap_log;
        let fifo = Fifo::new_heap(cap).unwrap();
        let mut consumer = fifo.consumer().unwrap();
        let mut model: VecDeque<(Slot, TransferCmd)> = VecDeque::new();
        let mut head = 0u64;
        let mut tail = 0u64;
        for op in ops {
            match op {
                Op::Push(word0, _) | Op::PushBlocking(word0) if model.len() == cap => {
                    let c = TransferCmd { word0, word1: 0 };
                    if matches!(op, Op::Push(..)) {
                        prop_assert_eq!(
                            fifo.try_push(c),
                            Err(PushError::Full { head, tail, capacity: cap })
                        );
                    } else {
                        // A past deadline: one attempt, then a timeout naming the indices.
                        let err = fifo.push(c, Instant::now()).unwrap_err();
                        let is_timeout = matches!(
                            err,
                            FifoError::PushTimeout { head: h, tail: t, capacity, .. }
                                if h == head && t == tail && capacity == cap
                        );
                        prop_assert!(is_timeout, "{:?}", err);
                    }
                }
                Op::Push(word0, word1) => {
                    let c = TransferCmd { word0, word1 };
                    prop_assert_eq!(fifo.try_push(c), Ok(Slot(head)));
                    model.push_back((Slot(head), c));
                    head += 1;
                }
                Op::PushBlocking(word0) => {
                    let c = TransferCmd { word0, word1: !word0 };
                    prop_assert_eq!(fifo.push(c, Instant::now()), Ok(Slot(head)));
                    model.push_back((Slot(head), c));
                    head += 1;
                }
                Op::PushZero => {
                    prop_assert_eq!(fifo.try_push(TransferCmd { word0: 0, word1: 1 }), Err(PushError::ZeroWord0));
                }
                Op::Poll => prop_assert_eq!(consumer.poll(), model.front().copied()),
                Op::Pop => match model.pop_front() {
                    Some((slot, _)) => {
                        prop_assert_eq!(consumer.pop(slot), Ok(()));
                        tail += 1;
                    }
                    None => {
                        let err = consumer.pop(Slot(tail)).unwrap_err();
                        prop_assert!(matches!(err, FifoError::PopNotReady { .. }), "{:?}", err);
                    }
                },
                Op::PopAhead(k) => {
                    let err = consumer.pop(Slot(tail + k)).unwrap_err();
                    prop_assert!(matches!(err, FifoError::PopNotAtTail { .. }), "{:?}", err);
                }
                Op::IsConsumed(s) => prop_assert_eq!(fifo.is_consumed(Slot(s)), s < tail),
            }
            prop_assert_eq!(fifo.len(), model.len());
            prop_assert_eq!(fifo.is_empty(), model.is_empty());
            prop_assert_eq!((fifo.head(), fifo.tail()), (head, tail));
            prop_assert_eq!(consumer.tail(), Slot(tail));
        }
    }
}
