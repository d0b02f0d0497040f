//! Deferred low-latency receives across nodes: a rank may hold two dispatches whose
//! receive it has not called, while a peer on another node runs ahead. What it receives
//! must still be what was sent for that step.

use std::time::Duration;

use half::bf16;
use uep_bootstrap::Group;
use uep_ep::{Buffer, BufferConfig, LlCombineInput, LlDispatchArgs, RecvTokens};
use uep_harness::ranks::run_ranks;

const HIDDEN: usize = 128;
const TOKENS: usize = 4;

/// A low-latency Buffer of 2 experts, top-1, for `TOKENS` tokens, with
/// `ranks_per_node` ranks a node; and this rank.
fn buffer(group: Group, ranks_per_node: usize) -> (Buffer, usize) {
    let mut cfg = BufferConfig::new(2, HIDDEN, 1, 0, TOKENS);
    cfg.ranks_per_node = Some(ranks_per_node);
    cfg.timeout = Duration::from_secs(30);
    let buf = Buffer::new(group, cfg).expect("buffer");
    let me = buf.rank();
    (buf, me)
}

/// Step `step`'s tokens of rank `rank`: every value names both.
fn x(rank: usize, step: usize) -> Vec<bf16> {
    vec![bf16::from_f32((10 * step + rank + 1) as f32); TOKENS * HIDDEN]
}

/// The received rows of a bf16 step.
fn bf16_rows<'b>(out: &uep_ep::LlDispatchOutput<'b>) -> &'b [bf16] {
    let RecvTokens::Bf16(rows) = out.recv_x else {
        panic!("bf16 expected")
    };
    rows
}

/// Rank `src`'s rows of local expert 0 in a received step, as the values they carry.
fn from(out: &uep_ep::LlDispatchOutput<'_>, src: usize) -> Vec<f32> {
    let rows = bf16_rows(out);
    let (begin, n) = out.handle.layout_range[src];
    (begin as usize..(begin + n) as usize)
        .map(|r| rows[r * HIDDEN].to_f32())
        .collect()
}

#[test]
fn a_peer_running_ahead_does_not_overwrite_a_step_not_yet_received() {
    let results = run_ranks(2, |group| {
        let (mut buf, me) = buffer(group, 1);
        // Every token goes to expert 0, on rank 0.
        let idx = vec![0i64; TOKENS];
        let mut got = Vec::new();
        let send = |buf: &mut Buffer, step| {
            buf.low_latency_dispatch_send(LlDispatchArgs::new(&x(me, step), &idx))
                .expect("send")
        };
        let (p0, p1) = (send(&mut buf, 0), send(&mut buf, 1));
        if me == 0 {
            // Rank 1 may now receive steps 0 and 1 and send steps 2 and 3.
            std::thread::sleep(Duration::from_millis(1500));
        }
        for (step, p) in [(0, p0), (1, p1)] {
            let out = buf.low_latency_dispatch_recv(p).expect("recv");
            got.push((step, from(&out, 1)));
        }
        let (p2, p3) = (send(&mut buf, 2), send(&mut buf, 3));
        for (step, p) in [(2, p2), (3, p3)] {
            let out = buf.low_latency_dispatch_recv(p).expect("recv");
            got.push((step, from(&out, 1)));
        }
        got
    })
    .expect("rendezvous");
    for (step, rows) in &results[0] {
        let want = vec![(10 * step + 2) as f32; TOKENS];
        assert_eq!(
            rows, &want,
            "rank 0's step {step} holds other rows from rank 1"
        );
    }
}

/// Two dispatches sent, the first received and combined before the second is received:
/// the combine must wait for the peer's expert outputs, not take the second dispatch's
/// arrival for them.
#[test]
fn a_combine_between_two_deferred_receives_waits_for_its_own_rows() {
    let results = run_ranks(2, |group| {
        let (mut buf, me) = buffer(group, 1);
        // Rank 0's tokens go to expert 1 (on rank 1), rank 1's to expert 0: every row
        // crosses.
        let idx = vec![1 - me as i64; TOKENS];
        let w = vec![1f32; TOKENS];
        let pa = buf
            .low_latency_dispatch_send(LlDispatchArgs::new(&x(me, 0), &idx))
            .expect("send A");
        let pb = buf
            .low_latency_dispatch_send(LlDispatchArgs::new(&x(me, 1), &idx))
            .expect("send B");
        let out = buf.low_latency_dispatch_recv(pa).expect("recv A");
        let y = bf16_rows(&out).to_vec();
        let handle = out.handle;
        if me == 1 {
            std::thread::sleep(Duration::from_millis(1000));
        }
        let combined = buf
            .low_latency_combine(&y, &idx, &w, &handle)
            .expect("combine A");
        let _ = buf.low_latency_dispatch_recv(pb).expect("recv B");
        combined
    })
    .expect("rendezvous");
    for (rank, combined) in results.iter().enumerate() {
        assert_eq!(combined, &x(rank, 0), "rank {rank}'s combine of A");
    }
}

