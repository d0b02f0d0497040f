//! The host device's compute phases: the reference functions of `layout` and `quant`,
//! spread over the kernel threads by rows.

use half::bf16;

use super::HostDevice;
use crate::area::SliceRows;
use crate::device::{CastPhase, LayoutPhase, ReducePhase};
use crate::error::Result;
use crate::layout::{get_dispatch_layout, DispatchLayout};
use crate::quant::{nvfp4_quantize_token, quantize_token, reduce_rows, Cast};

impl HostDevice {
    pub(super) fn layout_phase(&self, p: &LayoutPhase<'_>) -> Result<DispatchLayout> {
        get_dispatch_layout(
            p.topk_idx,
            p.topk,
            p.num_experts,
            p.num_ranks,
            p.ranks_per_node,
        )
    }

    pub(super) fn cast_phase(
        &self,
        p: &CastPhase<'_>,
        q: &mut [u8],
        scales: &mut [f32],
    ) -> Result<()> {
        p.check(q.len(), scales.len())?;
        let h = p.hidden;
        let f = p.cast.format();
        let (rb, g) = (f.row_bytes(h), f.scale_words(h));
        self.launch_row_pairs((q, rb), (scales, g), |first, codes, scales| {
            for (i, t) in (first..first + codes.len() / rb).enumerate() {
                let (q, s) = (codes.row_mut(i, rb), scales.row_mut(i, g));
                match p.cast {
                    Cast::Fp8 { round_scale } => quantize_token(p.x.row(t, h), round_scale, q, s),
                    Cast::Nvfp4(n) => {
                        let s: &mut [u8] = bytemuck::cast_slice_mut(s);
                        nvfp4_quantize_token(p.x.row(t, h), n, q, s);
                    }
                }
            }
            Ok(())
        })
    }

    pub(super) fn reduce_phase(&self, p: &ReducePhase<'_>, out: &mut [bf16]) -> Result<()> {
        p.check(out.len())?;
        let h = p.hidden;
        let sources: Vec<&[u16]> = (p.sources.iter())
            .map(|&s| p.memory.rows(s))
            .collect::<Result<_>>()?;
        self.launch_rows(out, h, |first, out| {
            let mut rows = Vec::new();
            for (t, out_row) in (first..).zip(out.chunks_exact_mut(h)) {
                rows.clear();
                rows.extend(
                    (p.parts_of(t).iter())
                        .map(|q| (sources[q.source as usize].row(q.row as usize, h), q.weight)),
                );
                reduce_rows(&rows, p.weighted, out_row);
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use crate::area::{Area, Layout, Mem, SliceRows};
    use crate::device::{CastPhase, Device, HostDevice, LayoutPhase, Part, ReducePhase, Rows};
    use crate::layout::get_dispatch_layout;
    use crate::quant::{nvfp4_quantize_token, quantize_token, reduce_rows, Cast, Nvfp4};
    use crate::symm;
    use crate::wait::Seen;

    fn random_rows(rng: &mut ChaCha8Rng, n: usize) -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.gen_range(-4.0f32..4.0)))
            .collect()
    }

    /// This process's own symmetric memory of `bytes` bytes, under a name of its own.
    fn own_memory(bytes: usize) -> symm::Symmetric {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = uep_shm::segment_name(&format!("phase-test{n}"), 0, std::process::id());
        let own = uep_shm::Segment::create(&name, bytes).unwrap();
        let mut memory = symm::Symmetric::from_parts(0, own, vec![None]);
        memory.unlink().unwrap();
        memory
    }

    #[test]
    fn the_cast_phase_is_quantize_token_on_every_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for (tokens, hidden) in [(0, 128), (1, 256), (9, 384), (64, 128)] {
            let x = random_rows(&mut rng, tokens * hidden);
            for round_scale in [false, true] {
                let (mut q0, mut s0) = (vec![0u8; x.len()], vec![0f32; x.len() / 128]);
                for t in 0..tokens {
                    let (q, s) = (q0.row_mut(t, hidden), s0.row_mut(t, hidden / 128));
                    quantize_token(x.row(t, hidden), round_scale, q, s);
                }
                for threads in [1, 3, 8] {
                    let (mut q, mut s) = (vec![7u8; x.len()], vec![-1f32; x.len() / 128]);
                    let phase = CastPhase {
                        x: &x,
                        hidden,
                        cast: Cast::Fp8 { round_scale },
                    };
                    HostDevice::new(threads)
                        .cast(&phase, &mut q, &mut s)
                        .unwrap();
                    assert_eq!((&q, &s), (&q0, &s0), "{tokens}x{hidden} on {threads}");
                }
            }
        }
    }

