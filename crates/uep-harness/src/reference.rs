//! The sequential model of every data path (docs/architecture.md, "What a call does"):
//! what each rank must receive and return. It is the
//! oracle of every test, so it is written plainly: loops in the order the spec states, no
//! parallelism, every input checked.
//!
//! All functions take every rank's [`RankInput`] and compute the result of one rank.

use half::bf16;

use crate::workload::{JobShape, RankInput, TokenData};
use uep_ep::invalid;
use uep_ep::quant::{nvfp4_quantize_token, quantize_token, FP8_GROUP};
use uep_ep::Cast;
use uep_ep::Result;
use uep_ep::{get_dispatch_layout, DispatchLayout};

/// What one rank receives from normal dispatch (docs/architecture.md, normal mode).
///
/// Rows are grouped by source rank ascending, token order kept inside a source; each token
/// arrives at most once per rank however many of its experts live there.
#[derive(Debug, Clone, PartialEq)]
pub struct NormalRecv {
    /// `[N, H]` rows; FP8 input gives FP8 rows plus their `[N, H/128]` scales, bit for bit.
    pub x: TokenData,
    /// `[N, K]`: the local expert id (`e - rank * E/R`) where expert `e` is on this rank, else `-1`.
    pub topk_idx: Option<Vec<i64>>,
    /// `[N, K]`: the gate weight where the local id is not `-1`, else `0.0`.
    pub topk_weights: Option<Vec<f32>>,
    /// `[N]`: source rank of each row.
    pub src_rank: Vec<i32>,
    /// `[N]`: token index of each row on its source rank.
    pub src_token: Vec<i32>,
    /// `[E/R]`: (token, slot) pairs naming each local expert, summed over all sources (a token
    /// naming an expert twice counts twice, as DeepEP), rounded up to `expert_alignment`.
    pub num_recv_tokens_per_expert: Vec<usize>,
    /// `[R * R]`, row-major: `[s][r]` = tokens that ranks `0..=s` send to rank `r` (DeepEP's
    /// `rank_prefix_matrix`; identical on every rank).
    pub rank_prefix_matrix: Vec<i32>,
}

impl NormalRecv {
    /// Received rows `N`.
    pub fn num_rows(&self) -> usize {
        self.src_rank.len()
    }
}

/// Check every rank's input against `shape` and return each rank's dispatch layout.
fn check_inputs(inputs: &[RankInput], shape: &JobShape) -> Result<Vec<DispatchLayout>> {
    shape.validate()?;
    if inputs.len() != shape.num_ranks {
        return Err(invalid!(
            "reference: {} rank inputs given; need one per rank (num_ranks = {})",
            inputs.len(),
            shape.num_ranks
        ));
    }
    let fp8 = inputs.first().is_some_and(|i| i.x.is_fp8());
    inputs
        .iter()
        .enumerate()
        .map(|(s, input)| {
            let t = input.num_tokens;
            let rows = input.x.num_rows(shape.hidden)?;
            if rows != t {
                return Err(invalid!(
                    "reference: rank {s} declares {t} tokens but x holds {rows} rows of hidden = {}",
                    shape.hidden
                ));
            }
            if input.x.is_fp8() != fp8 {
                return Err(invalid!(
                    "reference: rank {s}'s x is {} but rank 0's is {}; all ranks must use one format",
                    fmt_name(input.x.is_fp8()),
                    fmt_name(fp8)
                ));
            }
            let k = shape.topk;
            if input.topk_idx.len() != t * k || input.topk_weights.len() != t * k {
                return Err(invalid!(
                    "reference: rank {s} has {} topk ids and {} weights; need tokens * topk = {t} * {k}",
                    input.topk_idx.len(),
                    input.topk_weights.len()
                ));
            }
            get_dispatch_layout(
                &input.topk_idx,
                k,
                shape.num_experts,
                shape.num_ranks,
                shape.ranks_per_node,
            )
            .map_err(|e| invalid!("reference: rank {s}: {e}"))
        })
        .collect()
}

fn fmt_name(fp8: bool) -> &'static str {
    if fp8 {
        "fp8"
    } else {
        "bf16"
    }
}

fn check_rank(rank: usize, shape: &JobShape) -> Result<()> {
    if rank >= shape.num_ranks {
        return Err(invalid!(
            "reference: rank {rank} out of range; num_ranks = {}",
            shape.num_ranks
        ));
    }
    Ok(())
}

/// `n` as i32 for the DeepEP-typed index arrays.
fn to_i32(n: usize, what: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| invalid!("reference: {what} = {n} does not fit in i32"))
}

/// Normal dispatch as received by `rank`: every token goes once to each rank hosting at least
/// one of its experts. `with_topk` = whether the caller passed `topk_idx`/`topk_weights` on
/// (when false, those fields are `None`).
pub fn normal_dispatch(
    inputs: &[RankInput],
    shape: &JobShape,
    rank: usize,
    expert_alignment: usize,
    with_topk: bool,
) -> Result<NormalRecv> {
    let layouts = check_inputs(inputs, shape)?;
    check_rank(rank, shape)?;
    if expert_alignment == 0 {
        return Err(invalid!("normal_dispatch: expert_alignment must be >= 1"));
    }
    let (r_count, h, k, epr) = (
        shape.num_ranks,
        shape.hidden,
        shape.topk,
        shape.experts_per_rank(),
    );
    let first_local = (rank * epr) as i64;
    let mut x = match inputs[0].x.is_fp8() {
        true => TokenData::Fp8 {
            data: Vec::new(),
            scales: Vec::new(),
        },
        false => TokenData::Bf16(Vec::new()),
    };
    let mut topk_idx = Vec::new();
    let mut topk_weights = Vec::new();
    let mut src_rank = Vec::new();
    let mut src_token = Vec::new();
    for (s, (input, layout)) in inputs.iter().zip(&layouts).enumerate() {
        for t in (0..input.num_tokens).filter(|&t| layout.token_in_rank(t, rank)) {
            push_row(&mut x, &input.x, t, h);
            let ids = &input.topk_idx[t * k..(t + 1) * k];
            let ws = &input.topk_weights[t * k..(t + 1) * k];
            for (&e, &w) in ids.iter().zip(ws) {
                // This rank's experts by their local index; the others as -1.
                let local = e - first_local;
                let mine = e != -1 && (0..epr as i64).contains(&local);
                topk_idx.push(if mine { local } else { -1 });
                topk_weights.push(if mine { w } else { 0.0 });
            }
            src_rank.push(to_i32(s, "source rank")?);
            src_token.push(to_i32(t, "source token")?);
        }
    }
    let num_recv_tokens_per_expert = (0..epr)
        .map(|le| {
            let pairs: usize = layouts
                .iter()
                .map(|l| l.num_tokens_per_expert[rank * epr + le] as usize)
                .sum();
            pairs.div_ceil(expert_alignment) * expert_alignment
        })
        .collect();
    let rank_prefix_matrix = rank_prefix_matrix(&layouts, r_count);
    Ok(NormalRecv {
        x,
        topk_idx: with_topk.then_some(topk_idx),
        topk_weights: with_topk.then_some(topk_weights),
        src_rank,
        src_token,
        num_recv_tokens_per_expert,
        rank_prefix_matrix,
    })
}

