//! NVFP4: e2m1 values in blocks of 16 channels, each block with one 8-bit scale (an e4m3
//! value that includes the caller's global scale, or a UE8M0 power of two), as the
//! low-latency dispatch of DeepEP's `hybrid-ep` branch casts tokens (docs/python.md,
//! "NVFP4").
//!
//! Per block of 16 channels `v`, with the caller's `global_scale` `g`, exactly (f32, no
//! fused multiply-add):
//! ```text
//! amax  = max |v|                              (NaN channels ignored)
//! sf    = g * (amax * RECIP_6)                 RECIP_6 = f32(1/6), as the GPU kernels
//! byte  = e4m3_from_f32(sf)                    or ue8m0_round_up(sf) with `ue8m0`
//! out   = amax == 0 ? 0 : g / decode(byte)     (one f32 division a block)
//! q[i]  = e2m1_from_f32(v[i] * out)            (round to nearest even, saturating)
//! ```
//! so `v ≈ e2m1 * decode(byte) / g`. Two codes a byte, the even channel in the low
//! nibble. The GPU kernels compute `out` with a fast reciprocal, which may differ from
//! this division in the last bit of `out` (and, rarely, flip a code at a rounding tie);
//! a block of zeros gets zero codes here whatever the scale format (the UE8M0 scale of
//! 0 decodes to 2^-127, and the kernels' `g / 2^-127` can overflow).

use half::bf16;

use multiversion::multiversion;

use super::{bf16_bits_to_f32, e4m3_from_f32, e4m3_to_f32};

/// Channels that share one NVFP4 block scale.
pub const NVFP4_BLOCK: usize = 16;

/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The f32 nearest 1/6, which the block scale multiplies by (as the GPU kernels do).
const RECIP_6: f32 = 1.0 / 6.0;

/// How an NVFP4 cast scales its blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Nvfp4 {
    /// The tensor-wide scale `g` (DeepEP's `x_global_scale`; typically
    /// `448 * 6 / amax(|x|)` over every rank's tokens): finite and positive.
    pub global_scale: f32,
    /// Block scales as UE8M0 exponent bytes (`2^(byte - 127)`, rounded up) instead of
    /// e4m3 (DeepEP's `use_ue8m0_for_sf`).
    pub ue8m0: bool,
}

impl Nvfp4 {
    /// The value a block scale byte stands for.
    pub fn decode_scale(&self, byte: u8) -> f32 {
        if self.ue8m0 {
            ue8m0_to_f32(byte)
        } else {
            e4m3_to_f32(byte)
        }
    }
}

/// Encode `x` as e2m1 (bits: sign, 2 exponent bits, 1 mantissa bit; magnitudes 0, 0.5,
/// 1, 1.5, 2, 3, 4, 6): round to nearest, ties to even; beyond ±6 (infinities too)
/// saturates to ±6, and so does a NaN (by its sign bit); the sign bit is kept for
/// values that round to zero (`-0.1` is `0x8`).
///
/// Branch-free (comparisons summed; `min` turns NaN into the largest float) so the
/// cast's loops vectorise.
#[inline]
pub fn e2m1_from_f32(x: f32) -> u8 {
    let m = x.abs().min(f32::MAX);
    // One step up past each midpoint between neighbours; a tie goes to the even code
    // (the lower of 0.25, 1.25, 2.5, 5 and the upper of 0.75, 1.75, 3.5).
    let code = u8::from(m > 0.25)
        + u8::from(m >= 0.75)
        + u8::from(m > 1.25)
        + u8::from(m >= 1.75)
        + u8::from(m > 2.5)
        + u8::from(m >= 3.5)
        + u8::from(m > 5.0);
    code | ((x.to_bits() >> 28) & 0x8) as u8
}

/// Decode an e2m1 code (the low 4 bits of `c`).
pub fn e2m1_to_f32(c: u8) -> f32 {
    const MAGNITUDE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAGNITUDE[usize::from(c & 0x7)];
    if c & 0x8 != 0 {
        -m
    } else {
        m
    }
}

