//! FP8 e4m3fn per-128-channel quantisation (docs/architecture.md, "Numerics").
//!
//! This module is the single definition of the FP8 numerics: the device kernels call
//! [`quantize_token`] themselves, so the reference and the data path are bit-exact by
//! construction rather than by re-implementation.
//!
//! Format (`e4m3fn`, as `torch.float8_e4m3fn`): 1 sign bit, 4 exponent bits (bias 7), 3
//! mantissa bits; no infinities; `0x7f`/`0xff` are NaN; the largest finite magnitude is
//! `448 = 1.75 * 2^8`; subnormals are `m * 2^-9`, `m` in `1..=7`.
//!
//! The row kernels ([`quantize_token`], [`dequantize_token`], [`reduce_rows`]) choose their
//! machine code at run time: a copy compiled for AVX2+FMA where the CPU has both, the portable
//! (x86-64 baseline: SSE2) copy otherwise. Both copies compile the same source with no
//! reassociation or fused multiply-add (Rust never contracts `a * b + c`, and nothing here calls
//! `mul_add`), so they give the same bits; a test compares them.

use half::bf16;
use multiversion::multiversion;

use crate::error::Result;
use crate::invalid;
use crate::tokens::TokenFormat;

/// How a low-latency dispatch casts its rows on the way (`None` where the caller passes
/// an `Option<Cast>`: bf16 as given).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Cast {
    /// FP8 e4m3 with one f32 scale per 128 channels ([`quantize_token`]);
    /// `round_scale`: scales rounded up to powers of two.
    Fp8 {
        /// Power-of-two scales.
        round_scale: bool,
    },
    /// NVFP4: e2m1 in blocks of 16 with 8-bit block scales ([`nvfp4_quantize_token`]).
    Nvfp4(Nvfp4),
}

impl Cast {
    /// FP8 when `use_fp8` (DeepEP's two flags), else none.
    pub fn fp8_if(use_fp8: bool, round_scale: bool) -> Option<Cast> {
        use_fp8.then_some(Cast::Fp8 { round_scale })
    }

    /// The rows this cast makes.
    pub fn format(&self) -> TokenFormat {
        match self {
            Cast::Fp8 { .. } => TokenFormat::Fp8,
            Cast::Nvfp4(_) => TokenFormat::Nvfp4,
        }
    }
}

/// Channels that share one FP8 scale.
pub const FP8_GROUP: usize = 128;

/// Largest finite e4m3fn magnitude.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// Compiles `$f` once per target below plus the portable baseline, and picks one at run time
/// (first call; an atomic load after that). AVX2 doubles the vector width of the baseline's
/// SSE2 and adds the u16/u32 min/max and blends the kernels' selects need. One list for all
/// kernels, so the test of the dispatcher's choice covers each of them.
macro_rules! simd_dispatch {
    ($f:item) => {
        #[multiversion(targets("x86_64+avx2+fma"))]
        $f
    };
}

mod nvfp4;

pub use nvfp4::{
    e2m1_from_f32, e2m1_to_f32, nvfp4_dequantize_token, nvfp4_quantize_token, ue8m0_round_up,
    ue8m0_to_f32, Nvfp4, E2M1_MAX, NVFP4_BLOCK,
};

/// Lower clamp of a group's `amax`, so an all-zero group gets a finite, non-zero scale.
const AMAX_MIN: f32 = 1e-4;

/// f32 bits of 2^-6, the smallest normal e4m3 magnitude.
const MIN_NORMAL_BITS: u32 = 0x3c80_0000;
/// 2^14: its f32 ulp is 2^-9, the e4m3 subnormal step, so adding it rounds (RNE, by the
/// FPU) a magnitude below 2^-6 to a whole number of subnormal steps.
const SUBNORMAL_MAGIC: f32 = 16384.0;
/// f32 exponent bias minus e4m3 exponent bias, shifted into the f32 exponent field.
const REBIAS: u32 = (127 - 7) << 23;

