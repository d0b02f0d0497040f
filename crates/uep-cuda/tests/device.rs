//! The EP operations with their kernel phases on a device: four ranks (two nodes of
//! two) of `Buffer::with_device`, every output of normal and low-latency steps checked
//! bit for bit against the sequential reference, and each phase on its own compared
//! with the host device on fresh inputs. The emulated device always runs (its kernels
//! are the host build of the GPU's); the CUDA device where a GPU is, skipped with the
//! reason elsewhere.

use std::sync::Arc;

use uep_cuda::EmuDevice;
use uep_ep::device::{CastPhase, Device, HostDevice, LayoutPhase};
use uep_ep::{Buffer, BufferConfig, Connect};
use uep_harness::ranks::run_ranks;
use uep_harness::step::{verified_steps, StepOpts};
use uep_harness::workload::JobShape;
use uep_transport::mem::MemNet;

const HIDDEN: usize = 512;
const TOPK: usize = 4;
const EXPERTS: usize = 16;

/// The layout and FP8 cast phases of `device` against the host device's.
fn layout_and_cast_match_the_host(device: &dyn Device) {
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
        assert_eq!(device.layout(&p).unwrap(), host.layout(&p).unwrap());
        let x = uep_cuda::inputs::inputs(77, HIDDEN, seed);
        for round_scale in [false, true] {
            let p = CastPhase {
                x: &x,
                hidden: HIDDEN,
                cast: uep_ep::Cast::Fp8 { round_scale },
            };
            let mut a = (vec![0u8; x.len()], vec![0f32; x.len() / 128]);
            let mut b = a.clone();
            device.cast(&p, &mut a.0, &mut a.1).unwrap();
            host.cast(&p, &mut b.0, &mut b.1).unwrap();
            assert_eq!(a, b, "seed {seed}");
        }
    }
    // An id out of range: the host's error, not a fault of the kernel.
    let bad = vec![0, 1, EXPERTS as i64, 2];
    let p = LayoutPhase {
        topk_idx: &bad,
        topk: TOPK,
        num_experts: EXPERTS,
        num_ranks: 4,
        ranks_per_node: 2,
    };
    let (c, h) = (device.layout(&p).unwrap_err(), host.layout(&p).unwrap_err());
    assert_eq!(c.to_string(), h.to_string());
}

/// Eight verified normal and low-latency steps (bf16 and FP8, zero copy or not) of four
/// ranks as two nodes, `tokens` (normal, low-latency) a rank, each rank's Buffer on the
/// device `open` makes; returns the phases that ran as kernels on rank 0.
fn ep_steps_match_the_reference(
    open: impl Fn() -> Arc<dyn Device> + Sync,
    (tokens, ll_tokens): (usize, usize),
) -> Vec<&'static str> {
    let (ranks, per_node) = (4, 2);
    let shape = JobShape {
        num_ranks: ranks,
        ranks_per_node: per_node,
        hidden: HIDDEN,
        topk: TOPK,
        num_experts: EXPERTS,
    };
    let mut cfg = BufferConfig::new(EXPERTS, HIDDEN, TOPK, tokens, ll_tokens);
    cfg.ranks_per_node = Some(per_node);
    let nets: Vec<MemNet> = (0..cfg.net.proxy.threads)
        .map(|_| MemNet::new(ranks))
        .collect();
    cfg.net.connector = Some(Connect(Arc::new(nets)));
    let results = run_ranks(ranks, |group| {
        let device = open();
        let mut buffer =
            Buffer::with_device(Arc::new(group), cfg.clone(), device.clone()).expect("a Buffer");
        let opts = |step: u64| StepOpts {
            zero_copy: step % 2 == 1,
            fp8: step % 4 < 2,
            round_scale: step % 4 == 1,
            expert_alignment: 0,
        };
        let bad = verified_steps(&mut buffer, &shape, (tokens, ll_tokens), 8, 0xc0da, opts)
            .expect("verified steps");
        (bad, device.take_kernel_phases().names())
    })
    .expect("rendezvous");
    for (rank, (bad, _)) in results.iter().enumerate() {
        assert!(bad.is_empty(), "rank {rank}: {bad:#?}");
    }
    results
        .into_iter()
        .next()
        .map(|(_, ran)| ran)
        .unwrap_or_default()
}

#[test]
fn the_emulated_device_phases_match_the_host_device() {
    layout_and_cast_match_the_host(&EmuDevice::new(2));
}

#[test]
fn ep_steps_on_the_emulated_device_match_the_reference() {
    let ran = ep_steps_match_the_reference(|| Arc::new(EmuDevice::new(2)), (64, 16));
    // The steps call every phase the emulated device has a kernel for.
    let want: Vec<&str> = EmuDevice::KERNELS.iter().map(|p| p.name()).collect();
    assert_eq!(ran, want);
}

#[test]
fn ep_steps_whose_split_ends_in_an_empty_block_match_the_reference() {
    // 5 tokens over 4 lanes: blocks of 2, the fourth starting past the tokens.
    let ran = ep_steps_match_the_reference(|| Arc::new(EmuDevice::new(4)), (5, 5));
    assert!(ran.contains(&"normal_pack"), "{ran:?}");
}

#[test]
#[ignore = "long tier (./dev test runs it): a grid of 264 warps a rank"]
fn ep_steps_on_a_gpu_sized_grid_match_the_reference() {
    // As many producers as an H100's 132 multiprocessors with two warps each: every
    // packet's writes still fit its count signal (the pack pushes a chunk once all its
    // rows are stored, whichever warps stored them).
    let grid = uep_cuda::emu::Grid::new(132, 64, std::time::Duration::from_secs(100));
    let ran = ep_steps_match_the_reference(|| Arc::new(EmuDevice::with_grid(2, grid)), (64, 16));
    assert!(ran.contains(&"ll_pack"), "{ran:?}");
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use uep_cuda::CudaDevice;

    /// The GPU, or the reason there is none (printed).
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
        if let Some(cuda) = gpu() {
            layout_and_cast_match_the_host(&cuda);
        }
    }

    #[test]
    fn ep_steps_on_the_cuda_device_match_the_reference() {
        if gpu().is_some() {
            ep_steps_match_the_reference(
                || Arc::new(CudaDevice::open(0, 2).expect("the GPU")),
                (64, 16),
            );
        }
    }
}