/// Appends token `t` of `from` (its row, and its scales if FP8) to `to`, of the same
/// format (every rank's inputs share one: `check_inputs`).
fn push_row(to: &mut TokenData, from: &TokenData, t: usize, h: usize) {
    let g = h / FP8_GROUP;
    match (to, from) {
        (TokenData::Bf16(to), TokenData::Bf16(x)) => to.extend_from_slice(&x[t * h..(t + 1) * h]),
        (
            TokenData::Fp8 { data, scales },
            TokenData::Fp8 {
                data: d,
                scales: sc,
            },
        ) => {
            data.extend_from_slice(&d[t * h..(t + 1) * h]);
            scales.extend_from_slice(&sc[t * g..(t + 1) * g]);
        }
        _ => unreachable!("every rank's inputs have one format (check_inputs)"),
    }
}

/// `[R, R]`: entry `(s, r)` counts the tokens that ranks `0..=s` send to rank `r`.
fn rank_prefix_matrix(layouts: &[DispatchLayout], r_count: usize) -> Vec<i32> {
    let mut m = vec![0i32; r_count * r_count];
    for (s, layout) in layouts.iter().enumerate() {
        for r in 0..r_count {
            let above = if s == 0 { 0 } else { m[(s - 1) * r_count + r] };
            m[s * r_count + r] = above + layout.num_tokens_per_rank[r];
        }
    }
    m
}

/// Normal combine at source rank `rank` with `num_tokens` tokens.
///
/// `recvs[r]` is what rank `r` received, `ys[r]` its `[N_r, H]` expert outputs, `weights[r]` its
/// optional `[N_r, K]` weights. For each token `t`, the rows returned for it (those with
/// `src_rank == rank && src_token == t`) are summed in f32 and rounded once (RNE) to bf16:
/// `combined[t] = bf16(0.0 + p_0 + p_1 + ...)` over nodes ascending, where for `rank`'s own
/// node `p_m` stands for each of its ranks' rows, ranks ascending (rows in order inside a rank),
/// and for another node `p_m = f32(bf16(0.0 + y_r + ...))`, its ranks' rows summed the same way
/// and rounded to bf16 (the one row that crosses the network, docs/architecture.md). On one node this is
/// the plain sum in rank order. Combined weights are the same sums of the `[K]` weight rows in
/// f32, never rounded. Tokens sent nowhere get zeros. Each `[T, H]` of `bias` (DeepEP's
/// combine bias) is added to every token's sum after the rows, in f32, before the one
/// rounding.
pub fn normal_combine(
    shape: &JobShape,
    recvs: &[NormalRecv],
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    bias: &[&[bf16]],
    rank: usize,
    num_tokens: usize,
) -> Result<(Vec<bf16>, Option<Vec<f32>>)> {
    shape.validate()?;
    check_rank(rank, shape)?;
    let (r_count, h, k) = (shape.num_ranks, shape.hidden, shape.topk);
    if recvs.len() != r_count || ys.len() != r_count || weights.is_some_and(|w| w.len() != r_count)
    {
        return Err(invalid!(
            "normal_combine: {} recvs, {} ys and {} weight sets given; need one per rank ({r_count})",
            recvs.len(),
            ys.len(),
            weights.map_or(r_count, <[Vec<f32>]>::len)
        ));
    }
    let (l, home) = (shape.ranks_per_node, rank / shape.ranks_per_node);
    let mut total = TokenSums::new(num_tokens, h, k);
    // Another node's partial sums.
    let mut part = TokenSums::new(num_tokens, h, k);
    for r in 0..r_count {
        let remote = r / l != home;
        if remote && r % l == 0 {
            part = TokenSums::new(num_tokens, h, k);
        }
        let sums = if remote { &mut part } else { &mut total };
        let recv = &recvs[r];
        let w_r = combine_inputs_of(r, recv, &ys[r], weights, h, k)?;
        for i in 0..recv.num_rows() {
            if usize::try_from(recv.src_rank[i]).ok() != Some(rank) {
                continue;
            }
            let t = usize::try_from(recv.src_token[i])
                .ok()
                .filter(|&t| t < num_tokens)
                .ok_or_else(|| {
                    invalid!(
                        "normal_combine: rank {r} row {i} names source token {}; rank {rank} has {num_tokens} tokens",
                        recv.src_token[i]
                    )
                })?;
            sums.add(
                t,
                &ys[r][i * h..(i + 1) * h],
                w_r.map(|w| &w[i * k..(i + 1) * k]),
            );
        }
        if remote && r % l == l - 1 {
            // The node's last rank: its partial sums join the total, rounded to bf16.
            part.add_rounded_into(&mut total);
        }
    }
    for (i, b) in bias.iter().enumerate() {
        if b.len() != num_tokens * h {
            return Err(invalid!(
                "normal_combine: bias {i} has {} values; need tokens * hidden = {num_tokens} * {h}",
                b.len()
            ));
        }
        for (a, y) in total.x.iter_mut().zip(b.iter()) {
            *a += y.to_f32();
        }
    }
    let combined = total.x.iter().map(|&a| bf16::from_f32(a)).collect();
    Ok((combined, weights.map(|_| total.w)))
}

/// Checks rank `r`'s part of a normal combine's inputs (`src_token`, `y` and weights
/// sized by its rows); its weights.
fn combine_inputs_of<'a>(
    r: usize,
    recv: &NormalRecv,
    y: &[bf16],
    weights: Option<&'a [Vec<f32>]>,
    h: usize,
    k: usize,
) -> Result<Option<&'a [f32]>> {
    let n = recv.num_rows();
    if recv.src_token.len() != n || y.len() != n * h {
        return Err(invalid!(
            "normal_combine: rank {r} has {n} src ranks, {} src tokens and {} y values; need {n}, {n} and {n} * hidden = {}",
            recv.src_token.len(),
            y.len(),
            n * h
        ));
    }
    match weights {
        Some(w) if w[r].len() != n * k => Err(invalid!(
            "normal_combine: rank {r} has {} weights; need rows * topk = {n} * {k}",
            w[r].len()
        )),
        Some(w) => Ok(Some(&w[r])),
        None => Ok(None),
    }
}

/// Per token, the f32 sums of the rows and weights added to it, and whether any was.
struct TokenSums {
    x: Vec<f32>,
    w: Vec<f32>,
    touched: Vec<bool>,
    h: usize,
    k: usize,
}

impl TokenSums {
    fn new(tokens: usize, h: usize, k: usize) -> Self {
        TokenSums {
            x: vec![0.0; tokens * h],
            w: vec![0.0; tokens * k],
            touched: vec![false; tokens],
            h,
            k,
        }
    }

    /// Adds row `y` (and weights `w`) to token `t`.
    fn add(&mut self, t: usize, y: &[bf16], w: Option<&[f32]>) {
        let (h, k) = (self.h, self.k);
        self.touched[t] = true;
        for (a, y) in self.x[t * h..(t + 1) * h].iter_mut().zip(y) {
            *a += y.to_f32();
        }
        for (a, &w) in self.w[t * k..(t + 1) * k].iter_mut().zip(w.unwrap_or(&[])) {
            *a += w;
        }
    }

