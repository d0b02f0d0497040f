//! The combine's weighted reduction on the GPU (`kernels/combine.cu`), checked bit for
//! bit against `uep_ep::quant::reduce_rows`, the host device's combine loop (a NaN
//! matches any NaN: its payload is the hardware's).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
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
    let want = crate::pack::host_reduce(&y, &src, &w, topk, hidden, weighted);
    let stream = gpu.stream();
    let f = gpu.function(kernels::COMBINE, "uep_combine_reduce")?;
    let yd = stream.clone_htod(&y).map_err(driver("copying rows"))?;
    let sd = stream.clone_htod(&src).map_err(driver("copying sources"))?;
    let wd = stream.clone_htod(&w).map_err(driver("copying weights"))?;
    // Poisoned with a finite value, so an unwritten element cannot pass as a NaN.
    let mut od = stream
        .clone_htod(&vec![0x5a5au16; tokens * hidden])
        .map_err(driver("allocating out"))?;
    let shape = Shape {
        topk,
        hidden,
        weighted,
    };
    let run = |od: &mut CudaSlice<u16>| launch(gpu, &f, (&yd, &sd, &wd), shape, od);
    run(&mut od)?;
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
    let time = gpu.time(iters, || run(&mut od))?;
    let used = src.iter().filter(|&&s| s >= 0).count();
    let bytes = ((used + tokens) * hidden * 2) as u64;
    Ok(Measured { seed, time, bytes })
}

/// A reduction's shape: slots a token, channels a row, and whether slots are weighted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub(crate) topk: usize,
    pub(crate) hidden: usize,
    pub(crate) weighted: bool,
}

/// Reduces into `od` (`[tokens, hidden]`) the rows of `y` that `src` (`[tokens, topk]`,
/// `-1`: none) names, times `w` if weighted.
fn launch(
    gpu: &Gpu,
    f: &CudaFunction,
    (y, src, w): (&CudaSlice<u16>, &CudaSlice<i32>, &CudaSlice<f32>),
    s: Shape,
    od: &mut CudaSlice<u16>,
) -> Result<(), CudaError> {
    let tokens = src.len() / s.topk.max(1);
    if s.hidden % 2 != 0 || w.len() != src.len() || od.len() != tokens * s.hidden {
        return Err(CudaError::Invalid(format!(
            "a reduction of {} slots of {} channels (weights {}) into {}",
            src.len(),
            s.hidden,
            w.len(),
            od.len()
        )));
    }
    let dims = [tokens, s.topk, s.hidden, usize::from(s.weighted)].map(|v| v as u32);
    let cfg = LaunchConfig {
        grid_dim: (tokens.clamp(1, 65535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut l = gpu.stream().launch_builder(f);
    l.arg(y).arg(src).arg(w);
    for d in &dims {
        l.arg(d);
    }
    l.arg(od);
    // SAFETY: arguments match `uep_combine_reduce` (rows [*, hidden], sources and
    // weights [tokens, topk], four u32, out [tokens, hidden], checked above); every
    // source names a row of `y` (the callers' promise: `reduce` checks it).
    #[allow(unsafe_code)]
    unsafe { l.launch(cfg) }.map_err(driver("launching uep_combine_reduce"))?;
    Ok(())
}

/// The reduction of `src`'s rows of `y` (bf16 bits) into `out` by kernel `f`.
pub(crate) fn reduce(
    gpu: &Gpu,
    f: &CudaFunction,
    (y, src, w): (&[u16], &[i32], &[f32]),
    s: Shape,
    out: &mut [u16],
) -> Result<(), CudaError> {
    let rows = y.len() / s.hidden.max(1);
    if let Some(bad) = src.iter().find(|&&r| r >= 0 && r as usize >= rows) {
        return Err(CudaError::Invalid(format!("row {bad} of {rows}")));
    }
    if out.is_empty() {
        return Ok(());
    }
    let stream = gpu.stream();
    let yd = stream.clone_htod(y).map_err(driver("copying rows"))?;
    let sd = stream.clone_htod(src).map_err(driver("copying sources"))?;
    let wd = stream.clone_htod(w).map_err(driver("copying weights"))?;
    let mut od = stream
        .alloc_zeros(out.len())
        .map_err(driver("allocating out"))?;
    launch(gpu, f, (&yd, &sd, &wd), s, &mut od)?;
    stream
        .memcpy_dtoh(&od, out)
        .map_err(driver("copying out"))?;
    stream
        .synchronize()
        .map_err(driver("running the reduction"))
}
