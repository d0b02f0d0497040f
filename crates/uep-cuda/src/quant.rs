//! The low-latency dispatch's FP8 cast on the GPU (`kernels/quant.cu`), checked bit
//! for bit against `uep_ep::quant`, the definition the host device runs.

use std::time::Duration;

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::CudaError;

/// Channels a scale covers.
pub const GROUP: usize = uep_ep::quant::FP8_GROUP;

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

/// What one check found.
#[derive(Clone, Debug)]
pub struct QuantResult {
    /// Tokens cast.
    pub tokens: usize,
    /// Channels a token.
    pub hidden: usize,
    /// UE8M0 (power-of-two) scales.
    pub round_scale: bool,
    /// The input seed (replay with it).
    pub seed: u64,
    /// Median kernel time over the timed launches (device events).
    pub time: Duration,
}

impl QuantResult {
    /// Bytes the cast moves: bf16 in, e4m3 and f32 scales out.
    pub fn bytes(&self) -> u64 {
        (self.tokens * (self.hidden * 3 + self.hidden / GROUP * 4)) as u64
    }

    /// Bytes a second.
    pub fn bandwidth(&self) -> f64 {
        self.bytes() as f64 / self.time.as_secs_f64()
    }
}

/// Where the device's output first differs from the host's, if it does.
pub fn compare(
    host: (&[u8], &[f32]),
    device: (&[u8], &[f32]),
    hidden: usize,
) -> Result<(), CudaError> {
    if let Some(i) = (0..host.0.len()).find(|&i| host.0[i] != device.0[i]) {
        return Err(CudaError::Mismatch(format!(
            "FP8 cast differs from the host at token {} channel {}: device {:#04x}, host {:#04x}",
            i / hidden,
            i % hidden,
            device.0[i],
            host.0[i]
        )));
    }
    let groups = hidden / GROUP;
    if let Some(g) = (0..host.1.len()).find(|&g| host.1[g].to_bits() != device.1[g].to_bits()) {
        return Err(CudaError::Mismatch(format!(
            "FP8 scale differs from the host at token {} group {}: device {:e}, host {:e}",
            g / groups,
            g % groups,
            device.1[g],
            host.1[g]
        )));
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub use run::check;

#[cfg(feature = "cuda")]
mod run {
    use cudarc::driver::{sys::CUevent_flags, LaunchConfig, PushKernelArg};

    use super::*;
    use crate::gpu::{driver, kernels};
    use crate::Gpu;

    /// Casts fresh inputs on the GPU, compares every byte and scale with the host's
    /// cast of the same inputs, then times `iters` launches.
    pub fn check(
        gpu: &Gpu,
        tokens: usize,
        hidden: usize,
        round_scale: bool,
        seed: u64,
        iters: usize,
    ) -> Result<QuantResult, CudaError> {
        if tokens == 0 || hidden == 0 || hidden % GROUP != 0 {
            return Err(CudaError::Invalid(format!(
                "hidden {hidden} must be a positive multiple of {GROUP}, tokens {tokens} positive"
            )));
        }
        let x = inputs(tokens, hidden, seed);
        let (want_q, want_s) = uep_ep::quant::quantize(&x, hidden, round_scale)
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
        let stream = gpu.stream();
        let f = gpu.function(kernels::QUANT, "uep_fp8_quantize")?;
        let bits: Vec<u16> = x.iter().map(|v| v.to_bits()).collect();
        let xd = stream
            .clone_htod(&bits)
            .map_err(driver("copying the input"))?;
        // Poisoned, so an element the kernel never wrote cannot pass as the host's.
        let mut qd = stream
            .clone_htod(&vec![0xA5u8; x.len()])
            .map_err(driver("allocating q"))?;
        let mut sd = stream
            .clone_htod(&vec![f32::from_bits(0x7fa5_a5a5); x.len() / GROUP])
            .map_err(driver("allocating scales"))?;
        let groups = (x.len() / GROUP) as u64;
        let round = u32::from(round_scale);
        let sms = gpu.info()?.sms;
        let cfg = LaunchConfig {
            grid_dim: (sms * 4, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut times = Vec::with_capacity(iters);
        for i in 0..=iters {
            let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
            let t0 = stream
                .record_event(timing)
                .map_err(driver("recording an event"))?;
            let mut launch = stream.launch_builder(&f);
            launch
                .arg(&xd)
                .arg(&groups)
                .arg(&round)
                .arg(&mut qd)
                .arg(&mut sd);
            // SAFETY: arguments match `uep_fp8_quantize` (bf16 bits, groups, flag, q and
            // scales sized for `groups` groups of 128).
            #[allow(unsafe_code)]
            unsafe { launch.launch(cfg) }.map_err(driver("launching uep_fp8_quantize"))?;
            let t1 = stream
                .record_event(timing)
                .map_err(driver("recording an event"))?;
            t1.synchronize()
                .map_err(driver("running uep_fp8_quantize"))?;
            if i == 0 {
                // The first launch is the checked one (and the warm-up).
                let q = stream.clone_dtoh(&qd).map_err(driver("copying q"))?;
                let s = stream.clone_dtoh(&sd).map_err(driver("copying scales"))?;
                compare((&want_q, &want_s), (&q, &s), hidden)?;
            } else {
                let ms = t0.elapsed_ms(&t1).map_err(driver("reading an event"))?;
                times.push(Duration::from_secs_f64(f64::from(ms) / 1e3));
            }
        }
        times.sort();
        let time = times.get(times.len() / 2).copied().unwrap_or_default();
        Ok(QuantResult {
            tokens,
            hidden,
            round_scale,
            seed,
            time,
        })
    }
}