    /// Adds each touched token's sums to `total`'s, the rows rounded to bf16 first
    /// (a node's partial sum, as it crosses the network), the weights as they are.
    fn add_rounded_into(&self, total: &mut TokenSums) {
        let (h, k) = (self.h, self.k);
        for t in (0..self.touched.len()).filter(|&t| self.touched[t]) {
            for (a, p) in total.x[t * h..(t + 1) * h]
                .iter_mut()
                .zip(&self.x[t * h..(t + 1) * h])
            {
                *a += bf16::from_f32(*p).to_f32();
            }
            for (a, p) in total.w[t * k..(t + 1) * k]
                .iter_mut()
                .zip(&self.w[t * k..(t + 1) * k])
            {
                *a += p;
            }
        }
    }
}

/// What one rank receives from low-latency dispatch (docs/architecture.md, low-latency mode).
///
/// Local expert `e`'s rows are packed at the front of its `R * M` rows: source ranks
/// ascending, inside a source by (token, slot) ascending. Rows past `count[e]` are zero / `-1`.
#[derive(Debug, Clone, PartialEq)]
pub struct LlRecv {
    /// `[E/R, R*M, H]` bf16, or the call's cast of the source token (FP8 with
    /// `[E/R, R*M, H/128]` scales, NVFP4 with `[E/R, R*M, H/64]` scale words).
    pub x: TokenData,
    /// `[E/R]`: rows received by each local expert.
    pub count: Vec<i32>,
    /// `[E/R, R*M]`: source token index of each row, `-1` past `count`.
    pub src_token: Vec<i32>,
    /// `[E/R, R*M]`: the top-k slot that produced each row, `-1` past `count`.
    pub src_slot: Vec<i32>,
    /// `[E/R, R]`: `(begin, count)` of source `r`'s block in expert `e`'s packed rows.
    pub layout_range: Vec<(i32, i32)>,
}

/// Low-latency dispatch as received by `rank`: one row per (token, slot) whose expert lives
/// on `rank` (no dedup). Inputs must be bf16 with at most `max_tokens_per_rank` (`M`) tokens a
/// rank, and no source may send one expert more than `M` rows (possible only when a token names
/// an expert twice), because each source owns `M` receive slots per expert.
pub fn ll_dispatch(
    inputs: &[RankInput],
    shape: &JobShape,
    rank: usize,
    max_tokens_per_rank: usize,
    cast: Option<Cast>,
) -> Result<LlRecv> {
    check_inputs(inputs, shape)?;
    check_rank(rank, shape)?;
    let m = max_tokens_per_rank;
    let (r_count, h, k, epr) = (
        shape.num_ranks,
        shape.hidden,
        shape.topk,
        shape.experts_per_rank(),
    );
    if cast.is_some() && h % FP8_GROUP != 0 {
        return Err(invalid!(
            "ll_dispatch: a cast needs hidden = {h} to be a multiple of {FP8_GROUP}"
        ));
    }
    let xs = ll_inputs(inputs, m)?;
    let rows_per_expert = r_count * m;
    to_i32(rows_per_expert, "num_ranks * max_tokens_per_rank")?;
    let rows = epr * rows_per_expert;
    let mut x = LlRows::new(rows, h, cast);
    let mut count = vec![0i32; epr];
    let mut src_token = vec![-1i32; rows];
    let mut src_slot = vec![-1i32; rows];
    let mut layout_range = vec![(0i32, 0i32); epr * r_count];
    for (le, count_le) in count.iter_mut().enumerate() {
        let e = (rank * epr + le) as i64;
        let mut packed = 0usize;
        for (s, input) in inputs.iter().enumerate() {
            let begin = packed;
            for t in 0..input.num_tokens {
                for slot in (0..k).filter(|&slot| input.topk_idx[t * k + slot] == e) {
                    let row = le * rows_per_expert + packed;
                    x.put(row, &xs[s][t * h..(t + 1) * h]);
                    src_token[row] = t as i32; // t < M, which fits i32 (checked above)
                    src_slot[row] = slot as i32;
                    packed += 1;
                }
            }
            let from_s = packed - begin;
            if from_s > m {
                return Err(invalid!(
                    "ll_dispatch: rank {s} sends {from_s} rows to expert {e}, more than \
                     max_tokens_per_rank = {m} (its tokens name that expert in several slots)"
                ));
            }
            layout_range[le * r_count + s] = (begin as i32, from_s as i32);
        }
        *count_le = packed as i32;
    }
    Ok(LlRecv {
        x: x.into_data(),
        count,
        src_token,
        src_slot,
        layout_range,
    })
}

/// Every rank's bf16 rows, checked: at most `m` tokens a rank, none FP8 (the
/// low-latency dispatch casts them itself).
fn ll_inputs(inputs: &[RankInput], m: usize) -> Result<Vec<&[bf16]>> {
    let mut xs = Vec::with_capacity(inputs.len());
    for (s, input) in inputs.iter().enumerate() {
        let x = input.x.as_bf16().ok_or_else(|| {
            invalid!("ll_dispatch: rank {s}'s x is fp8; low-latency dispatch takes bf16 input (it quantises itself)")
        })?;
        if input.num_tokens > m {
            return Err(invalid!(
                "ll_dispatch: rank {s} has {} tokens, more than max_tokens_per_rank = {m}",
                input.num_tokens
            ));
        }
        xs.push(x);
    }
    Ok(xs)
}

/// The rows of an LL receive as they are written: bf16, or the call's cast (FP8 with
/// a scale per 128 channels, NVFP4 with a scale byte per 16).
struct LlRows {
    h: usize,
    cast: Option<Cast>,
    bf16: Vec<bf16>,
    /// The cast's codes and scale words, `row_bytes` and `words` a row.
    codes: Vec<u8>,
    words: Vec<f32>,
}

impl LlRows {
    fn new(rows: usize, h: usize, cast: Option<Cast>) -> Self {
        let (row_bytes, words) = cast.map_or((0, 0), |c| {
            (c.format().row_bytes(h), c.format().scale_words(h))
        });
        LlRows {
            h,
            cast,
            bf16: match cast {
                Some(_) => Vec::new(),
                None => vec![bf16::ZERO; rows * h],
            },
            codes: vec![0u8; rows * row_bytes],
            words: vec![0f32; rows * words],
        }
    }

    /// Writes `src` as row `row`.
    fn put(&mut self, row: usize, src: &[bf16]) {
        let h = self.h;
        let Some(cast) = self.cast else {
            return self.bf16[row * h..(row + 1) * h].copy_from_slice(src);
        };
        let (rb, w) = (cast.format().row_bytes(h), cast.format().scale_words(h));
        let (q, s) = (
            &mut self.codes[row * rb..(row + 1) * rb],
            &mut self.words[row * w..(row + 1) * w],
        );
        match cast {
            Cast::Fp8 { round_scale } => quantize_token(src, round_scale, q, s),
            Cast::Nvfp4(n) => nvfp4_quantize_token(src, n, q, bytemuck::cast_slice_mut(s)),
        }
    }

