//! The compute phases' descriptors: what each phase reads and writes, named as the
//! caller's tensors, areas of symmetric memory (a rank and an [`Area`]: offset and
//! shape, the same on every device) and dimensions, so that one call means the same on
//! CPU threads and on a GPU.
//!
//! A device reads a symmetric area through the [`Symmetric`] view the descriptor
//! carries: the host device takes a slice of the mapping ([`Symmetric::rows`]); a
//! device whose symmetric memory is its own resolves the same rank and offset in it.
//! The view exists only once a wait acquired the area's publication for the call, so
//! reading it is safe on any device.

use half::bf16;

use crate::area::Area;
use crate::error::{EpError, Result};
use crate::quant::{check_fp8_shape, Cast};
use crate::symm::{self, Published};

/// The layout phase (DeepEP's `get_dispatch_layout`): which ranks, nodes and experts
/// each token of `topk_idx` goes to.
#[derive(Clone, Copy, Debug)]
pub struct LayoutPhase<'a> {
    /// `[tokens, topk]` expert ids, `-1` for an empty slot.
    pub topk_idx: &'a [i64],
    /// Slots a token.
    pub topk: usize,
    /// Experts over all ranks.
    pub num_experts: usize,
    /// Ranks of the job.
    pub num_ranks: usize,
    /// Ranks a node.
    pub ranks_per_node: usize,
}

/// The cast phase of a low-latency dispatch: `[tokens, hidden]` bf16 rows into codes
/// and 32-bit scale words, as `cast` says: FP8 e4m3 with one f32 scale per 128
/// channels ([`crate::quant::quantize_token`]), or NVFP4 with four block scale bytes a
/// word ([`crate::quant::nvfp4_quantize_token`]); the definitions every device matches
/// bit for bit. [`crate::TokenFormat`] gives the sizes a row.
///
/// ```
/// use half::bf16;
/// use uep_ep::device::{CastPhase, Device, HostDevice};
/// use uep_ep::Cast;
/// let x: Vec<bf16> = (0..3 * 128).map(|i| bf16::from_f32(i as f32 / 7.0)).collect();
/// let (mut q, mut scales) = (vec![0u8; x.len()], vec![0f32; 3]);
/// let phase = CastPhase { x: &x, hidden: 128, cast: Cast::Fp8 { round_scale: false } };
/// HostDevice::new(2).cast(&phase, &mut q, &mut scales).unwrap();
/// assert_eq!((q, scales), uep_ep::quant::quantize(&x, 128, false).unwrap());
/// ```
#[derive(Clone, Copy, Debug)]
pub struct CastPhase<'a> {
    /// `[tokens, hidden]` rows.
    pub x: &'a [bf16],
    /// Channels a row, a multiple of 128.
    pub hidden: usize,
    /// What the rows become.
    pub cast: Cast,
}

impl CastPhase<'_> {
    /// Checks that `hidden` is a multiple of 128 that divides the input, that an NVFP4
    /// global scale is finite and positive, and that `q` and `scales` hold `q_len`
    /// codes and `scales_len` scale words, the format's sizes: what a device relies on
    /// before it casts.
    pub fn check(&self, q_len: usize, scales_len: usize) -> Result<()> {
        check_fp8_shape(self.x.len(), self.hidden)?;
        if let Cast::Nvfp4(n) = self.cast {
            if !(n.global_scale.is_finite() && n.global_scale > 0.0) {
                return Err(crate::invalid!(
                    "NVFP4 needs a finite, positive global scale, got {}",
                    n.global_scale
                ));
            }
        }
        let (n, f, h) = (self.x.len(), self.cast.format(), self.hidden.max(1));
        let (codes, words) = (n / h * f.row_bytes(h), n / h * f.scale_words(h));
        if q_len != codes || scales_len != words {
            return Err(crate::invalid!(
                "cast: {n} values need {codes} code bytes and {words} scale words, got {q_len} and {scales_len}"
            ));
        }
        Ok(())
    }
}

/// Where rows of bf16 values that a phase reads are.
#[derive(Clone, Copy, Debug)]
pub enum Rows<'a> {
    /// One of the caller's tensors.
    Tensor(&'a [bf16]),
    /// An area of `rank`'s symmetric memory (this rank's or a same-node peer's).
    Symmetric {
        /// Whose memory.
        rank: usize,
        /// The rows, as bf16 bits.
        area: Area<u16>,
    },
}

/// One row a token's output sums: row `row` of source `source`, times `weight` in a
/// weighted reduction. Laid out as C (three 4-byte fields), so a device hands the parts
/// to its kernel as they are.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct Part {
    /// Index into [`ReducePhase::sources`].
    pub source: u32,
    /// Row of that source.
    pub row: u32,
    /// The row's weight (ignored unless [`ReducePhase::weighted`]).
    pub weight: f32,
}

impl Part {
    /// The parts of an unweighted reduction of `n` tokens in CSR form (`starts`,
    /// `parts`), token `t` summing `of(t)`'s `(source, row)` pairs in order.
    pub(crate) fn csr<I>(n: usize, of: impl Fn(usize) -> I) -> (Vec<u32>, Vec<Part>)
    where
        I: Iterator<Item = (u32, usize)>,
    {
        let mut starts = Vec::with_capacity(n + 1);
        let mut parts = Vec::new();
        for t in 0..n {
            starts.push(parts.len() as u32);
            parts.extend(of(t).map(|(source, row)| Part {
                source,
                row: row as u32,
                weight: 1.0,
            }));
        }
        starts.push(parts.len() as u32);
        (starts, parts)
    }
}

