//! The 16-byte [`TransferCmd`] and its typed form [`Command`].
//!
//! A command is two little-endian `u64` words, `word0` first. `word0`'s low
//! byte is the *type byte*; `word0` of a valid command is never zero (the
//! kind is never 0), which is what lets the FIFO treat a zero `word0` as
//! "slot empty". Every bit not listed for a kind is reserved: the encoder
//! writes zero there and the decoder rejects a command that has it set, so
//! `encode(decode(w)) == w` for every `w` that decodes.
//!
//! ## `word0` (all kinds share the type byte)
//!
//! | bits    | Write                         | Atomic              | Quiet | Barrier             |
//! |---------|-------------------------------|---------------------|-------|---------------------|
//! | 0..=3   | kind = 1                      | kind = 2            | 3     | kind = 4            |
//! | 4       | combine flag                  | combine flag        | 0     | 0                   |
//! | 5       | LL buffer index               | LL buffer index     | 0     | 0                   |
//! | 6..=15  | dst rank (10 bits)            | dst rank (10 bits)  | 0     | scope (0 all peers, 1 same rail, 2 node leader) |
//! | 16..=31 | piggyback slot, `0xFFFF` = none | slot (u16)        | 0     | 0                   |
//! | 32..=55 | len in bytes (24 bits)        | value (i32, two's complement, bits 32..=63) | 0 | seq (u32, bits 32..=63) |
//! | 56..=63 | piggyback value (u8; 0 if none) | (value, cont.)    | 0     | (seq, cont.)        |
//!
//! The rank field is 10 bits, so a command addresses up to [`MAX_RANKS`] (1024)
//! ranks, DeepEP v2's limit. (The paper's format gave the kind 6 bits and the
//! rank 8, i.e. 256 ranks: four kinds need 3 bits, so the kind field gave up 2.)
//!
//! ## `word1`
//!
//! | bits    | Write                 | Atomic                         | Quiet | Barrier |
//! |---------|-----------------------|--------------------------------|-------|---------|
//! | 0..=31  | dst offset >> 4       | dst offset >> 2 (bits 0..=33)  | 0     | 0       |
//! | 32..=63 | src offset >> 4       | bits 34..=63: 0                | 0     | 0       |
//!
//! Offsets are byte offsets into the symmetric buffer, never pointers.
//! Write offsets must be 16-byte aligned and reach [`MAX_OFFSET`] (64 GiB − 16);
//! the Atomic target is an `i32` counter, 4-byte aligned, up to
//! [`MAX_ATOMIC_OFFSET`] (64 GiB − 4). A Write moves at most [`MAX_WRITE_LEN`]
//! bytes (16 MiB − 1; zero-length writes carry only their immediate); larger
//! transfers are split by the producer, the last piece carrying the piggyback.
//!
//! The piggyback of a Write, the slot of an Atomic and the combine / LL-buffer
//! flags are carried for the proxy, which turns them into a 32-bit immediate
//! (see [`crate::imm`]); their meaning (expert index, channel, counter slot) is
//! the proxy's.

use crate::error::{check_max, WireError};

/// Mask of the kind bits (0..=3) of `word0`.
pub const KIND_MASK: u64 = 0xF;
/// The combine flag, bit 4 of `word0`.
pub const FLAG_COMBINE: u64 = 1 << 4;
/// The LL buffer index, bit 5 of `word0`.
pub const FLAG_LL_BUFFER: u64 = 1 << 5;
/// Bits of the destination rank (bits 6..=15 of `word0`).
pub const RANK_BITS: u32 = 10;
/// Number of ranks a command can address (the 10-bit `dst rank`): 1024.
pub const MAX_RANKS: usize = 1 << RANK_BITS;
/// Alignment of Write offsets (they are stored shifted right by 4).
pub const OFFSET_ALIGN: u64 = 16;
/// Largest Write src/dst offset: `u32::MAX << 4` (64 GiB − 16).
pub const MAX_OFFSET: u64 = (u32::MAX as u64) << 4;
/// Alignment of the Atomic target (an `i32` counter; stored shifted right by 2).
pub const ATOMIC_ALIGN: u64 = 4;
/// Largest Atomic dst offset: 34 bits shifted left by 2 (64 GiB − 4).
pub const MAX_ATOMIC_OFFSET: u64 = ((1u64 << 34) - 1) << 2;
/// Largest Write length in bytes (24 bits: 16 MiB − 1).
pub const MAX_WRITE_LEN: u32 = (1 << 24) - 1;
/// Piggyback slot value that means "no piggyback" in the encoding.
pub const PIGGYBACK_NONE: u16 = u16::MAX;
/// Largest piggyback slot (one below [`PIGGYBACK_NONE`]).
pub const MAX_PIGGYBACK_SLOT: u16 = PIGGYBACK_NONE - 1;

