//! Micro-benchmarks of the host device's inner kernels at the DeepSeek-V3
//! shape (docs/architecture.md: H = 7168, K = 8, E = 256), one thread each:
//!
//! * FP8 quantise / dequantise (the crate's own `quant` functions), reported
//!   as bytes/s of the bf16 rows they stand for (target: >= 2 GB/s a core);
//! * the NVFP4 cast (`nvfp4_quantize_token`, e4m3 or UE8M0 block scales), the same way;
//! * `get_dispatch_layout` of 4096 tokens x 8 slots over 8 ranks;
//! * token packing: 4096 rows of 14336 bytes copied to scattered rows, the
//!   memory traffic of a normal dispatch's sends;
//! * the combine reduction `quant::reduce_rows`: `sum_k w_k * y_k` (LL combine)
//!   or `sum_k y_k` (normal combine) over K = 8 bf16 rows with f32 accumulation,
//!   rounded once.
//!
//! Run: `cargo bench -p uep-ep --bench kernels` (each bench stops after about
//! a second; divan's `--sample-count N` / `--max-time S` override that).

use divan::counter::{BytesCount, ItemsCount};
use divan::{black_box, Bencher};
use half::bf16;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uep_ep::quant::{
    dequantize_token, nvfp4_quantize_token, quantize, quantize_token, reduce_rows, Nvfp4,
    FP8_GROUP, NVFP4_BLOCK,
};

const H: usize = 7168;
const K: usize = 8;
const E: usize = 256;
const R: usize = 8;
/// Normal-mode tokens per rank.
const T_NORMAL: usize = 4096;
/// Low-latency tokens per rank: the rows a quantise/combine pass touches.
const T_LL: usize = 128;

fn main() {
    divan::main();
}

/// `rows` tokens of activation-like bf16 values (roughly N(0, 1) with a few
/// outliers, so group scales differ).
fn activations(rows: usize, seed: u64) -> Vec<bf16> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows * H)
        .map(|_| {
            let v: f32 = rng.gen::<f32>() * 2.0 - 1.0 + rng.gen::<f32>() * 2.0 - 1.0;
            let v = if rng.gen_ratio(1, 512) { v * 40.0 } else { v };
            bf16::from_f32(v)
        })
        .collect()
}

/// Quantise T_LL tokens, one `quantize_token` call each.
#[divan::bench(args = [false, true], max_time = 1)]
fn fp8_quantize(b: Bencher, round_scale: bool) {
    let x = activations(T_LL, 1);
    let mut q = vec![0u8; T_LL * H];
    let mut s = vec![0f32; T_LL * H / FP8_GROUP];
    b.counter(BytesCount::new(T_LL * H * 2)).bench_local(|| {
        for ((xt, qt), st) in x
            .chunks_exact(H)
            .zip(q.chunks_exact_mut(H))
            .zip(s.chunks_exact_mut(H / FP8_GROUP))
        {
            quantize_token(black_box(xt), round_scale, qt, st);
        }
        black_box(&q);
    });
}

/// Cast T_LL tokens to NVFP4, one `nvfp4_quantize_token` call each.
#[divan::bench(args = [false, true], max_time = 1)]
fn nvfp4_quantize(b: Bencher, ue8m0: bool) {
    let x = activations(T_LL, 1);
    let amax = x.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
    let cast = Nvfp4 {
        global_scale: 448.0 * 6.0 / amax,
        ue8m0,
    };
    let mut q = vec![0u8; T_LL * H / 2];
    let mut s = vec![0u8; T_LL * H / NVFP4_BLOCK];
    b.counter(BytesCount::new(T_LL * H * 2)).bench_local(|| {
        for ((xt, qt), st) in x
            .chunks_exact(H)
            .zip(q.chunks_exact_mut(H / 2))
            .zip(s.chunks_exact_mut(H / NVFP4_BLOCK))
        {
            nvfp4_quantize_token(black_box(xt), cast, qt, st);
        }
        black_box(&q);
    });
}

/// Dequantise T_LL tokens to f32; bytes counted as the bf16 rows they become.
#[divan::bench(max_time = 1)]
fn fp8_dequantize(b: Bencher) {
    let (q, s) = quantize(&activations(T_LL, 2), H, false).expect("valid shape");
    let mut out = vec![0f32; T_LL * H];
    b.counter(BytesCount::new(T_LL * H * 2)).bench_local(|| {
        for ((qt, st), ot) in q
            .chunks_exact(H)
            .zip(s.chunks_exact(H / FP8_GROUP))
            .zip(out.chunks_exact_mut(H))
        {
            dequantize_token(black_box(qt), st, ot);
        }
        black_box(&out);
    });
}

/// `get_dispatch_layout` of 4096 tokens x top-8 over 256 experts on 8 ranks
/// (one node), 2% of slots empty.
#[divan::bench(max_time = 1)]
fn dispatch_layout(b: Bencher) {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let experts: Vec<i64> = (0..E as i64).collect();
    let mut ids = Vec::with_capacity(T_NORMAL * K);
    for _ in 0..T_NORMAL {
        ids.extend(experts.choose_multiple(&mut rng, K).copied());
    }
    for id in &mut ids {
        if rng.gen_ratio(1, 50) {
            *id = -1;
        }
    }
    b.counter(ItemsCount::new(T_NORMAL)).bench_local(|| {
        uep_ep::get_dispatch_layout(black_box(&ids), K, E, R, R).expect("valid layout")
    });
}

/// Normal dispatch's sends as memory traffic: 4096 rows of 2H bytes, each
/// copied to a row in random order (scattered destinations).
#[divan::bench(max_time = 1)]
fn token_packing(b: Bencher) {
    let row = H * 2;
    let src: Vec<u8> = (0..T_NORMAL * row).map(|i| i as u8).collect();
    // Written once so page faults are not timed.
    let mut dst = vec![1u8; T_NORMAL * row];
    let mut order: Vec<usize> = (0..T_NORMAL).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(4));
    b.counter(BytesCount::new(T_NORMAL * row)).bench_local(|| {
        for (s, &d) in src.chunks_exact(row).zip(&order) {
            dst[d * row..(d + 1) * row].copy_from_slice(s);
        }
        black_box(&dst);
    });
}

/// The combine reduction for T_LL tokens: `quant::reduce_rows` over K rows of H
/// bf16 each, f32 accumulation, one rounding to bf16, called per token exactly as
/// `Buffer::low_latency_combine` (weighted) and the normal combine (unweighted,
/// the plain sum) call it; bytes counted are the bf16 rows read.
#[divan::bench(args = [true, false], max_time = 1)]
fn combine_reduce(b: Bencher, weighted: bool) {
    let rows: Vec<u16> = activations(T_LL * K, 5)
        .iter()
        .map(|v| v.to_bits())
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let weights: Vec<f32> = (0..T_LL * K).map(|_| rng.gen::<f32>()).collect();
    let mut out = vec![bf16::ZERO; T_LL * H];
    let mut parts = Vec::with_capacity(K);
    b.counter(BytesCount::new(T_LL * K * H * 2))
        .bench_local(|| {
            for (t, out_row) in out.chunks_exact_mut(H).enumerate() {
                parts.clear();
                for s in 0..K {
                    let i = t * K + s;
                    parts.push((&rows[i * H..(i + 1) * H], weights[i]));
                }
                reduce_rows(black_box(&parts), weighted, out_row);
            }
            black_box(&out);
        });
}