    fn into_data(self) -> TokenData {
        match self.cast {
            None => TokenData::Bf16(self.bf16),
            Some(Cast::Fp8 { .. }) => TokenData::Fp8 {
                data: self.codes,
                scales: self.words,
            },
            Some(Cast::Nvfp4(cast)) => TokenData::Nvfp4 {
                data: self.codes,
                scales: self.words.iter().map(|w| w.to_bits()).collect(),
                cast,
            },
        }
    }
}

/// Low-latency combine at source rank `rank`.
///
/// `recvs[r]`/`ys[r]` are rank `r`'s LL receive record and its `[E/R, R*M, H]` expert outputs
/// (row for row); `inputs[rank]` supplies the token count, `topk_idx` and `topk_weights`. For
/// each token `t`: `acc = 0.0; for k ascending with topk_idx[t][k] != -1 { acc = acc + w[t][k] * y }`
/// in f32 (no fma) with `y` the row expert `topk_idx[t][k]` got from `(rank, t, k)`, then one
/// RNE round to bf16. Tokens whose slots are all `-1` get zeros. Every row of this source must
/// be accounted for exactly once.
pub fn ll_combine(
    shape: &JobShape,
    recvs: &[LlRecv],
    ys: &[Vec<bf16>],
    inputs: &[RankInput],
    rank: usize,
    max_tokens_per_rank: usize,
) -> Result<Vec<bf16>> {
    shape.validate()?;
    check_rank(rank, shape)?;
    let m = max_tokens_per_rank;
    let (r_count, h, k) = (shape.num_ranks, shape.hidden, shape.topk);
    if recvs.len() != r_count || ys.len() != r_count || inputs.len() != r_count {
        return Err(invalid!(
            "ll_combine: {} recvs, {} ys and {} inputs given; need one per rank ({r_count})",
            recvs.len(),
            ys.len(),
            inputs.len()
        ));
    }
    let input = &inputs[rank];
    let t_count = input.num_tokens;
    if t_count > m || input.topk_idx.len() != t_count * k || input.topk_weights.len() != t_count * k
    {
        return Err(invalid!(
            "ll_combine: rank {rank} has {t_count} tokens (max_tokens_per_rank = {m}), {} topk ids \
             and {} weights; need tokens <= max and tokens * topk = {t_count} * {k} of each",
            input.topk_idx.len(),
            input.topk_weights.len()
        ));
    }
    // source[t * K + slot] = (rank r, row index in r's [E/R * R*M] rows) of that slot's output.
    let mut source: Vec<Option<(usize, usize)>> = vec![None; t_count * k];
    let me = LlSource {
        rank,
        input,
        shape,
        rows_per_expert: r_count * m,
    };
    for (r, recv) in recvs.iter().enumerate() {
        me.locate(r, recv, ys[r].len(), &mut source)?;
    }

    let mut combined = vec![bf16::ZERO; t_count * h];
    let mut acc = vec![0f32; h];
    for t in 0..t_count {
        acc.fill(0.0);
        for slot in 0..k {
            let e = input.topk_idx[t * k + slot];
            if e == -1 {
                continue;
            }
            let (r, row) = source[t * k + slot].ok_or_else(|| {
                invalid!(
                    "ll_combine: no row came back for source ({rank}, token {t}, slot {slot}) from expert {e} on rank {}",
                    shape.rank_of_expert(e as usize)
                )
            })?;
            let w = input.topk_weights[t * k + slot];
            for (a, y) in acc.iter_mut().zip(&ys[r][row * h..(row + 1) * h]) {
                // acc = acc + w * y: a rounded multiply then a rounded add (Rust never fuses).
                *a += w * y.to_f32();
            }
        }
        for (c, &a) in combined[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *c = bf16::from_f32(a);
        }
    }
    Ok(combined)
}

/// The source rank of a low-latency combine, finding where each of its (token, slot)
/// outputs came back.
struct LlSource<'a> {
    rank: usize,
    input: &'a RankInput,
    shape: &'a JobShape,
    rows_per_expert: usize,
}

