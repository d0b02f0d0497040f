//! The one error type of the wire format.

/// Why a command or an immediate could not be encoded or decoded.
///
/// Every variant names the field (or word) at fault, the value seen and what
/// is allowed, so a bad command can be diagnosed from the message alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A field's value does not fit its slot in the encoding.
    #[error("{field} = {value} is out of range (allowed {min}..={max})")]
    OutOfRange {
        /// The field, as named in the documentation tables.
        field: &'static str,
        /// The value that was given.
        value: i128,
        /// The smallest allowed value.
        min: i128,
        /// The largest allowed value.
        max: i128,
    },
    /// An offset is not a multiple of the alignment its encoding needs.
    #[error("{field} = {value:#x} is not {align}-byte aligned (it is stored shifted right)")]
    Misaligned {
        /// The offset field.
        field: &'static str,
        /// The offset that was given.
        value: u64,
        /// The required alignment in bytes.
        align: u64,
    },
    /// `word0` is zero, which no valid command has (the FIFO uses a zero
    /// `word0` to mean "slot empty").
    #[error("word0 is zero: not a command (a valid command's word0 is never zero)")]
    ZeroWord0,
    /// The kind bits name no command kind.
    #[error("unknown command kind {kind} (valid kinds: 1 Write, 2 Atomic, 3 Quiet, 4 Barrier)")]
    UnknownKind {
        /// The low 6 bits of `word0`.
        kind: u8,
    },
    /// Bits that the command's kind leaves unused are not zero.
    #[error(
        "{kind} command has reserved bits set in word{word}: {bits:#018x} (they must be zero)"
    )]
    ReservedBits {
        /// The command kind.
        kind: &'static str,
        /// Which word (0 or 1).
        word: u8,
        /// The offending bits, in place.
        bits: u64,
    },
    /// An enumerated field holds a value with no meaning.
    #[error("{field} = {value} is not valid (allowed: {allowed})")]
    InvalidValue {
        /// The field.
        field: &'static str,
        /// The raw value found.
        value: u64,
        /// The allowed values, in words.
        allowed: &'static str,
    },
    /// An immediate carries another encoding's tag.
    #[error("immediate {imm:#010x} has tag {found} ({found_name}), expected tag {expected} ({expected_name})")]
    WrongTag {
        /// The whole immediate.
        imm: u32,
        /// The tag the decoder wanted.
        expected: u8,
        /// Name of the expected encoding.
        expected_name: &'static str,
        /// The tag found in bits 30..=31.
        found: u8,
        /// Name of the encoding the found tag belongs to.
        found_name: &'static str,
    },
    /// An immediate has bits set that its encoding leaves unused.
    #[error(
        "{kind} immediate {imm:#010x} has reserved bits set: {bits:#010x} (they must be zero)"
    )]
    ReservedImmBits {
        /// The immediate encoding.
        kind: &'static str,
        /// The whole immediate.
        imm: u32,
        /// The offending bits, in place.
        bits: u32,
    },
}

/// Checks `value <= max` for an unsigned field.
pub(crate) fn check_max(field: &'static str, value: u64, max: u64) -> Result<(), WireError> {
    if value > max {
        return Err(WireError::OutOfRange {
            field,
            value: value.into(),
            min: 0,
            max: max.into(),
        });
    }
    Ok(())
}
