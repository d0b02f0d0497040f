//! The EP operations with their compute phases on the GPU: four ranks (two nodes of
//! two) of `Buffer::with_device(.., CudaDevice)`, every output of normal and
//! low-latency steps checked bit for bit against the sequential reference. Each phase
//! on its own is also compared with the host device on fresh inputs. Without a GPU it
//! is skipped with the reason.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use half::bf16;
use uep_cuda::CudaDevice;
use uep_ep::device::{CastPhase, Device, HostDevice, LayoutPhase};
use uep_ep::{Buffer, BufferConfig, Connect};
use uep_harness::check::Mismatches;
use uep_harness::ranks::run_ranks;
use uep_harness::step::{ll_step, normal_step, StepOpts};
use uep_harness::workload::{generate_all, JobShape, Routing, WorkloadSpec};
use uep_transport::mem::MemNet;

const HIDDEN: usize = 512;
const TOPK: usize = 4;
const EXPERTS: usize = 16;

/// The GPU, or the reason there is none (printed by the caller).
fn gpu() -> Option<CudaDevice> {
    match CudaDevice::open(0, 2) {
        Ok(d) => Some(d),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

#[test]
fn layout_and_cast_phases_match_the_host_device() {
    let Some(cuda) = gpu() else { return };
    let host = HostDevice::new(2);
    for seed in 0..4u64 {
        let ids = uep_cuda::inputs::routing(300, TOPK, EXPERTS, 4, seed);
        let p = LayoutPhase {
            topk_idx: &ids,
            topk: TOPK,
            num_experts: EXPERTS,
            num_ranks: 4,
            ranks_per_node: 2,
        };
        assert_eq!(cuda.layout(&p).unwrap(), host.layout(&p).unwrap());
        let x = uep_cuda::inputs::inputs(77, HIDDEN, seed);
        for round_scale in [false, true] {
            let p = CastPhase {
                x: &x,
                hidden: HIDDEN,
                round_scale,
            };
            let mut a = (vec![0u8; x.len()], vec![0f32; x.len() / 128]);
            let mut b = a.clone();
            cuda.cast(&p, &mut a.0, &mut a.1).unwrap();
            host.cast(&p, &mut b.0, &mut b.1).unwrap();
            assert_eq!(a, b, "seed {seed}");
        }
    }
    // An id out of range: the host's error, not a GPU fault.
    let bad = vec![0, 1, EXPERTS as i64, 2];
    let p = LayoutPhase {
        topk_idx: &bad,
        topk: TOPK,
        num_experts: EXPERTS,
        num_ranks: 4,
        ranks_per_node: 2,
    };
    let (c, h) = (cuda.layout(&p).unwrap_err(), host.layout(&p).unwrap_err());
    assert_eq!(c.to_string(), h.to_string());
}

#[test]
fn ep_steps_on_the_cuda_device_match_the_reference() {
    if gpu().is_none() {
        return;
    }
    let (ranks, per_node) = (4, 2);
    let shape = JobShape {
        num_ranks: ranks,
        ranks_per_node: per_node,
        hidden: HIDDEN,
        topk: TOPK,
        num_experts: EXPERTS,
    };
    let (tokens, ll_tokens) = (64, 16);
    let mut cfg = BufferConfig::new(EXPERTS, HIDDEN, TOPK, tokens, ll_tokens);
    cfg.ranks_per_node = Some(per_node);
    let nets: Vec<MemNet> = (0..cfg.net.proxy.threads)
        .map(|_| MemNet::new(ranks))
        .collect();
    cfg.net.connector = Some(Connect(Arc::new(nets)));
    let routings = [
        Routing::Uniform,
        Routing::SameRank,
        Routing::EmptyRanks,
        Routing::Mixed,
    ];
    let results = run_ranks(ranks, |group| {
        let device = Arc::new(CudaDevice::open(0, 2).expect("the GPU"));
        let mut buffer =
            Buffer::with_device(Arc::new(group), cfg.clone(), device).expect("a Buffer");
        let mut bad = Mismatches::new(buffer.rank());
        let mut y = Vec::new();
        let mut ll_y = vec![bf16::ZERO; EXPERTS * ll_tokens * HIDDEN];
        for step in 0..8u64 {
            let spec = |tokens: usize, salt: u64| WorkloadSpec {
                shape,
                tokens_per_rank: tokens,
                routing: routings[step as usize % routings.len()],
                drop_prob: 0.1,
                fp8_input: false,
                seed: 0xc0da ^ salt ^ step,
            };
            let opts = StepOpts {
                zero_copy: step % 2 == 1,
                fp8: step % 4 < 2,
                round_scale: step % 4 == 1,
                expert_alignment: 0,
            };
            let inputs = generate_all(&spec(tokens, 0)).expect("inputs");
            normal_step(&mut buffer, inputs, &shape, opts, &mut bad, &mut y).expect("normal step");
            let inputs = generate_all(&spec(ll_tokens, 0x11)).expect("inputs");
            ll_step(
                &mut buffer,
                &inputs,
                &shape,
                ll_tokens,
                opts,
                &mut bad,
                &mut ll_y,
            )
            .expect("LL step");
        }
        bad.messages().to_vec()
    })
    .expect("rendezvous");
    for (rank, bad) in results.iter().enumerate() {
        assert!(bad.is_empty(), "rank {rank}: {bad:#?}");
    }
}
