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
