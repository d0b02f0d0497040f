//! The host build against what it must be: the warp collectives, barriers and spins
//! as CUDA defines them (and the misuses it reports), and every kernel bit for bit
//! against the host device on fresh inputs with the edge cases (the seed is printed).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use half::bf16;
use uep_ep::device::{CastPhase, Device, HostDevice, LayoutPhase, Phase, ReducePhase, Rows};
use uep_ep::quant::Nvfp4;
use uep_ep::Cast;

use super::ffi::Grid;
use super::{kernels, EmuDevice};
use crate::inputs::{inputs, reduce_parts, routing, same_bits};
use crate::quant::Loads;
use crate::selftest::WORDS as SELFTEST_WORDS;

/// A fresh seed, printed so that a failure can be replayed.
fn seed() -> u64 {
    let seed = std::env::var("UEP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            t.map_or(1, |d| d.as_nanos() as u64)
        });
    println!("seed {seed} (replay with UEP_SEED={seed})");
    seed
}

fn grid(blocks: u32, threads: u32) -> Grid {
    Grid::new(blocks, threads, Duration::from_secs(60))
}

/// Runs self-test case `which` on `grid`: each thread's words, or the launch's error.
fn selftest(grid: Grid, which: u32) -> Result<Vec<[u64; SELFTEST_WORDS]>, String> {
    let threads = (grid.blocks * grid.threads) as usize;
    let mut out = vec![0u64; threads * SELFTEST_WORDS];
    let flags: Vec<AtomicU64> = (0..threads.max(grid.blocks as usize))
        .map(|_| AtomicU64::new(0))
        .collect();
    kernels::selftest(grid, which, &mut out, &flags)?;
    Ok(out
        .chunks(SELFTEST_WORDS)
        .map(|w| w.try_into().unwrap())
        .collect())
}

/// Case `which` on `grid` against what CUDA defines.
fn selftest_as_cuda(grid: Grid, which: u32) {
    let words: Vec<u64> = selftest(grid, which)
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    let diff = crate::selftest::first_difference(which, &words, u64::from(grid.threads));
    assert!(diff.is_none(), "{grid:?}: {}", diff.unwrap_or_default());
}

#[test]
fn warp_collectives_give_what_cuda_defines() {
    // Two blocks of two warps: every warp's lanes and masks are its own.
    selftest_as_cuda(grid(2, 64), 0);
}

#[test]
fn block_barriers_order_stores_across_warps() {
    for (blocks, threads) in [(1, 64), (3, 96), (2, 256)] {
        selftest_as_cuda(grid(blocks, threads), 1);
    }
}

#[test]
fn every_block_of_a_grid_runs_at_once() {
    // Each block waits for the next one's flag: only a grid whose blocks all run at
    // once ends, here more blocks than the machine has cores.
    selftest_as_cuda(grid(24, 64), 2);
}

#[test]
fn a_kernel_spinning_on_a_word_another_thread_stores_goes_on() {
    let mut out = vec![0u64; 64 * SELFTEST_WORDS];
    let flags: Vec<AtomicU64> = (0..64).map(|_| AtomicU64::new(0)).collect();
    let started = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            flags[0].store(1, Ordering::Release);
        });
        // Case 7 spins on flags[0] until the other thread stores it.
        kernels::selftest(grid(1, 64), 7, &mut out, &flags).unwrap();
    });
    assert!(started.elapsed() >= Duration::from_millis(100));
}

