//! The combine's weighted reduction on the GPU (`kernels/combine.cu`), checked bit for
//! bit against `uep_ep::quant::reduce_rows`, the host device's combine loop (a NaN
//! matches any NaN: its payload is the hardware's).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::gpu::{driver, kernels};
use crate::inputs::inputs;
use crate::{CudaError, Gpu, Measured};

/// `[tokens, topk]` rows of `rows` expert outputs each token sums (`-1`: none), one in
/// eight slots empty and some rows taken twice by one token.
fn sources(tokens: usize, topk: usize, rows: usize, rng: &mut ChaCha8Rng) -> Vec<i32> {
    let mut src = Vec::with_capacity(tokens * topk);
    for _ in 0..tokens {
        let first = rng.gen_range(0..rows) as i32;
        for k in 0..topk {
            src.push(match rng.gen_range(0..8u32) {
                0 => -1,
                1 if k > 0 => first,
                _ => rng.gen_range(0..rows) as i32,
            });
        }
    }
    src
}

/// Equal bits, or both NaN: a NaN's sign and payload are the arithmetic unit's own
/// (x86 keeps an operand's, a GPU returns its canonical NaN), not the reduction's.
fn same(a: u16, b: u16) -> bool {
    let nan = |v: u16| v & 0x7fff > 0x7f80;
    a == b || (nan(a) && nan(b))
}

/// Reduces `tokens` tokens of `topk` rows of `hidden` channels on the GPU and with the
/// host's loop, weighted or not, compares every bit, then times `iters` launches.
pub fn check(
    gpu: &Gpu,
    tokens: usize,
    topk: usize,
    hidden: usize,
    weighted: bool,
    seed: u64,
    iters: usize,
) -> Result<Measured, CudaError> {
    if tokens == 0 || topk == 0 || hidden == 0 || hidden % 2 != 0 {
        return Err(CudaError::Invalid(format!(
            "tokens {tokens}, topk {topk} must be positive and hidden {hidden} even"
        )));
    }
    let rows = tokens * topk;
    let y: Vec<u16> = inputs(rows, hidden.next_multiple_of(128), seed)
        .chunks(hidden.next_multiple_of(128))
        .flat_map(|r| r[..hidden].iter().map(|v| v.to_bits()))
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x00c0_b14e);
    let src = sources(tokens, topk, rows, &mut rng);
    let w: Vec<f32> = (0..tokens * topk)
        .map(|_| rng.gen_range(-2.0..2.0))
        .collect();
    let want = reference(&y, &src, &w, topk, hidden, weighted);
    let stream = gpu.stream();
    let f = gpu.function(kernels::COMBINE, "uep_combine_reduce")?;
    let yd = stream.clone_htod(&y).map_err(driver("copying rows"))?;
    let sd = stream.clone_htod(&src).map_err(driver("copying sources"))?;
    let wd = stream.clone_htod(&w).map_err(driver("copying weights"))?;
    // Poisoned with a finite value, so an unwritten element cannot pass as a NaN.
    let mut od = stream
        .clone_htod(&vec![0x5a5au16; tokens * hidden])
        .map_err(driver("allocating out"))?;
    let dims = [
        tokens as u32,
        topk as u32,
        hidden as u32,
        u32::from(weighted),
    ];
    let cfg = LaunchConfig {
        grid_dim: (tokens.min(65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let launch = |od: &mut CudaSlice<u16>| {
        let mut l = stream.launch_builder(&f);
        l.arg(&yd).arg(&sd).arg(&wd);
        for d in &dims {
            l.arg(d);
        }
        l.arg(od);
        // SAFETY: arguments match `uep_combine_reduce` (rows [tokens*topk, hidden], sources
        // and weights [tokens, topk], four u32, out [tokens, hidden]).
        #[allow(unsafe_code)]
        unsafe { l.launch(cfg) }.map_err(driver("launching uep_combine_reduce"))?;
        Ok(())
    };
    launch(&mut od)?;
    let got = stream.clone_dtoh(&od).map_err(driver("copying out"))?;
    if let Some(i) = (0..got.len()).find(|&i| !same(got[i], want[i].to_bits())) {
        return Err(CudaError::Mismatch(format!(
            "combine reduction differs from the host at token {} channel {} (seed {seed}): \
             device {:#06x}, host {:#06x}",
            i / hidden,
            i % hidden,
            got[i],
            want[i].to_bits()
        )));
    }
    let time = gpu.time(iters, || launch(&mut od))?;
    let used = src.iter().filter(|&&s| s >= 0).count();
    let bytes = ((used + tokens) * hidden * 2) as u64;
    Ok(Measured { seed, time, bytes })
}

/// The host device's reduction of the same rows: `reduce_rows` per token, in slot
/// order, `-1` slots skipped.
fn reference(
    y: &[u16],
    src: &[i32],
    w: &[f32],
    topk: usize,
    hidden: usize,
    weighted: bool,
) -> Vec<bf16> {
    let tokens = src.len() / topk;
    let rows: Vec<&[u16]> = y.chunks_exact(hidden).collect();
    let mut want = vec![bf16::ZERO; tokens * hidden];
    for (t, out) in want.chunks_mut(hidden).enumerate() {
        let picked: Vec<(&[u16], f32)> = (0..topk)
            .filter_map(|k| {
                let r = usize::try_from(src[t * topk + k]).ok()?;
                Some((rows[r], w[t * topk + k]))
            })
            .collect();
        uep_ep::quant::reduce_rows(&picked, weighted, out);
    }
    want
}
