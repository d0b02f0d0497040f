//! One verified step of each mode: dispatch the inputs every rank can regenerate, apply
//! an identity expert, combine, and check every output against the reference bit for
//! bit. Shared by `uep bench --soak`, the EP layer's in-process tests and the CLI.

use half::bf16;
use uep_ep::{Buffer, Cast, DispatchArgs, LlCombineInput, LlDispatchArgs, Result};

use crate::case::{identity_expert, LlCase, NormalCase, ScaleLayout};
use crate::check::{self, Mismatches};
use crate::workload::{without_ranks, JobShape, RankInput, TokenData};

/// How a step casts and sends its rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepOpts {
    /// Dispatch FP8 rows (per-128 scales).
    pub fp8: bool,
    /// Low-latency FP8 with power-of-two scales.
    pub round_scale: bool,
    /// Normal dispatch's `expert_alignment` (0 or 1: none).
    pub expert_alignment: usize,
    /// Low-latency combine from the combine buffer (zero copy) instead of rows.
    pub zero_copy: bool,
}

/// A normal dispatch and combine of `inputs` (every rank's), checked into `bad`; `y`
/// is the expert's output rows, reused across steps.
pub fn normal_step(
    buffer: &mut Buffer,
    inputs: Vec<RankInput>,
    shape: &JobShape,
    opts: StepOpts,
    bad: &mut Mismatches,
    y: &mut Vec<bf16>,
) -> Result<()> {
    let (rank, h) = (buffer.rank(), shape.hidden);
    let align = opts.expert_alignment.max(1);
    let case = |masked: &[bool]| -> Result<NormalCase> {
        let seen = without_ranks(&inputs, shape, masked);
        NormalCase::new(seen, shape, rank, opts.fp8, align)
    };
    let sent = case(&[])?;
    let mine = &sent.sent[rank];
    let out = buffer.dispatch(
        DispatchArgs::new(sent.x(rank))
            .topk(&mine.topk_idx, Some(&mine.topk_weights))
            .layout(&sent.layout)
            .expert_alignment(align),
    )?;
    let masked = out.handle.masked.clone();
    let dispatched = match masked.contains(&true) {
        true => case(&masked)?,
        false => sent,
    };
    check::normal_dispatch(bad, &out, &dispatched.expected, h);
    let n = out.handle.num_recv_tokens;
    y.resize(n * h, bf16::ZERO);
    identity_expert(out.recv_x, 0..n, h, ScaleLayout::RowMajor, None, y)?;
    let w = out.recv_topk_weights.map(<[f32]>::to_vec);
    let handle = out.handle;
    let combined = buffer.combine(y, w.as_deref(), &handle)?;
    // A rank masked between dispatch and combine leaves the combine without it.
    let combine_mask = buffer.last_combine_mask();
    let expected = match buffer.is_elastic() && combine_mask != masked {
        true => case(&combine_mask)?.expected_combine,
        false => dispatched.expected_combine,
    };
    bad.bits("combine.combined_x", &combined.combined_x, &expected.0);
    Ok(())
}