const DST_RANK_SHIFT: u32 = 6;
const RANK_MASK: u64 = (1 << RANK_BITS) - 1;
const AUX_SHIFT: u32 = 16;
// The rank field ends where the 16-bit slot begins.
const _: () = assert!(DST_RANK_SHIFT + RANK_BITS == AUX_SHIFT);
const HIGH_SHIFT: u32 = 32;
const LEN_MASK: u64 = (1 << 24) - 1;
const PIGGY_VALUE_SHIFT: u32 = 56;
const LOW32: u64 = 0xFFFF_FFFF;
const ATOMIC_OFF_MASK: u64 = (1 << 34) - 1;

/// The kind of a command: the low 4 bits of `word0`. Zero is never a kind.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum Kind {
    /// One-sided write, optionally with a piggybacked atomic.
    Write = 1,
    /// Atomic add on a remote `i32` counter (native or emulated).
    Atomic = 2,
    /// Wait until everything pushed before it has completed.
    Quiet = 3,
    /// A barrier across peers.
    Barrier = 4,
}

impl Kind {
    /// The kind named by the low 4 bits of `word0`, if any.
    pub const fn from_bits(bits: u8) -> Option<Kind> {
        match bits {
            1 => Some(Kind::Write),
            2 => Some(Kind::Atomic),
            3 => Some(Kind::Quiet),
            4 => Some(Kind::Barrier),
            _ => None,
        }
    }

    /// The kind's name, for messages.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Write => "Write",
            Kind::Atomic => "Atomic",
            Kind::Quiet => "Quiet",
            Kind::Barrier => "Barrier",
        }
    }
}

/// The two flag bits of the type byte (Write and Atomic only).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct CmdFlags {
    /// The command belongs to a combine (not a dispatch) phase.
    pub combine: bool,
    /// Which of the two LL buffers (0 or 1) the command targets.
    pub ll_buffer: u8,
}

impl CmdFlags {
    fn encode(self) -> Result<u64, WireError> {
        check_max("ll_buffer", self.ll_buffer.into(), 1)?;
        let mut bits = 0;
        if self.combine {
            bits |= FLAG_COMBINE;
        }
        if self.ll_buffer == 1 {
            bits |= FLAG_LL_BUFFER;
        }
        Ok(bits)
    }

    fn decode(word0: u64) -> CmdFlags {
        CmdFlags {
            combine: word0 & FLAG_COMBINE != 0,
            ll_buffer: u8::from(word0 & FLAG_LL_BUFFER != 0),
        }
    }
}

/// An atomic that rides on a Write: the proxy folds it into the write's
/// immediate instead of sending a separate message.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Piggyback {
    /// Counter slot / expert index / channel, as the proxy defines it;
    /// at most [`MAX_PIGGYBACK_SLOT`].
    pub slot: u16,
    /// Small value (e.g. a token count).
    pub value: u8,
}

/// Which peers a barrier spans.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum BarrierScope {
    /// Every rank.
    AllPeers = 0,
    /// The ranks on the same rail (same local index on every node).
    SameRail = 1,
    /// The leaders of the nodes (the inter-node phase of a hierarchical barrier).
    NodeLeader = 2,
}

impl BarrierScope {
    /// The scope with this code, if any.
    pub const fn from_code(code: u8) -> Option<BarrierScope> {
        match code {
            0 => Some(BarrierScope::AllPeers),
            1 => Some(BarrierScope::SameRail),
            2 => Some(BarrierScope::NodeLeader),
            _ => None,
        }
    }

    pub(crate) const ALLOWED: &'static str = "0 all peers, 1 same rail, 2 node leader";
}

/// A command in typed form; [`TransferCmd::encode`] packs it into 16 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Command {
    /// Copy `len` bytes from `src_off` in the local symmetric buffer to
    /// `dst_off` in `dst_rank`'s.
    Write {
        /// Type-byte flags.
        flags: CmdFlags,
        /// Destination rank, below [`MAX_RANKS`].
        dst_rank: u16,
        /// Source offset, 16-byte aligned, at most [`MAX_OFFSET`].
        src_off: u64,
        /// Destination offset, 16-byte aligned, at most [`MAX_OFFSET`].
        dst_off: u64,
        /// Bytes to copy, at most [`MAX_WRITE_LEN`].
        len: u32,
        /// Optional atomic folded into the write's immediate.
        piggyback: Option<Piggyback>,
    },
    /// Add `value` to the `i32` counter at `dst_off` on `dst_rank`.
    Atomic {
        /// Type-byte flags.
        flags: CmdFlags,
        /// Destination rank, below [`MAX_RANKS`].
        dst_rank: u16,
        /// Counter offset, 4-byte aligned, at most [`MAX_ATOMIC_OFFSET`].
        dst_off: u64,
        /// Expert index / counter slot for atomic emulation (the proxy's meaning).
        slot: u16,
        /// The addend.
        value: i32,
    },
    /// Completes (is popped) only when everything before it has completed.
    Quiet,
    /// Completes only when the barrier has been passed.
    Barrier {
        /// Which peers take part.
        scope: BarrierScope,
        /// Barrier sequence number (the proxy wraps it for the immediate).
        seq: u32,
    },
}