/// The reduce phase of both combines (normal and low-latency receive): token `t`'s
/// output row is `bf16(0.0 + w0*r0 + w1*r1 + ...)` over `parts[starts[t]..starts[t+1]]`
/// in that order, accumulated in f32 and rounded once (`crate::quant::reduce_rows`).
#[derive(Clone, Copy, Debug)]
pub struct ReducePhase<'a> {
    /// Channels a row.
    pub hidden: usize,
    /// The row sets the parts name.
    pub sources: &'a [Rows<'a>],
    /// `[tokens + 1]`: token `t`'s parts are `parts[starts[t]..starts[t + 1]]`.
    pub starts: &'a [u32],
    /// Every token's parts, in summation order.
    pub parts: &'a [Part],
    /// Multiply each row by its part's weight.
    pub weighted: bool,
    /// The symmetric memory the sources may name, published for this call.
    pub memory: Symmetric<'a>,
}

impl ReducePhase<'_> {
    /// Tokens reduced.
    pub fn tokens(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }

    /// Token `t`'s parts.
    pub fn parts_of(&self, t: usize) -> &[Part] {
        &self.parts[self.starts[t] as usize..self.starts[t + 1] as usize]
    }

    /// Checks that `starts` is a well-formed index of `parts`, that every part names a
    /// source and a row it has, and that `out` holds `tokens × hidden` values: what a
    /// device relies on before it reads a row.
    pub fn check(&self, out_len: usize) -> Result<()> {
        let bad = |what: String| Err(EpError::internal(format!("reduce phase: {what}")));
        let h = self.hidden;
        if out_len != self.tokens() * h {
            return bad(format!(
                "{out_len} outputs for {} tokens of {h}",
                self.tokens()
            ));
        }
        let ends_right = self.starts.last().map_or(0, |&e| e as usize) == self.parts.len();
        if self.starts.first().is_some_and(|&s| s != 0)
            || !self.starts.windows(2).all(|w| w[0] <= w[1])
            || !ends_right
        {
            return bad(format!("starts do not index {} parts", self.parts.len()));
        }
        let rows: Vec<usize> = (self.sources.iter())
            .map(|s| self.memory.len_of(*s) / h.max(1))
            .collect();
        match self.parts.iter().find(|p| {
            rows.get(p.source as usize)
                .is_none_or(|&n| p.row as usize >= n)
        }) {
            Some(p) => bad(format!("{p:?} names no row of its source")),
            None => Ok(()),
        }
    }
}

/// Symmetric memory as a phase reads it: published to this rank for the call, or none
/// (a phase over the caller's tensors only).
#[derive(Clone, Copy)]
pub struct Symmetric<'a> {
    memory: Option<(&'a symm::Symmetric, Published<'a>)>,
}

impl std::fmt::Debug for Symmetric<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symmetric").finish_non_exhaustive()
    }
}

impl<'a> Symmetric<'a> {
    /// The view of `symm` that `published` proves readable.
    pub(crate) fn new(symm: &'a symm::Symmetric, published: Published<'a>) -> Self {
        Symmetric {
            memory: Some((symm, published)),
        }
    }

    /// No symmetric memory: a phase whose sources are all tensors.
    ///
    /// ```
    /// use half::bf16;
    /// use uep_ep::device::{Device, HostDevice, Part, ReducePhase, Rows, Symmetric};
    /// let (a, b) = (vec![bf16::from_f32(1.5); 128], vec![bf16::from_f32(2.0); 128]);
    /// let parts = [Part { source: 0, row: 0, weight: 2.0 }, Part { source: 1, row: 0, weight: 0.5 }];
    /// let phase = ReducePhase {
    ///     hidden: 128,
    ///     sources: &[Rows::Tensor(&a), Rows::Tensor(&b)],
    ///     starts: &[0, 2],
    ///     parts: &parts,
    ///     weighted: true,
    ///     memory: Symmetric::none(),
    /// };
    /// let mut out = vec![bf16::ZERO; 128];
    /// HostDevice::new(2).reduce(&phase, &mut out).unwrap();
    /// assert!(out.iter().all(|&v| v == bf16::from_f32(4.0)));
    /// ```
    pub fn none() -> Self {
        Symmetric { memory: None }
    }

    /// `rows` as a host slice (host devices: the mapping is host memory).
    pub fn rows(&self, rows: Rows<'a>) -> Result<&'a [u16]> {
        match (rows, self.memory) {
            (Rows::Tensor(t), _) => Ok(bytemuck::cast_slice(t)),
            (Rows::Symmetric { rank, area }, Some((symm, published))) => {
                let region = symm.peer(rank).ok_or_else(|| {
                    EpError::internal(format!("rank {rank} shares no memory with this one"))
                })?;
                published.view_of(region, area)
            }
            (Rows::Symmetric { rank, .. }, None) => Err(EpError::internal(format!(
                "a phase without symmetric memory names rank {rank}'s"
            ))),
        }
    }

    /// Values in `rows`.
    pub fn len_of(&self, rows: Rows<'_>) -> usize {
        match rows {
            Rows::Tensor(t) => t.len(),
            Rows::Symmetric { area, .. } => area.len(),
        }
    }
}
