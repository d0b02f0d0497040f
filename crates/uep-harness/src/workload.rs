//! Deterministic inputs for benchmarks and tests.
//!
//! Every rank can regenerate every rank's input from `(seed, rank)` alone, so a test or a
//! benchmark can check its own output against [`crate::reference`] without exchanging data.
//! The stream of a rank does not depend on the other ranks' token counts.

use std::fmt;
use std::str::FromStr;

use half::bf16;
use rand::seq::index::sample;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use uep_ep::invalid;
use uep_ep::quant::{quantize, Nvfp4, FP8_GROUP};
use uep_ep::{EpError, Result};

/// Token activations of one rank, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum TokenData {
    /// `[T, H]` bf16.
    Bf16(Vec<bf16>),
    /// FP8 e4m3fn `[T, H]` bytes and their `[T, H/128]` f32 scales (see [`uep_ep::quant`]).
    Fp8 {
        /// `[T, H]` e4m3fn codes.
        data: Vec<u8>,
        /// `[T, H/128]` scales.
        scales: Vec<f32>,
    },
    /// NVFP4 `[T, H/2]` bytes of e2m1 pairs and `[T, H/64]` words of four block scales
    /// each, cast with `cast` (see [`uep_ep::quant::Nvfp4`]): what a low-latency
    /// dispatch receives when it casts to NVFP4.
    Nvfp4 {
        /// `[T, H/2]` e2m1 pairs, the even channel in the low nibble.
        data: Vec<u8>,
        /// `[T, H/64]` block scale words.
        scales: Vec<u32>,
        /// The global scale and the scales' format.
        cast: Nvfp4,
    },
}

impl TokenData {
    /// Whether the rows are FP8.
    pub fn is_fp8(&self) -> bool {
        matches!(self, TokenData::Fp8 { .. })
    }

    /// Rows held, given the hidden size; errors if the lengths are not whole rows (or the FP8
    /// scales do not match the data).
    pub fn num_rows(&self, hidden: usize) -> Result<usize> {
        if hidden == 0 {
            return Err(invalid!("token data: hidden must be >= 1"));
        }
        let (len, scales) = match self {
            TokenData::Bf16(x) => (x.len(), None),
            TokenData::Fp8 { data, scales } => (data.len(), Some(scales.len())),
            TokenData::Nvfp4 { data, scales, .. } => {
                let rows = data.len() / (hidden / 2).max(1);
                return match data.len() == rows * (hidden / 2) && scales.len() * 64 == rows * hidden
                {
                    true => Ok(rows),
                    false => Err(invalid!(
                        "token data: NVFP4 rows of hidden {hidden}: {} bytes and {} scale words",
                        data.len(),
                        scales.len()
                    )),
                };
            }
        };
        if len % hidden != 0 {
            return Err(invalid!(
                "token data: {len} values is not a whole number of rows of hidden = {hidden}"
            ));
        }
        let rows = len / hidden;
        if let Some(n) = scales {
            if hidden % FP8_GROUP != 0 || n != rows * (hidden / FP8_GROUP) {
                return Err(invalid!(
                    "token data: fp8 rows need hidden a multiple of {FP8_GROUP} and {} scales \
                     ({rows} rows x hidden/{FP8_GROUP}); got hidden = {hidden}, {n} scales",
                    rows * (hidden / FP8_GROUP)
                ));
            }
        }
        Ok(rows)
    }

    /// The bf16 rows, or `None` for FP8 and NVFP4 data.
    pub fn as_bf16(&self) -> Option<&[bf16]> {
        match self {
            TokenData::Bf16(x) => Some(x),
            TokenData::Fp8 { .. } | TokenData::Nvfp4 { .. } => None,
        }
    }
}

/// One rank's router output and activations: what that rank hands to dispatch.
#[derive(Debug, Clone, PartialEq)]
pub struct RankInput {
    /// Tokens `T` of this rank (may be 0).
    pub num_tokens: usize,
    /// Activations `[T, H]`.
    pub x: TokenData,
    /// `[T, K]` global expert ids, `-1` = no expert in that slot.
    pub topk_idx: Vec<i64>,
    /// `[T, K]` gate weights; `0.0` where the slot is `-1`.
    pub topk_weights: Vec<f32>,
}

