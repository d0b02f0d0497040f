//! What the self-test kernel (`kernels/selftest.cu`) must give on any target: the warp
//! collectives, barriers and spins as CUDA defines them. The emulated device's tests
//! compare the host build with it; `uep gpu check` compares a GPU, so that the
//! emulation is checked against the hardware it stands for.

/// Words each thread writes (`uep::kSelftestWords`).
pub const WORDS: usize = 8;

/// The cases whose words are defined (`uep::SelftestCase`): the collectives, the block
/// barrier, and the spin ring.
pub const DEFINED: [u32; 3] = [0, 1, 2];

/// What thread `t` of block `b` (of `threads` a block) writes in case `which`, for the
/// words it defines.
pub fn expected(which: u32, b: u64, t: u64, threads: u64) -> Vec<u64> {
    let lane = t % 32;
    let by_lane = |f: &dyn Fn(u64) -> bool| (0..32).filter(|&l| f(l)).fold(0, |m, l| m | 1 << l);
    match which {
        0 => vec![
            1000 + (lane * 7) % 32,
            (lane ^ 5) * 3,
            by_lane(&|l| l % 3 == 0),
            by_lane(&|l| l % 5 == lane % 5),
            if lane < 16 { 0xaaaa } else { 0xaaaa_0000 },
            if lane < 16 { 15 } else { 16 },
            (0..lane % 4).sum::<u64>() + 32,
            9,
        ],
        1 => vec![7 * ((t + 33) % threads) + b],
        2 => vec![1],
        _ => Vec::new(),
    }
}

/// The first thread whose words differ from [`expected`], as a message.
pub fn first_difference(which: u32, words: &[u64], threads: u64) -> Option<String> {
    (words.chunks(WORDS).enumerate()).find_map(|(i, got)| {
        let (b, t) = (i as u64 / threads, i as u64 % threads);
        let want = expected(which, b, t, threads);
        (got[..want.len()] != want[..]).then(|| {
            format!(
                "self-test case {which}, block {b} thread {t}: got {:x?}, CUDA defines {want:x?}",
                &got[..want.len()]
            )
        })
    })
}

#[cfg(feature = "cuda")]
pub use run::check;

#[cfg(feature = "cuda")]
mod run {
    use cudarc::driver::LaunchConfig;

    use super::*;
    use crate::api::SelftestArgs;
    use crate::gpu::{driver, kernels};
    use crate::{CudaError, Gpu};

    /// Runs the defined cases on the GPU (`blocks` blocks of 64 threads) and compares
    /// every word with [`expected`].
    pub fn check(gpu: &Gpu, blocks: u32) -> Result<(), CudaError> {
        let f = gpu.function(kernels::SELFTEST, "uep_selftest")?;
        let stream = gpu.stream();
        let threads = 64u32;
        let n = (blocks * threads) as usize;
        for which in DEFINED {
            let out = stream
                .alloc_zeros::<u64>(n * WORDS)
                .map_err(driver("allocating the self-test's words"))?;
            let flags = stream
                .alloc_zeros::<u64>(n)
                .map_err(driver("allocating the self-test's flags"))?;
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            let args = SelftestArgs {
                out: gpu.addr(&out),
                flags: gpu.addr(&flags),
                which,
                pad: 0,
            };
            // SAFETY: a thread's words of `out` and a flag a thread, allocated above and
            // alive until the synchronize below.
            #[allow(unsafe_code)]
            unsafe {
                gpu.launch(&f, cfg, &args, "launching uep_selftest")?;
            }
            let words = stream
                .clone_dtoh(&out)
                .map_err(driver("copying the self-test's words"))?;
            if let Some(e) = first_difference(which, &words, u64::from(threads)) {
                return Err(CudaError::Mismatch(e));
            }
        }
        Ok(())
    }
}