/// Encode `x` as e4m3fn: round to nearest, ties to even; finite values and infinities beyond
/// ±448 saturate to ±448 (`0x7e`/`0xfe`); NaN becomes `0x7f`; `-0.0` becomes `0x80`.
///
/// Written branch-free (selects only) so the loops of [`quantize_token`] vectorise.
#[inline]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7fff_ffff;
    // Normal range [2^-6, 448): re-bias the exponent, then round the 23-bit mantissa to 3
    // bits (add half-ulp-minus-one plus the kept lsb = ties to even); a mantissa carry
    // correctly bumps the exponent. Wrapping ops: the result is discarded when out of range.
    let normal = abs
        .wrapping_sub(REBIAS)
        .wrapping_add(0x7_ffff + ((abs >> 20) & 1))
        >> 20;
    // Subnormal range [0, 2^-6): the FPU's own RNE does the rounding; a result of 8 steps is
    // exactly the code of 2^-6, so the boundary needs no special case.
    let mag = f32::from_bits(abs);
    let subnormal = (mag + SUBNORMAL_MAGIC)
        .to_bits()
        .wrapping_sub(SUBNORMAL_MAGIC.to_bits());
    // The range tests compare the magnitude as a float: for non-NaN values the same order as
    // its bits, but one vector instruction, where x86 (no unsigned 32-bit vector compare)
    // needs two for the bits. A NaN fails both and is caught last.
    let mut code = if mag < f32::from_bits(MIN_NORMAL_BITS) {
        subnormal
    } else {
        normal
    };
    code = if mag >= FP8_E4M3_MAX { 0x7e } else { code };
    code |= sign;
    code = if mag.is_nan() { 0x7f } else { code };
    code as u8
}

/// Decode an e4m3fn byte to f32 (exact; `0x7f`/`0xff` decode to NaN).
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let b = u32::from(b);
    let sign = (b & 0x80) << 24;
    let exp = (b >> 3) & 0xf;
    let mant = b & 0x7;
    let magnitude = if exp == 0xf && mant == 0x7 {
        f32::NAN.to_bits()
    } else if exp == 0 {
        // Subnormal m * 2^-9: exact in f32.
        (mant as f32 * (1.0 / 512.0)).to_bits()
    } else {
        ((exp << 23) + REBIAS) | (mant << 20)
    };
    f32::from_bits(sign | magnitude)
}

/// The FP8 scale of a group whose largest magnitude is `amax`.
///
/// `amax` is clamped below at 1e-4 (a NaN `amax` also becomes 1e-4), then
/// `scale = amax / 448` (one f32 division). With `round_scale` the scale is rounded up to a
/// power of two (UE8M0): `2^ceil(log2(amax / 448))`, computed exactly from the bits of the f32
/// quotient (DeepEP rounds the same f32 quotient), so it is `>=` that quotient.
#[inline]
pub fn fp8_scale(amax: f32, round_scale: bool) -> f32 {
    let scale = amax.max(AMAX_MIN) / FP8_E4M3_MAX;
    if !round_scale || !scale.is_finite() {
        return scale;
    }
    // scale >= 1e-4/448 > 2^-23 is a positive normal f32: a zero mantissa means it is
    // already a power of two; otherwise take the next exponent up (255 = +inf on overflow).
    let bits = scale.to_bits();
    if bits & 0x7f_ffff == 0 {
        scale
    } else {
        f32::from_bits(((bits >> 23) + 1) << 23)
    }
}

/// Quantise one token (`x.len()` channels, a multiple of 128) into `q` (same length) and
/// `scales` (`x.len() / 128`).
///
/// Per group `g` of 128 channels, exactly:
/// ```text
/// amax  = max |f32(x_g)|            (as bits: |bf16| orders like its low 15 bits)
/// s     = fp8_scale(amax, round_scale)
/// inv   = 1.0_f32 / s               (one f32 division, once per group)
/// q[i]  = e4m3_from_f32(f32(x[i]) * inv)   (one f32 multiply, no fma)
/// scales[g] = s
/// ```
/// This is THE definition; the device kernels call this function. Preconditions (lengths) are
/// only `debug_assert`ed because callers validate them; see [`quantize`] for a checked version.
/// A NaN channel encodes as `0x7f` and does not raise the group's scale above the clamp.
pub fn quantize_token(x: &[bf16], round_scale: bool, q: &mut [u8], scales: &mut [f32]) {
    debug_assert_eq!(x.len() % FP8_GROUP, 0, "hidden must be a multiple of 128");
    debug_assert_eq!(q.len(), x.len(), "q must have one byte per channel");
    debug_assert_eq!(
        scales.len(),
        x.len() / FP8_GROUP,
        "one scale per 128 channels"
    );
    simd_dispatch! {
        fn dispatch(x: &[bf16], round_scale: bool, q: &mut [u8], scales: &mut [f32]) {
            quantize_token_body(x, round_scale, q, scales);
        }
    }
    dispatch(x, round_scale, q, scales);
}

