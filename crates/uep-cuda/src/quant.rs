//! The low-latency dispatch's casts on the GPU (`kernels/cast.cu`), checked bit for
//! bit against `uep_ep::quant`, the definition the host device runs.

use crate::CudaError;

/// Channels a scale covers.
pub const GROUP: usize = uep_ep::quant::FP8_GROUP;

/// Bytes the cast of `tokens × hidden` moves: bf16 in, e4m3 and f32 scales out.
pub fn bytes(tokens: usize, hidden: usize) -> u64 {
    (tokens * (hidden * 3 + hidden / GROUP * 4)) as u64
}

/// Where the device's cast first differs from the host's, if it does: `q` bytes and
/// `scales` of rows of `hidden` channels.
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

/// Which cast kernel: the lane width of its loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loads {
    /// 8 bytes (four channels) a lane, a warp a group: `uep_fp8_quantize`.
    X8,
    /// 16 bytes (eight channels) a lane, half a warp a group: `uep_fp8_quantize_x16`.
    X16,
}

impl Loads {
    /// The kernel's name.
    pub fn kernel(self) -> &'static str {
        match self {
            Loads::X8 => "uep_fp8_quantize",
            Loads::X16 => "uep_fp8_quantize_x16",
        }
    }
}

#[cfg(feature = "cuda")]
pub(crate) use run::{cast, cast_nvfp4};
#[cfg(feature = "cuda")]
pub use run::{check, check_nvfp4};

#[cfg(feature = "cuda")]
mod run {
    use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

    use super::*;
    use crate::api::{Fp8CastArgs, Nvfp4CastArgs};
    use crate::gpu::{driver, kernels};
    use crate::inputs::inputs;
    use crate::{Gpu, Measured};

