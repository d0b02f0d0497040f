//! One step's inputs together with what the reference says every output must be.

use half::bf16;
use uep_ep::quant::{dequantize, nvfp4_dequantize_token, quantize, Nvfp4};
use uep_ep::{get_dispatch_layout, Cast, DispatchLayout, RecvTokens, Result, Tokens};

use crate::reference::{self, LlRecv, NormalRecv};
use crate::workload::{JobShape, RankInput, TokenData};

/// `input` with its rows cast to FP8 (per 128 channels, scales not rounded).
pub fn to_fp8(input: &RankInput, hidden: usize) -> Result<RankInput> {
    let TokenData::Bf16(x) = &input.x else {
        return Ok(input.clone());
    };
    let (data, scales) = quantize(x, hidden, false)?;
    Ok(RankInput {
        x: TokenData::Fp8 { data, scales },
        ..input.clone()
    })
}

/// `data` as the [`Tokens`] a dispatch takes (bf16 or FP8; NVFP4 is a low-latency
/// dispatch's cast, never its input).
pub fn tokens(data: &TokenData) -> Tokens<'_> {
    match data {
        TokenData::Bf16(v) => Tokens::Bf16(v),
        TokenData::Fp8 { data, scales } => Tokens::Fp8 { data, scales },
        TokenData::Nvfp4 { .. } => {
            panic!("NVFP4 rows are what a low-latency dispatch casts to, never its input")
        }
    }
}

/// How the scales of received FP8 rows are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleLayout {
    /// `[N, H/128]` (normal dispatch).
    RowMajor,
    /// `[E/R, H/128, rows_per_expert]` (low-latency dispatch, as DeepEP).
    ColumnMajor {
        /// Rows of one expert, `R * M`.
        rows_per_expert: usize,
    },
}

/// What an identity expert returns for received rows `rows` of `x`: the rows
/// themselves, or their dequantised values rounded to bf16 (NVFP4 rows by `nvfp4`, the
/// call's cast), written into `y` (which
/// keeps its size, so other rows stay as they were, and is reused across steps: a real
/// expert computes only the rows it got, into memory it keeps).
pub fn identity_expert(
    x: RecvTokens<'_>,
    rows: std::ops::Range<usize>,
    hidden: usize,
    layout: ScaleLayout,
    nvfp4: Option<Nvfp4>,
    y: &mut [bf16],
) -> Result<()> {
    let span = rows.start * hidden..rows.end * hidden;
    match x {
        RecvTokens::Bf16(v) => y[span.clone()].copy_from_slice(&v[span]),
        RecvTokens::Fp8 { data, scales } => {
            let g = hidden / 128;
            let row_scales: Vec<f32> = match layout {
                ScaleLayout::RowMajor => scales[rows.start * g..rows.end * g].to_vec(),
                ScaleLayout::ColumnMajor { rows_per_expert } => rows
                    .clone()
                    .flat_map(|r| {
                        let (e, j) = (r / rows_per_expert, r % rows_per_expert);
                        (0..g).map(move |c| scales[(e * g + c) * rows_per_expert + j])
                    })
                    .collect(),
            };
            let values = dequantize(&data[span.clone()], &row_scales, hidden)?;
            for (o, v) in y[span].iter_mut().zip(values) {
                *o = bf16::from_f32(v);
            }
        }
        RecvTokens::Nvfp4 { data, scales } => {
            let (Some(cast), ScaleLayout::ColumnMajor { rows_per_expert }) = (nvfp4, layout) else {
                return Err(uep_ep::EpError::InvalidArgument(
                    "the identity expert takes NVFP4 rows of a low-latency dispatch with their cast".into(),
                ));
            };
            let (rb, w) = (hidden / 2, hidden / 64);
            let mut values = vec![0f32; hidden];
            for r in rows {
                let (e, j) = (r / rows_per_expert, r % rows_per_expert);
                let words: Vec<u32> = (0..w)
                    .map(|c| scales[(e * w + c) * rows_per_expert + j])
                    .collect();
                let sf: &[u8] = bytemuck::cast_slice(&words);
                nvfp4_dequantize_token(&data[r * rb..(r + 1) * rb], sf, cast, &mut values);
                for (o, v) in y[r * hidden..(r + 1) * hidden].iter_mut().zip(&values) {
                    *o = bf16::from_f32(*v);
                }
            }
        }
    }
    Ok(())
}

/// One normal-mode step's inputs and what the reference says every output must be.
#[derive(Debug)]
pub struct NormalCase {
    /// Every rank's input as sent (cast to FP8 if the case is FP8).
    pub sent: Vec<RankInput>,
    /// What this rank receives.
    pub expected: NormalRecv,
    /// What this rank's combine returns when every expert is the identity.
    pub expected_combine: (Vec<bf16>, Option<Vec<f32>>),
    /// This rank's dispatch layout.
    pub layout: DispatchLayout,
}

impl NormalCase {
    /// The case of `rank` for every rank's `inputs`.
    pub fn new(
        inputs: Vec<RankInput>,
        shape: &JobShape,
        rank: usize,
        fp8: bool,
        expert_alignment: usize,
    ) -> Result<Self> {
        let sent: Vec<RankInput> = if fp8 {
            inputs
                .iter()
                .map(|i| to_fp8(i, shape.hidden))
                .collect::<Result<_>>()?
        } else {
            inputs
        };
        let expected = reference::normal_dispatch(&sent, shape, rank, expert_alignment, true)?;
        let expected_combine = reference::normal_combine_identity(&sent, shape, rank)?;
        let layout = get_dispatch_layout(
            &sent[rank].topk_idx,
            shape.topk,
            shape.num_experts,
            shape.num_ranks,
            shape.ranks_per_node,
        )?;
        Ok(NormalCase {
            sent,
            expected,
            expected_combine,
            layout,
        })
    }

    /// Rank `rank`'s x, as a dispatch takes it.
    pub fn x(&self, rank: usize) -> Tokens<'_> {
        tokens(&self.sent[rank].x)
    }
}

/// One low-latency step's inputs and expected outputs.
#[derive(Debug)]
pub struct LlCase {
    /// Every rank's input.
    pub inputs: Vec<RankInput>,
    /// What this rank receives.
    pub expected: LlRecv,
    /// What this rank's combine returns when every expert is the identity.
    pub expected_combine: Vec<bf16>,
    /// What the dispatch casts its rows to (`None`: bf16 as given).
    pub cast: Option<Cast>,
}

impl LlCase {
    /// The case of `rank` for every rank's `inputs`, `max_tokens` a rank, the dispatch
    /// casting to `cast`.
    pub fn new(
        rank: usize,
        inputs: Vec<RankInput>,
        shape: &JobShape,
        max_tokens: usize,
        cast: Option<Cast>,
    ) -> Result<Self> {
        let expected = reference::ll_dispatch(&inputs, shape, rank, max_tokens, cast)?;
        let expected_combine = reference::ll_combine_identity(&inputs, shape, rank, cast)?;
        Ok(LlCase {
            inputs,
            expected,
            expected_combine,
            cast,
        })
    }
}