/// The loops of [`quantize_token`]; `inline(always)` so each dispatched copy gets its own
/// vectorisation of them (the tests call this directly for the portable result).
#[inline(always)]
fn quantize_token_body(x: &[bf16], round_scale: bool, q: &mut [u8], scales: &mut [f32]) {
    for ((xg, qg), sg) in x
        .chunks_exact(FP8_GROUP)
        .zip(q.chunks_exact_mut(FP8_GROUP))
        .zip(scales.iter_mut())
    {
        // Integer max of the magnitude bits: vectorises, and equals max |x| for non-NaN input.
        let amax_bits = xg.iter().fold(0u16, |m, v| m.max(v.to_bits() & 0x7fff));
        let amax = bf16::from_bits(amax_bits).to_f32();
        let s = fp8_scale(amax, round_scale);
        let inv = 1.0 / s;
        for (o, v) in qg.iter_mut().zip(xg) {
            // The plain widening, not `bf16::to_f32`, which also quiets a signalling NaN: a
            // NaN input gives a NaN product and code 0x7f either way, and the select costs.
            *o = e4m3_from_f32(bf16_bits_to_f32(v.to_bits()) * inv);
        }
        *sg = s;
    }
}

/// Quantise `[tokens, hidden]` bf16 rows: returns `(q [tokens, hidden], scales [tokens, hidden/128])`.
///
/// Errors if `hidden` is not a positive multiple of 128 or `x.len()` is not a multiple of it.
pub fn quantize(x: &[bf16], hidden: usize, round_scale: bool) -> Result<(Vec<u8>, Vec<f32>)> {
    check_fp8_shape(x.len(), hidden)?;
    let mut q = vec![0u8; x.len()];
    let mut scales = vec![0f32; x.len() / FP8_GROUP];
    let groups = hidden / FP8_GROUP;
    for ((xt, qt), st) in x
        .chunks_exact(hidden)
        .zip(q.chunks_exact_mut(hidden))
        .zip(scales.chunks_exact_mut(groups))
    {
        quantize_token(xt, round_scale, qt, st);
    }
    Ok((q, scales))
}

/// Dequantise one token: `out[i] = e4m3_to_f32(q[i]) * scales[i / 128]`.
///
/// Lengths are only `debug_assert`ed (`q.len() == out.len() == 128 * scales.len()`).
pub fn dequantize_token(q: &[u8], scales: &[f32], out: &mut [f32]) {
    debug_assert_eq!(q.len() % FP8_GROUP, 0, "hidden must be a multiple of 128");
    debug_assert_eq!(out.len(), q.len(), "out must have one value per channel");
    debug_assert_eq!(
        scales.len(),
        q.len() / FP8_GROUP,
        "one scale per 128 channels"
    );
    simd_dispatch! {
        fn dispatch(q: &[u8], scales: &[f32], out: &mut [f32]) {
            dequantize_token_body(q, scales, out);
        }
    }
    dispatch(q, scales, out);
}

/// The loops of [`dequantize_token`], inlined into each dispatched copy.
#[inline(always)]
fn dequantize_token_body(q: &[u8], scales: &[f32], out: &mut [f32]) {
    for ((qg, og), &s) in q
        .chunks_exact(FP8_GROUP)
        .zip(out.chunks_exact_mut(FP8_GROUP))
        .zip(scales)
    {
        for (o, &b) in og.iter_mut().zip(qg) {
            *o = e4m3_to_f32(b) * s;
        }
    }
}

/// Dequantise `[tokens, hidden]` FP8 rows with their `[tokens, hidden/128]` scales to f32.
///
/// Errors if `hidden` is not a positive multiple of 128, `q.len()` is not a multiple of
/// `hidden`, or `scales.len() != q.len() / 128`.
pub fn dequantize(q: &[u8], scales: &[f32], hidden: usize) -> Result<Vec<f32>> {
    check_fp8_shape(q.len(), hidden)?;
    if scales.len() != q.len() / FP8_GROUP {
        return Err(invalid!(
            "dequantize: {} scales given for {} fp8 values; need one per {FP8_GROUP} channels ({})",
            scales.len(),
            q.len(),
            q.len() / FP8_GROUP
        ));
    }
    let mut out = vec![0f32; q.len()];
    dequantize_token(q, scales, &mut out);
    Ok(out)
}

/// Shared shape check of [`quantize`] and [`dequantize`].
pub(crate) fn check_fp8_shape(len: usize, hidden: usize) -> Result<()> {
    if hidden == 0 || hidden % FP8_GROUP != 0 {
        return Err(invalid!(
            "fp8: hidden = {hidden} must be a positive multiple of {FP8_GROUP} (one scale per {FP8_GROUP} channels)"
        ));
    }
    if len % hidden != 0 {
        return Err(invalid!(
            "fp8: {len} values is not a whole number of rows of hidden = {hidden}"
        ));
    }
    Ok(())
}

/// f32 to bf16 bits, rounding to nearest even, NaN kept quiet: bit for bit what
/// `half::bf16::from_f32` returns, but branch-free, so a loop over a row vectorises
/// (the combine kernels round every output element once).
#[inline]
pub fn bf16_bits_from_f32(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x40) as u16;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// bf16 bits to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Columns reduced at a time: the accumulators of one block stay in L1.
const REDUCE_BLOCK: usize = 512;