/// The EP geometry shared by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobShape {
    /// Ranks `R`.
    pub num_ranks: usize,
    /// Ranks on one node (shared-memory domain); divides `R`.
    pub ranks_per_node: usize,
    /// Channels `H` of a token.
    pub hidden: usize,
    /// Slots `K` of the router output.
    pub topk: usize,
    /// Experts `E` over all ranks; a multiple of `R`.
    pub num_experts: usize,
}

impl JobShape {
    /// Local experts of each rank, `E / R` (0 if `R` is 0; call [`JobShape::validate`] first).
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts.checked_div(self.num_ranks).unwrap_or(0)
    }

    /// Rank hosting global expert `e` (`e / (E/R)`; meaningful for a validated shape).
    pub fn rank_of_expert(&self, e: usize) -> usize {
        e.checked_div(self.experts_per_rank()).unwrap_or(0)
    }

    /// Check that every count is positive and `E % R == 0`, `R % ranks_per_node == 0`.
    pub fn validate(&self) -> Result<()> {
        let JobShape {
            num_ranks,
            ranks_per_node,
            hidden,
            topk,
            num_experts,
        } = *self;
        if ranks_per_node == 0 || num_ranks == 0 || num_ranks % ranks_per_node != 0 {
            return Err(invalid!(
                "shape: num_ranks = {num_ranks} must be a positive multiple of ranks_per_node = {ranks_per_node} (>= 1)"
            ));
        }
        if num_experts == 0 || num_experts % num_ranks != 0 {
            return Err(invalid!(
                "shape: num_experts = {num_experts} must be a positive multiple of num_ranks = {num_ranks}"
            ));
        }
        if hidden == 0 || topk == 0 {
            return Err(invalid!(
                "shape: hidden = {hidden} and topk = {topk} must both be >= 1"
            ));
        }
        Ok(())
    }
}

/// How a generated token picks its experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Routing {
    /// `K` distinct experts, uniformly (needs `K <= E`).
    Uniform,
    /// All `K` experts on one random rank: distinct when `E/R >= K`, otherwise drawn with
    /// repeats (a token then names the same expert several times).
    SameRank,
    /// Slot 0 is expert 0; the other slots are distinct experts `!= 0`, uniformly (needs `K <= E`).
    OneExpert,
    /// Rank `R-1` has no tokens (sends nothing) and, when `R >= 2`, no token names an expert of
    /// rank 0 (rank 0 receives nothing); tokens pick `K` experts uniformly among the rest,
    /// distinct when there are at least `K`, otherwise with repeats. With `R == 1` the only
    /// rank has no tokens.
    EmptyRanks,
    /// Every rank has `tokens_per_rank` tokens; each token picks one of the per-token rules
    /// above at random (Uniform, SameRank, OneExpert, or, with `R >= 2`, EmptyRanks' "no
    /// expert of rank 0"). Needs `K <= E`.
    Mixed,
}

impl Routing {
    /// Every routing, in declaration order.
    pub const ALL: [Routing; 5] = [
        Routing::Uniform,
        Routing::SameRank,
        Routing::OneExpert,
        Routing::EmptyRanks,
        Routing::Mixed,
    ];

    /// The name used by [`FromStr`] and [`fmt::Display`].
    pub fn name(self) -> &'static str {
        match self {
            Routing::Uniform => "uniform",
            Routing::SameRank => "same-rank",
            Routing::OneExpert => "one-expert",
            Routing::EmptyRanks => "empty-ranks",
            Routing::Mixed => "mixed",
        }
    }
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Routing {
    type Err = EpError;

    fn from_str(s: &str) -> Result<Self> {
        Routing::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Routing::ALL.iter().map(|r| r.name()).collect();
                invalid!("unknown routing {s:?}; allowed: {}", names.join(", "))
            })
    }
}

/// Everything that determines the generated inputs of all ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    /// The EP geometry.
    pub shape: JobShape,
    /// Tokens of each rank (except where the routing empties a rank).
    pub tokens_per_rank: usize,
    /// How tokens pick experts.
    pub routing: Routing,
    /// Probability, in `[0, 1]`, that a slot is independently replaced by `-1` after routing.
    pub drop_prob: f64,
    /// Hand out FP8 activations: `quantize(x, H, round_scale = false)` of the bf16 data.
    pub fp8_input: bool,
    /// Seed of every rank's streams.
    pub seed: u64,
}