#[test]
fn misused_collectives_and_endless_spins_are_errors() {
    let cases: [(u32, &str); 4] = [
        (3, "exited"),
        (4, "waits at"),
        (5, "reads lane 20, outside the mask"),
        (6, "deadlock"),
    ];
    for (which, says) in cases {
        let err = selftest(grid(2, 64), which).unwrap_err();
        assert!(err.contains(says), "case {which}: {err}");
        assert!(err.contains("uep_selftest"), "{err}");
    }
    let started = Instant::now();
    let err = selftest(Grid::new(2, 64, Duration::from_millis(200)), 7).unwrap_err();
    assert!(err.contains("deadline"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    // A full-mask collective in a warp that has only 8 lanes (a block of 40 threads).
    let err = selftest(grid(1, 40), 0).unwrap_err();
    assert!(err.contains("the warp has only 8"), "{err}");
    // A grid the runtime cannot run.
    let err = selftest(grid(1, 2048), 0).unwrap_err();
    assert!(err.contains("1 to 1024"), "{err}");
}

#[test]
fn the_layout_kernel_is_get_dispatch_layout() {
    let seed = seed();
    let (emu, host) = (EmuDevice::new(1), HostDevice::new(1));
    let shapes = [
        (1, 1, 4, 1, 1),
        (37, 8, 64, 4, 2),
        (300, 32, 256, 16, 4),
        (129, 6, 24, 8, 8),
    ];
    for (i, (tokens, topk, experts, ranks, per_node)) in shapes.into_iter().enumerate() {
        let ids = routing(tokens, topk, experts, ranks, seed + i as u64);
        let p = LayoutPhase {
            topk_idx: &ids,
            topk,
            num_experts: experts,
            num_ranks: ranks,
            ranks_per_node: per_node,
        };
        assert_eq!(emu.layout(&p).unwrap(), host.layout(&p).unwrap(), "{p:?}");
        assert!(emu.take_kernel_phases().contains(Phase::Layout));
    }
    // An id out of range: the host's error, not a fault of the kernel.
    let bad = [0, 1, 16, 2];
    let p = LayoutPhase {
        topk_idx: &bad,
        topk: 4,
        num_experts: 16,
        num_ranks: 4,
        ranks_per_node: 2,
    };
    let (e, h) = (emu.layout(&p).unwrap_err(), host.layout(&p).unwrap_err());
    assert_eq!(e.to_string(), h.to_string());
}

/// `tokens × hidden` inputs starting `skew` elements into their buffer (a caller's
/// tensor may start anywhere; the kernels' wide loads need an aligned copy then).
fn skewed(tokens: usize, hidden: usize, seed: u64, skew: usize) -> (Vec<bf16>, usize) {
    let x = inputs(tokens, hidden, seed);
    let mut buf = vec![bf16::ZERO; skew];
    buf.extend(x);
    (buf, skew)
}

#[test]
fn the_cast_kernels_are_the_host_casts() {
    let seed = seed();
    let (emu, host) = (EmuDevice::with_grid(1, grid(3, 64)), HostDevice::new(1));
    let casts = [
        Cast::Fp8 { round_scale: false },
        Cast::Fp8 { round_scale: true },
        Cast::Nvfp4(Nvfp4 {
            global_scale: 448.0 * 6.0 / 3.0,
            ue8m0: false,
        }),
        Cast::Nvfp4(Nvfp4 {
            global_scale: 1e-3,
            ue8m0: true,
        }),
        Cast::Nvfp4(Nvfp4 {
            global_scale: 3e30,
            ue8m0: false,
        }),
    ];
    for (i, (tokens, hidden, skew)) in [(1, 128, 0), (7, 384, 1), (33, 1024, 3), (2, 7168, 0)]
        .into_iter()
        .enumerate()
    {
        let (buf, skew) = skewed(tokens, hidden, seed + i as u64, skew);
        let x = &buf[skew..];
        for cast in casts {
            let f = cast.format();
            let (codes, words) = (tokens * f.row_bytes(hidden), tokens * f.scale_words(hidden));
            let p = CastPhase { x, hidden, cast };
            // Poisoned, so a value the kernel never wrote cannot pass.
            let mut got = (
                vec![0xa5u8; codes],
                vec![f32::from_bits(0x7fa5_a5a5); words],
            );
            let mut want = (vec![0u8; codes], vec![0f32; words]);
            emu.cast(&p, &mut got.0, &mut got.1).unwrap();
            host.cast(&p, &mut want.0, &mut want.1).unwrap();
            let bits = |s: &[f32]| s.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(got.0, want.0, "{tokens}x{hidden} {cast:?}: codes");
            assert_eq!(
                bits(&got.1),
                bits(&want.1),
                "{tokens}x{hidden} {cast:?}: scales"
            );
        }
        // The 8-byte kernel too (the GPU check times both).
        let xs: &[u16] = bytemuck::cast_slice(x);
        let (mut q, mut s) = (vec![0u8; x.len()], vec![0f32; x.len() / 128]);
        kernels::fp8_cast(grid(2, 64), Loads::X8, xs, true, &mut q, &mut s).unwrap();
        let want = uep_ep::quant::quantize(x, hidden, true).unwrap();
        assert_eq!((q, s), want, "8-byte loads, {tokens}x{hidden}");
    }
}

#[test]
fn the_reduce_kernel_is_the_host_reduce_reading_rows_in_place() {
    let seed = seed();
    let (emu, host) = (EmuDevice::with_grid(1, grid(2, 96)), HostDevice::new(1));
    for (i, (tokens, topk, hidden, skew)) in [
        (1, 1, 128usize, 0),
        (9, 8, 256, 1),
        (40, 9, 1024, 0),
        (5, 3, 7, 0),
    ]
    .into_iter()
    .enumerate()
    {
        let rows = [tokens * topk, 3, 0];
        // Rows one element into their buffer: the kernel's one-channel path.
        let bufs: Vec<Vec<bf16>> = (rows.iter().enumerate())
            .map(|(s, &n)| {
                let mut b = vec![bf16::ZERO; skew];
                b.extend(
                    inputs(n, hidden.next_multiple_of(128), seed + s as u64)
                        .chunks(hidden.next_multiple_of(128))
                        .flat_map(|r| r[..hidden].to_vec()),
                );
                b
            })
            .collect();
        let sources: Vec<Rows> = bufs.iter().map(|b| Rows::Tensor(&b[skew..])).collect();
        let (starts, parts) = reduce_parts(tokens, topk, &rows, seed + i as u64);
        for weighted in [false, true] {
            let p = ReducePhase {
                hidden,
                sources: &sources,
                starts: &starts,
                parts: &parts,
                weighted,
                memory: uep_ep::device::Symmetric::none(),
            };
            let mut got = vec![bf16::from_bits(0x5a5a); tokens * hidden];
            let mut want = vec![bf16::ZERO; tokens * hidden];
            emu.reduce(&p, &mut got).unwrap();
            host.reduce(&p, &mut want).unwrap();
            if let Some(j) =
                (0..got.len()).find(|&j| !same_bits(got[j].to_bits(), want[j].to_bits()))
            {
                panic!(
                    "{tokens}x{hidden} weighted {weighted}: token {} channel {}: {:#06x} vs {:#06x}",
                    j / hidden,
                    j % hidden,
                    got[j].to_bits(),
                    want[j].to_bits()
                );
            }
        }
    }
    assert!(emu.take_kernel_phases().contains(Phase::Reduce));
    assert!(emu.take_kernel_phases().names().is_empty(), "taken once");
}

#[test]
fn the_fifo_producer_kernel_feeds_uep_fifo_consumers() {
    use std::sync::atomic::AtomicBool;
    // Small rings, so producers wait for the consumer to free slots.
    for (rings, batch, capacity) in [(1, 1, 8), (3, 7, 16), (2, 32, 64)] {
        let host = kernels::HostRings::new(rings, capacity);
        let per_ring = 3000;
        let mut ns = vec![0u64; rings];
        let failed = AtomicBool::new(false);
        std::thread::scope(|s| {
            let consumer = s.spawn(|| crate::fifo_bench::drain(&host.all(), per_ring, &failed));
            let pushed =
                kernels::fifo_push(grid(rings as u32, 32), &host, per_ring, batch, &mut ns);
            if pushed.is_err() {
                failed.store(true, Ordering::Relaxed);
            }
            pushed.unwrap();
            consumer.join().unwrap().unwrap();
        });
        assert!(ns.iter().all(|&t| t > 0), "{ns:?}");
    }
    // Round trips: the kernel sees each pop.
    let host = kernels::HostRings::new(1, 8);
    let mut ns = vec![0u64; 200];
    let failed = AtomicBool::new(false);
    std::thread::scope(|s| {
        let consumer = s.spawn(|| crate::fifo_bench::drain(&host.all(), 200, &failed));
        kernels::fifo_ping(grid(1, 32), &host, &mut ns).unwrap();
        consumer.join().unwrap().unwrap();
    });
    assert!(ns.iter().all(|&t| t > 0));
}

/// Every command `host`'s rings carry until `n` arrived (or `failed` is raised).
fn collect(
    host: &kernels::HostRings,
    n: usize,
    failed: &std::sync::atomic::AtomicBool,
) -> Vec<uep_wire::TransferCmd> {
    let mut consumers: Vec<_> = (host.all().iter())
        .map(|(_, f)| f.consumer().unwrap())
        .collect();
    let (mut got, start) = (Vec::new(), Instant::now());
    while got.len() < n && !failed.load(Ordering::Relaxed) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} of {n}",
            got.len()
        );
        for c in consumers.iter_mut() {
            while let Some((slot, cmd)) = c.poll() {
                got.push(cmd);
                c.pop(slot).unwrap();
            }
        }
    }
    got
}