/// `out = bf16(0.0 + w0*r0 + w1*r1 + ...)` per column, accumulated in f32 in the order
/// given and rounded once (with `weighted == false`, the plain sum `0.0 + r0 + r1 + ...`).
/// Rows are bf16 bits. This is the combine kernels' inner loop; it computes exactly
/// what the reference's straightforward loop computes, a column block at a time.
pub fn reduce_rows(rows: &[(&[u16], f32)], weighted: bool, out: &mut [bf16]) {
    if let ([(row, _)], false) = (rows, weighted) {
        // A relay's token from one rank of its node, the common case with one rank a
        // node: the sum is the row itself up to what `0.0 + y` changes.
        return canonical_copy(row, out);
    }
    simd_dispatch! {
        fn dispatch(rows: &[(&[u16], f32)], weighted: bool, out: &mut [bf16]) {
            reduce_rows_body(rows, weighted, out);
        }
    }
    dispatch(rows, weighted, out);
}

/// `out = bf16(0.0 + y)` per column without the f32 round trip: the same bits as `y`
/// except that `-0.0` becomes `+0.0` and a NaN becomes quiet (the rounding's
/// `| 0x40`), so a copy with two fix-ups gives exactly what [`reduce_rows_body`] gives.
fn canonical_copy(row: &[u16], out: &mut [bf16]) {
    simd_dispatch! {
        fn dispatch(row: &[u16], out: &mut [bf16]) {
            for (o, &y) in out.iter_mut().zip(row) {
                let nan = y & 0x7fff > 0x7f80;
                let bits = if y == 0x8000 { 0 } else { y | if nan { 0x40 } else { 0 } };
                *o = bf16::from_bits(bits);
            }
        }
    }
    dispatch(row, out);
}

/// The loops of [`reduce_rows`], inlined into each dispatched copy.
#[inline(always)]
fn reduce_rows_body(rows: &[(&[u16], f32)], weighted: bool, out: &mut [bf16]) {
    let mut acc = [0f32; REDUCE_BLOCK];
    for start in (0..out.len()).step_by(REDUCE_BLOCK) {
        let end = (start + REDUCE_BLOCK).min(out.len());
        let acc = &mut acc[..end - start];
        acc.fill(0.0);
        for &(row, w) in rows {
            let row = &row[start..end];
            if weighted {
                for (a, &y) in acc.iter_mut().zip(row) {
                    *a += w * bf16_bits_to_f32(y);
                }
            } else {
                for (a, &y) in acc.iter_mut().zip(row) {
                    *a += bf16_bits_to_f32(y);
                }
            }
        }
        round_row_to_bf16(acc, &mut out[start..end]);
    }
}

