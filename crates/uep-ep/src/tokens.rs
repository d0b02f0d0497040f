//! Token rows going in and coming out: bf16, or FP8 e4m3 with one f32 scale per 128
//! channels.

use half::bf16;

use crate::area::SliceRows;
use crate::error::Result;
use crate::invalid;

/// Activations a rank sends: bf16, or FP8 e4m3 bytes with one f32 scale per 128 channels.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    /// `[T, H]` bf16.
    Bf16(&'a [bf16]),
    /// `[T, H]` e4m3 bytes and `[T, H/128]` scales.
    Fp8 {
        /// The e4m3 values.
        data: &'a [u8],
        /// The per-128-channel scales.
        scales: &'a [f32],
    },
}

impl Tokens<'_> {
    /// Whether these are FP8.
    pub fn is_fp8(&self) -> bool {
        matches!(self, Tokens::Fp8 { .. })
    }

    /// Bytes of one token row (without scales).
    pub fn row_bytes(&self, hidden: usize) -> usize {
        if self.is_fp8() {
            hidden
        } else {
            hidden * 2
        }
    }

    /// Number of tokens, checking the shapes against `hidden`.
    pub fn num_tokens(&self, hidden: usize) -> Result<usize> {
        match self {
            Tokens::Bf16(x) => {
                if hidden == 0 || x.len() % hidden != 0 {
                    return Err(invalid!(
                        "x has {} bf16 values, not a multiple of hidden = {hidden}",
                        x.len()
                    ));
                }
                Ok(x.len() / hidden)
            }
            Tokens::Fp8 { data, scales } => {
                if hidden == 0 || hidden % 128 != 0 {
                    return Err(invalid!(
                        "FP8 needs hidden to be a multiple of 128, got {hidden}"
                    ));
                }
                if data.len() % hidden != 0 {
                    return Err(invalid!(
                        "x has {} FP8 values, not a multiple of hidden = {hidden}",
                        data.len()
                    ));
                }
                let t = data.len() / hidden;
                if scales.len() != t * (hidden / 128) {
                    return Err(invalid!(
                        "x scales have {} values, expected [tokens = {t}, hidden/128 = {}]",
                        scales.len(),
                        hidden / 128
                    ));
                }
                Ok(t)
            }
        }
    }

    /// The bytes of row `t`.
    pub(crate) fn row(&self, t: usize, hidden: usize) -> &[u8] {
        match self {
            Tokens::Bf16(x) => bytemuck::cast_slice(x.row(t, hidden)),
            Tokens::Fp8 { data, .. } => data.row(t, hidden),
        }
    }

    /// The scales of row `t` (empty for bf16).
    pub(crate) fn row_scales(&self, t: usize, hidden: usize) -> &[f32] {
        match self {
            Tokens::Bf16(_) => &[],
            Tokens::Fp8 { scales, .. } => {
                let g = hidden / 128;
                scales.row(t, g)
            }
        }
    }
}

/// Received activations, borrowed from the Buffer until its next call.
#[derive(Clone, Copy, Debug)]
pub enum RecvTokens<'a> {
    /// `[N, H]` bf16.
    Bf16(&'a [bf16]),
    /// `[N, H]` e4m3 bytes and their scales (`[N, H/128]` in normal mode;
    /// `[E/R, H/128, R*M]`, column-major, in low-latency mode).
    Fp8 {
        /// The e4m3 values.
        data: &'a [u8],
        /// The per-128-channel scales.
        scales: &'a [f32],
    },
}

impl<'a> RecvTokens<'a> {
    /// Received rows given as bytes: FP8 codes with their `scales`, or bf16.
    pub(crate) fn from_bytes(fp8: bool, x: &'a [u8], scales: &'a [f32]) -> RecvTokens<'a> {
        if fp8 {
            RecvTokens::Fp8 { data: x, scales }
        } else {
            RecvTokens::Bf16(bytemuck::cast_slice(x))
        }
    }
}