impl Command {
    /// The command's kind.
    pub const fn kind(&self) -> Kind {
        match self {
            Command::Write { .. } => Kind::Write,
            Command::Atomic { .. } => Kind::Atomic,
            Command::Quiet => Kind::Quiet,
            Command::Barrier { .. } => Kind::Barrier,
        }
    }
}

/// The 16-byte command as it lies in a FIFO slot (see the module docs for
/// the bit layout). The fields are public so the FIFO can store the words
/// separately; build one with [`TransferCmd::encode`].
#[repr(C, align(16))]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct TransferCmd {
    /// Type byte, rank and the 32-bit field; never zero when valid.
    pub word0: u64,
    /// Offsets.
    pub word1: u64,
}

const _: () = assert!(std::mem::size_of::<TransferCmd>() == 16);
const _: () = assert!(std::mem::align_of::<TransferCmd>() == 16);

fn check_offset(field: &'static str, off: u64, align: u64, max: u64) -> Result<(), WireError> {
    if off % align != 0 {
        return Err(WireError::Misaligned {
            field,
            value: off,
            align,
        });
    }
    check_max(field, off, max)
}

fn check_rank(dst_rank: u16) -> Result<(), WireError> {
    check_max("dst_rank", dst_rank.into(), MAX_RANKS as u64 - 1)
}

fn reserved(kind: Kind, word: u8, bits: u64) -> Result<(), WireError> {
    if bits != 0 {
        return Err(WireError::ReservedBits {
            kind: kind.name(),
            word,
            bits,
        });
    }
    Ok(())
}

impl TransferCmd {
    /// Packs a command; fails (never truncates) if a field does not fit or
    /// an offset is misaligned, naming the field, its value and the range.
    pub fn encode(cmd: &Command) -> Result<TransferCmd, WireError> {
        let kind = u64::from(cmd.kind() as u8);
        match *cmd {
            Command::Write {
                flags,
                dst_rank,
                src_off,
                dst_off,
                len,
                piggyback,
            } => {
                check_rank(dst_rank)?;
                check_offset("src_off", src_off, OFFSET_ALIGN, MAX_OFFSET)?;
                check_offset("dst_off", dst_off, OFFSET_ALIGN, MAX_OFFSET)?;
                check_max("len", len.into(), MAX_WRITE_LEN.into())?;
                let (slot, value) = match piggyback {
                    Some(p) => {
                        check_max("piggyback.slot", p.slot.into(), MAX_PIGGYBACK_SLOT.into())?;
                        (p.slot, p.value)
                    }
                    None => (PIGGYBACK_NONE, 0),
                };
                let word0 = kind
                    | flags.encode()?
                    | u64::from(dst_rank) << DST_RANK_SHIFT
                    | u64::from(slot) << AUX_SHIFT
                    | u64::from(len) << HIGH_SHIFT
                    | u64::from(value) << PIGGY_VALUE_SHIFT;
                let word1 = (dst_off >> 4) | (src_off >> 4) << HIGH_SHIFT;
                Ok(TransferCmd { word0, word1 })
            }
            Command::Atomic {
                flags,
                dst_rank,
                dst_off,
                slot,
                value,
            } => {
                check_rank(dst_rank)?;
                check_offset("dst_off", dst_off, ATOMIC_ALIGN, MAX_ATOMIC_OFFSET)?;
                // `as u32` reinterprets the i32's two's-complement bits; lossless.
                let word0 = kind
                    | flags.encode()?
                    | u64::from(dst_rank) << DST_RANK_SHIFT
                    | u64::from(slot) << AUX_SHIFT
                    | u64::from(value as u32) << HIGH_SHIFT;
                Ok(TransferCmd {
                    word0,
                    word1: dst_off >> 2,
                })
            }
            Command::Quiet => Ok(TransferCmd {
                word0: kind,
                word1: 0,
            }),
            Command::Barrier { scope, seq } => Ok(TransferCmd {
                word0: kind
                    | u64::from(scope as u8) << DST_RANK_SHIFT
                    | u64::from(seq) << HIGH_SHIFT,
                word1: 0,
            }),
        }
    }

