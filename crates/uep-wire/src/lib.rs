//! uep wire format: the 16-byte [`TransferCmd`] a device pushes into a FIFO,
//! and the 32-bit immediates a proxy attaches to the writes it posts.
//!
//! * [`cmd`]: [`TransferCmd`] (two `u64` words, `repr(C, align(16))`) and its
//!   typed form [`Command`]; the bit-by-bit layout is tabled in the module docs.
//! * [`imm`]: [`WriteImm`], [`LlImm`], [`AtomicImm`], [`BarrierImm`] and the
//!   tag-dispatching [`Imm`]; bit layouts tabled in the module docs.
//!
//! Encoding never truncates: a value that does not fit its field, or a
//! misaligned offset, is a [`WireError`] naming the field, the value and the
//! allowed range. Decoding never panics: unknown kinds, invalid enumerated
//! values and set reserved bits are errors, so every word that decodes
//! re-encodes to itself.
//!
//! Limits, as constants: ranks [`MAX_RANKS`] (1024, DeepEP v2's EP limit), Write offsets up to
//! [`MAX_OFFSET`] (64 GiB − 16, 16-byte aligned), Atomic offsets up to
//! [`MAX_ATOMIC_OFFSET`] (4-byte aligned), Write length [`MAX_WRITE_LEN`]
//! (16 MiB − 1), normal-mode streams (source rank x channel)
//! [`MAX_STREAMS`] (1024), local experts [`MAX_LOCAL_EXPERTS`] (1024), LL
//! counts [`MAX_LL_COUNT`] (255), normal-mode tail increments
//! [`MAX_WRITE_COUNT`] (255), atomic slots [`MAX_ATOMIC_SLOTS`] (16384).
#![forbid(unsafe_code)]

pub mod cmd;
mod error;
pub mod imm;

pub use cmd::{
    BarrierScope, CmdFlags, Command, Kind, Piggyback, TransferCmd, ATOMIC_ALIGN, MAX_ATOMIC_OFFSET,
    MAX_OFFSET, MAX_PIGGYBACK_SLOT, MAX_RANKS, MAX_WRITE_LEN, OFFSET_ALIGN, PIGGYBACK_NONE,
    RANK_BITS,
};
pub use error::WireError;
pub use imm::{
    imm_tag, AtomicImm, BarrierImm, Imm, LlImm, LlSignal, WriteImm, BARRIER_SEQ_MODULUS,
    MAX_ATOMIC_SLOTS, MAX_LL_COUNT, MAX_LOCAL_EXPERTS, MAX_STREAMS, MAX_WRITE_COUNT,
    WRITE_SEQ_BITS, WRITE_SEQ_MODULUS,
};
