//! Comparing what a rank received with what the sequential reference says it should.
//!
//! Everything is compared bit for bit: bf16 and FP8 payloads, scales, weights, ids and
//! counts. The first mismatch of each output is kept with its index, so a failure says
//! where to look.

use std::fmt::Debug;

use uep_ep::{DispatchOutput, LlDispatchOutput, RecvTokens};

use crate::reference::{LlRecv, NormalRecv};
use crate::workload::TokenData;

/// Mismatches found on one rank.
#[derive(Debug)]
pub struct Mismatches {
    rank: usize,
    found: Vec<String>,
}

impl Mismatches {
    /// None yet, on `rank`.
    pub fn new(rank: usize) -> Self {
        Mismatches {
            rank,
            found: Vec::new(),
        }
    }

    /// Number of outputs that did not match.
    pub fn count(&self) -> usize {
        self.found.len()
    }

    /// The mismatch messages.
    pub fn messages(&self) -> &[String] {
        &self.found
    }

    /// Print the mismatches to stderr.
    pub fn print(&self) {
        for m in &self.found {
            eprintln!("rank {}: MISMATCH {m}", self.rank);
        }
    }

    /// Record a mismatch.
    pub fn note(&mut self, what: String) {
        self.found.push(what);
    }

    /// Compare values with `==`.
    pub fn eq<T: PartialEq + Debug>(&mut self, what: &str, got: &[T], want: &[T]) {
        if got.len() != want.len() {
            self.note(format!(
                "{what}: {} values, expected {}",
                got.len(),
                want.len()
            ));
        } else if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
            self.note(format!(
                "{what}[{i}]: got {:?}, expected {:?}",
                got[i], want[i]
            ));
        }
    }

    /// Compare the bits of plain-old-data values (so NaNs and -0.0 count too).
    pub fn bits<T: bytemuck::Pod + Debug>(&mut self, what: &str, got: &[T], want: &[T]) {
        if got.len() != want.len() {
            self.note(format!(
                "{what}: {} values, expected {}",
                got.len(),
                want.len()
            ));
            return;
        }
        let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
        if g != w {
            let size = std::mem::size_of::<T>().max(1);
            let byte = g.iter().zip(w).position(|(a, b)| a != b).unwrap_or(0);
            let i = byte / size;
            self.note(format!(
                "{what}[{i}]: got {:?}, expected {:?}",
                got[i], want[i]
            ));
        }
    }

    /// Compare rows `rows` of received tokens with the reference's (row-major scales).
    fn tokens(
        &mut self,
        what: &str,
        got: RecvTokens<'_>,
        want: &TokenData,
        rows: std::ops::Range<usize>,
        hidden: usize,
    ) {
        let g = hidden / 128;
        let span = rows.start * hidden..rows.end * hidden;
        match (got, want) {
            (RecvTokens::Bf16(a), TokenData::Bf16(b)) => {
                self.bits(what, &a[span.clone()], &b[span])
            }
            (RecvTokens::Fp8 { data, scales }, TokenData::Fp8 { data: d, scales: s }) => {
                self.bits(what, &data[span.clone()], &d[span]);
                self.bits(
                    &format!("{what} scales"),
                    &scales[rows.start * g..rows.end * g],
                    &s[rows.start * g..rows.end * g],
                );
            }
            _ => self.note(format!("{what}: dtype differs from the reference")),
        }
    }
}

/// Check a normal dispatch against the reference.
pub fn normal_dispatch(
    bad: &mut Mismatches,
    out: &DispatchOutput<'_>,
    want: &NormalRecv,
    hidden: usize,
) {
    let n = want.num_rows();
    if out.handle.num_recv_tokens != n {
        bad.note(format!(
            "dispatch: received {} rows, expected {n}",
            out.handle.num_recv_tokens
        ));
        return;
    }
    if n > 0 {
        bad.tokens("dispatch.recv_x", out.recv_x, &want.x, 0..n, hidden);
    }
    if let (Some(got), Some(w)) = (out.recv_topk_idx, &want.topk_idx) {
        bad.eq("dispatch.recv_topk_idx", &got[..w.len()], w);
        // Padding rows (num_worst_tokens) must route nowhere.
        if let Some(i) = got[w.len()..].iter().position(|&e| e != -1) {
            bad.note(format!(
                "dispatch.recv_topk_idx padding[{}] = {}, expected -1",
                w.len() + i,
                got[w.len() + i]
            ));
        }
    }
    if let (Some(got), Some(w)) = (out.recv_topk_weights, &want.topk_weights) {
        bad.bits("dispatch.recv_topk_weights", &got[..w.len()], w);
    }
    bad.eq(
        "dispatch.num_recv_tokens_per_expert",
        &out.num_recv_tokens_per_expert,
        &want.num_recv_tokens_per_expert,
    );
    bad.eq(
        "dispatch.handle.recv_src_idx",
        &out.handle.recv_src_idx,
        &want.src_token,
    );
    bad.eq(
        "dispatch.handle.rank_prefix_matrix",
        &out.handle.rank_prefix_matrix,
        &want.rank_prefix_matrix,
    );
    bad.eq(
        "dispatch.handle.recv_src_rank",
        &out.handle.recv_src_rank(bad.rank),
        &want.src_rank,
    );
}

