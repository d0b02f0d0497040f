//! The EP operations with their compute phases on the GPU: four ranks (two nodes of
//! two) of `Buffer::with_device(.., CudaDevice)`, every output of normal and
//! low-latency steps checked bit for bit against the sequential reference. Each phase
//! on its own is also compared with the host device on fresh inputs. Without a GPU it
//! is skipped with the reason.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use uep_cuda::CudaDevice;
use uep_ep::device::{CastPhase, Device, HostDevice, LayoutPhase};
use uep_ep::{Buffer, BufferConfig, Connect};
use uep_harness::ranks::run_ranks;
use uep_harness::step::{verified_steps, StepOpts};
use uep_harness::workload::JobShape;
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
                cast: uep_ep::Cast::Fp8 { round_scale },
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
    let results = run_ranks(ranks, |group| {
        let device = Arc::new(CudaDevice::open(0, 2).expect("the GPU"));
        let mut buffer =
            Buffer::with_device(Arc::new(group), cfg.clone(), device).expect("a Buffer");
        let opts = |step: u64| StepOpts {
            zero_copy: step % 2 == 1,
            fp8: step % 4 < 2,
            round_scale: step % 4 == 1,
            expert_alignment: 0,
        };
        verified_steps(&mut buffer, &shape, (tokens, ll_tokens), 8, 0xc0da, opts)
            .expect("verified steps")
    })
    .expect("rendezvous");
    for (rank, bad) in results.iter().enumerate() {
        assert!(bad.is_empty(), "rank {rank}: {bad:#?}");
    }
}
