//! `uep bench --dump DIR`: every output of the last step as `.npy`, one folder a rank.
//!
//! Files (`DIR/rank{r}/`), all C order, little-endian; bf16 is stored as `uint16` bits
//! (`np.uint16`; view as bf16 with `ml_dtypes` or shift into float32: `(a.astype(np.uint32) << 16).view(np.float32)`):
//!
//! | file | dtype | shape |
//! |---|---|---|
//! | `recv_x.npy` | uint16 (bf16) or uint8 (FP8 e4m3) | `[N, H]` |
//! | `recv_x_scales.npy` | float32 (FP8 only) | `[N, H/128]` |
//! | `recv_topk_idx.npy` | int64 | `[N, K]` |
//! | `recv_topk_weights.npy` | float32 | `[N, K]` |
//! | `recv_src_idx.npy` | int32 | `[N]` |
//! | `num_recv_tokens_per_expert.npy` | int64 | `[E/R]` |
//! | `combined_x.npy` | uint16 (bf16) | `[T, H]` |
//! | `combined_topk_weights.npy` | float32 | `[T, K]` |
//! | `ll_recv_x.npy` | uint16 (bf16) or uint8 (FP8) | `[E/R, R*M, H]` (rows past `ll_recv_count` are unspecified) |
//! | `ll_recv_x_scales.npy` | float32 (FP8 only) | `[E/R, H/128, R*M]` (column-major scales, as DeepEP returns them) |
//! | `ll_recv_count.npy` | int32 | `[E/R]` |
//! | `ll_recv_src_info.npy` | int32 | `[E/R, R*M]` (source token, -1 past the count) |
//! | `ll_combined_x.npy` | uint16 (bf16) | `[T, H]` |

use std::path::Path;

use half::bf16;
use uep_ep::{DispatchOutput, LlDispatchOutput, RecvTokens};

use uep_harness::npy::{NpyArray, NpyData};

/// Arrays to write for one rank.
#[derive(Debug, Default)]
pub struct Dump {
    arrays: Vec<(String, NpyArray)>,
}

impl Dump {
    fn push(&mut self, name: &str, shape: &[usize], data: NpyData) {
        let array =
            NpyArray::new(shape.to_vec(), data).expect("shape matches the data by construction");
        self.arrays.push((name.to_string(), array));
    }

    /// Rows of `hidden` channels with leading dimensions `lead`, and their scales in
    /// shape `scale_shape`.
    fn tokens(
        &mut self,
        prefix: &str,
        x: RecvTokens<'_>,
        lead: &[usize],
        hidden: usize,
        scale_shape: &[usize],
    ) {
        let shape: Vec<usize> = lead.iter().copied().chain([hidden]).collect();
        match x {
            RecvTokens::Bf16(v) => self.bf16(&format!("{prefix}recv_x"), &shape, v),
            RecvTokens::Fp8 { data, scales } => {
                self.push(
                    &format!("{prefix}recv_x"),
                    &shape,
                    NpyData::U8(data.to_vec()),
                );
                self.f32(&format!("{prefix}recv_x_scales"), scale_shape, scales);
            }
            // Low-latency only: e2m1 pairs, and the scale words as their four bytes.
            RecvTokens::Nvfp4 { data, scales } => {
                let pairs: Vec<usize> = lead.iter().copied().chain([hidden / 2]).collect();
                self.push(
                    &format!("{prefix}recv_x"),
                    &pairs,
                    NpyData::U8(data.to_vec()),
                );
                let bytes: &[u8] = bytemuck::cast_slice(scales);
                self.push(
                    &format!("{prefix}recv_x_scales"),
                    &[scales.len(), 4],
                    NpyData::U8(bytes.to_vec()),
                );
            }
        }
    }

    /// The outputs of a normal dispatch of `hidden` channels (and the top-k they
    /// carried): every array keeps its trailing dimensions, also with no rows.
    pub fn normal(out: &DispatchOutput<'_>, hidden: usize) -> Dump {
        let mut d = Dump::default();
        let n = out.handle.num_rows;
        d.tokens("", out.recv_x, &[n], hidden, &[n, hidden / 128]);
        let k = out.handle.topk;
        if let Some(idx) = out.recv_topk_idx {
            d.push("recv_topk_idx", &[n, k], NpyData::I64(idx.to_vec()));
        }
        if let Some(w) = out.recv_topk_weights {
            d.f32("recv_topk_weights", &[n, k], w);
        }
        let src = &out.handle.recv_src_idx;
        d.push("recv_src_idx", &[src.len()], NpyData::I32(src.clone()));
        let counts: Vec<i64> = out
            .num_recv_tokens_per_expert
            .iter()
            .map(|&c| c as i64)
            .collect();
        d.push(
            "num_recv_tokens_per_expert",
            &[counts.len()],
            NpyData::I64(counts),
        );
        d
    }

    /// The outputs of a low-latency dispatch.
    pub fn ll(out: &LlDispatchOutput<'_>, hidden: usize) -> Dump {
        let mut d = Dump::default();
        let experts = out.recv_count.len();
        let rows = out.handle.src_info.len() / experts.max(1);
        d.tokens(
            "ll_",
            out.recv_x,
            &[experts, rows],
            hidden,
            &[experts, hidden / 128, rows],
        );
        d.push(
            "ll_recv_count",
            &[experts],
            NpyData::I32(out.recv_count.clone()),
        );
        d.push(
            "ll_recv_src_info",
            &[experts, rows],
            NpyData::I32(out.handle.src_info.clone()),
        );
        d
    }

    /// Add a bf16 array (stored as uint16 bits).
    pub fn bf16(&mut self, name: &str, shape: &[usize], v: &[bf16]) {
        self.push(
            name,
            shape,
            NpyData::U16(v.iter().map(|b| b.to_bits()).collect()),
        );
    }

    /// Add an f32 array.
    pub fn f32(&mut self, name: &str, shape: &[usize], v: &[f32]) {
        self.push(name, shape, NpyData::F32(v.to_vec()));
    }

    /// Write every array to `dir/rank{rank}/NAME.npy`.
    pub fn write(&self, dir: &Path, rank: usize) -> anyhow::Result<()> {
        let d = dir.join(format!("rank{rank}"));
        std::fs::create_dir_all(&d)
            .map_err(|e| anyhow::anyhow!("creating {}: {e}", d.display()))?;
        for (name, array) in &self.arrays {
            array.write(&d.join(format!("{name}.npy")))?;
        }
        Ok(())
    }
}