/// Combines whose receives wait, while a peer runs ahead: a peer's combine may not
/// overwrite the rows of one this rank has not received. Across nodes and inside one;
/// from rows of the caller's and zero-copy (where, inside a node, this rank reads its
/// rows from the peer's combine buffer, which the peer may not refill too early).
#[test]
fn a_peer_running_ahead_does_not_overwrite_a_combine_not_yet_received() {
    for (ranks_per_node, zero_copy) in [(1, false), (2, false), (1, true), (2, true)] {
        let results = run_ranks(2, |group| {
            let (mut buf, me) = buffer(group, ranks_per_node);
            // Every token to the other rank's expert.
            let idx = vec![1 - me as i64; TOKENS];
            let w = vec![1f32; TOKENS];
            let out = buf
                .low_latency_dispatch(LlDispatchArgs::new(&x(me, 0), &idx))
                .expect("dispatch");
            let rows = bf16_rows(&out);
            let handle = out.handle;
            // Combine c returns every row as the value c + 1.
            let y: Vec<Vec<bf16>> = (0..4)
                .map(|c| vec![bf16::from_f32((c + 1) as f32); rows.len()])
                .collect();
            let mut got = Vec::new();
            let mut round = |buf: &mut Buffer, cs: [usize; 2], wait: bool| {
                let input = |c: usize| match zero_copy {
                    true => LlCombineInput::ZeroCopy,
                    false => LlCombineInput::Rows(&y[c]),
                };
                let pending: Vec<_> = cs
                    .iter()
                    .map(|&c| {
                        if zero_copy {
                            let next = buf.low_latency_combine_buffer().expect("combine buffer");
                            next.copy_from_slice(&y[c]);
                        }
                        buf.low_latency_combine_send(input(c), &idx, &w, &handle)
                            .expect("combine send")
                    })
                    .collect();
                if wait {
                    // The peer may now receive both and send the next two.
                    std::thread::sleep(Duration::from_millis(1500));
                }
                for (p, &c) in pending.into_iter().zip(&cs) {
                    let mut out = vec![bf16::ZERO; TOKENS * HIDDEN];
                    buf.low_latency_combine_recv(p, input(c), &mut out)
                        .expect("combine recv");
                    got.push((c, out[0].to_f32()));
                }
            };
            round(&mut buf, [0, 1], me == 0);
            round(&mut buf, [2, 3], false);
            got
        })
        .expect("rendezvous");
        for (c, v) in &results[0] {
            assert_eq!(
                *v,
                (c + 1) as f32,
                "{ranks_per_node} rank(s) a node, zero copy {zero_copy}: rank 0's combine {c} holds another combine's rows"
            );
        }
    }
}

/// A third dispatch or combine while two wait for their receive is refused, with the
/// reason; as any misuse, it leaves the Buffer unusable, and a peer still in an earlier
/// call learns why from the abort.
#[test]
fn at_most_two_low_latency_calls_wait_for_their_receive() {
    for combine in [false, true] {
        let results = run_ranks(2, |group| {
            let (mut buf, me) = buffer(group, 1);
            let idx = vec![1 - me as i64; TOKENS];
            let w = vec![1f32; TOKENS];
            if !combine {
                for step in 0..3 {
                    if let Err(e) =
                        buf.low_latency_dispatch_send(LlDispatchArgs::new(&x(me, step), &idx))
                    {
                        return e.to_string();
                    }
                }
                return "a third dispatch was accepted".into();
            }
            let out = buf
                .low_latency_dispatch(LlDispatchArgs::new(&x(me, 0), &idx))
                .unwrap();
            let handle = out.handle;
            let y = vec![bf16::ONE; 2 * TOKENS * HIDDEN];
            for _ in 0..3 {
                if let Err(e) = buf.low_latency_combine_send(&y, &idx, &w, &handle) {
                    return e.to_string();
                }
            }
            "a third combine was accepted".into()
        })
        .expect("rendezvous");
        let what = if combine { "combines" } else { "dispatches" };
        for err in results {
            assert!(
                err.contains(&format!("at most two low-latency {what} may wait")),
                "{err}"
            );
        }
    }
}

