//! Both combines' reduction on a GPU (`kernels/reduce.cu`), reading every row where it
//! is; checked bit for bit against the host device's reduce phase (a NaN matches any
//! NaN: its payload is the hardware's).
//!
//! Until symmetric memory is the GPU's own, the rows a phase names are host memory: each
//! source is copied to the device once, whole, and the kernel reads its rows there.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};
use half::bf16;
use uep_ep::device::{Device, HostDevice, Part, ReducePhase, Rows, Symmetric};

use crate::api::ReduceArgs;
use crate::gpu::{driver, kernels};
use crate::inputs::{inputs, reduce_parts, same_bits};
use crate::{CudaError, Gpu, Measured};

/// A reduce phase's rows, starts and parts on the device.
pub(crate) struct Uploaded {
    // Held for the table's addresses.
    _sources: Vec<CudaSlice<u16>>,
    table: CudaSlice<u64>,
    starts: CudaSlice<u32>,
    parts: CudaSlice<u32>,
    tokens: usize,
    hidden: usize,
    weighted: bool,
}

impl Uploaded {
    /// Copies `p`'s sources (each whole), starts and parts to the device. `p` is
    /// checked ([`ReducePhase::check`]) and has tokens.
    pub(crate) fn new(gpu: &Gpu, p: &ReducePhase<'_>) -> Result<Uploaded, CudaError> {
        let stream = gpu.stream();
        let ep = |e: uep_ep::EpError| CudaError::Invalid(e.to_string());
        let sources = (p.sources.iter())
            .map(|&s| {
                let rows = p.memory.rows(s).map_err(ep)?;
                // A source of no rows still needs an address; no part names it.
                let rows = if rows.is_empty() { &[0u16][..] } else { rows };
                stream.clone_htod(rows).map_err(driver("copying rows"))
            })
            .collect::<Result<Vec<_>, CudaError>>()?;
        let addrs: Vec<u64> = sources.iter().map(|s| gpu.addr(s)).collect();
        let words: &[u32] = bytemuck::cast_slice(p.parts);
        let words = if words.is_empty() { &[0u32][..] } else { words };
        Ok(Uploaded {
            table: stream
                .clone_htod(&addrs)
                .map_err(driver("copying the source table"))?,
            starts: stream
                .clone_htod(p.starts)
                .map_err(driver("copying starts"))?,
            parts: stream.clone_htod(words).map_err(driver("copying parts"))?,
            _sources: sources,
            tokens: p.tokens(),
            hidden: p.hidden,
            weighted: p.weighted,
        })
    }

    /// Reduces into `out` (`[tokens, hidden]` bf16 bits on the device).
    fn launch(
        &self,
        gpu: &Gpu,
        f: &CudaFunction,
        out: &mut CudaSlice<u16>,
    ) -> Result<(), CudaError> {
        if out.len() != self.tokens * self.hidden {
            return Err(CudaError::Invalid(format!(
                "a reduction of {} tokens of {} into {} values",
                self.tokens,
                self.hidden,
                out.len()
            )));
        }
        let cfg = LaunchConfig {
            grid_dim: (self.tokens.clamp(1, 65535) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = ReduceArgs {
            sources: gpu.addr(&self.table),
            starts: gpu.addr(&self.starts),
            parts: gpu.addr(&self.parts),
            out: gpu.addr(out),
            tokens: self.tokens as u32,
            hidden: self.hidden as u32,
            weighted: u32::from(self.weighted),
            pad: 0,
        };
        // SAFETY: the table holds each source's device copy, every part names a row of
        // its source and `starts` indexes the parts (the phase was checked before the
        // upload), `out` holds the tokens' rows (checked above); `Part` is
        // `uep::ReducePart`'s layout. All live until the caller synchronises.
        #[allow(unsafe_code)]
        unsafe {
            gpu.launch(f, cfg, &args, "launching uep_reduce")
        }
    }
}

/// `p` (checked, with tokens) reduced on the GPU into `out`.
pub(crate) fn reduce(
    gpu: &Gpu,
    f: &CudaFunction,
    p: &ReducePhase<'_>,
    out: &mut [bf16],
) -> Result<(), CudaError> {
    let up = Uploaded::new(gpu, p)?;
    let stream = gpu.stream();
    let mut od = stream
        .alloc_zeros::<u16>(out.len())
        .map_err(driver("allocating out"))?;
    up.launch(gpu, f, &mut od)?;
    stream
        .memcpy_dtoh(&od, bytemuck::cast_slice_mut::<bf16, u16>(out))
        .map_err(driver("copying out"))?;
    stream
        .synchronize()
        .map_err(driver("running the reduction"))
}

/// Reduces `tokens` tokens of up to `topk` rows of `hidden` channels from two sources on
/// the GPU and on the host device, weighted or not, compares every bit, then times
/// `iters` launches.
pub fn check(
    gpu: &Gpu,
    tokens: usize,
    topk: usize,
    hidden: usize,
    weighted: bool,
    seed: u64,
    iters: usize,
) -> Result<Measured, CudaError> {
    if tokens == 0 || topk == 0 || hidden == 0 {
        return Err(CudaError::Invalid(format!(
            "tokens {tokens}, topk {topk} and hidden {hidden} must be positive"
        )));
    }
    let width = hidden.next_multiple_of(128);
    let rows = [tokens * topk / 2 + 1, tokens * topk / 2 + 1];
    let y: Vec<Vec<bf16>> = (rows.iter().enumerate())
        .map(|(s, &n)| {
            (inputs(n, width, seed + s as u64).chunks(width))
                .flat_map(|r| r[..hidden].to_vec())
                .collect()
        })
        .collect();
    let (starts, parts): (Vec<u32>, Vec<Part>) = reduce_parts(tokens, topk, &rows, seed);
    let sources = [Rows::Tensor(&y[0]), Rows::Tensor(&y[1])];
    let phase = ReducePhase {
        hidden,
        sources: &sources,
        starts: &starts,
        parts: &parts,
        weighted,
        memory: Symmetric::none(),
    };
    let mut want = vec![bf16::ZERO; tokens * hidden];
    HostDevice::new(1)
        .reduce(&phase, &mut want)
        .map_err(|e| CudaError::Invalid(e.to_string()))?;
    let f = gpu.function(kernels::REDUCE, "uep_reduce")?;
    let up = Uploaded::new(gpu, &phase)?;
    let stream = gpu.stream();
    // Poisoned with a finite value, so an unwritten element cannot pass as a NaN.
    let mut od = stream
        .clone_htod(&vec![0x5a5au16; tokens * hidden])
        .map_err(driver("allocating out"))?;
    up.launch(gpu, &f, &mut od)?;
    let got = stream.clone_dtoh(&od).map_err(driver("copying out"))?;
    if let Some(i) = (0..got.len()).find(|&i| !same_bits(got[i], want[i].to_bits())) {
        return Err(CudaError::Mismatch(format!(
            "the reduction differs from the host at token {} channel {} (seed {seed}): \
             device {:#06x}, host {:#06x}",
            i / hidden,
            i % hidden,
            got[i],
            want[i].to_bits()
        )));
    }
    let time = gpu.time(iters, || up.launch(gpu, &f, &mut od))?;
    let bytes = ((parts.len() + tokens) * hidden * 2) as u64;
    Ok(Measured { seed, time, bytes })
}
