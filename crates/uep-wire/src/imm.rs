//! The 32-bit immediates that carry ordering and emulated atomics (docs/architecture.md,
//! "uep-wire" and "uep-proxy").
//!
//! Every write a proxy posts carries one immediate; the receiving proxy learns
//! of arrivals only from its completion queue and applies the atomics itself.
//! Bits 30..=31 are a tag naming the encoding, so a receiver can dispatch on
//! [`Imm::decode`]; decoding an immediate as the wrong encoding is an error.
//!
//! | tag | encoding       | use |
//! |-----|----------------|-----|
//! | 0   | [`WriteImm`]   | normal mode: per-(source, channel) ordered tail increments |
//! | 1   | [`LlImm`]      | LL mode: partial completion fence (data arrival / count signal) |
//! | 2   | [`AtomicImm`]  | generic emulated atomic add on a counter slot |
//! | 3   | [`BarrierImm`] | barrier arrival (sent as a zero-length write) |
//!
//! ## `WriteImm` (tag 0)
//!
//! | bits    | field |
//! |---------|-------|
//! | 0..=7   | count: tail increment in tokens, `0..=`[`MAX_WRITE_COUNT`] (255) |
//! | 8..=19  | seq: per-stream sequence number, wraps modulo [`WRITE_SEQ_MODULUS`] (4096) |
//! | 20..=29 | stream: (source rank, channel) as `src * num_channels + channel`, `0..`[`MAX_STREAMS`] (1024) |
//! | 30..=31 | tag = 0 |
//!
//! The receiving transport does not say who sent a write, so the source
//! rank travels in the immediate, folded with the channel into one
//! `stream` id: any `num_ranks * num_channels <= 1024` fits (e.g. 256 ranks
//! x 4 channels, 100 x 10, 64 x 16). Why these widths:
//!
//! * **stream, 10 bits**: the product ranks x channels is what must fit;
//!   splitting it into fixed rank and channel fields would waste codes.
//! * **seq, 12 bits**: the receiver keeps a reorder window per stream and
//!   takes an arrival as "ahead" only when it is less than half the modulus
//!   ([`WRITE_SEQ_MODULUS`]` / 2` = 2048) past the next sequence number it
//!   expects; anything else is stale or a duplicate. So a sender must never
//!   let two writes of one stream that the receiver may not have seen yet
//!   lie `WRITE_SEQ_MODULUS / 2` or more apart in sequence: then the writes
//!   pending at the receiver all lie in a span shorter than half the
//!   modulus and their wrapped numbers cannot alias. `uep-proxy` enforces
//!   this with a per-stream send window (see its crate docs); 2048 is 8x
//!   the per-thread in-flight bound of the paper's LL figures (8 FIFOs x 32
//!   writes), so the window rarely throttles.
//! * **count, 8 bits**: the tail increment per write. The EP layer only
//!   uses 0 and 1; a larger increment (more than 255 tokens) can be split
//!   over several writes, each with its own sequence number.
//!
//! The TransferCmd's `combine` flag is not carried: no receiver acts on it.
//!
//! ## `LlImm` (tag 1)
//!
//! | bits    | field |
//! |---------|-------|
//! | 0..=7   | count N for a count signal (`0..=`[`MAX_LL_COUNT`]); 0 for a data arrival |
//! | 8..=17  | source rank (10 bits, `0..`[`MAX_RANKS`]) |
//! | 18..=27 | local expert index, `0..`[`MAX_LOCAL_EXPERTS`] |
//! | 28      | 0 = data arrival, 1 = count signal |
//! | 29      | LL buffer index |
//! | 30..=31 | tag = 1 |
//!
//! The source rank has 10 bits so that an LL job reaches [`MAX_RANKS`] (1024)
//! ranks, every one writing to every other; the count gave up 2 bits for it (the
//! paper's 10-bit count and 8-bit rank). A sender that needs more than 255 writes
//! for one (buffer, expert) block makes its pieces larger instead.
//!
//! ## `AtomicImm` (tag 2)
//!
//! | bits    | field |
//! |---------|-------|
//! | 0..=15  | value (i16, two's complement) |
//! | 16..=29 | counter slot, `0..`[`MAX_ATOMIC_SLOTS`] |
//! | 30..=31 | tag = 2 |
//!
//! ## `BarrierImm` (tag 3)
//!
//! | bits    | field |
//! |---------|-------|
//! | 0..=17  | seq, wraps modulo [`BARRIER_SEQ_MODULUS`] (2^18) |
//! | 18..=27 | source rank (10 bits, `0..`[`MAX_RANKS`]) |
//! | 28..=29 | scope: 0 all peers, 1 same rail, 2 node leader (3 invalid) |
//! | 30..=31 | tag = 3 |