    /// Unpacks a command; fails on a zero `word0`, an unknown kind, an
    /// invalid enumerated field or any reserved bit set. Never panics.
    pub fn decode(&self) -> Result<Command, WireError> {
        let (w0, w1) = (self.word0, self.word1);
        if w0 == 0 {
            return Err(WireError::ZeroWord0);
        }
        let kind_bits = (w0 & KIND_MASK) as u8;
        let kind = Kind::from_bits(kind_bits).ok_or(WireError::UnknownKind { kind: kind_bits })?;
        let dst_rank = self.rank_field();
        let aux = (w0 >> AUX_SHIFT) as u16;
        let high = (w0 >> HIGH_SHIFT) as u32;
        match kind {
            Kind::Write => {
                let value = (w0 >> PIGGY_VALUE_SHIFT) as u8;
                let piggyback = if aux == PIGGYBACK_NONE {
                    reserved(kind, 0, w0 & !((1 << PIGGY_VALUE_SHIFT) - 1))?;
                    None
                } else {
                    Some(Piggyback { slot: aux, value })
                };
                Ok(Command::Write {
                    flags: CmdFlags::decode(w0),
                    dst_rank,
                    src_off: (w1 >> HIGH_SHIFT) << 4,
                    dst_off: (w1 & LOW32) << 4,
                    len: ((w0 >> HIGH_SHIFT) & LEN_MASK) as u32,
                    piggyback,
                })
            }
            Kind::Atomic => {
                reserved(kind, 1, w1 & !ATOMIC_OFF_MASK)?;
                Ok(Command::Atomic {
                    flags: CmdFlags::decode(w0),
                    dst_rank,
                    dst_off: w1 << 2,
                    slot: aux,
                    // Reinterprets the stored two's-complement bits.
                    value: high as i32,
                })
            }
            Kind::Quiet => {
                reserved(kind, 0, w0 & !KIND_MASK)?;
                reserved(kind, 1, w1)?;
                Ok(Command::Quiet)
            }
            Kind::Barrier => {
                reserved(
                    kind,
                    0,
                    w0 & (FLAG_COMBINE | FLAG_LL_BUFFER | 0xFFFF << AUX_SHIFT),
                )?;
                reserved(kind, 1, w1)?;
                let scope = (u8::try_from(dst_rank).ok())
                    .and_then(BarrierScope::from_code)
                    .ok_or(WireError::InvalidValue {
                        field: "barrier scope",
                        value: dst_rank.into(),
                        allowed: BarrierScope::ALLOWED,
                    })?;
                Ok(Command::Barrier { scope, seq: high })
            }
        }
    }

    /// The kind named by `word0`'s low 4 bits, if any (cheap; no validation
    /// of the other bits).
    pub const fn kind(&self) -> Option<Kind> {
        Kind::from_bits((self.word0 & KIND_MASK) as u8)
    }

    /// The destination rank of a Write or Atomic (`word0` bits 6..=15; a Barrier's
    /// scope), cheap and without validating the other bits, as [`TransferCmd::kind`].
    pub const fn rank_field(&self) -> u16 {
        ((self.word0 >> DST_RANK_SHIFT) & RANK_MASK) as u16
    }

    /// The 16 bytes: `word0` then `word1`, each little-endian (the in-memory
    /// image on little-endian machines).
    pub const fn to_bytes(&self) -> [u8; 16] {
        self.to_u128().to_le_bytes()
    }

    /// Inverse of [`TransferCmd::to_bytes`]; does not validate (use
    /// [`TransferCmd::decode`]).
    pub const fn from_bytes(bytes: [u8; 16]) -> TransferCmd {
        TransferCmd::from_u128(u128::from_le_bytes(bytes))
    }

    /// `word0` in the low 64 bits, `word1` in the high 64 bits.
    pub const fn to_u128(&self) -> u128 {
        self.word0 as u128 | (self.word1 as u128) << 64
    }

    /// Inverse of [`TransferCmd::to_u128`]; does not validate.
    pub const fn from_u128(v: u128) -> TransferCmd {
        TransferCmd {
            word0: v as u64,
            word1: (v >> 64) as u64,
        }
    }
}

impl TryFrom<&Command> for TransferCmd {
    type Error = WireError;
    fn try_from(cmd: &Command) -> Result<Self, WireError> {
        TransferCmd::encode(cmd)
    }
}

impl TryFrom<Command> for TransferCmd {
    type Error = WireError;
    fn try_from(cmd: Command) -> Result<Self, WireError> {
        TransferCmd::encode(&cmd)
    }
}

impl TryFrom<TransferCmd> for Command {
    type Error = WireError;
    fn try_from(cmd: TransferCmd) -> Result<Self, WireError> {
        cmd.decode()
    }
}