/// The UE8M0 byte of the least power of two `>= x` (`2^(byte - 127)`), saturated to
/// `[2^-127, 2^127]` (`0` and `254`); NaN gives `255`.
pub fn ue8m0_round_up(x: f32) -> u8 {
    if x.is_nan() {
        return 255;
    }
    let bits = x.to_bits();
    let (exp, mantissa) = ((bits >> 23) & 0xff, bits & 0x7f_ffff);
    if x <= 0.0 {
        return 0;
    }
    let byte = match exp {
        // A subnormal: above 2^-127 (half the subnormal range) it rounds up to 2^-126.
        0 => u32::from(mantissa > 1 << 22),
        255 => 254,
        e => e + u32::from(mantissa != 0),
    };
    byte.min(254) as u8
}

/// The value of a UE8M0 byte, `2^(byte - 127)` (exact in f32; `255` is NaN).
pub fn ue8m0_to_f32(byte: u8) -> f32 {
    match byte {
        255 => f32::NAN,
        // 2^-127 is an f32 subnormal.
        0 => f32::from_bits(1 << 22),
        b => f32::from_bits(u32::from(b) << 23),
    }
}

simd_dispatch! {
/// Quantise one token (`x.len()` channels, a multiple of 16) into `q` (`x.len() / 2`
/// bytes, two codes each) and `sf` (`x.len() / 16` block scale bytes): THE definition
/// (module docs) that every device's NVFP4 cast matches. Lengths are only
/// `debug_assert`ed; the cast phase checks them.
pub fn nvfp4_quantize_token(x: &[bf16], cast: Nvfp4, q: &mut [u8], sf: &mut [u8]) {
    debug_assert!(x.len() % NVFP4_BLOCK == 0);
    debug_assert!(q.len() * 2 == x.len() && sf.len() * NVFP4_BLOCK == x.len());
    let g = cast.global_scale;
    for ((block, codes), byte) in x
        .chunks_exact(NVFP4_BLOCK)
        .zip(q.chunks_exact_mut(NVFP4_BLOCK / 2))
        .zip(sf.iter_mut())
    {
        // |bf16| orders like its low 15 bits: an integer max, which vectorises. A NaN
        // (above +inf's bits) does not count: then the largest of the others (rare, so
        // off the vector path).
        let mut amax_bits = block.iter().fold(0u16, |m, v| m.max(v.to_bits() & 0x7fff));
        if amax_bits > 0x7f80 {
            amax_bits = (block.iter().map(|v| v.to_bits() & 0x7fff))
                .filter(|&b| b <= 0x7f80)
                .fold(0, u16::max);
        }
        let amax = bf16_bits_to_f32(amax_bits);
        let s = g * (amax * RECIP_6);
        *byte = if cast.ue8m0 {
            ue8m0_round_up(s)
        } else {
            e4m3_from_f32(s)
        };
        let decoded = cast.decode_scale(*byte);
        let out = if amax == 0.0 || decoded == 0.0 {
            0.0
        } else {
            g / decoded
        };
        // Fixed-size lanes, so the codes are computed 8 or 16 at a time. The plain
        // widening (as the FP8 cast), not `bf16::to_f32`, which quiets a signalling NaN.
        let c: [u8; NVFP4_BLOCK] =
            std::array::from_fn(|i| e2m1_from_f32(bf16_bits_to_f32(block[i].to_bits()) * out));
        for (o, pair) in codes.iter_mut().zip(c.chunks_exact(2)) {
            *o = pair[0] | (pair[1] << 4);
        }
    }
}
}