    /// Eight blocks of 256 threads a multiprocessor: its 2048 threads, full occupancy.
    fn grid(gpu: &Gpu) -> Result<LaunchConfig, CudaError> {
        Ok(LaunchConfig {
            grid_dim: (gpu.info()?.sms * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Casts `xd` (`groups` groups of 128 bf16 channels) into `qd` and `sd`.
    fn launch(
        gpu: &Gpu,
        f: &CudaFunction,
        xd: &CudaSlice<u16>,
        round_scale: bool,
        qd: &mut CudaSlice<u8>,
        sd: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let groups = (xd.len() / GROUP) as u64;
        if qd.len() != xd.len() || sd.len() as u64 != groups {
            return Err(CudaError::Invalid(format!(
                "{} channels cast into {} codes and {} scales",
                xd.len(),
                qd.len(),
                sd.len()
            )));
        }
        let args = Fp8CastArgs {
            x: gpu.addr(xd),
            q: gpu.addr(qd),
            scales: gpu.addr(sd),
            groups,
            round_scale: u32::from(round_scale),
            pad: 0,
        };
        // SAFETY: q and scales sized for `groups` groups of 128 (checked above), device
        // allocations (256-byte aligned, as the wide loads need), alive until the
        // caller synchronises.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(f, grid(gpu)?, &args, "launching the FP8 cast")
        }
    }

    /// The cast of `x` (bf16 bits, a multiple of 128 of them) into `q` and `scales`
    /// by kernel `f`.
    pub(crate) fn cast(
        gpu: &Gpu,
        f: &CudaFunction,
        x: &[u16],
        round_scale: bool,
        q: &mut [u8],
        scales: &mut [f32],
    ) -> Result<(), CudaError> {
        let stream = gpu.stream();
        let xd = stream.clone_htod(x).map_err(driver("copying the input"))?;
        let mut qd = stream
            .alloc_zeros(q.len())
            .map_err(driver("allocating q"))?;
        let mut sd = stream
            .alloc_zeros(scales.len())
            .map_err(driver("allocating scales"))?;
        launch(gpu, f, &xd, round_scale, &mut qd, &mut sd)?;
        stream.memcpy_dtoh(&qd, q).map_err(driver("copying q"))?;
        stream
            .memcpy_dtoh(&sd, scales)
            .map_err(driver("copying scales"))?;
        stream.synchronize().map_err(driver("running the FP8 cast"))
    }

    /// The NVFP4 cast of `x` (bf16 bits, a multiple of 128 of them) into `q` (two codes
    /// a byte) and `sf` (a scale byte a block of 16) by kernel `f`.
    pub(crate) fn cast_nvfp4(
        gpu: &Gpu,
        f: &CudaFunction,
        x: &[u16],
        cast: uep_ep::quant::Nvfp4,
        q: &mut [u8],
        sf: &mut [u8],
    ) -> Result<(), CudaError> {
        let groups = x.len() / GROUP;
        if x.len() % GROUP != 0 || q.len() != groups * GROUP / 2 || sf.len() != groups * 8 {
            return Err(CudaError::Invalid(format!(
                "{} channels cast into {} codes and {} scale bytes",
                x.len(),
                q.len(),
                sf.len()
            )));
        }
        let stream = gpu.stream();
        let xd = stream.clone_htod(x).map_err(driver("copying the input"))?;
        let qd = stream
            .alloc_zeros::<u8>(q.len())
            .map_err(driver("allocating q"))?;
        let sd = stream
            .alloc_zeros::<u8>(sf.len())
            .map_err(driver("allocating scales"))?;
        let args = Nvfp4CastArgs {
            x: gpu.addr(&xd),
            q: gpu.addr(&qd),
            sf: gpu.addr(&sd),
            groups: groups as u64,
            global_scale: cast.global_scale,
            ue8m0: u32::from(cast.ue8m0),
        };
        // SAFETY: 64 code bytes and 8 scale bytes a group of 128 channels (checked
        // above), device allocations alive until the synchronize below.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(f, grid(gpu)?, &args, "launching the NVFP4 cast")?;
        }
        stream.memcpy_dtoh(&qd, q).map_err(driver("copying q"))?;
        stream
            .memcpy_dtoh(&sd, sf)
            .map_err(driver("copying scales"))?;
        stream
            .synchronize()
            .map_err(driver("running the NVFP4 cast"))
    }

    /// A check's inputs: some tokens, whole groups of channels.
    fn check_shape(tokens: usize, hidden: usize) -> Result<(), CudaError> {
        if tokens == 0 || hidden == 0 || hidden % GROUP != 0 {
            return Err(CudaError::Invalid(format!(
                "hidden {hidden} must be a positive multiple of {GROUP}, tokens {tokens} positive"
            )));
        }
        Ok(())
    }

    /// Casts fresh inputs on the GPU, compares every byte and scale with the host's
    /// cast of the same inputs, then times `iters` launches.
    pub fn check(
        gpu: &Gpu,
        loads: Loads,
        tokens: usize,
        hidden: usize,
        round_scale: bool,
        seed: u64,
        iters: usize,
    ) -> Result<Measured, CudaError> {
        check_shape(tokens, hidden)?;
        let x = inputs(tokens, hidden, seed);
        let (want_q, want_s) = uep_ep::quant::quantize(&x, hidden, round_scale)
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
        let stream = gpu.stream();
        let f = gpu.function(kernels::CAST, loads.kernel())?;
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
        launch(gpu, &f, &xd, round_scale, &mut qd, &mut sd)?;
        let q = stream.clone_dtoh(&qd).map_err(driver("copying q"))?;
        let s = stream.clone_dtoh(&sd).map_err(driver("copying scales"))?;
        compare((&want_q, &want_s), (&q, &s), hidden)?;
        let time = gpu.time(iters, || {
            launch(gpu, &f, &xd, round_scale, &mut qd, &mut sd)
        })?;
        Ok(Measured {
            seed,
            time,
            bytes: bytes(tokens, hidden),
        })
    }

    /// Casts fresh inputs to NVFP4 on the GPU (global scale from their largest finite
    /// magnitude, as a caller computes it), compares every code and scale byte with the
    /// host device's cast, then times `iters` launches.
    pub fn check_nvfp4(
        gpu: &Gpu,
        tokens: usize,
        hidden: usize,
        ue8m0: bool,
        seed: u64,
        iters: usize,
    ) -> Result<Measured, CudaError> {
        use uep_ep::device::{CastPhase, Device, HostDevice};
        check_shape(tokens, hidden)?;
        let x = inputs(tokens, hidden, seed);
        let amax = (x.iter().map(|v| v.to_f32().abs()))
            .filter(|v| v.is_finite())
            .fold(1e-6f32, f32::max);
        let cast = uep_ep::quant::Nvfp4 {
            global_scale: 448.0 * 6.0 / amax,
            ue8m0,
        };
        let (mut want_q, mut want_s) = (vec![0u8; x.len() / 2], vec![0f32; x.len() / 64]);
        let phase = CastPhase {
            x: &x,
            hidden,
            cast: uep_ep::Cast::Nvfp4(cast),
        };
        HostDevice::new(1)
            .cast(&phase, &mut want_q, &mut want_s)
            .map_err(|e| CudaError::Invalid(e.to_string()))?;
        let f = gpu.function(kernels::CAST, "uep_nvfp4_quantize")?;
        let bits: Vec<u16> = x.iter().map(|v| v.to_bits()).collect();
        let (mut q, mut sf) = (vec![0xa5u8; want_q.len()], vec![0xa5u8; want_s.len() * 4]);
        let time = gpu.time(1 + iters, || {
            cast_nvfp4(gpu, &f, &bits, cast, &mut q, &mut sf)
        })?;
        let want_sf: &[u8] = bytemuck::cast_slice(&want_s);
        if let Some(i) = (0..q.len()).find(|&i| q[i] != want_q[i]) {
            return Err(CudaError::Mismatch(format!(
                "NVFP4 codes differ from the host at token {} byte {} (seed {seed}): {:#04x} vs {:#04x}",
                i / (hidden / 2),
                i % (hidden / 2),
                q[i],
                want_q[i]
            )));
        }
        if let Some(i) = (0..sf.len()).find(|&i| sf[i] != want_sf[i]) {
            return Err(CudaError::Mismatch(format!(
                "NVFP4 scale differs from the host at token {} block {} (seed {seed}): {:#04x} vs {:#04x}",
                i / (hidden / 16),
                i % (hidden / 16),
                sf[i],
                want_sf[i]
            )));
        }
        let bytes = (tokens * (hidden * 2 + hidden / 2 + hidden / 16)) as u64;
        Ok(Measured { seed, time, bytes })
    }
}