/// The LL send's commands for routing `ids`: each token's staged row once to each rank
/// its slots name, at its row of the source's block there.
fn ll_send_commands(
    ids: &[i64],
    (topk, epr, row_bytes): (usize, usize, usize),
    (staged_off, recv_off): (u64, u64),
    src_rank: u32,
) -> Vec<uep_wire::TransferCmd> {
    use uep_wire::{Command, TransferCmd};
    let tokens = ids.len() / topk;
    let mut want = Vec::new();
    for t in 0..tokens {
        let mut to: Vec<usize> = (ids[t * topk..(t + 1) * topk].iter())
            .filter(|&&e| e >= 0)
            .map(|&e| e as usize / epr)
            .collect();
        to.sort();
        to.dedup();
        for r in to {
            let row = (t * row_bytes) as u64;
            let block = u64::from(src_rank) * tokens as u64 * row_bytes as u64;
            let write = Command::Write {
                flags: Default::default(),
                dst_rank: r as u16,
                src_off: staged_off + row,
                dst_off: recv_off + block + row,
                len: row_bytes as u32,
                piggyback: None,
            };
            want.push(TransferCmd::encode(&write).unwrap());
        }
    }
    want
}

#[test]
fn the_ll_send_kernel_stages_the_host_cast_and_pushes_each_rank_once() {
    use std::sync::atomic::AtomicBool;
    let seed = seed();
    let (tokens, hidden, topk, experts, ranks) = (37, 512, 8, 64, 8);
    let x = inputs(tokens, hidden, seed);
    let ids = routing(tokens, topk, experts, ranks, seed);
    let row_bytes = hidden + hidden / 32;
    let mut staged = vec![0xa5u8; tokens * row_bytes];
    let host = kernels::HostRings::new(3, 16);
    let (staged_off, recv_off, src_rank) = (1u64 << 20, 1u64 << 30, 1u32);
    let mut want = ll_send_commands(
        &ids,
        (topk, experts / ranks, row_bytes),
        (staged_off, recv_off),
        src_rank,
    );
    let args = crate::api::LlSendArgs {
        staged_off,
        recv_off,
        src_rank,
        max_tokens: tokens as u32,
        tokens: tokens as u32,
        topk: topk as u32,
        hidden: hidden as u32,
        experts: experts as u32,
        ranks: ranks as u32,
        round_scale: 1,
        ..Default::default()
    };
    let failed = AtomicBool::new(false);
    let mut got = std::thread::scope(|s| {
        let consumer = s.spawn(|| collect(&host, want.len(), &failed));
        let xs: &[u16] = bytemuck::cast_slice(&x);
        let sent = kernels::ll_send(grid(3, 32), &host, xs, &ids, &mut staged, args);
        failed.store(sent.is_err(), Ordering::Relaxed);
        sent.unwrap();
        consumer.join().unwrap()
    });
    got.sort_by_key(|c| c.to_u128());
    want.sort_by_key(|c| c.to_u128());
    assert_eq!(got, want);
    // The staged rows: the host's cast, codes then scales.
    let (q, scales) = uep_ep::quant::quantize(&x, hidden, true).unwrap();
    for t in 0..tokens {
        let row = &staged[t * row_bytes..(t + 1) * row_bytes];
        assert_eq!(
            &row[..hidden],
            &q[t * hidden..(t + 1) * hidden],
            "token {t} codes"
        );
        let s: Vec<f32> = row[hidden..]
            .chunks(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let w = &scales[t * hidden / 128..(t + 1) * hidden / 128];
        assert_eq!(
            s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            w.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "token {t} scales"
        );
    }
}

#[test]
fn the_placement_kernel_is_the_host_placement() {
    use uep_ep::device::LlPlacePhase;
    let seed = seed();
    let (emu, host) = (EmuDevice::with_grid(1, grid(2, 64)), HostDevice::new(1));
    for (i, (tokens, topk, experts, ranks, max_rows)) in [
        (1, 1, 4, 1, 8),
        (37, 8, 64, 8, 128),
        (128, 8, 256, 16, 128),
        (70, 5, 30, 3, 70),
    ]
    .into_iter()
    .enumerate()
    {
        let ids = routing(tokens, topk, experts, ranks, seed + i as u64);
        let p = LlPlacePhase {
            topk_idx: &ids,
            topk,
            num_experts: experts,
            num_ranks: ranks,
            max_rows,
            rank: 3,
        };
        assert_eq!(
            emu.ll_place(&p).unwrap(),
            host.ll_place(&p).unwrap(),
            "{p:?}"
        );
        assert!(emu.take_kernel_phases().contains(Phase::LlPlace));
        // An id out of range, or an expert past its rows: the host's error, at the
        // same slot, whichever comes first.
        let mut bad = ids.clone();
        bad[ids.len() / 2] = experts as i64;
        bad[ids.len() - 1] = -2;
        let p = LlPlacePhase {
            topk_idx: &bad,
            ..p
        };
        let (e, h) = (
            emu.ll_place(&p).unwrap_err(),
            host.ll_place(&p).unwrap_err(),
        );
        assert_eq!(e.to_string(), h.to_string());
        let crowded = vec![1i64; ids.len()];
        let p = LlPlacePhase {
            topk_idx: &crowded,
            max_rows: 3.min(ids.len()),
            ..p
        };
        match (emu.ll_place(&p), host.ll_place(&p)) {
            (Ok(a), Ok(b)) => assert_eq!(a, b),
            (a, b) => assert_eq!(a.unwrap_err().to_string(), b.unwrap_err().to_string()),
        }
    }
}