impl LlSource<'_> {
    /// Records in `source` the rows rank `r` (its record `recv`, `y_len` output values)
    /// returns to this source; an error for a record of the wrong size, a range past
    /// the rows, a row that names no slot of this source's routing to that expert, or a
    /// slot that came back twice.
    fn locate(
        &self,
        r: usize,
        recv: &LlRecv,
        y_len: usize,
        source: &mut [Option<(usize, usize)>],
    ) -> Result<()> {
        let (rank, rows_per_expert) = (self.rank, self.rows_per_expert);
        let (r_count, h, k, epr) = (
            self.shape.num_ranks,
            self.shape.hidden,
            self.shape.topk,
            self.shape.experts_per_rank(),
        );
        if recv.layout_range.len() != epr * r_count
            || recv.src_token.len() != epr * rows_per_expert
            || recv.src_slot.len() != epr * rows_per_expert
            || y_len != epr * rows_per_expert * h
        {
            return Err(invalid!(
                "ll_combine: rank {r}'s record has {} layout ranges, {} src tokens, {} src slots and \
                 {y_len} y values; need E/R*R = {}, E/R*R*M = {} (twice) and E/R*R*M*H = {}",
                recv.layout_range.len(),
                recv.src_token.len(),
                recv.src_slot.len(),
                epr * r_count,
                epr * rows_per_expert,
                epr * rows_per_expert * h
            ));
        }
        for le in 0..epr {
            let e = (r * epr + le) as i64;
            let (begin, cnt) = recv.layout_range[le * r_count + rank];
            let range = usize::try_from(begin)
                .ok()
                .zip(usize::try_from(cnt).ok())
                .filter(|&(b, c)| b + c <= rows_per_expert)
                .ok_or_else(|| {
                    invalid!(
                        "ll_combine: rank {r} expert {e} gives source {rank} the range (begin {begin}, count {cnt}); \
                         need 0 <= begin, 0 <= count, begin + count <= R*M = {rows_per_expert}"
                    )
                })?;
            for i in range.0..range.0 + range.1 {
                let row = le * rows_per_expert + i;
                let (t, slot) = (recv.src_token[row], recv.src_slot[row]);
                let idx = usize::try_from(t)
                    .ok()
                    .zip(usize::try_from(slot).ok())
                    .filter(|&(t, s)| t < self.input.num_tokens && s < k)
                    .map(|(t, s)| t * k + s)
                    .filter(|&ts| self.input.topk_idx[ts] == e)
                    .ok_or_else(|| {
                        invalid!(
                            "ll_combine: rank {r} expert {e} row {i} claims source ({rank}, token {t}, slot {slot}), \
                             which does not name expert {e}"
                        )
                    })?;
                if source[idx].replace((r, row)).is_some() {
                    return Err(invalid!(
                        "ll_combine: source ({rank}, token {t}, slot {slot}) came back twice"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// DeepEP's similarity distance `1 - 2 * sum(a*b) / sum(a*a + b*b)` in f64: 0 for identical
/// inputs (also when both are all zero), up to 2 for `a = -b`. Different lengths give NaN, so
/// any `calc_diff(..) < threshold` check fails. (DeepEP's Python adds 1 to both first; this is
/// the plain form of docs/architecture.md, "Numerics".)
pub fn calc_diff(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let (mut dot, mut norm) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        dot += x * y;
        norm += x * x + y * y;
    }
    if norm == 0.0 {
        0.0
    } else {
        1.0 - 2.0 * dot / norm
    }
}

/// The bf16 row an *identity expert* returns for a received copy of `x` row `t`: the row
/// itself, or for FP8 its dequantised value rounded once to bf16.
pub fn identity_row(x: &TokenData, t: usize, hidden: usize, out: &mut [f32]) {
    match x {
        TokenData::Bf16(v) => {
            for (o, y) in out.iter_mut().zip(&v[t * hidden..(t + 1) * hidden]) {
                *o = y.to_f32();
            }
        }
        TokenData::Fp8 { data, scales } => {
            let g = hidden / FP8_GROUP;
            uep_ep::quant::dequantize_token(
                &data[t * hidden..(t + 1) * hidden],
                &scales[t * g..(t + 1) * g],
                out,
            );
            for o in out.iter_mut() {
                *o = bf16::from_f32(*o).to_f32();
            }
        }
        TokenData::Nvfp4 { data, scales, cast } => {
            let (rb, w) = (hidden / 2, hidden / 64);
            let sf: &[u8] = bytemuck::cast_slice(&scales[t * w..(t + 1) * w]);
            uep_ep::quant::nvfp4_dequantize_token(&data[t * rb..(t + 1) * rb], sf, *cast, out);
            for o in out.iter_mut() {
                *o = bf16::from_f32(*o).to_f32();
            }
        }
    }
}

/// [`normal_combine`] when every expert returns the rows it received unchanged (FP8 rows
/// dequantised to bf16), computed from `rank`'s own inputs: the same sums in the same
/// order, without materialising every rank's receive buffer (the benchmark's check at
/// full scale). Equal to `normal_combine` with `ys = recv_x`; a test keeps it so.
pub fn normal_combine_identity(
    inputs: &[RankInput],
    shape: &JobShape,
    rank: usize,
) -> Result<(Vec<bf16>, Option<Vec<f32>>)> {
    let layouts = check_inputs(inputs, shape)?;
    check_rank(rank, shape)?;
    let (r_count, h, k, epr) = (
        shape.num_ranks,
        shape.hidden,
        shape.topk,
        shape.experts_per_rank(),
    );
    let input = &inputs[rank];
    let layout = &layouts[rank];
    let t_count = input.num_tokens;
    let mut out = vec![bf16::ZERO; t_count * h];
    let mut weights = vec![0f32; t_count * k];
    let l = shape.ranks_per_node;
    let mut row = vec![0f32; h];
    let mut acc = vec![0f32; h];
    let mut part = vec![0f32; h];
    let mut part_w = vec![0f32; k];
    for t in 0..t_count {
        identity_row(&input.x, t, h, &mut row);
        acc.fill(0.0);
        for node in 0..r_count / l {
            let ranks = (node * l..(node + 1) * l).filter(|&r| layout.token_in_rank(t, r));
            let remote = node != rank / l;
            part.fill(0.0);
            part_w.fill(0.0);
            let mut hit = false;
            for r in ranks {
                hit = true;
                let (sum, sum_w) = if remote {
                    (&mut part, &mut part_w[..])
                } else {
                    (&mut acc, &mut weights[t * k..(t + 1) * k])
                };
                for (a, y) in sum.iter_mut().zip(&row) {
                    *a += y;
                }
                let slots = input.topk_idx[t * k..(t + 1) * k]
                    .iter()
                    .zip(&input.topk_weights[t * k..(t + 1) * k]);
                for (a, (&e, &w)) in sum_w.iter_mut().zip(slots) {
                    // A slot whose expert lives elsewhere adds 0.0, as the rank's row does.
                    *a += if e >= 0 && e as usize / epr == r {
                        w
                    } else {
                        0.0
                    };
                }
            }
            if remote && hit {
                for (a, p) in acc.iter_mut().zip(&part) {
                    *a += bf16::from_f32(*p).to_f32();
                }
                for (a, p) in weights[t * k..(t + 1) * k].iter_mut().zip(&part_w) {
                    *a += p;
                }
            }
        }
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    Ok((out, Some(weights)))
}

/// [`ll_combine`] when every expert returns the rows it received unchanged (FP8 rows
/// dequantised to bf16), from `rank`'s own inputs: `sum_k w_k * y_k` in slot order.
/// Equal to `ll_combine` with `ys = recv_x`; a test keeps it so.
pub fn ll_combine_identity(
    inputs: &[RankInput],
    shape: &JobShape,
    rank: usize,
    cast: Option<Cast>,
) -> Result<Vec<bf16>> {
    check_inputs(inputs, shape)?;
    check_rank(rank, shape)?;
    let (h, k) = (shape.hidden, shape.topk);
    let input = &inputs[rank];
    let Some(x) = input.x.as_bf16() else {
        return Err(invalid!("reference: low-latency inputs must be bf16"));
    };
    let sent = match cast {
        None => input.x.clone(),
        Some(cast) => {
            let mut rows = LlRows::new(input.num_tokens, h, Some(cast));
            for t in 0..input.num_tokens {
                rows.put(t, &x[t * h..(t + 1) * h]);
            }
            rows.into_data()
        }
    };
    let mut out = vec![bf16::ZERO; input.num_tokens * h];
    let mut row = vec![0f32; h];
    let mut acc = vec![0f32; h];
    for t in 0..input.num_tokens {
        identity_row(&sent, t, h, &mut row);
        acc.fill(0.0);
        for s in 0..k {
            if input.topk_idx[t * k + s] < 0 {
                continue;
            }
            let w = input.topk_weights[t * k + s];
            for (a, y) in acc.iter_mut().zip(&row) {
                *a += w * y;
            }
        }
        for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
            *o = bf16::from_f32(*a);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{generate_all, Routing, WorkloadSpec};
    use uep_ep::quant::quantize;

    const H: usize = 128;

    fn shape3() -> JobShape {
        JobShape {
            num_ranks: 3,
            ranks_per_node: 1,
            hidden: H,
            topk: 2,
            num_experts: 6,
        }
    }

    /// Token `t` of rank `s`: channel `c` holds `s*100 + t*10 + c/64` (exact in bf16).
    fn token_row(s: usize, t: usize) -> Vec<bf16> {
        (0..H)
            .map(|c| bf16::from_f32((s * 100 + t * 10 + c / 64) as f32 + 1.0))
            .collect()
    }

    fn input(s: usize, topk_idx: Vec<i64>) -> RankInput {
        let t = topk_idx.len() / 2;
        let x = (0..t).flat_map(|t| token_row(s, t)).collect();
        let topk_weights = topk_idx
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                if e == -1 {
                    0.0
                } else {
                    0.25 + i as f32 * 0.125 + s as f32
                }
            })
            .collect();
        RankInput {
            num_tokens: t,
            x: TokenData::Bf16(x),
            topk_idx,
            topk_weights,
        }
    }

    /// 3 ranks, 2 experts each, K = 2. Rank 0: t0 -> experts 0, 3 (ranks 0, 1); t1 -> nowhere;
    /// t2 -> experts 5, 4 (rank 2 twice). Rank 1: t0 -> expert 1 twice (rank 0); t1 -> 2, -1
    /// (rank 1). Rank 2: no tokens.
    fn hand_inputs() -> Vec<RankInput> {
        vec![
            input(0, vec![0, 3, -1, -1, 5, 4]),
            input(1, vec![1, 1, 2, -1]),
            input(2, vec![]),
        ]
    }

    fn bf16_rows(d: &TokenData) -> &[bf16] {
        d.as_bf16().expect("bf16 rows")
    }

    #[test]
    fn normal_dispatch_hand_worked() {
        let (inputs, shape) = (hand_inputs(), shape3());
        let r0 = normal_dispatch(&inputs, &shape, 0, 1, true).unwrap();
        assert_eq!(r0.src_rank, vec![0, 1]);
        assert_eq!(r0.src_token, vec![0, 0]);
        let want_x: Vec<bf16> = [token_row(0, 0), token_row(1, 0)].concat();
        assert_eq!(bf16_rows(&r0.x), &want_x[..]);
        assert_eq!(r0.topk_idx, Some(vec![0, -1, 1, 1]));
        assert_eq!(r0.topk_weights, Some(vec![0.25, 0.0, 1.25, 1.375]));
        assert_eq!(r0.num_recv_tokens_per_expert, vec![1, 2]);
        assert_eq!(r0.rank_prefix_matrix, vec![1, 1, 1, 2, 2, 1, 2, 2, 1]);

        let r1 = normal_dispatch(&inputs, &shape, 1, 4, true).unwrap();
        assert_eq!(
            (r1.src_rank.clone(), r1.src_token.clone()),
            (vec![0, 1], vec![0, 1])
        );
        assert_eq!(r1.topk_idx, Some(vec![-1, 1, 0, -1]));
        assert_eq!(r1.topk_weights, Some(vec![0.0, 0.375, 1.5, 0.0]));
        assert_eq!(
            r1.num_recv_tokens_per_expert,
            vec![4, 4],
            "1 and 1 aligned up to 4"
        );
        assert_eq!(r1.rank_prefix_matrix, r0.rank_prefix_matrix);

        let r2 = normal_dispatch(&inputs, &shape, 2, 1, false).unwrap();
        assert_eq!(
            (r2.src_rank.clone(), r2.src_token.clone()),
            (vec![0], vec![2])
        );
        assert_eq!(bf16_rows(&r2.x), &token_row(0, 2)[..]);
        assert_eq!((r2.topk_idx, r2.topk_weights), (None, None));
        assert_eq!(r2.num_recv_tokens_per_expert, vec![1, 1]);
    }

    /// Combine with y = recv_x: every token comes back as bf16(n_ranks(t) * x[t]).
    fn check_normal_round_trip(inputs: &[RankInput], shape: &JobShape) {
        let recvs: Vec<NormalRecv> = (0..shape.num_ranks)
            .map(|r| normal_dispatch(inputs, shape, r, 1, true).unwrap())
            .collect();
        let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| bf16_rows(&r.x).to_vec()).collect();
        let ws: Vec<Vec<f32>> = recvs
            .iter()
            .map(|r| r.topk_weights.clone().unwrap())
            .collect();
        for (s, input) in inputs.iter().enumerate() {
            let layout = get_dispatch_layout(
                &input.topk_idx,
                shape.topk,
                shape.num_experts,
                shape.num_ranks,
                1,
            )
            .unwrap();
            let (combined, cw) =
                normal_combine(shape, &recvs, &ys, Some(&ws), &[], s, input.num_tokens).unwrap();
            let x = bf16_rows(&input.x);
            let h = shape.hidden;
            for t in 0..input.num_tokens {
                let n = (0..shape.num_ranks)
                    .filter(|&r| layout.token_in_rank(t, r))
                    .count() as f32;
                for c in 0..h {
                    assert_eq!(
                        combined[t * h + c],
                        bf16::from_f32(n * x[t * h + c].to_f32()),
                        "s{s} t{t} c{c}"
                    );
                }
            }
            // Each slot's weight comes back from exactly the rank holding its expert.
            assert_eq!(
                cw.unwrap(),
                input.topk_weights,
                "combined weights of rank {s}"
            );
        }
    }

    #[test]
    fn normal_round_trip_hand_worked() {
        check_normal_round_trip(&hand_inputs(), &shape3());
        let (inputs, shape) = (hand_inputs(), shape3());
        let recvs: Vec<NormalRecv> = (0..3)
            .map(|r| normal_dispatch(&inputs, &shape, r, 1, true).unwrap())
            .collect();
        let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| bf16_rows(&r.x).to_vec()).collect();
        let (c, w) = normal_combine(&shape, &recvs, &ys, None, &[], 0, 3).unwrap();
        assert!(w.is_none());
        // t0 went to ranks 0 and 1, t1 nowhere, t2 to rank 2 once.
        let two: Vec<bf16> = token_row(0, 0)
            .iter()
            .map(|v| bf16::from_f32(2.0 * v.to_f32()))
            .collect();
        assert_eq!(&c[..H], &two[..]);
        assert!(c[H..2 * H].iter().all(|v| v.to_bits() == 0));
        assert_eq!(&c[2 * H..], &token_row(0, 2)[..]);
        // The empty rank combines to nothing.
        assert!(normal_combine(&shape, &recvs, &ys, None, &[], 2, 0)
            .unwrap()
            .0
            .is_empty());
    }

    /// On two nodes, another node's rows are summed there and cross the network as one
    /// bf16 row: rounding that partial changes the result, and the reference must say so.
    #[test]
    fn normal_combine_rounds_each_remote_node_once() {
        let h = 8;
        let tiny = bf16::from_f32(1.0 / 256.0);
        let inputs: Vec<RankInput> = (0..4)
            .map(|r| {
                let t = usize::from(r == 0);
                RankInput {
                    num_tokens: t,
                    x: TokenData::Bf16(vec![bf16::ONE; t * h]),
                    topk_idx: [0, 2, 3].repeat(t),
                    topk_weights: [0.5, 0.25, 0.125].repeat(t),
                }
            })
            .collect();
        let combine = |ranks_per_node| {
            let shape = JobShape {
                num_ranks: 4,
                ranks_per_node,
                hidden: h,
                topk: 3,
                num_experts: 4,
            };
            let recvs: Vec<NormalRecv> = (0..4)
                .map(|r| normal_dispatch(&inputs, &shape, r, 1, true).unwrap())
                .collect();
            // Rank 0 returns 2^-8, rank 2 returns 1, rank 3 returns 2^-8.
            let ys: Vec<Vec<bf16>> = recvs
                .iter()
                .enumerate()
                .map(|(r, recv)| vec![if r == 2 { bf16::ONE } else { tiny }; recv.num_rows() * h])
                .collect();
            normal_combine(&shape, &recvs, &ys, None, &[], 0, 1)
                .unwrap()
                .0
        };
        // One node: bf16(2^-8 + 1 + 2^-8) = 1 + 2^-7, exact in bf16.
        assert_eq!(combine(4), vec![bf16::from_f32(1.0 + 1.0 / 128.0); h]);
        // Two nodes: node 1 sends bf16(1 + 2^-8) = 1 (a tie, to even), then 2^-8 + 1 ties to 1.
        assert_eq!(combine(2), vec![bf16::ONE; h]);
    }

    #[test]
    fn normal_round_trip_generated() {
        for routing in Routing::ALL {
            let spec = WorkloadSpec {
                shape: JobShape {
                    num_ranks: 4,
                    ranks_per_node: 2,
                    hidden: H,
                    topk: 3,
                    num_experts: 8,
                },
                tokens_per_rank: 24,
                routing,
                drop_prob: 0.2,
                fp8_input: false,
                seed: 5,
            };
            check_normal_round_trip(&generate_all(&spec).unwrap(), &spec.shape);
        }
    }

    #[test]
    fn normal_dispatch_carries_fp8_bit_for_bit() {
        let spec = WorkloadSpec {
            shape: JobShape {
                num_ranks: 2,
                ranks_per_node: 1,
                hidden: 256,
                topk: 2,
                num_experts: 4,
            },
            tokens_per_rank: 16,
            routing: Routing::Uniform,
            drop_prob: 0.1,
            fp8_input: true,
            seed: 9,
        };
        let inputs = generate_all(&spec).unwrap();
        for rank in 0..2 {
            let recv = normal_dispatch(&inputs, &spec.shape, rank, 1, false).unwrap();
            let TokenData::Fp8 { data, scales } = &recv.x else {
                panic!("fp8 expected")
            };
            assert_eq!(data.len(), recv.num_rows() * 256);
            for (i, (&s, &t)) in recv.src_rank.iter().zip(&recv.src_token).enumerate() {
                let TokenData::Fp8 {
                    data: sd,
                    scales: ss,
                } = &inputs[s as usize].x
                else {
                    unreachable!()
                };
                let t = t as usize;
                assert_eq!(&data[i * 256..(i + 1) * 256], &sd[t * 256..(t + 1) * 256]);
                assert_eq!(&scales[i * 2..(i + 1) * 2], &ss[t * 2..(t + 1) * 2]);
            }
        }
    }

    #[test]
    fn ll_dispatch_hand_worked() {
        let (inputs, shape) = (hand_inputs(), shape3());
        let m = 3;
        let r0 = ll_dispatch(&inputs, &shape, 0, m, None).unwrap();
        assert_eq!(r0.count, vec![1, 2]);
        // Expert 0: (s0, t0, k0). Expert 1: (s1, t0, k0), (s1, t0, k1).
        // Each expert owns R * M = 9 rows.
        let padded = |v: &[i32]| {
            let mut p = v.to_vec();
            p.resize(9, -1);
            p
        };
        assert_eq!(r0.src_token, [padded(&[0]), padded(&[0, 0])].concat());
        assert_eq!(r0.src_slot, [padded(&[0]), padded(&[0, 1])].concat());
        assert_eq!(
            r0.layout_range,
            vec![(0, 1), (1, 0), (1, 0), (0, 0), (0, 2), (2, 0)]
        );
        let x = bf16_rows(&r0.x);
        assert_eq!(x.len(), 2 * 9 * H);
        assert_eq!(&x[..H], &token_row(0, 0)[..]);
        assert_eq!(&x[9 * H..10 * H], &token_row(1, 0)[..]);
        assert_eq!(&x[10 * H..11 * H], &token_row(1, 0)[..]);
        assert!(x[H..9 * H]
            .iter()
            .chain(&x[11 * H..])
            .all(|v| v.to_bits() == 0));

        let r2 = ll_dispatch(&inputs, &shape, 2, m, None).unwrap();
        // Expert 4 <- (s0, t2, k1); expert 5 <- (s0, t2, k0).
        assert_eq!(r2.count, vec![1, 1]);
        assert_eq!((r2.src_token[0], r2.src_slot[0]), (2, 1));
        assert_eq!((r2.src_token[9], r2.src_slot[9]), (2, 0));

        // FP8: each row is quantize_token of the source token with the call's round_scale.
        for round_scale in [false, true] {
            let f = ll_dispatch(&inputs, &shape, 0, m, Cast::fp8_if(true, round_scale)).unwrap();
            let TokenData::Fp8 { data, scales } = &f.x else {
                panic!("fp8 expected")
            };
            assert_eq!((data.len(), scales.len()), (2 * 9 * H, 2 * 9));
            let (q, s) = quantize(&token_row(1, 0), H, round_scale).unwrap();
            assert_eq!(&data[10 * H..11 * H], &q[..]);
            assert_eq!(scales[10], s[0]);
            assert!(
                data[11 * H..].iter().all(|&b| b == 0) && scales[11..].iter().all(|&s| s == 0.0)
            );
        }
    }

    /// LL combine with y = recv_x gives bf16(sum_k w_k * x_t) in slot order.
    fn check_ll_round_trip(inputs: &[RankInput], shape: &JobShape, m: usize) {
        let recvs: Vec<LlRecv> = (0..shape.num_ranks)
            .map(|r| ll_dispatch(inputs, shape, r, m, None).unwrap())
            .collect();
        let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| bf16_rows(&r.x).to_vec()).collect();
        let (h, k) = (shape.hidden, shape.topk);
        for (s, input) in inputs.iter().enumerate() {
            let combined = ll_combine(shape, &recvs, &ys, inputs, s, m).unwrap();
            let x = bf16_rows(&input.x);
            for t in 0..input.num_tokens {
                for c in 0..h {
                    let mut acc = 0f32;
                    for slot in 0..k {
                        if input.topk_idx[t * k + slot] != -1 {
                            acc += input.topk_weights[t * k + slot] * x[t * h + c].to_f32();
                        }
                    }
                    assert_eq!(combined[t * h + c], bf16::from_f32(acc), "s{s} t{t} c{c}");
                }
            }
        }
    }

    #[test]
    fn ll_round_trip_hand_worked() {
        let (inputs, shape) = (hand_inputs(), shape3());
        check_ll_round_trip(&inputs, &shape, 3);
        let recvs: Vec<LlRecv> = (0..3)
            .map(|r| ll_dispatch(&inputs, &shape, r, 3, None).unwrap())
            .collect();
        let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| bf16_rows(&r.x).to_vec()).collect();
        let c = ll_combine(&shape, &recvs, &ys, &inputs, 1, 3).unwrap();
        // Rank 1 t0 names expert 1 twice with weights 1.25 and 1.375: 2.625 * x.
        let want: Vec<bf16> = token_row(1, 0)
            .iter()
            .map(|v| bf16::from_f32(2.625 * v.to_f32()))
            .collect();
        assert_eq!(&c[..H], &want[..]);
        // t1: 1.5 * x.
        let want: Vec<bf16> = token_row(1, 1)
            .iter()
            .map(|v| bf16::from_f32(1.5 * v.to_f32()))
            .collect();
        assert_eq!(&c[H..], &want[..]);
        // Rank 0's t1 went nowhere: zeros.
        let c0 = ll_combine(&shape, &recvs, &ys, &inputs, 0, 3).unwrap();
        assert!(c0[H..2 * H].iter().all(|v| v.to_bits() == 0));
    }

    #[test]
    fn ll_round_trip_generated() {
        for routing in Routing::ALL {
            let spec = WorkloadSpec {
                shape: JobShape {
                    num_ranks: 3,
                    ranks_per_node: 1,
                    hidden: H,
                    topk: 4,
                    num_experts: 6,
                },
                tokens_per_rank: 10,
                routing,
                drop_prob: 0.25,
                fp8_input: false,
                seed: 11,
            };
            // M = K * T leaves room for the repeats SameRank produces (E/R = 2 < K).
            check_ll_round_trip(&generate_all(&spec).unwrap(), &spec.shape, 40);
        }
    }

    #[test]
    fn ll_combine_detects_missing_or_misrouted_rows() {
        let (inputs, shape) = (hand_inputs(), shape3());
        let mut recvs: Vec<LlRecv> = (0..3)
            .map(|r| ll_dispatch(&inputs, &shape, r, 3, None).unwrap())
            .collect();
        let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| bf16_rows(&r.x).to_vec()).collect();
        recvs[0].layout_range[0] = (0, 0); // rank 0 expert 0 "loses" (s0, t0, k0)
        let e = ll_combine(&shape, &recvs, &ys, &inputs, 0, 3)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no row came back") && e.contains("token 0, slot 0"),
            "{e}"
        );
        recvs[0].layout_range[0] = (0, 1);
        recvs[0].src_slot[0] = 1; // claims slot 1, which names expert 3
        let e = ll_combine(&shape, &recvs, &ys, &inputs, 0, 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("does not name expert 0"), "{e}");
    }

    #[test]
    fn argument_errors_name_the_problem() {
        let (inputs, shape) = (hand_inputs(), shape3());
        let err = |r: Result<LlRecv>| r.unwrap_err().to_string();
        let e = err(ll_dispatch(&inputs, &shape, 0, 2, None));
        assert!(
            e.contains("rank 0 has 3 tokens") && e.contains("max_tokens_per_rank = 2"),
            "{e}"
        );
        let mut fp8 = inputs.clone();
        for i in &mut fp8 {
            let (data, scales) = quantize(bf16_rows(&i.x), H, false).unwrap();
            i.x = TokenData::Fp8 { data, scales };
        }
        assert!(err(ll_dispatch(&fp8, &shape, 0, 3, None)).contains("takes bf16 input"));
        assert!(err(ll_dispatch(&inputs, &shape, 3, 3, None)).contains("rank 3 out of range"));
        // One token naming expert 1 twice: 2 rows from rank 1 > M = 1.
        let dup = vec![input(0, vec![]), input(1, vec![1, 1]), input(2, vec![])];
        let e = err(ll_dispatch(&dup, &shape, 0, 1, None));
        assert!(e.contains("rank 1 sends 2 rows to expert 1"), "{e}");

        let mut mixed = inputs.clone();
        mixed[1] = fp8[1].clone();
        let e = normal_dispatch(&mixed, &shape, 0, 1, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("one format"), "{e}");
        let mut bad = inputs.clone();
        bad[0].topk_idx[1] = 6;
        let e = normal_dispatch(&bad, &shape, 0, 1, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank 0") && e.contains("topk_idx[0][1] = 6"),
            "{e}"
        );
        let e = normal_dispatch(&inputs[..2], &shape, 0, 1, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 rank inputs"), "{e}");
        let e = normal_dispatch(&inputs, &shape, 0, 0, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expert_alignment"), "{e}");
        let mut short = inputs.clone();
        short[1].num_tokens = 3;
        let e = normal_dispatch(&short, &shape, 0, 1, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 declares 3 tokens"), "{e}");
    }

    #[test]
    fn calc_diff_values() {
        let a = [1.0f32, -2.0, 3.0];
        assert_eq!(calc_diff(&a, &a), 0.0);
        assert_eq!(calc_diff(&[0.0; 4], &[0.0; 4]), 0.0);
        assert_eq!(calc_diff(&a, &[-1.0, 2.0, -3.0]), 2.0);
        assert_eq!(calc_diff(&[1.0, 0.0], &[0.0, 1.0]), 1.0);
        assert!(calc_diff(&a, &a[..2]).is_nan());
        let b = [1.0f32, -2.0, 3.001];
        let d = calc_diff(&a, &b);
        assert!(d > 0.0 && d < 1e-7, "{d}");
    }

    /// The benchmark's identity-expert shortcuts equal the general model with `ys = recv_x`.
    #[test]
    fn identity_combines_equal_the_general_model() {
        // One node, two nodes of three (partials that round), six nodes of one.
        for (routing, ranks_per_node) in Routing::ALL
            .into_iter()
            .flat_map(|r| [(r, 6), (r, 3), (r, 1)])
        {
            for fp8 in [false, true] {
                let shape = JobShape {
                    num_ranks: 6,
                    ranks_per_node,
                    hidden: 256,
                    topk: 4,
                    num_experts: 12,
                };
                let spec = WorkloadSpec {
                    shape,
                    tokens_per_rank: 9,
                    routing,
                    drop_prob: 0.2,
                    fp8_input: false,
                    seed: 7,
                };
                let bf16_inputs = generate_all(&spec).unwrap();
                let sent: Vec<RankInput> = bf16_inputs
                    .iter()
                    .map(|i| {
                        if !fp8 {
                            return i.clone();
                        }
                        let (data, scales) = quantize(i.x.as_bf16().unwrap(), 256, false).unwrap();
                        RankInput {
                            x: TokenData::Fp8 { data, scales },
                            ..i.clone()
                        }
                    })
                    .collect();
                let as_y = |x: &TokenData, rows: usize| -> Vec<bf16> {
                    let mut row = vec![0f32; 256];
                    (0..rows)
                        .flat_map(|t| {
                            identity_row(x, t, 256, &mut row);
                            row.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()
                        })
                        .collect()
                };
                let recvs: Vec<NormalRecv> = (0..6)
                    .map(|r| normal_dispatch(&sent, &shape, r, 1, true).unwrap())
                    .collect();
                let ys: Vec<Vec<bf16>> = recvs.iter().map(|r| as_y(&r.x, r.num_rows())).collect();
                let ws: Vec<Vec<f32>> = recvs
                    .iter()
                    .map(|r| r.topk_weights.clone().unwrap())
                    .collect();
                let m = 9;
                let ll: Vec<LlRecv> = (0..6)
                    .map(|r| {
                        ll_dispatch(&bf16_inputs, &shape, r, m, Cast::fp8_if(fp8, fp8)).unwrap()
                    })
                    .collect();
                let lly: Vec<Vec<bf16>> =
                    ll.iter().map(|r| as_y(&r.x, r.src_token.len())).collect();
                for rank in 0..6 {
                    let general = normal_combine(
                        &shape,
                        &recvs,
                        &ys,
                        Some(&ws),
                        &[],
                        rank,
                        sent[rank].num_tokens,
                    )
                    .unwrap();
                    assert_eq!(
                        general,
                        normal_combine_identity(&sent, &shape, rank).unwrap(),
                        "{routing} fp8={fp8} {ranks_per_node} ranks a node, rank {rank}"
                    );
                    let general = ll_combine(&shape, &ll, &lly, &bf16_inputs, rank, m).unwrap();
                    let fast =
                        ll_combine_identity(&bf16_inputs, &shape, rank, Cast::fp8_if(fp8, fp8))
                            .unwrap();
                    assert_eq!(
                        general.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
                        fast.iter().map(|b| b.to_bits()).collect::<Vec<_>>(),
                        "{routing} fp8={fp8} rank {rank}"
                    );
                }
            }
        }
    }
}