impl WorkloadSpec {
    /// Check the shape and that the routing can be satisfied.
    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        if !(0.0..=1.0).contains(&self.drop_prob) {
            return Err(invalid!(
                "workload: drop_prob = {} must be in [0, 1]",
                self.drop_prob
            ));
        }
        let JobShape {
            topk, num_experts, ..
        } = self.shape;
        let needs_distinct = matches!(
            self.routing,
            Routing::Uniform | Routing::OneExpert | Routing::Mixed
        );
        if needs_distinct && topk > num_experts {
            return Err(invalid!(
                "workload: routing {} needs topk = {topk} distinct experts but num_experts = {num_experts}",
                self.routing
            ));
        }
        if self.fp8_input && self.shape.hidden % FP8_GROUP != 0 {
            return Err(invalid!(
                "workload: fp8_input needs hidden = {} to be a multiple of {FP8_GROUP}",
                self.shape.hidden
            ));
        }
        Ok(())
    }

    /// Tokens of `rank` under this spec (0 for rank `R-1` with [`Routing::EmptyRanks`]).
    pub fn num_tokens(&self, rank: usize) -> usize {
        if self.routing == Routing::EmptyRanks && rank + 1 == self.shape.num_ranks {
            0
        } else {
            self.tokens_per_rank
        }
    }
}

/// Per-token rules that [`Routing::Mixed`] chooses among.
#[derive(Debug, Clone, Copy)]
enum TokenRule {
    Uniform,
    SameRank,
    OneExpert,
    AvoidRank0,
}

/// Fill `out` with `first + i`, `i` drawn from `0..count`: distinct when `count >= out.len()`,
/// otherwise with repeats.
fn pick_experts(rng: &mut ChaCha8Rng, first: usize, count: usize, out: &mut [i64]) {
    let n = out.len();
    if count >= n {
        for (o, i) in out.iter_mut().zip(sample(rng, count, n).iter()) {
            *o = (first + i) as i64;
        }
    } else {
        for o in out.iter_mut() {
            *o = (first + rng.gen_range(0..count)) as i64;
        }
    }
}

/// Fill one token's `K` slots following `rule` (the spec is validated, so every range drawn
/// from is non-empty and the distinct rules have room).
fn route_token(rule: TokenRule, shape: &JobShape, rng: &mut ChaCha8Rng, out: &mut [i64]) {
    let (e, epr) = (shape.num_experts, shape.experts_per_rank());
    match rule {
        TokenRule::Uniform => pick_experts(rng, 0, e, out),
        TokenRule::SameRank => {
            let rank = rng.gen_range(0..shape.num_ranks);
            pick_experts(rng, rank * epr, epr, out);
        }
        TokenRule::OneExpert => {
            out[0] = 0;
            pick_experts(rng, 1, e - 1, &mut out[1..]);
        }
        TokenRule::AvoidRank0 => pick_experts(rng, epr, e - epr, out),
    }
}

/// Random activations of one token: Irwin-Hall(4) values in [-4, 4) (normal-ish), with some
/// 128-channel groups scaled x100 or x0.01 and a few all-zero, so FP8 scales vary and the
/// amax clamp is exercised.
fn fill_token(rng: &mut ChaCha8Rng, row: &mut [bf16]) {
    for group in row.chunks_mut(FP8_GROUP) {
        let factor = match rng.gen_range(0u32..32) {
            0 => 0.0,
            1 | 2 => 100.0,
            3 | 4 => 0.01,
            _ => 1.0,
        };
        for v in group.iter_mut() {
            // One u64 gives four 16-bit uniforms: cheap enough for [4096, 7168] per rank.
            let u = rng.next_u64();
            let sum: u32 = (0..4).map(|i| ((u >> (16 * i)) & 0xffff) as u32).sum();
            let normalish = (sum as f32 / 65536.0 - 2.0) * 2.0;
            *v = bf16::from_f32(normalish * factor);
        }
    }
}