use crate::cmd::{BarrierScope, MAX_RANKS, RANK_BITS};
use crate::error::{check_max, WireError};

/// Bits of the [`WriteImm`] count (tail increment).
const WRITE_COUNT_BITS: u32 = 8;
/// Bits of the [`WriteImm`] stream.
const WRITE_STREAM_BITS: u32 = 10;
const WRITE_SEQ_SHIFT: u32 = WRITE_COUNT_BITS;
const WRITE_STREAM_SHIFT: u32 = WRITE_SEQ_SHIFT + WRITE_SEQ_BITS;
// The three fields fill exactly the 30 bits below the tag.
const _: () = assert!(WRITE_STREAM_SHIFT + WRITE_STREAM_BITS == TAG_SHIFT);

/// Number of (source rank, channel) streams a [`WriteImm`] can name (10
/// bits): a job needs `num_ranks * num_channels <= MAX_STREAMS`.
pub const MAX_STREAMS: usize = 1 << WRITE_STREAM_BITS;
/// Bits of the [`WriteImm`] sequence number.
pub const WRITE_SEQ_BITS: u32 = 12;
/// The [`WriteImm`] sequence number wraps modulo this (4096). Two writes of
/// one stream that the receiver may not have seen yet must be less than
/// half of it apart (module docs).
pub const WRITE_SEQ_MODULUS: u32 = 1 << WRITE_SEQ_BITS;
/// Largest [`WriteImm`] tail increment (8 bits, 255); [`WriteImm::encode`]
/// rejects more.
pub const MAX_WRITE_COUNT: u16 = (1 << WRITE_COUNT_BITS) - 1;
/// Bits of the [`LlImm`] count.
const LL_COUNT_BITS: u32 = 8;
const LL_SRC_SHIFT: u32 = LL_COUNT_BITS;
const LL_EXPERT_SHIFT: u32 = LL_SRC_SHIFT + RANK_BITS;
const LL_EXPERT_BITS: u32 = 10;
const LL_IS_COUNT_SHIFT: u32 = LL_EXPERT_SHIFT + LL_EXPERT_BITS;
const LL_BUFFER_SHIFT: u32 = LL_IS_COUNT_SHIFT + 1;
// The fields and the two flag bits fill exactly the 30 bits below the tag.
const _: () = assert!(LL_BUFFER_SHIFT + 1 == TAG_SHIFT);
/// Number of local experts an [`LlImm`] can name (10 bits).
pub const MAX_LOCAL_EXPERTS: usize = 1 << LL_EXPERT_BITS;
/// Largest count an [`LlImm`] count signal can announce (8 bits).
pub const MAX_LL_COUNT: u16 = (1 << LL_COUNT_BITS) - 1;
/// Number of counter slots an [`AtomicImm`] can name (14 bits).
pub const MAX_ATOMIC_SLOTS: usize = 1 << 14;
/// Bits of the [`BarrierImm`] sequence number.
pub const BARRIER_SEQ_BITS: u32 = 18;
const BARRIER_SCOPE_SHIFT: u32 = BARRIER_SEQ_BITS + RANK_BITS;
const _: () = assert!(BARRIER_SCOPE_SHIFT + 2 == TAG_SHIFT);
/// The [`BarrierImm`] sequence number wraps modulo this.
pub const BARRIER_SEQ_MODULUS: u32 = 1 << BARRIER_SEQ_BITS;

const TAG_SHIFT: u32 = 30;
const TAG_WRITE: u8 = 0;
const TAG_LL: u8 = 1;
const TAG_ATOMIC: u8 = 2;
const TAG_BARRIER: u8 = 3;
const TAG_NAMES: [&str; 4] = ["WriteImm", "LlImm", "AtomicImm", "BarrierImm"];

const fn field(imm: u32, shift: u32, bits: u32) -> u32 {
    (imm >> shift) & ((1 << bits) - 1)
}

/// The tag (bits 30..=31) of an immediate.
pub const fn imm_tag(imm: u32) -> u8 {
    (imm >> TAG_SHIFT) as u8
}

fn check_tag(imm: u32, expected: u8) -> Result<(), WireError> {
    let found = imm_tag(imm);
    if found != expected {
        return Err(WireError::WrongTag {
            imm,
            expected,
            expected_name: TAG_NAMES[usize::from(expected)],
            found,
            found_name: TAG_NAMES[usize::from(found)],
        });
    }
    Ok(())
}

/// Normal mode, per-channel order: the tail increment rides on the data
/// write with a per-stream (per (source, channel)) sequence number; the
/// receiver applies increments strictly in sequence order.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct WriteImm {
    /// The (source rank, channel) pair as `src * num_channels + channel`,
    /// below [`MAX_STREAMS`].
    pub stream: u16,
    /// Sequence number, below [`WRITE_SEQ_MODULUS`] (wrap it with [`WriteImm::wrap_seq`]).
    pub seq: u16,
    /// Tail increment in tokens, at most [`MAX_WRITE_COUNT`].
    pub count: u16,
}