    #[test]
    fn the_nvfp4_cast_phase_is_nvfp4_quantize_token_on_every_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        for (tokens, hidden) in [(0, 128), (1, 256), (9, 384), (33, 128)] {
            let x = random_rows(&mut rng, tokens * hidden);
            for ue8m0 in [false, true] {
                let n = Nvfp4 {
                    global_scale: 448.0 * 6.0 / 3.0,
                    ue8m0,
                };
                let (mut q0, mut s0) = (vec![0u8; x.len() / 2], vec![0u8; x.len() / 16]);
                for t in 0..tokens {
                    let (q, s) = (q0.row_mut(t, hidden / 2), s0.row_mut(t, hidden / 16));
                    nvfp4_quantize_token(x.row(t, hidden), n, q, s);
                }
                for threads in [1, 3, 8] {
                    let (mut q, mut s) = (vec![7u8; x.len() / 2], vec![-1f32; x.len() / 64]);
                    let phase = CastPhase {
                        x: &x,
                        hidden,
                        cast: Cast::Nvfp4(n),
                    };
                    HostDevice::new(threads)
                        .cast(&phase, &mut q, &mut s)
                        .unwrap();
                    let words: &[u8] = bytemuck::cast_slice(&s);
                    assert_eq!(
                        (&q, words),
                        (&q0, &s0[..]),
                        "{tokens}x{hidden} on {threads}"
                    );
                }
            }
        }
        // A global scale that is not finite and positive is refused.
        let x = vec![bf16::ONE; 128];
        let (mut q, mut s) = (vec![0u8; 64], vec![0f32; 2]);
        for g in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let phase = CastPhase {
                x: &x,
                hidden: 128,
                cast: Cast::Nvfp4(Nvfp4 {
                    global_scale: g,
                    ue8m0: false,
                }),
            };
            assert!(
                HostDevice::new(1).cast(&phase, &mut q, &mut s).is_err(),
                "{g}"
            );
        }
    }

    #[test]
    fn a_cast_into_outputs_of_the_wrong_size_is_refused() {
        let x = vec![bf16::ONE; 256];
        let phase = CastPhase {
            x: &x,
            hidden: 128,
            cast: Cast::Fp8 { round_scale: false },
        };
        let (mut q, mut s) = (vec![0u8; 255], vec![0f32; 2]);
        assert!(HostDevice::new(2).cast(&phase, &mut q, &mut s).is_err());
    }

    #[test]
    fn the_layout_phase_is_get_dispatch_layout() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let topk_idx: Vec<i64> = (0..50 * 4).map(|_| rng.gen_range(-1..16)).collect();
        let phase = LayoutPhase {
            topk_idx: &topk_idx,
            topk: 4,
            num_experts: 16,
            num_ranks: 4,
            ranks_per_node: 2,
        };
        let want = get_dispatch_layout(&topk_idx, 4, 16, 4, 2).unwrap();
        assert_eq!(HostDevice::new(2).layout(&phase).unwrap(), want);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Rows from a tensor and from symmetric memory, repeated, weighted or not,
        /// tokens with no part: every token is `reduce_rows` of its parts.
        #[test]
        fn the_reduce_phase_is_reduce_rows_on_every_token(
            seed in any::<u64>(),
            tokens in 0usize..12,
            threads in 1usize..5,
            weighted in any::<bool>(),
        ) {
            let (h, rows_a, rows_b) = (128, 5, 7);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let a = random_rows(&mut rng, rows_a * h);
            let mut layout = Layout::new(64);
            let area: Area<u16> = layout.take(rows_b * h);
            let memory = own_memory(layout.len());
            let b = random_rows(&mut rng, rows_b * h);
            memory.local().put(area, bytemuck::cast_slice::<bf16, u16>(&b)).unwrap();
            let sources = [Rows::Tensor(&a), Rows::Symmetric { rank: 0, area }];
            let mut starts = vec![0u32];
            let mut parts = Vec::new();
            for _ in 0..tokens {
                for _ in 0..rng.gen_range(0..6) {
                    let source = rng.gen_range(0..2u32);
                    let row = rng.gen_range(0..[rows_a, rows_b][source as usize]) as u32;
                    let weight = rng.gen_range(-2.0f32..2.0);
                    parts.push(Part { source, row, weight });
                }
                starts.push(parts.len() as u32);
            }
            let seen = Seen::nothing_to_wait_for();
            let phase = ReducePhase {
                hidden: h,
                sources: &sources,
                starts: &starts,
                parts: &parts,
                weighted,
                memory: crate::device::Symmetric::new(&memory, memory.published(&seen)),
            };
            let mut out = vec![bf16::NAN; tokens * h];
            HostDevice::new(threads).reduce(&phase, &mut out).unwrap();
            let (a, b): (&[u16], &[u16]) = (bytemuck::cast_slice(&a), bytemuck::cast_slice(&b));
            for t in 0..tokens {
                let rows: Vec<(&[u16], f32)> = phase.parts_of(t).iter()
                    .map(|p| ([a, b][p.source as usize].row(p.row as usize, h), p.weight))
                    .collect();
                let mut want = vec![bf16::ZERO; h];
                reduce_rows(&rows, weighted, &mut want);
                let got: &[u16] = bytemuck::cast_slice(out.row(t, h));
                let want: &[u16] = bytemuck::cast_slice(&want);
                prop_assert_eq!(got, want, "token {}", t);
            }
            // A part naming a row its source lacks is refused before any row is read.
            let bad = [Part { source: 1, row: rows_b as u32, weight: 1.0 }];
            let phase = ReducePhase { starts: &[0, 1], parts: &bad, ..phase };
            prop_assert!(HostDevice::new(threads).reduce(&phase, &mut vec![bf16::ZERO; h]).is_err());
        }
    }
}