/// Generate `rank`'s input. Deterministic in `(spec, rank)`: routing and activations come from
/// two ChaCha8 streams of `seed` (`2*rank` and `2*rank + 1`), so the routing does not depend
/// on `hidden` or `fp8_input`.
pub fn generate(spec: &WorkloadSpec, rank: usize) -> Result<RankInput> {
    spec.validate()?;
    let shape = &spec.shape;
    if rank >= shape.num_ranks {
        return Err(invalid!(
            "workload: rank {rank} out of range; num_ranks = {}",
            shape.num_ranks
        ));
    }
    let (t, k, h) = (spec.num_tokens(rank), shape.topk, shape.hidden);
    let mut route_rng = ChaCha8Rng::seed_from_u64(spec.seed);
    route_rng.set_stream(2 * rank as u64);
    let mut data_rng = ChaCha8Rng::seed_from_u64(spec.seed);
    data_rng.set_stream(2 * rank as u64 + 1);

    let mixed_rules: &[TokenRule] = if shape.num_ranks >= 2 {
        &[
            TokenRule::Uniform,
            TokenRule::SameRank,
            TokenRule::OneExpert,
            TokenRule::AvoidRank0,
        ]
    } else {
        &[
            TokenRule::Uniform,
            TokenRule::SameRank,
            TokenRule::OneExpert,
        ]
    };
    let mut topk_idx = vec![-1i64; t * k];
    let mut topk_weights = vec![0f32; t * k];
    for (idx, w) in topk_idx
        .chunks_exact_mut(k)
        .zip(topk_weights.chunks_exact_mut(k))
    {
        let rule = match spec.routing {
            Routing::Uniform => TokenRule::Uniform,
            Routing::SameRank => TokenRule::SameRank,
            Routing::OneExpert => TokenRule::OneExpert,
            Routing::EmptyRanks => TokenRule::AvoidRank0,
            Routing::Mixed => mixed_rules[route_rng.gen_range(0..mixed_rules.len())],
        };
        route_token(rule, shape, &mut route_rng, idx);
        for (id, w) in idx.iter_mut().zip(w.iter_mut()) {
            if route_rng.gen_bool(spec.drop_prob) {
                *id = -1;
            } else {
                *w = route_rng.gen_range(0.05f32..1.0);
            }
        }
    }

    let mut x = vec![bf16::ZERO; t * h];
    for row in x.chunks_exact_mut(h) {
        fill_token(&mut data_rng, row);
    }
    let x = if spec.fp8_input {
        let (data, scales) = quantize(&x, h, false)?;
        TokenData::Fp8 { data, scales }
    } else {
        TokenData::Bf16(x)
    };
    Ok(RankInput {
        num_tokens: t,
        x,
        topk_idx,
        topk_weights,
    })
}

/// Generate every rank's input (`generate(spec, r)` for `r` in `0..R`).
pub fn generate_all(spec: &WorkloadSpec) -> Result<Vec<RankInput>> {
    spec.validate()?;
    (0..spec.shape.num_ranks)
        .map(|r| generate(spec, r))
        .collect()
}