impl WriteImm {
    /// Reduces a free-running sequence counter to the encoded width.
    pub const fn wrap_seq(seq: u64) -> u16 {
        (seq % WRITE_SEQ_MODULUS as u64) as u16
    }

    /// Packs the immediate; fails if a field is out of range.
    pub fn encode(&self) -> Result<u32, WireError> {
        check_max(
            "WriteImm.stream",
            self.stream.into(),
            MAX_STREAMS as u64 - 1,
        )?;
        check_max(
            "WriteImm.seq",
            self.seq.into(),
            u64::from(WRITE_SEQ_MODULUS) - 1,
        )?;
        check_max("WriteImm.count", self.count.into(), MAX_WRITE_COUNT.into())?;
        Ok(u32::from(TAG_WRITE) << TAG_SHIFT
            | u32::from(self.stream) << WRITE_STREAM_SHIFT
            | u32::from(self.seq) << WRITE_SEQ_SHIFT
            | u32::from(self.count))
    }

    /// Unpacks the immediate; fails on another encoding's tag.
    pub fn decode(imm: u32) -> Result<WriteImm, WireError> {
        check_tag(imm, TAG_WRITE)?;
        Ok(WriteImm {
            stream: field(imm, WRITE_STREAM_SHIFT, WRITE_STREAM_BITS) as u16,
            seq: field(imm, WRITE_SEQ_SHIFT, WRITE_SEQ_BITS) as u16,
            count: field(imm, 0, WRITE_COUNT_BITS) as u16,
        })
    }
}

/// What an [`LlImm`] announces.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum LlSignal {
    /// One data write for (buffer, expert, source) has arrived.
    Arrival,
    /// The source sent N writes for (buffer, expert); apply the count signal
    /// once N arrivals have been seen. N is at most [`MAX_LL_COUNT`].
    Count(u16),
}

/// LL mode partial completion fence: the receiver counts arrived writes per
/// (buffer, expert, source) and applies a count signal only when the count
/// it announces has arrived.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct LlImm {
    /// LL buffer index, 0 or 1.
    pub buffer: u8,
    /// Local expert index, below [`MAX_LOCAL_EXPERTS`].
    pub expert: u16,
    /// The sending rank, below [`MAX_RANKS`].
    pub src_rank: u16,
    /// Data arrival or count signal.
    pub signal: LlSignal,
}

impl LlImm {
    /// Packs the immediate; fails if a field is out of range.
    pub fn encode(&self) -> Result<u32, WireError> {
        check_max("LlImm.buffer", self.buffer.into(), 1)?;
        check_max(
            "LlImm.expert",
            self.expert.into(),
            MAX_LOCAL_EXPERTS as u64 - 1,
        )?;
        check_max("LlImm.src_rank", self.src_rank.into(), MAX_RANKS as u64 - 1)?;
        let (is_count, count) = match self.signal {
            LlSignal::Arrival => (0, 0),
            LlSignal::Count(n) => {
                check_max("LlImm.count", n.into(), MAX_LL_COUNT.into())?;
                (1, u32::from(n))
            }
        };
        Ok(u32::from(TAG_LL) << TAG_SHIFT
            | u32::from(self.buffer) << LL_BUFFER_SHIFT
            | is_count << LL_IS_COUNT_SHIFT
            | u32::from(self.expert) << LL_EXPERT_SHIFT
            | u32::from(self.src_rank) << LL_SRC_SHIFT
            | count)
    }

    /// Unpacks the immediate; fails on another encoding's tag, or a data
    /// arrival with count bits set.
    pub fn decode(imm: u32) -> Result<LlImm, WireError> {
        check_tag(imm, TAG_LL)?;
        let count = field(imm, 0, LL_COUNT_BITS);
        let signal = if field(imm, LL_IS_COUNT_SHIFT, 1) == 1 {
            LlSignal::Count(count as u16)
        } else if count != 0 {
            return Err(WireError::ReservedImmBits {
                kind: "LlImm data arrival",
                imm,
                bits: count,
            });
        } else {
            LlSignal::Arrival
        };
        Ok(LlImm {
            buffer: field(imm, LL_BUFFER_SHIFT, 1) as u8,
            expert: field(imm, LL_EXPERT_SHIFT, LL_EXPERT_BITS) as u16,
            src_rank: field(imm, LL_SRC_SHIFT, RANK_BITS) as u16,
            signal,
        })
    }
}

/// A generic emulated atomic add: the receiver adds `value` to the counter
/// it maps `slot` to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct AtomicImm {
    /// Counter slot, below [`MAX_ATOMIC_SLOTS`].
    pub slot: u16,
    /// The addend.
    pub value: i16,
}

