//! How the CUDA device hands a reduce phase to its kernel: every row a token sums,
//! gathered into one upload, and per token their places in it (padded with `-1` to the
//! most parts a token has) and weights. Host code, so it is checked here without a GPU:
//! the kernel's definition run on the packed rows ([`host_reduce`]) must equal the host
//! device's reduce phase.

use half::bf16;
use uep_ep::device::ReducePhase;

/// A reduce phase as `uep_combine_reduce` takes it.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedReduce {
    /// `[parts, hidden]` bf16 bits: each part's row, in order.
    pub y: Vec<u16>,
    /// `[tokens, topk]`: the row of `y` each slot sums (`-1`: none).
    pub src: Vec<i32>,
    /// `[tokens, topk]` weights.
    pub w: Vec<f32>,
    /// Slots a token: the most parts a token has (at least 1).
    pub topk: usize,
}

/// Packs `p` for an output of `out_len` values (checked first, as every device does).
pub fn pack_reduce(p: &ReducePhase<'_>, out_len: usize) -> uep_ep::Result<PackedReduce> {
    let (h, tokens) = (p.hidden, p.tokens());
    p.check(out_len)?;
    let topk = (0..tokens)
        .map(|t| p.parts_of(t).len())
        .max()
        .unwrap_or(0)
        .max(1);
    let sources: Vec<&[u16]> = (p.sources.iter())
        .map(|&s| p.memory.rows(s))
        .collect::<uep_ep::Result<_>>()?;
    let mut y = Vec::with_capacity(p.parts.len() * h);
    let (mut src, mut w) = (vec![-1i32; tokens * topk], vec![0f32; tokens * topk]);
    for t in 0..tokens {
        for (k, part) in p.parts_of(t).iter().enumerate() {
            let row = part.row as usize;
            src[t * topk + k] = (y.len() / h) as i32;
            w[t * topk + k] = part.weight;
            y.extend_from_slice(&sources[part.source as usize][row * h..(row + 1) * h]);
        }
    }
    Ok(PackedReduce { y, src, w, topk })
}

/// The reduction kernel's definition on the host: per token, `reduce_rows` over the
/// rows its slots name, in slot order, `-1` slots skipped.
pub fn host_reduce(
    y: &[u16],
    src: &[i32],
    w: &[f32],
    topk: usize,
    hidden: usize,
    weighted: bool,
) -> Vec<bf16> {
    let tokens = src.len() / topk.max(1);
    let rows: Vec<&[u16]> = y.chunks_exact(hidden.max(1)).collect();
    let mut out = vec![bf16::ZERO; tokens * hidden];
    for (t, out) in out.chunks_mut(hidden.max(1)).enumerate() {
        let picked: Vec<(&[u16], f32)> = (0..topk)
            .filter_map(|k| {
                let r = usize::try_from(src[t * topk + k]).ok()?;
                Some((rows[r], w[t * topk + k]))
            })
            .collect();
        uep_ep::quant::reduce_rows(&picked, weighted, out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use uep_ep::device::{Device, HostDevice, Part, Rows, Symmetric};

    proptest! {
        /// Tensors of several sizes, tokens with no part or with one row twice,
        /// weighted or not: the kernel's definition on the packed rows is the host
        /// device's reduce, bit for bit.
        #[test]
        fn packed_rows_reduce_as_the_host_device_does(
            seed in any::<u64>(),
            tokens in 0usize..10,
            weighted in any::<bool>(),
        ) {
            let h = 128;
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let tensors: Vec<Vec<bf16>> = [3usize, 1, 5]
                .iter()
                .map(|&n| (0..n * h).map(|_| bf16::from_f32(rng.gen_range(-4.0..4.0))).collect())
                .collect();
            let sources: Vec<Rows<'_>> = tensors.iter().map(|t| Rows::Tensor(t)).collect();
            let (mut starts, mut parts) = (vec![0u32], Vec::new());
            for _ in 0..tokens {
                for _ in 0..rng.gen_range(0..5) {
                    let source = rng.gen_range(0..3u32);
                    let row = rng.gen_range(0..tensors[source as usize].len() / h) as u32;
                    let weight = rng.gen_range(-2.0f32..2.0);
                    parts.push(Part { source, row, weight });
                }
                starts.push(parts.len() as u32);
            }
            let phase = ReducePhase {
                hidden: h,
                sources: &sources,
                starts: &starts,
                parts: &parts,
                weighted,
                memory: Symmetric::none(),
            };
            let mut want = vec![bf16::NAN; tokens * h];
            HostDevice::new(2).reduce(&phase, &mut want).unwrap();
            let p = pack_reduce(&phase, tokens * h).unwrap();
            let got = host_reduce(&p.y, &p.src, &p.w, p.topk, h, weighted);
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&got), bits(&want));
            prop_assert_eq!(p.src.len(), tokens * p.topk);
        }
    }
}