/// The inputs as an elastic job sees them with the ranks in `masked` gone: a masked
/// rank sends no tokens, and every slot routed to a masked rank's experts is `-1`
/// (weight 0). The reference of these inputs is what the survivors must get.
pub fn without_ranks(inputs: &[RankInput], shape: &JobShape, masked: &[bool]) -> Vec<RankInput> {
    let epr = shape.experts_per_rank().max(1) as i64;
    let gone = |e: i64| e >= 0 && masked.get((e / epr) as usize).copied().unwrap_or(false);
    inputs
        .iter()
        .enumerate()
        .map(|(r, input)| {
            if masked.get(r).copied().unwrap_or(false) {
                let x = match &input.x {
                    TokenData::Bf16(_) => TokenData::Bf16(Vec::new()),
                    TokenData::Fp8 { .. } => TokenData::Fp8 {
                        data: Vec::new(),
                        scales: Vec::new(),
                    },
                    TokenData::Nvfp4 { cast, .. } => TokenData::Nvfp4 {
                        data: Vec::new(),
                        scales: Vec::new(),
                        cast: *cast,
                    },
                };
                return RankInput {
                    num_tokens: 0,
                    x,
                    topk_idx: Vec::new(),
                    topk_weights: Vec::new(),
                };
            }
            let mut input = input.clone();
            for (e, w) in input.topk_idx.iter_mut().zip(&mut input.topk_weights) {
                if gone(*e) {
                    *e = -1;
                    *w = 0.0;
                }
            }
            input
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_ranks_empties_them_and_their_experts() {
        let s = spec(Routing::Uniform, 4, 8, 2);
        let inputs = generate_all(&s).unwrap();
        let masked = [false, false, true, false];
        let out = without_ranks(&inputs, &s.shape, &masked);
        assert_eq!(out[2].num_tokens, 0);
        for (r, input) in out.iter().enumerate().filter(|(r, _)| *r != 2) {
            assert_eq!(input.num_tokens, inputs[r].num_tokens);
            for (i, &e) in input.topk_idx.iter().enumerate() {
                assert!(!(4..6).contains(&e), "rank 2's experts 4..6 are gone");
                if e < 0 {
                    assert_eq!(input.topk_weights[i], 0.0);
                }
            }
        }
    }

    fn spec(routing: Routing, num_ranks: usize, experts: usize, topk: usize) -> WorkloadSpec {
        WorkloadSpec {
            shape: JobShape {
                num_ranks,
                ranks_per_node: 1,
                hidden: 256,
                topk,
                num_experts: experts,
            },
            tokens_per_rank: 64,
            routing,
            drop_prob: 0.0,
            fp8_input: false,
            seed: 42,
        }
    }

    fn tokens(input: &RankInput, k: usize) -> impl Iterator<Item = &[i64]> {
        input.topk_idx.chunks_exact(k)
    }

    fn distinct(row: &[i64]) -> bool {
        let mut v: Vec<i64> = row.iter().copied().filter(|&e| e != -1).collect();
        v.sort_unstable();
        v.windows(2).all(|w| w[0] != w[1])
    }

    #[test]
    fn deterministic_and_seed_sensitive() {
        let mut s = spec(Routing::Mixed, 3, 12, 4);
        s.drop_prob = 0.2;
        let a = generate_all(&s).unwrap();
        assert_eq!(a, generate_all(&s).unwrap());
        assert_eq!(a[1], generate(&s, 1).unwrap());
        assert_ne!(a[0], a[1], "ranks get different streams");
        s.seed = 43;
        assert_ne!(a, generate_all(&s).unwrap());
        // Routing does not depend on the activations' shape or format.
        let mut s2 = spec(Routing::Mixed, 3, 12, 4);
        s2.drop_prob = 0.2;
        s2.shape.hidden = 384;
        s2.fp8_input = true;
        let b = generate_all(&s2).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.topk_idx, y.topk_idx);
            assert_eq!(x.topk_weights, y.topk_weights);
        }
    }

    #[test]
    fn shapes_and_weights() {
        let mut s = spec(Routing::Uniform, 2, 8, 3);
        s.drop_prob = 0.3;
        for input in generate_all(&s).unwrap() {
            assert_eq!(input.num_tokens, 64);
            assert_eq!(input.x.num_rows(256).unwrap(), 64);
            assert_eq!(input.topk_idx.len(), 64 * 3);
            for (&id, &w) in input.topk_idx.iter().zip(&input.topk_weights) {
                assert!((-1..8).contains(&id));
                if id == -1 {
                    assert_eq!(w, 0.0);
                } else {
                    assert!(w > 0.0 && w < 1.0);
                }
            }
            let dropped = input.topk_idx.iter().filter(|&&e| e == -1).count();
            assert!(
                dropped > 20 && dropped < 100,
                "~30% of 192 dropped: {dropped}"
            );
            let x = input.x.as_bf16().unwrap();
            assert!(x.iter().all(|v| v.to_f32().abs() <= 400.0));
            assert!(
                x.iter().any(|v| v.to_f32().abs() > 4.0),
                "some groups scaled x100"
            );
            assert!(x.iter().filter(|v| v.to_f32() != 0.0).count() > x.len() / 2);
        }
    }

    #[test]
    fn fp8_input_is_quantized_bf16() {
        let mut s = spec(Routing::Uniform, 2, 4, 2);
        let bf = generate(&s, 1).unwrap();
        s.fp8_input = true;
        let f = generate(&s, 1).unwrap();
        let (data, scales) = quantize(bf.x.as_bf16().unwrap(), 256, false).unwrap();
        assert_eq!(f.x, TokenData::Fp8 { data, scales });
        assert!(f.x.is_fp8() && f.x.as_bf16().is_none());
        assert_eq!(f.x.num_rows(256).unwrap(), 64);
    }

    #[test]
    fn uniform_is_distinct() {
        let s = spec(Routing::Uniform, 4, 8, 8);
        for input in generate_all(&s).unwrap() {
            for row in tokens(&input, 8) {
                assert!(distinct(row) && row.iter().all(|&e| e >= 0), "{row:?}");
            }
        }
        let e = generate(&spec(Routing::Uniform, 2, 4, 5), 0).unwrap_err();
        assert!(e.to_string().contains("num_experts = 4"), "{e}");
    }

    #[test]
    fn same_rank_stays_on_one_rank() {
        // E/R = 2 < K = 3: repeats are forced.
        let s = spec(Routing::SameRank, 3, 6, 3);
        let mut saw_repeat = false;
        for input in generate_all(&s).unwrap() {
            for row in tokens(&input, 3) {
                let r0 = s.shape.rank_of_expert(row[0] as usize);
                assert!(row
                    .iter()
                    .all(|&e| s.shape.rank_of_expert(e as usize) == r0));
                saw_repeat |= !distinct(row);
            }
        }
        assert!(saw_repeat);
        // E/R = 4 >= K = 3: distinct.
        let s = spec(Routing::SameRank, 2, 8, 3);
        for input in generate_all(&s).unwrap() {
            for row in tokens(&input, 3) {
                let r0 = s.shape.rank_of_expert(row[0] as usize);
                assert!(row
                    .iter()
                    .all(|&e| s.shape.rank_of_expert(e as usize) == r0));
                assert!(distinct(row));
            }
        }
    }

    #[test]
    fn one_expert_slot_zero() {
        let s = spec(Routing::OneExpert, 2, 4, 4);
        for input in generate_all(&s).unwrap() {
            for row in tokens(&input, 4) {
                assert_eq!(row[0], 0);
                assert!(distinct(row) && row.iter().all(|&e| e >= 0));
            }
        }
    }

    #[test]
    fn empty_ranks_send_and_receive_nothing() {
        for r in [1usize, 2, 3] {
            let s = spec(Routing::EmptyRanks, r, 2 * r, 3);
            let all = generate_all(&s).unwrap();
            assert_eq!(all[r - 1].num_tokens, 0, "last rank sends nothing");
            assert!(all[r - 1].topk_idx.is_empty());
            for input in &all {
                for row in tokens(input, 3) {
                    assert!(row.iter().all(|&e| s.shape.rank_of_expert(e as usize) != 0));
                }
            }
            if r >= 2 {
                assert!(all[0].num_tokens > 0);
            }
        }
    }

    #[test]
    fn mixed_uses_every_rule() {
        let mut s = spec(Routing::Mixed, 4, 16, 4);
        s.tokens_per_rank = 256;
        let all = generate_all(&s).unwrap();
        let (mut one, mut same, mut spread) = (0, 0, 0);
        for input in &all {
            assert_eq!(input.num_tokens, 256);
            for row in tokens(input, 4) {
                one += usize::from(row[0] == 0);
                let ranks: Vec<usize> = row
                    .iter()
                    .map(|&e| s.shape.rank_of_expert(e as usize))
                    .collect();
                if ranks.iter().all(|&r| r == ranks[0]) {
                    same += 1;
                } else {
                    spread += 1;
                }
            }
        }
        assert!(
            one > 150 && same > 150 && spread > 300,
            "{one} {same} {spread}"
        );
    }

    #[test]
    fn routing_names_round_trip() {
        for r in Routing::ALL {
            assert_eq!(r.to_string().parse::<Routing>().unwrap(), r);
        }
        let e = "zipf".parse::<Routing>().unwrap_err().to_string();
        assert!(
            e.contains("zipf") && e.contains("uniform, same-rank, one-expert, empty-ranks, mixed"),
            "{e}"
        );
    }

    #[test]
    fn rejects_bad_specs() {
        let mut s = spec(Routing::Uniform, 2, 4, 2);
        s.drop_prob = 1.5;
        assert!(generate(&s, 0)
            .unwrap_err()
            .to_string()
            .contains("drop_prob"));
        let s = spec(Routing::Uniform, 2, 4, 2);
        assert!(generate(&s, 2)
            .unwrap_err()
            .to_string()
            .contains("rank 2 out of range"));
        let mut s = spec(Routing::Uniform, 2, 4, 2);
        s.shape.hidden = 100;
        s.fp8_input = true;
        assert!(generate(&s, 0)
            .unwrap_err()
            .to_string()
            .contains("multiple of 128"));
        let s = spec(Routing::Uniform, 2, 5, 2);
        assert!(generate_all(&s)
            .unwrap_err()
            .to_string()
            .contains("num_experts = 5"));
        let mut s = spec(Routing::Uniform, 3, 6, 2);
        s.shape.ranks_per_node = 2;
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("ranks_per_node = 2"));
    }
}