impl AtomicImm {
    /// Packs the immediate; fails if the slot is out of range.
    pub fn encode(&self) -> Result<u32, WireError> {
        check_max(
            "AtomicImm.slot",
            self.slot.into(),
            MAX_ATOMIC_SLOTS as u64 - 1,
        )?;
        // `as u16` keeps the i16's two's-complement bits; lossless.
        Ok(u32::from(TAG_ATOMIC) << TAG_SHIFT
            | u32::from(self.slot) << 16
            | u32::from(self.value as u16))
    }

    /// Unpacks the immediate; fails on another encoding's tag.
    pub fn decode(imm: u32) -> Result<AtomicImm, WireError> {
        check_tag(imm, TAG_ATOMIC)?;
        Ok(AtomicImm {
            slot: field(imm, 16, 14) as u16,
            value: field(imm, 0, 16) as u16 as i16,
        })
    }
}

/// A barrier arrival from `src_rank`, carried by a zero-length write.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BarrierImm {
    /// Which barrier phase / peer set.
    pub scope: BarrierScope,
    /// The sending rank, below [`MAX_RANKS`].
    pub src_rank: u16,
    /// Barrier sequence number, below [`BARRIER_SEQ_MODULUS`] (wrap it with
    /// [`BarrierImm::wrap_seq`]).
    pub seq: u32,
}

impl BarrierImm {
    /// Reduces a free-running barrier counter to the encoded width.
    pub const fn wrap_seq(seq: u64) -> u32 {
        (seq % BARRIER_SEQ_MODULUS as u64) as u32
    }

    /// Packs the immediate; fails if the sequence number is out of range.
    pub fn encode(&self) -> Result<u32, WireError> {
        check_max(
            "BarrierImm.seq",
            self.seq.into(),
            u64::from(BARRIER_SEQ_MODULUS) - 1,
        )?;
        check_max(
            "BarrierImm.src_rank",
            self.src_rank.into(),
            MAX_RANKS as u64 - 1,
        )?;
        Ok(u32::from(TAG_BARRIER) << TAG_SHIFT
            | u32::from(self.scope as u8) << BARRIER_SCOPE_SHIFT
            | u32::from(self.src_rank) << BARRIER_SEQ_BITS
            | self.seq)
    }

    /// Unpacks the immediate; fails on another encoding's tag or scope 3.
    pub fn decode(imm: u32) -> Result<BarrierImm, WireError> {
        check_tag(imm, TAG_BARRIER)?;
        let code = field(imm, BARRIER_SCOPE_SHIFT, 2) as u8;
        let scope = BarrierScope::from_code(code).ok_or(WireError::InvalidValue {
            field: "BarrierImm.scope",
            value: code.into(),
            allowed: BarrierScope::ALLOWED,
        })?;
        Ok(BarrierImm {
            scope,
            src_rank: field(imm, BARRIER_SEQ_BITS, RANK_BITS) as u16,
            seq: field(imm, 0, BARRIER_SEQ_BITS),
        })
    }
}

/// Any immediate, dispatched on its tag: what a receiving proxy decodes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Imm {
    /// Tag 0.
    Write(WriteImm),
    /// Tag 1.
    Ll(LlImm),
    /// Tag 2.
    Atomic(AtomicImm),
    /// Tag 3.
    Barrier(BarrierImm),
}

impl Imm {
    /// Packs the immediate; fails if a field is out of range.
    pub fn encode(&self) -> Result<u32, WireError> {
        match self {
            Imm::Write(i) => i.encode(),
            Imm::Ll(i) => i.encode(),
            Imm::Atomic(i) => i.encode(),
            Imm::Barrier(i) => i.encode(),
        }
    }

    /// Unpacks any immediate by its tag.
    pub fn decode(imm: u32) -> Result<Imm, WireError> {
        match imm_tag(imm) {
            TAG_WRITE => WriteImm::decode(imm).map(Imm::Write),
            TAG_LL => LlImm::decode(imm).map(Imm::Ll),
            TAG_ATOMIC => AtomicImm::decode(imm).map(Imm::Atomic),
            _ => BarrierImm::decode(imm).map(Imm::Barrier),
        }
    }
}

impl From<WriteImm> for Imm {
    fn from(i: WriteImm) -> Imm {
        Imm::Write(i)
    }
}

impl From<LlImm> for Imm {
    fn from(i: LlImm) -> Imm {
        Imm::Ll(i)
    }
}

impl From<AtomicImm> for Imm {
    fn from(i: AtomicImm) -> Imm {
        Imm::Atomic(i)
    }
}

impl From<BarrierImm> for Imm {
    fn from(i: BarrierImm) -> Imm {
        Imm::Barrier(i)
    }
}
