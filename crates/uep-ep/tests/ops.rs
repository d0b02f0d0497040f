//! The EP operations in one process: every rank a thread, nodes emulated by
//! `ranks_per_node`, the other nodes reached through the real proxy over libfabric, the
//! in-memory network, or the in-memory network behind the fault injector. Every output
//! of every step is checked bit for bit against the sequential reference, with fresh
//! random inputs (empty `-1` slots, ranks with no tokens, tokens naming one rank's
//! experts several times).

use std::sync::Arc;

use uep_ep::{Buffer, BufferConfig, Connect};
use uep_harness::ranks::run_ranks;
use uep_harness::step::{verified_steps, StepOpts};
use uep_harness::workload::JobShape;
use uep_transport::mem::MemNet;
use uep_transport::FaultConfig;

const HIDDEN: usize = 256;
const TOPK: usize = 4;
const EXPERTS: usize = 16;
const TOKENS: usize = 96;
const LL_TOKENS: usize = 24;

/// What carries the traffic between nodes.
#[derive(Clone, Copy, Debug)]
enum Wire {
    Libfabric,
    Memory,
    /// The in-memory network behind the fault injector (reorders, delays, splits).
    MemoryFaulty(u64),
}

/// What one rank saw: its mismatches, and the faults injected into its path.
type Seen = (Vec<String>, u64);

/// Run `steps` verified steps of both modes on `ranks` ranks, `per_node` a node, each
/// step with another routing.
fn run(ranks: usize, per_node: usize, wire: Wire, steps: u64, opts: StepOpts) -> Vec<Seen> {
    let shape = JobShape {
        num_ranks: ranks,
        ranks_per_node: per_node,
        hidden: HIDDEN,
        topk: TOPK,
        num_experts: EXPERTS,
    };
    let mut cfg = BufferConfig::new(EXPERTS, HIDDEN, TOPK, TOKENS, LL_TOKENS);
    cfg.ranks_per_node = Some(per_node);
    cfg.device_threads = 2;
    if let Wire::Memory | Wire::MemoryFaulty(_) = wire {
        let nets: Vec<MemNet> = (0..cfg.net.proxy.threads)
            .map(|_| MemNet::new(ranks))
            .collect();
        cfg.net.connector = Some(Connect(Arc::new(nets)));
    }
    if let Wire::MemoryFaulty(seed) = wire {
        cfg.net.faults = Some(FaultConfig::with_seed(seed));
    }
    run_ranks(ranks, |group| {
        let mut buffer = Buffer::new(group, cfg.clone()).expect("a Buffer");
        let bad = verified_steps(
            &mut buffer,
            &shape,
            (TOKENS, LL_TOKENS),
            steps,
            0x5eed,
            |step| StepOpts {
                zero_copy: step % 2 == 1,
                ..opts
            },
        )
        .expect("verified steps");
        (bad, buffer.faults_injected())
    })
    .expect("rendezvous")
}

/// Assert every rank matched the reference; returns the faults injected in all.
fn assert_exact(results: Vec<Seen>) -> u64 {
    for (rank, (bad, _)) in results.iter().enumerate() {
        assert!(bad.is_empty(), "rank {rank}: {bad:#?}");
    }
    results.iter().map(|(_, f)| f).sum()
}

#[test]
fn one_node_of_four_matches_the_reference() {
    assert_exact(run(4, 4, Wire::Memory, 4, StepOpts::default()));
}

#[test]
fn two_nodes_of_two_over_libfabric_match_the_reference() {
    assert_exact(run(4, 2, Wire::Libfabric, 4, StepOpts::default()));
}

#[test]
fn four_nodes_of_one_over_the_memory_network_match_the_reference() {
    let fp8 = StepOpts {
        fp8: true,
        ..StepOpts::default()
    };
    assert_exact(run(4, 1, Wire::Memory, 4, StepOpts::default()));
    assert_exact(run(4, 1, Wire::Memory, 2, fp8));
    let ue8m0 = StepOpts {
        fp8: true,
        round_scale: true,
        expert_alignment: 4,
        ..StepOpts::default()
    };
    assert_exact(run(4, 1, Wire::Memory, 2, ue8m0));
}

#[test]
fn faults_on_the_wire_change_no_bit() {
    for seed in [1, 2] {
        let faults = assert_exact(run(4, 2, Wire::MemoryFaulty(seed), 4, StepOpts::default()));
        assert!(faults > 0, "seed {seed}: no fault was injected");
    }
}