/// Decode one NVFP4 token (`q`, `sf` as [`nvfp4_quantize_token`] writes them) to f32:
/// `e2m1 * decode(byte) / global_scale`.
pub fn nvfp4_dequantize_token(q: &[u8], sf: &[u8], cast: Nvfp4, out: &mut [f32]) {
    for ((codes, &byte), out) in q
        .chunks_exact(NVFP4_BLOCK / 2)
        .zip(sf)
        .zip(out.chunks_exact_mut(NVFP4_BLOCK))
    {
        let scale = cast.decode_scale(byte) / cast.global_scale;
        for (&c, pair) in codes.iter().zip(out.chunks_exact_mut(2)) {
            pair[0] = e2m1_to_f32(c) * scale;
            pair[1] = e2m1_to_f32(c >> 4) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.0, 0x0),
            (-0.0, 0x8),
            (0.25, 0x0),
            (0.2500001, 0x1),
            (0.75, 0x2),
            (0.7499999, 0x1),
            (1.25, 0x2),
            (1.75, 0x4),
            (2.5, 0x4),
            (3.5, 0x6),
            (5.0, 0x6),
            (5.0001, 0x7),
            (1e9, 0x7),
            (f32::INFINITY, 0x7),
            (f32::NEG_INFINITY, 0xf),
            (-3.0, 0xd),
            (-0.1, 0x8),
            (f32::NAN, 0x7),
        ];
        for (x, code) in cases {
            assert_eq!(e2m1_from_f32(x), code, "{x}");
        }
    }

    #[test]
    fn every_e2m1_code_decodes_to_itself() {
        for c in 0u8..16 {
            let back = e2m1_from_f32(e2m1_to_f32(c));
            // +0 and -0 keep their sign.
            assert_eq!(back, c, "{c}");
        }
    }

    #[test]
    fn ue8m0_rounds_up_to_a_power_of_two() {
        assert_eq!(ue8m0_round_up(1.0), 127);
        assert_eq!(ue8m0_round_up(1.0000001), 128);
        assert_eq!(ue8m0_round_up(0.75), 127);
        assert_eq!(ue8m0_round_up(0.5), 126);
        assert_eq!(ue8m0_round_up(0.0), 0);
        assert_eq!(ue8m0_round_up(f32::INFINITY), 254);
        assert_eq!(ue8m0_round_up(f32::MAX), 254);
        assert_eq!(ue8m0_round_up(f32::NAN), 255);
        assert_eq!(ue8m0_round_up(f32::from_bits(1 << 22)), 0);
        assert_eq!(ue8m0_round_up(f32::from_bits((1 << 22) + 1)), 1);
        for b in 0..=254u8 {
            assert_eq!(ue8m0_round_up(ue8m0_to_f32(b)), b);
        }
    }

    #[test]
    fn a_block_of_zeros_is_zero_codes() {
        let x = vec![bf16::ZERO; 32];
        for ue8m0 in [false, true] {
            let cast = Nvfp4 {
                global_scale: 1e30,
                ue8m0,
            };
            let (mut q, mut sf) = ([0xffu8; 16], [0xffu8; 2]);
            nvfp4_quantize_token(&x, cast, &mut q, &mut sf);
            assert_eq!(q, [0u8; 16]);
            assert_eq!(sf, [0u8; 2]);
        }
    }

    proptest! {
        /// Every value comes back within one unit of its block's scale (half the
        /// widest gap of the e2m1 grid, 4 to 6; an e4m3-rounded scale saturates a
        /// value by less).
        #[test]
        fn dequantised_values_are_within_the_grid(
            vals in prop::collection::vec(-1000f32..1000f32, 64),
            amax in 1f32..1e3,
            ue8m0 in any::<bool>(),
        ) {
            let x: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v * amax / 1000.0)).collect();
            let global = x.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
            prop_assume!(global > 0.0);
            let cast = Nvfp4 { global_scale: 448.0 * 6.0 / global, ue8m0 };
            let (mut q, mut sf) = (vec![0u8; 32], vec![0u8; 4]);
            nvfp4_quantize_token(&x, cast, &mut q, &mut sf);
            let mut back = vec![0f32; 64];
            nvfp4_dequantize_token(&q, &sf, cast, &mut back);
            for (b, (block, out)) in x.chunks(16).zip(back.chunks(16)).enumerate() {
                let bmax = block.iter().fold(0f32, |a, v| a.max(v.to_f32().abs()));
                let step = cast.decode_scale(sf[b]) / cast.global_scale;
                for (v, o) in block.iter().zip(out) {
                    // Half of the widest gap (4 to 6), or saturation at 6 steps.
                    let err = (v.to_f32() - o).abs();
                    prop_assert!(err <= step + bmax * 1e-6, "{v} -> {o}, step {step}");
                }
            }
        }
    }
}