/// Round a row of f32 accumulators to bf16 (`out.len() == acc.len()`).
#[inline]
pub fn round_row_to_bf16(acc: &[f32], out: &mut [bf16]) {
    for (o, &a) in out.iter_mut().zip(acc) {
        *o = bf16::from_bits(bf16_bits_from_f32(a));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// The 254 finite codes with their values, for brute-force rounding.
    fn finite_codes() -> Vec<(u8, f64)> {
        (0u8..=255)
            .filter(|&b| b & 0x7f != 0x7f)
            .map(|b| (b, f64::from(e4m3_to_f32(b))))
            .collect()
    }

    /// Independent reference: nearest finite code by exhaustive search in f64 (exact for
    /// f32 inputs), ties to the even mantissa, saturating, NaN -> 0x7f.
    fn brute_encode(x: f32, codes: &[(u8, f64)]) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let xd = f64::from(x);
        if xd >= 448.0 {
            return 0x7e;
        }
        if xd <= -448.0 {
            return 0xfe;
        }
        let mut best: Option<(u8, f64)> = None;
        for &(b, v) in codes {
            // Keep the sign of zero: +x only maps to codes with the sign bit of x.
            if (b & 0x80 != 0) != x.is_sign_negative() {
                continue;
            }
            let d = (v - xd).abs();
            best = match best {
                None => Some((b, d)),
                Some((bb, bd)) if d < bd || (d == bd && b & 1 == 0 && bb & 1 == 1) => Some((b, d)),
                keep => keep,
            };
        }
        best.expect("codes of each sign exist").0
    }

    #[test]
    fn decode_all_codes() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert!(e4m3_to_f32(0x80) == 0.0 && e4m3_to_f32(0x80).is_sign_negative());
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Independent formula for every code.
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if b & 0x7f == 0x7f {
                assert!(v.is_nan(), "code {b:#04x}");
                continue;
            }
            let (e, m) = (i32::from((b >> 3) & 0xf), f64::from(b & 7));
            let mag = if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            };
            let want = if b & 0x80 != 0 { -mag } else { mag };
            assert_eq!(f64::from(v), want, "code {b:#04x}");
        }
    }

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0u8..=255 {
            if b & 0x7f != 0x7f {
                assert_eq!(e4m3_from_f32(e4m3_to_f32(b)), b, "code {b:#04x}");
            }
        }
    }

    #[test]
    fn midpoints_round_to_even() {
        for b in 0u8..0x7e {
            for sign in [0u8, 0x80] {
                let (lo, hi) = (b | sign, (b + 1) | sign);
                let mid = (f64::from(e4m3_to_f32(lo)) + f64::from(e4m3_to_f32(hi))) / 2.0;
                let mid32 = mid as f32;
                assert_eq!(f64::from(mid32), mid, "midpoint exact in f32");
                let even = if lo & 1 == 0 { lo } else { hi };
                assert_eq!(
                    e4m3_from_f32(mid32),
                    even,
                    "midpoint of {lo:#04x},{hi:#04x}"
                );
                // Just off the midpoint goes to the nearer code (bit steps move the magnitude,
                // whatever the sign; lo has the smaller magnitude).
                let near_lo = f32::from_bits(mid32.to_bits() - 1);
                let near_hi = f32::from_bits(mid32.to_bits() + 1);
                if mid != 0.0 {
                    assert_eq!(e4m3_from_f32(near_lo), lo, "just inside {lo:#04x}");
                    assert_eq!(e4m3_from_f32(near_hi), hi, "just inside {hi:#04x}");
                }
            }
        }
    }

    #[test]
    fn saturation_nan_and_zero() {
        for v in [448.0f32, 448.01, 464.0, 480.0, 1e6, f32::MAX, f32::INFINITY] {
            assert_eq!(e4m3_from_f32(v), 0x7e, "{v}");
            assert_eq!(e4m3_from_f32(-v), 0xfe, "{v}");
        }
        assert_eq!(e4m3_from_f32(f32::NAN), 0x7f);
        assert_eq!(e4m3_from_f32(-f32::NAN), 0x7f);
        assert_eq!(e4m3_from_f32(0.0), 0x00);
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
        // Half the smallest subnormal ties to even (zero); just above rounds up.
        let half_min = 2f32.powi(-10);
        assert_eq!(e4m3_from_f32(half_min), 0x00);
        assert_eq!(e4m3_from_f32(f32::from_bits(half_min.to_bits() + 1)), 0x01);
        assert_eq!(e4m3_from_f32(f32::from_bits(1)), 0x00, "f32 subnormal");
        assert_eq!(e4m3_from_f32(-f32::MIN_POSITIVE), 0x80);
    }

    #[test]
    fn agrees_with_brute_force() {
        let codes = finite_codes();
        let mut edges = vec![
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            447.99997,
            448.0,
            463.99997,
            464.0,
            2f32.powi(-6),
            2f32.powi(-7),
            2f32.powi(-9),
            2f32.powi(-10),
            1.0,
        ];
        // Each code's value +-1 and +-2 f32 ulps.
        for &(_, v) in &codes {
            let v = v as f32;
            for d in [1u32, 2] {
                edges.push(f32::from_bits(v.to_bits().wrapping_add(d)));
                if v != 0.0 {
                    edges.push(f32::from_bits(v.to_bits() - d));
                }
            }
        }
        for &e in &edges {
            for x in [e, -e] {
                assert_eq!(e4m3_from_f32(x), brute_encode(x, &codes), "x = {x:e}");
            }
        }
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // 1e6 samples: half random magnitudes over the exponents e4m3 can resolve (and a few
        // binades beyond either end), half random f32 bit patterns (mostly saturating/zero).
        for i in 0..1_000_000u32 {
            let x = if i % 2 == 0 {
                let exp: i32 = rng.gen_range(-14..11);
                let m: f32 = rng.gen_range(1.0..2.0);
                let s = if rng.gen::<bool>() { -1.0 } else { 1.0 };
                s * m * 2f32.powi(exp)
            } else {
                f32::from_bits(rng.gen())
            };
            assert_eq!(
                e4m3_from_f32(x),
                brute_encode(x, &codes),
                "x = {x:e} ({:#x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn scale_clamp_and_rounding() {
        assert_eq!(fp8_scale(0.0, false), 1e-4 / 448.0);
        assert_eq!(fp8_scale(f32::NAN, false), 1e-4 / 448.0);
        assert_eq!(fp8_scale(448.0, false), 1.0);
        assert_eq!(fp8_scale(448.0, true), 1.0);
        assert_eq!(fp8_scale(449.0, true), 2.0);
        assert_eq!(fp8_scale(224.0, true), 0.5);
        assert_eq!(fp8_scale(225.0, true), 1.0);
        assert_eq!(fp8_scale(0.0, true), 2f32.powi(-22)); // 1e-4/448 = 2.23e-7 in (2^-23, 2^-22]
        assert_eq!(fp8_scale(f32::INFINITY, true), f32::INFINITY);
    }

    fn bf16_vec(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|&f| bf16::from_f32(f)).collect()
    }

    #[test]
    fn quantize_token_worked_example() {
        // Group 0: amax 448 -> scale 1, values land on codes exactly. Group 1: all zero.
        let mut x = vec![0f32; 256];
        x[0] = 448.0;
        x[1] = -1.0;
        x[2] = 0.5;
        let x = bf16_vec(&x);
        let mut q = vec![0u8; 256];
        let mut s = vec![0f32; 2];
        quantize_token(&x, false, &mut q, &mut s);
        assert_eq!(s, vec![1.0, 1e-4 / 448.0]);
        assert_eq!(&q[..4], &[0x7e, 0xb8, 0x30, 0x00]);
        assert!(q[128..].iter().all(|&b| b == 0));
        let (q2, s2) = quantize(&x, 128, false).unwrap();
        assert_eq!((q2, s2), (q, s));
    }

    #[test]
    fn checked_wrappers_reject_bad_shapes() {
        let x = bf16_vec(&[1.0; 256]);
        for hidden in [0, 64, 200] {
            let e = quantize(&x, hidden, false).unwrap_err().to_string();
            assert!(e.contains("multiple of 128"), "{e}");
        }
        let e = quantize(&x[..255], 128, false).unwrap_err().to_string();
        assert!(e.contains("whole number of rows"), "{e}");
        let e = dequantize(&[0u8; 256], &[1.0], 128)
            .unwrap_err()
            .to_string();
        assert!(e.contains("need one per 128"), "{e}");
        assert_eq!(
            dequantize(&[0x38; 128], &[2.0], 128).unwrap(),
            vec![2.0; 128]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Error bound, justified: let s = scale, inv = RN(1/s), y = RN(x * inv) = x/s * (1 + d)
        /// with |d| <= 2^-23. e4m3 keeps 3 mantissa bits, so rounding y to a code errs by at
        /// most half an ulp: <= |y| * 2^-4 in the normal range, <= 2^-10 (half of 2^-9) in the
        /// subnormal range; above 448 (only by the rounding of inv) it saturates, erring by
        /// <= |y| * 2^-22. Scaling back by s (one more f32 rounding) gives, per element,
        /// |dq - x| <= max(|x| * 2^-4, s * 2^-10) * (1 + 1e-6) + |x| * 2^-20.
        /// Since |x| <= amax, the group-wide form is |dq - x| <= amax * 2^-4 = (amax/448) * 28:
        /// half an ulp (16) of the top binade [256, 448] times the scale. (A bound of
        /// amax/448 * 2^-3 would be wrong: it ignores that e4m3 steps are 32 near 448.)
        #[test]
        fn quant_dequant_error_bound(
            mags in proptest::collection::vec((-1.0f32..1.0, -24i32..12), 256),
            round_scale: bool,
        ) {
            // Magnitudes over ~36 binades so groups hit saturation, normal and subnormal codes.
            let vals: Vec<f32> = mags.iter().map(|&(m, e)| m * 2f32.powi(e)).collect();
            let x = bf16_vec(&vals);
            let (q, s) = quantize(&x, 128, round_scale).unwrap();
            let dq = dequantize(&q, &s, 128).unwrap();
            // The dispatched (AVX2 where the CPU has it) results are the portable ones.
            let (mut q_p, mut s_p) = (vec![0u8; 256], vec![0f32; 2]);
            quantize_token_body(&x, round_scale, &mut q_p, &mut s_p);
            prop_assert_eq!(&q, &q_p);
            prop_assert_eq!(bits(&s), bits(&s_p));
            let mut dq_p = vec![0f32; 256];
            dequantize_token_body(&q, &s, &mut dq_p);
            prop_assert_eq!(bits(&dq), bits(&dq_p));
            for g in 0..2 {
                let xg = &x[g * 128..(g + 1) * 128];
                let amax = xg.iter().map(|v| v.to_f32().abs()).fold(0f32, f32::max);
                let quot = amax.max(1e-4) / 448.0;
                if round_scale {
                    prop_assert!(s[g] >= quot);
                    prop_assert_eq!(s[g].to_bits() & 0x7f_ffff, 0, "power of two");
                    prop_assert!(s[g] < 2.0 * quot);
                } else {
                    prop_assert_eq!(s[g], quot);
                }
                for i in 0..128 {
                    let xi = f64::from(xg[i].to_f32());
                    let err = (f64::from(dq[g * 128 + i]) - xi).abs();
                    let sg = f64::from(s[g]);
                    let bound = (xi.abs() * 2f64.powi(-4)).max(sg * 2f64.powi(-10)) * (1.0 + 1e-6)
                        + xi.abs() * 2f64.powi(-20);
                    prop_assert!(err <= bound, "x={} dq={} err={} bound={}", xi, dq[g*128+i], err, bound);
                    // The group-wide form of the same bound.
                    prop_assert!(err <= f64::from(amax.max(1e-4)) * 2f64.powi(-4) * 1.0001);
                }
            }
        }
    }

    #[test]
    fn branch_free_bf16_rounding_equals_half() {
        let edges = [
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::EPSILON,
            1.0e-40,
            -1.0e-40,
        ];
        let check = |x: f32| {
            assert_eq!(
                bf16_bits_from_f32(x),
                bf16::from_f32(x).to_bits(),
                "{x:e} ({:#010x})",
                x.to_bits()
            );
        };
        edges.into_iter().for_each(check);
        // Every rounding case around every bf16 value of a wide range: the exact halfway
        // point, one ulp either side, and signalling/quiet NaN payloads.
        for hi in (0u32..=0xFFFF).step_by(7) {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                check(f32::from_bits((hi << 16) | lo));
            }
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            check(f32::from_bits(state as u32));
        }
        assert_eq!(bf16_bits_to_f32(bf16::from_f32(3.5).to_bits()), 3.5);
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|f| f.to_bits()).collect()
    }

    simd_dispatch! {
        /// Whether the kernels' dispatcher runs the AVX2 copy on this CPU.
        fn dispatches_to_avx2() -> bool {
            multiversion::target::match_target! {
                "x86_64+avx2+fma" => true,
                _ => false,
            }
        }
    }

    /// The comparisons below prove something only if the dispatched copy is not the portable
    /// one: on a CPU with AVX2 and FMA it must be the AVX2 copy.
    #[test]
    fn dispatcher_runs_the_avx2_copy_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        let want = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let want = false;
        assert_eq!(dispatches_to_avx2(), want);
    }

    /// f32 results equal bit for bit, except that two NaNs may differ in sign or payload:
    /// Rust leaves those unspecified (which NaN operand propagates depends on the operand
    /// order the compiler picked), so no two builds are bound to agree on them.
    fn assert_same_f32(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{what}[{i}]: dispatched {g:e} ({:#010x}), portable {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }

    /// One group of 128 bf16 values of kind `kind % 9`: the edge cases of the quantiser.
    fn edge_group(kind: u32, rng: &mut ChaCha8Rng) -> Vec<bf16> {
        let sign = |rng: &mut ChaCha8Rng| if rng.gen() { 0x8000u16 } else { 0 };
        let mut g: Vec<bf16> = (0..FP8_GROUP)
            .map(|_| match kind % 9 {
                // Any bf16: NaNs, infinities, subnormals, zeros, everything.
                0 => bf16::from_bits(rng.gen()),
                // Activation-like, a few outliers.
                1 => {
                    let v: f32 = rng.gen_range(-3.0..3.0);
                    bf16::from_f32(if rng.gen_ratio(1, 64) { v * 40.0 } else { v })
                }
                // Zeros of both signs (the scale clamps).
                2 => bf16::from_bits(sign(rng)),
                // bf16 subnormals only.
                3 => bf16::from_bits(sign(rng) | rng.gen_range(0..0x80)),
                // Huge finite values.
                4 => bf16::from_bits(sign(rng) | rng.gen_range(0x7e00..0x7f80)),
                // Below the amax clamp of 1e-4.
                5 => bf16::from_f32(rng.gen_range(-1e-5..1e-5)),
                // 36 binades: saturating, normal, subnormal and zero codes in one group.
                6 | 7 => {
                    bf16::from_f32(rng.gen_range(-1.0f32..1.0) * 2f32.powi(rng.gen_range(-30..6)))
                }
                // e4m3 codes and their midpoints, +-1 bf16 ulp (scale 1, see below).
                _ => {
                    let c = rng.gen_range(0u8..0x7e) | (sign(rng) >> 8) as u8;
                    let mid = (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0;
                    let b = bf16::from_f32(if rng.gen() { e4m3_to_f32(c) } else { mid }).to_bits();
                    bf16::from_bits(b.wrapping_add(rng.gen_range(0..3)).wrapping_sub(1))
                }
            })
            .collect();
        match kind % 9 {
            // An infinity (scale +inf, inv 0: products 0 or NaN) or a NaN (scale clamps).
            6 => g[rng.gen_range(0..FP8_GROUP)] = bf16::from_bits(sign(rng) | 0x7f80),
            7 => g[rng.gen_range(0..FP8_GROUP)] = bf16::from_bits(sign(rng) | 0x7fc1),
            // amax 448 gives scale 1 with or without round_scale, so the midpoints stay ties.
            8 => g[rng.gen_range(0..FP8_GROUP)] = bf16::from_f32(448.0),
            _ => {}
        }
        g
    }

    #[test]
    fn dispatched_quantise_equals_portable_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let hidden = 1024;
        for token in 0..300u32 {
            let x: Vec<bf16> = (0..hidden / FP8_GROUP as u32)
                .flat_map(|g| edge_group(token * 7 + g, &mut rng))
                .collect();
            for round_scale in [false, true] {
                let (mut q, mut s) = (vec![0u8; x.len()], vec![0f32; x.len() / FP8_GROUP]);
                let (mut q_p, mut s_p) = (q.clone(), s.clone());
                quantize_token(&x, round_scale, &mut q, &mut s);
                quantize_token_body(&x, round_scale, &mut q_p, &mut s_p);
                assert_eq!(q, q_p, "token {token}, round_scale {round_scale}");
                assert_eq!(
                    bits(&s),
                    bits(&s_p),
                    "token {token}, round_scale {round_scale}"
                );
            }
        }
    }

    #[test]
    fn dispatched_dequantise_equals_portable_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        let specials = [
            0.0f32,
            -0.0,
            1e-4 / 448.0,
            f32::from_bits(1),
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            -1.0,
        ];
        for token in 0..100 {
            // Every byte, NaN codes included.
            let q: Vec<u8> = (0..2048).map(|_| rng.gen()).collect();
            let scales: Vec<f32> = (0..q.len() / FP8_GROUP)
                .map(|g| match (token + g) % 3 {
                    0 => specials[rng.gen_range(0..specials.len())],
                    1 => fp8_scale(f32::from_bits(rng.gen::<u32>() >> 1), true),
                    _ => rng.gen::<f32>() * 2f32.powi(rng.gen_range(-30..30)),
                })
                .collect();
            let (mut out, mut out_p) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            dequantize_token(&q, &scales, &mut out);
            dequantize_token_body(&q, &scales, &mut out_p);
            assert_same_f32(&out, &out_p, &format!("token {token}"));
        }
    }

    #[test]
    fn one_row_sum_is_the_general_loop_for_every_bf16() {
        let row: Vec<u16> = (0..=u16::MAX).collect();
        let (mut fast, mut general) = (vec![bf16::ZERO; row.len()], vec![bf16::ZERO; row.len()]);
        reduce_rows(&[(&row, 1.0)], false, &mut fast);
        reduce_rows_body(&[(&row, 1.0)], false, &mut general);
        for (i, (a, b)) in fast.iter().zip(&general).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "input bits {i:#06x}");
        }
    }

    #[test]
    fn dispatched_reduce_equals_portable_bit_for_bit() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        for case in 0..60u32 {
            // Lengths across the 512-column blocks and the vector tails.
            let len = [1, 7, 8, 100, 511, 512, 513, 1031, 2048][case as usize % 9];
            let k = rng.gen_range(0..10);
            let rows: Vec<Vec<u16>> = (0..k)
                .map(|r| {
                    (0..len)
                        .map(|_| match (case + r) % 4 {
                            0 => rng.gen(),
                            1 => rng.gen_range(0..0x80) | if rng.gen() { 0x8000 } else { 0 },
                            _ => bf16::from_f32(rng.gen_range(-3.0..3.0)).to_bits(),
                        })
                        .collect()
                })
                .collect();
            let weights: Vec<f32> = (0..k)
                .map(|_| match rng.gen_range(0..6) {
                    0 => 0.0,
                    1 => -rng.gen::<f32>(),
                    2 => 3e38,
                    3 => 1e-39,
                    _ => rng.gen(),
                })
                .collect();
            let parts: Vec<(&[u16], f32)> = rows.iter().map(Vec::as_slice).zip(weights).collect();
            for weighted in [false, true] {
                let (mut out, mut out_p) = (vec![bf16::ZERO; len], vec![bf16::ZERO; len]);
                reduce_rows(&parts, weighted, &mut out);
                reduce_rows_body(&parts, weighted, &mut out_p);
                let widen = |v: &[bf16]| {
                    v.iter()
                        .map(|b| bf16_bits_to_f32(b.to_bits()))
                        .collect::<Vec<_>>()
                };
                assert_same_f32(
                    &widen(&out),
                    &widen(&out_p),
                    &format!("case {case}, weighted {weighted}"),
                );
            }
        }
    }
}