/// Check a low-latency dispatch against the reference (valid rows only: rows past an
/// expert's count are unspecified).
pub fn ll_dispatch(bad: &mut Mismatches, out: &LlDispatchOutput<'_>, want: &LlRecv, hidden: usize) {
    bad.eq("ll_dispatch.recv_count", &out.recv_count, &want.count);
    if bad.count() > 0 {
        return;
    }
    let experts = want.count.len().max(1);
    let rows_per_expert = want.src_token.len() / experts;
    let g = hidden / 128;
    for (le, &n) in want.count.iter().enumerate() {
        let begin = le * rows_per_expert;
        let rows = begin..begin + n as usize;
        let what = format!("ll_dispatch.recv_x[expert {le}]");
        match (out.recv_x, &want.x) {
            // Scales come column-major, `[E/R, H/128, R*M]`: gather this expert's rows.
            (RecvTokens::Fp8 { data, scales }, TokenData::Fp8 { data: d, scales: s }) => {
                let span = rows.start * hidden..rows.end * hidden;
                bad.bits(&what, &data[span.clone()], &d[span]);
                let got: Vec<f32> = (0..n as usize)
                    .flat_map(|j| (0..g).map(move |c| scales[(le * g + c) * rows_per_expert + j]))
                    .collect();
                bad.bits(
                    &format!("{what} scales"),
                    &got,
                    &s[rows.start * g..rows.end * g],
                );
            }
            // NVFP4 scale words come column-major too, `[E/R, H/64, R*M]`.
            (
                RecvTokens::Nvfp4 { data, scales },
                TokenData::Nvfp4 {
                    data: d, scales: s, ..
                },
            ) => {
                let (rb, w) = (hidden / 2, hidden / 64);
                let span = rows.start * rb..rows.end * rb;
                bad.bits(&what, &data[span.clone()], &d[span]);
                let got: Vec<u32> = (0..n as usize)
                    .flat_map(|j| (0..w).map(move |c| scales[(le * w + c) * rows_per_expert + j]))
                    .collect();
                bad.bits(
                    &format!("{what} scales"),
                    &got,
                    &s[rows.start * w..rows.end * w],
                );
            }
            (got, want) => bad.tokens(&what, got, want, rows, hidden),
        }
    }
    bad.eq(
        "ll_dispatch.handle.src_info",
        &out.handle.src_info,
        &want.src_token,
    );
    bad.eq(
        "ll_dispatch.handle.src_slot",
        &out.handle.src_slot,
        &want.src_slot,
    );
    bad.eq(
        "ll_dispatch.handle.layout_range",
        &out.handle.layout_range,
        &want.layout_range,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_single_flipped_bit_is_caught() {
        let want: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        for (i, bit) in [(0usize, 0u32), (517, 13), (999, 31)] {
            let mut got = want.clone();
            got[i] = f32::from_bits(got[i].to_bits() ^ (1 << bit));
            let mut bad = Mismatches::new(0);
            bad.bits("x", &got, &want);
            assert_eq!(bad.count(), 1, "bit {bit} of value {i}");
            assert!(
                bad.messages()[0].starts_with(&format!("x[{i}]")),
                "{:?}",
                bad.messages()
            );
        }
        // -0.0 and 0.0 compare equal as floats but not as bits.
        let mut bad = Mismatches::new(0);
        bad.bits("z", &[-0.0f32], &[0.0f32]);
        bad.eq("e", &[1, 2, 3], &[1, 2, 4]);
        bad.eq("len", &[1, 2], &[1, 2, 3]);
        assert_eq!(bad.count(), 3);
        let mut good = Mismatches::new(0);
        good.bits("x", &want, &want);
        good.eq("y", &[1u8], &[1u8]);
        assert_eq!(good.count(), 0);
    }
}