/// A low-latency dispatch and combine of `inputs` (every rank's, bf16), checked into
/// `bad`; in elastic mode each output against the reference without the ranks that
/// call masked. `ll_y` holds the expert's rows when the combine does not send from the
/// combine buffer.
pub fn ll_step(
    buffer: &mut Buffer,
    inputs: &[RankInput],
    shape: &JobShape,
    max_tokens: usize,
    opts: StepOpts,
    bad: &mut Mismatches,
    ll_y: &mut [bf16],
) -> Result<()> {
    let (rank, h) = (buffer.rank(), shape.hidden);
    let rows_per_expert = buffer.num_ranks() * max_tokens;
    let mine = &inputs[rank];
    let TokenData::Bf16(x) = &mine.x else {
        return Err(uep_ep::EpError::InvalidArgument(
            "a low-latency step takes bf16 inputs (it casts them itself)".into(),
        ));
    };
    let case = |masked: &[bool]| -> Result<LlCase> {
        let seen: Vec<RankInput> = match masked.iter().any(|&m| m) {
            true => without_ranks(inputs, shape, masked),
            false => inputs.to_vec(),
        };
        LlCase::new(
            rank,
            seen,
            shape,
            max_tokens,
            Cast::fp8_if(opts.fp8, opts.round_scale),
        )
    };
    let mut out = buffer.low_latency_dispatch(
        LlDispatchArgs::new(x, &mine.topk_idx).cast(Cast::fp8_if(opts.fp8, opts.round_scale)),
    )?;
    let dispatched = case(&out.handle.masked)?;
    check::ll_dispatch(bad, &out, &dispatched.expected, h);
    let y = match (opts.zero_copy, out.combine_buffer.take()) {
        (true, Some(buffer)) => buffer,
        (true, None) => {
            return Err(uep_ep::EpError::Internal(
                "no combine buffer after a low-latency dispatch".into(),
            ))
        }
        (false, _) => &mut *ll_y,
    };
    for (le, &n) in out.recv_count.iter().enumerate() {
        let begin = le * rows_per_expert;
        let layout = ScaleLayout::ColumnMajor { rows_per_expert };
        identity_expert(out.recv_x, begin..begin + n as usize, h, layout, None, y)?;
    }
    let handle = out.handle;
    let input = match opts.zero_copy {
        true => LlCombineInput::ZeroCopy,
        false => LlCombineInput::Rows(ll_y),
    };
    let combined =
        buffer.low_latency_combine(input, &mine.topk_idx, &mine.topk_weights, &handle)?;
    // A rank masked between dispatch and combine leaves the combine without its experts.
    let combine_mask = buffer.last_combine_mask();
    let expected = match buffer.is_elastic() && combine_mask != handle.masked {
        true => case(&combine_mask)?.expected_combine,
        false => dispatched.expected_combine,
    };
    bad.bits("ll_combine.combined_x", &combined, &expected);
    Ok(())
}

/// `steps` verified steps of both modes on `buffer`: step `i` draws fresh inputs
/// (`seed ^ i`, tokens of `tokens.0` a rank for normal mode and `tokens.1` for
/// low-latency mode, one slot in ten empty), routes them by the next of uniform,
/// same-rank, empty-ranks and mixed routing, and runs with `opts(i)`. Returns every
/// mismatch, as messages.
pub fn verified_steps(
    buffer: &mut Buffer,
    shape: &JobShape,
    tokens: (usize, usize),
    steps: u64,
    seed: u64,
    opts: impl Fn(u64) -> StepOpts,
) -> Result<Vec<String>> {
    use crate::workload::{generate_all, Routing, WorkloadSpec};
    let routings = [
        Routing::Uniform,
        Routing::SameRank,
        Routing::EmptyRanks,
        Routing::Mixed,
    ];
    let mut bad = Mismatches::new(buffer.rank());
    let mut y = Vec::new();
    let mut ll_y = vec![bf16::ZERO; shape.num_experts * tokens.1 * shape.hidden];
    for step in 0..steps {
        let spec = |tokens_per_rank: usize, salt: u64| WorkloadSpec {
            shape: *shape,
            tokens_per_rank,
            routing: routings[step as usize % routings.len()],
            drop_prob: 0.1,
            fp8_input: false,
            seed: seed ^ salt ^ step,
        };
        let inputs = generate_all(&spec(tokens.0, 0))?;
        normal_step(buffer, inputs, shape, opts(step), &mut bad, &mut y)?;
        let inputs = generate_all(&spec(tokens.1, 0x11))?;
        ll_step(
            buffer,
            &inputs,
            shape,
            tokens.1,
            opts(step),
            &mut bad,
            &mut ll_y,
        )?;
    }
    Ok(bad.messages().to_vec())
}
