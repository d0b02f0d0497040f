//! Comparing what a rank received with what the sequential reference says it should.
//!
//! Everything is compared bit for bit: bf16 and FP8 payloads, scales, weights, ids and
//! counts. The first mismatch of each output is kept with its index, so a failure says
//! where to look.

use std::fmt::Debug;

use uep_ep::reference::{LlRecv, NormalRecv};
use uep_ep::workload::TokenData;
use uep_ep::{DispatchOutput, LlDispatchOutput, RecvTokens};

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

    fn tokens(
        &mut self,
        what: &str,
        got: RecvTokens<'_>,
        want: &TokenData,
        rows: std::ops::Range<usize>,
        hidden: usize,
    ) {
        let g = hidden / 128;
        match (got, want) {
            (RecvTokens::Bf16(a), TokenData::Bf16(b)) => self.bits(
                what,
                &a[rows.start * hidden..rows.end * hidden],
                &b[rows.start * hidden..rows.end * hidden],
            ),
            (RecvTokens::Fp8 { data, scales }, TokenData::Fp8 { data: d, scales: s }) => {
                self.bits(
                    what,
                    &data[rows.start * hidden..rows.end * hidden],
                    &d[rows.start * hidden..rows.end * hidden],
                );
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
pub fn normal_dispatch(bad: &mut Mismatches, out: &DispatchOutput<'_>, want: &NormalRecv) {
    let n = want.num_rows();
    let hidden = match &want.x {
        TokenData::Bf16(v) => v.len() / n.max(1),
        TokenData::Fp8 { data, .. } => data.len() / n.max(1),
    };
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
    let rows_per_expert = want.src_token.len() / want.count.len().max(1);
    for (le, &n) in want.count.iter().enumerate() {
        let begin = le * rows_per_expert;
        bad.tokens(
            &format!("ll_dispatch.recv_x[expert {le}]"),
            out.recv_x,
            &want.x,
            begin..begin + n as usize,
            hidden,
        );
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
