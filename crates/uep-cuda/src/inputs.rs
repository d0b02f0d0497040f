//! Fresh random inputs for the device checks: token rows with the FP8 cast's edge
//! cases, and routings with `-1` slots, tokens routed nowhere and tokens routed to
//! one rank many times.

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use uep_ep::quant::FP8_GROUP as GROUP;

/// `tokens × hidden` fresh bf16 inputs from `seed`: most groups Gaussian-like at one
/// magnitude per group (from 2^-20 to 2^12), and groups with the edge cases (zeros,
/// negative zero, subnormals, values beyond 448, infinities, NaN).
pub fn inputs(tokens: usize, hidden: usize, seed: u64) -> Vec<bf16> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut x = Vec::with_capacity(tokens * hidden);
    for _ in 0..tokens * hidden / GROUP {
        let kind = rng.gen_range(0..16u32);
        let scale = 2f32.powi(rng.gen_range(-20..=12));
        for _ in 0..GROUP {
            let v: f32 = match kind {
                0 => 0.0,
                1 => [0.0, -0.0, f32::from_bits(1 << 16), 1e-40][rng.gen_range(0..4)],
                2 => [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e30, -3e38][rng.gen_range(0..5)],
                3 if rng.gen_bool(0.05) => f32::NAN,
                _ => (rng.gen::<f32>() - 0.5) * 2.0 * scale,
            };
            x.push(bf16::from_f32(v));
        }
    }
    x
}

/// `[tokens, topk]` expert ids from `seed`: about one slot in ten `-1`, one token in
/// twenty routed nowhere, one in eight with every slot on one rank (often one expert
/// twice).
pub fn routing(tokens: usize, topk: usize, experts: usize, ranks: usize, seed: u64) -> Vec<i64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x05ee_d0f7_091c);
    let epr = experts / ranks;
    let mut ids = Vec::with_capacity(tokens * topk);
    for _ in 0..tokens {
        let kind = rng.gen_range(0..40u32);
        let rank = rng.gen_range(0..ranks);
        for _ in 0..topk {
            let id = match kind {
                0 | 1 => -1,
                2..=6 => (rank * epr + rng.gen_range(0..epr.min(2))) as i64,
                _ if rng.gen_bool(0.1) => -1,
                _ => rng.gen_range(0..experts) as i64,
            };
            ids.push(id);
        }
    }
    ids
}

/// The parts of a reduction of `tokens` tokens over sources of `rows[s]` rows each, from
/// `seed`, in CSR form (`starts`, `parts`): up to `topk` parts a token (one token in
/// eight with none), a row often taken twice by one token, weights in `[-2, 2)`.
pub fn reduce_parts(
    tokens: usize,
    topk: usize,
    rows: &[usize],
    seed: u64,
) -> (Vec<u32>, Vec<uep_ep::device::Part>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x00c0_b14e);
    let (mut starts, mut parts) = (vec![0u32], Vec::new());
    let sources: Vec<u32> = (0..rows.len() as u32)
        .filter(|&s| rows[s as usize] > 0)
        .collect();
    for _ in 0..tokens {
        let n = if rng.gen_range(0..8) == 0 || sources.is_empty() {
            0
        } else {
            rng.gen_range(1..=topk)
        };
        for k in 0..n {
            let part = match parts.last() {
                Some(&p) if k > 0 && rng.gen_range(0..6) == 0 => p,
                _ => {
                    let source = sources[rng.gen_range(0..sources.len())];
                    uep_ep::device::Part {
                        source,
                        row: rng.gen_range(0..rows[source as usize]) as u32,
                        weight: 0.0,
                    }
                }
            };
            parts.push(uep_ep::device::Part {
                weight: rng.gen_range(-2.0..2.0),
                ..part
            });
        }
        starts.push(parts.len() as u32);
    }
    (starts, parts)
}

/// Equal bf16 bits, or both NaN: a NaN's sign and payload are the arithmetic unit's own
/// (x86 keeps an operand's, a GPU returns its canonical NaN), not the definition's.
pub fn same_bits(a: u16, b: u16) -> bool {
    let nan = |v: u16| v & 0x7fff > 0x7f80;
    a == b || (nan(a) && nan(b))
}
