//! Token rows going in and coming out: bf16, FP8 e4m3 with one f32 scale per 128
//! channels, or (low-latency dispatch only) NVFP4 with one byte scale per 16 channels.

use half::bf16;

use crate::area::SliceRows;
use crate::error::Result;
use crate::invalid;

/// What a row of `hidden` channels is made of on the wire and in the outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenFormat {
    /// `hidden` bf16 values, no scales.
    Bf16,
    /// `hidden` e4m3 bytes and `hidden / 128` f32 scales.
    Fp8,
    /// `hidden / 2` bytes of e2m1 pairs and `hidden / 16` scale bytes, four to a
    /// 32-bit scale word (block `4w + i` in byte `i`, little-endian).
    Nvfp4,
}

impl TokenFormat {
    /// Bytes of a row's values.
    pub fn row_bytes(self, hidden: usize) -> usize {
        match self {
            TokenFormat::Bf16 => 2 * hidden,
            TokenFormat::Fp8 => hidden,
            TokenFormat::Nvfp4 => hidden / 2,
        }
    }

    /// 32-bit scale words of a row (an f32 scale each for FP8, four scale bytes each for
    /// NVFP4).
    pub fn scale_words(self, hidden: usize) -> usize {
        match self {
            TokenFormat::Bf16 => 0,
            TokenFormat::Fp8 => hidden / 128,
            TokenFormat::Nvfp4 => hidden / 64,
        }
    }

    /// The most scale words any format gives a row of `hidden` channels (what an area
    /// sized for every format holds).
    pub fn max_scale_words(hidden: usize) -> usize {
        hidden.div_ceil(64)
    }
}

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

    /// What these rows are made of.
    pub fn format(&self) -> TokenFormat {
        match self {
            Tokens::Bf16(_) => TokenFormat::Bf16,
            Tokens::Fp8 { .. } => TokenFormat::Fp8,
        }
    }

    /// Bytes of one token row (without scales).
    pub fn row_bytes(&self, hidden: usize) -> usize {
        self.format().row_bytes(hidden)
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
    /// Low-latency only: `[E/R, R*M, H/2]` bytes of e2m1 pairs and `[E/R, H/64, R*M]`
    /// scale words (column-major in the last two dimensions), four block scales each.
    Nvfp4 {
        /// The e2m1 pairs, the even channel in the low nibble.
        data: &'a [u8],
        /// The scale words.
        scales: &'a [u32],
    },
}

impl<'a> RecvTokens<'a> {
    /// Received rows of `format` given as bytes, with their scale words.
    pub(crate) fn from_bytes(
        format: TokenFormat,
        x: &'a [u8],
        scales: &'a [f32],
    ) -> RecvTokens<'a> {
        match format {
            TokenFormat::Bf16 => RecvTokens::Bf16(bytemuck::cast_slice(x)),
            TokenFormat::Fp8 => RecvTokens::Fp8 { data: x, scales },
            TokenFormat::Nvfp4 => RecvTokens::Nvfp4 {
                data: x,
                scales: bytemuck::cast_slice(scales),
            },
        }
    }
}