/// Zero-copy combines (rows sent from the combine buffer, no staging copy) while a
/// receive waits: the next dispatch hands out the next buffer, and scribbling on it
/// does not reach the combine still waiting, which reads this rank's own rows from its
/// own buffer. Across nodes and inside one; every token's row comes back exactly.
#[test]
fn a_zero_copy_combine_sends_from_its_own_buffer() {
    for ranks_per_node in [1, 2] {
        let results = run_ranks(2, |group| {
            let (mut buf, me) = buffer(group, ranks_per_node);
            // Tokens alternate between the experts: some rows stay, some cross.
            let idx: Vec<i64> = (0..TOKENS as i64).map(|t| t % 2).collect();
            let w = vec![1f32; TOKENS];
            // A: the identity expert writes every received row into the combine buffer.
            let mut a = buf
                .low_latency_dispatch(LlDispatchArgs::new(&x(me, 0), &idx))
                .expect("dispatch A");
            let y_a = bf16_rows(&a).to_vec();
            let buffer_a = a.combine_buffer.take().expect("a combine buffer");
            buffer_a.copy_from_slice(&y_a);
            let at_a = buffer_a.as_ptr() as usize;
            let handle_a = a.handle;
            let pending_a = buf
                .low_latency_combine_send(LlCombineInput::ZeroCopy, &idx, &w, &handle_a)
                .expect("combine A send");
            // B, dispatched while A waits for its receive: its buffer is another one.
            let mut b = buf
                .low_latency_dispatch(LlDispatchArgs::new(&x(me, 1), &idx))
                .expect("dispatch B");
            let y_b = bf16_rows(&b).to_vec();
            let scribble = b.combine_buffer.take().expect("the next buffer");
            let at_b = scribble.as_ptr() as usize;
            scribble.fill(bf16::NAN);
            let handle_b = b.handle;
            let mut combined_a = vec![bf16::ZERO; TOKENS * HIDDEN];
            buf.low_latency_combine_recv(pending_a, LlCombineInput::ZeroCopy, &mut combined_a)
                .expect("combine A recv");
            // The same buffer again, from the Buffer itself.
            let buffer_b = buf.low_latency_combine_buffer().expect("the next buffer");
            assert_eq!(buffer_b.as_ptr() as usize, at_b);
            buffer_b.copy_from_slice(&y_b);
            let combined_b = buf
                .low_latency_combine(LlCombineInput::ZeroCopy, &idx, &w, &handle_b)
                .expect("combine B");
            (at_a != at_b, combined_a, combined_b)
        })
        .expect("rendezvous");
        for (rank, (distinct, a, b)) in results.iter().enumerate() {
            assert!(
                distinct,
                "rank {rank}: combine B was handed combine A's buffer"
            );
            assert_eq!(
                a,
                &x(rank, 0),
                "{ranks_per_node} a node: rank {rank}'s combine A"
            );
            assert_eq!(
                b,
                &x(rank, 1),
                "{ranks_per_node} a node: rank {rank}'s combine B"
            );
        }
    }
}

/// The receive half of a zero-copy combine must be told so too: given rows instead, it
/// is refused with the reason.
#[test]
fn a_combine_is_received_with_the_input_it_was_sent_with() {
    let results = run_ranks(2, |group| {
        let (mut buf, me) = buffer(group, 1);
        let idx = vec![1 - me as i64; TOKENS];
        let w = vec![1f32; TOKENS];
        // The peer that refuses first aborts: the other may learn it in its send, or
        // still in its dispatch (an abort ends a peer's waits at once).
        let out = match buf.low_latency_dispatch(LlDispatchArgs::new(&x(me, 0), &idx)) {
            Ok(out) => out,
            Err(e) => return e.to_string(),
        };
        let y = bf16_rows(&out).to_vec();
        let handle = out.handle;
        let mut combined = vec![bf16::ZERO; TOKENS * HIDDEN];
        match buf.low_latency_combine_send(LlCombineInput::ZeroCopy, &idx, &w, &handle) {
            Ok(pending) => buf
                .low_latency_combine_recv(pending, &y, &mut combined)
                .expect_err("received with rows")
                .to_string(),
            Err(e) => e.to_string(),
        }
    })
    .expect("rendezvous");
    for err in results {
        assert!(err.contains("pass the send half's input"), "{err}");
    }
}
