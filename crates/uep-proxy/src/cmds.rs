//! Command helpers: build the 16-byte commands producers push, so no
//! producer hand-builds a piggyback.
//!
//! # How a Write's piggyback becomes an immediate
//!
//! Every Write must carry a piggyback; its 16-bit `slot` selects the
//! namespace by bit 15 and its 8-bit `value` holds the low bits of a count.
//!
//! | piggyback slot bits | normal channel write (bit 15 = 0) | LL data write (bit 15 = 1, bit 10 = 0) | LL count signal (bit 15 = 1, bit 10 = 1) |
//! |---------------------|-----------------------------------|-----------------------------------------|-------------------------------------------|
//! | 0..=5               | channel bits 0..=5                | local expert bits 0..=5                 | local expert bits 0..=5                   |
//! | 6..=7               | channel bits 6..=7                | local expert bits 6..=7                 | local expert bits 6..=7                   |
//! | 8..=9               | 0 (reserved)                      | local expert bits 8..=9                 | local expert bits 8..=9                   |
//! | 10                  | 0 (reserved)                      | 0 = data arrival                        | 1 = count signal                          |
//! | 11..=14             | 0 (reserved)                      | 0 (reserved)                            | 0 (reserved)                              |
//! | piggyback value     | tail increment (`0..=`[`MAX_WRITE_COUNT`] = 255) | 0                        | count (`0..=`[`MAX_LL_COUNT`] = 255)      |
//! | flags.combine       | must be 0 (WriteImm has no combine bit) | must be 0 (LlImm has no combine bit) | must be 0                         |
//! | flags.ll_buffer     | must be 0                         | `LlImm.buffer`                          | `LlImm.buffer`                            |
//! | len                 | any (0 = signal only)             | any (0 still counts as one arrival)     | any (its own data is not among the count) |
//! | immediate sent      | [`WriteImm`](uep_wire::WriteImm) `{stream: src * num_channels + channel, seq, count: tail increment}` | [`LlImm`](uep_wire::LlImm) `Arrival` | [`LlImm`](uep_wire::LlImm) `Count(count)` |
//!
//! The channel (below the layout's `num_channels`, at most 256 by this
//! encoding) travels in the Write, the source rank does not: the proxy
//! folds both into the immediate's 10-bit `stream`, so a job needs
//! `num_ranks * num_channels <=` [`MAX_STREAMS`] (1024), which
//! [`CounterLayout::validate`] checks when the proxy starts. The `seq` is
//! the sending thread's per-(destination, channel) counter; see the crate
//! docs for the send window that keeps it from aliasing at the receiver.
//!
//! A Write without a piggyback is rejected: on an unordered transport a write
//! nobody counts could land after the signal meant to cover it. Split large
//! transfers into several normal-channel Writes (tail increment 0 on all but
//! the last): each piece gets its own sequence number, so the increment still
//! applies only after every piece has landed.
//!
//! The other kinds map directly:
//!
//! | command | what the proxy sends |
//! |---------|----------------------|
//! | `Atomic {dst_rank, dst_off, slot, value}` | zero-length write with [`AtomicImm`](uep_wire::AtomicImm) `{slot, value}`; `value` must fit an `i16`, `dst_off` must equal [`CounterLayout::atomic`]`(slot)` (flags are ignored) |
//! | `Quiet` | nothing; popped once every earlier command of its FIFO has completed |
//! | `Barrier {scope, seq}` | after every earlier command of the FIFO completed, a zero-length write with [`BarrierImm`](uep_wire::BarrierImm) `{scope, src_rank: self, seq mod 2^20}` to every peer in scope; popped once every such peer's barrier counter is `>= seq` |

#[cfg(doc)]
use uep_wire::MAX_STREAMS;
use uep_wire::{
    BarrierScope, CmdFlags, Command, Kind, Piggyback, TransferCmd, MAX_LL_COUNT, MAX_LOCAL_EXPERTS,
    MAX_RANKS, MAX_WRITE_COUNT,
};

use crate::error::{ProxyError, Result};
use crate::layout::CounterLayout;

/// Bit 15 of the piggyback slot: LL namespace.
const LL_BIT: u16 = 1 << 15;
/// Bit 10 of an LL slot: count signal (else data arrival).
const LL_COUNT_BIT: u16 = 1 << 10;
const LL_EXPERT_MASK: u16 = 0x3FF;
const LL_RESERVED: u16 = 0xF << 11;
const NORMAL_CHANNEL_MASK: u16 = 0xFF;
const NORMAL_RESERVED: u16 = 0x7F00;

/// What a Write asks the receiver to do, decoded from its piggyback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// Normal mode: add `tail_inc` to the (source, channel) tail, in order.
    Normal { channel: u8, tail_inc: u16 },
    /// LL data arrival for (buffer, expert, source).
    LlArrival { buffer: u8, expert: u16 },
    /// LL count signal: `count` arrivals for (buffer, expert, source).
    LlCount { buffer: u8, expert: u16, count: u16 },
}

/// Decodes a Write's piggyback and flags per the module table; the error
/// says what is wrong and what is allowed.
pub(crate) fn classify(
    flags: CmdFlags,
    piggyback: Option<Piggyback>,
) -> std::result::Result<Signal, String> {
    let Some(p) = piggyback else {
        return Err(
            "a Write must carry a piggyback (a normal channel or an LL expert); \
                    build it with uep_proxy::cmds"
                .into(),
        );
    };
    if p.slot & LL_BIT == 0 {
        if p.slot & NORMAL_RESERVED != 0 {
            return Err(format!(
                "normal-channel piggyback slot {:#06x} has reserved bits {:#06x} set",
                p.slot,
                p.slot & NORMAL_RESERVED
            ));
        }
        if flags.ll_buffer != 0 {
            return Err("a normal-channel Write must not set the LL buffer flag".into());
        }
        if flags.combine {
            // Rejected rather than dropped: a flag that silently vanishes
            // would hide a producer's mistake.
            return Err(
                "a normal-channel Write cannot carry the combine flag (WriteImm has no combine \
                 bit); give combine its own channels"
                    .into(),
            );
        }
        return Ok(Signal::Normal {
            channel: (p.slot & NORMAL_CHANNEL_MASK) as u8,
            tail_inc: u16::from(p.value),
        });
    }
    if p.slot & LL_RESERVED != 0 {
        return Err(format!(
            "LL piggyback slot {:#06x} has reserved bits {:#06x} set",
            p.slot,
            p.slot & LL_RESERVED
        ));
    }
    if flags.combine {
        return Err(
            "an LL Write cannot carry the combine flag (LlImm has no combine bit); \
                    give combine its own expert indices"
                .into(),
        );
    }
    let expert = p.slot & LL_EXPERT_MASK;
    if p.slot & LL_COUNT_BIT == 0 {
        if p.value != 0 {
            return Err(format!(
                "LL data-arrival piggyback (slot {:#06x}, value {}) must have a zero count",
                p.slot, p.value
            ));
        }
        return Ok(Signal::LlArrival {
            buffer: flags.ll_buffer,
            expert,
        });
    }
    // A count signal may carry data (the last piece of what it counts): a write's
    // immediate is delivered only after its own data is placed, so only the *other*
    // writes need the fence.
    Ok(Signal::LlCount {
        buffer: flags.ll_buffer,
        expert,
        count: u16::from(p.value),
    })
}

fn wire_rank(dst_rank: usize) -> Result<u16> {
    u16::try_from(dst_rank)
        .ok()
        .filter(|_| dst_rank < MAX_RANKS)
        .ok_or_else(|| {
            ProxyError::Invalid(format!(
                "dst_rank {dst_rank} is out of range (allowed 0..{MAX_RANKS})"
            ))
        })
}

fn check(what: &str, value: u64, max: u64) -> Result<()> {
    if value > max {
        return Err(ProxyError::Invalid(format!(
            "{what} {value} is out of range (allowed 0..={max})"
        )));
    }
    Ok(())
}

fn write(
    flags: CmdFlags,
    dst_rank: usize,
    src_off: u64,
    dst_off: u64,
    len: u32,
    slot: u16,
    value: u8,
) -> Result<TransferCmd> {
    Ok(TransferCmd::encode(&Command::Write {
        flags,
        dst_rank: wire_rank(dst_rank)?,
        src_off,
        dst_off,
        len,
        piggyback: Some(Piggyback { slot, value }),
    })?)
}

/// A normal-mode data write of `len` bytes (0 = signal only) from `src_off`
/// here to `dst_off` on `dst_rank`, adding `tail_inc` (at most
/// [`MAX_WRITE_COUNT`], 255; more is an error: split a larger increment over
/// several writes) to the receiver's tail counter of (this rank, `channel`)
/// once this write and every earlier write on that channel have landed.
/// `channel` must be below the layout's `num_channels` (checked by the
/// proxy). Offsets must be 16-byte aligned.
pub fn normal_write(
    dst_rank: usize,
    src_off: u64,
    dst_off: u64,
    len: u32,
    channel: u8,
    tail_inc: u16,
) -> Result<TransferCmd> {
    check("tail_inc", tail_inc.into(), MAX_WRITE_COUNT.into())?;
    write(
        CmdFlags::default(),
        dst_rank,
        src_off,
        dst_off,
        len,
        u16::from(channel),
        // Checked above: at most 255.
        tail_inc as u8,
    )
}

fn ll_flags(buffer: u8) -> Result<CmdFlags> {
    check("LL buffer", buffer.into(), 1)?;
    Ok(CmdFlags {
        combine: false,
        ll_buffer: buffer,
    })
}

/// An LL data write of `len` bytes to `dst_rank`, counted by the receiver as
/// one arrival for (`buffer`, `local_expert`, this rank).
pub fn ll_write(
    dst_rank: usize,
    src_off: u64,
    dst_off: u64,
    len: u32,
    buffer: u8,
    local_expert: u16,
) -> Result<TransferCmd> {
    let to = (dst_rank, src_off, dst_off, len);
    ll(to, buffer, local_expert, None)
}

/// An LL count signal (a zero-length write): "I sent `count` (at most 255)
/// data writes for (`buffer`, `local_expert`)". The receiver stores
/// `(k << 32) | count` in its LL counter once `count` arrivals have been
/// seen, `k` numbering the signals applied (1, 2, ...).
pub fn ll_count(dst_rank: usize, buffer: u8, local_expert: u16, count: u16) -> Result<TransferCmd> {
    ll((dst_rank, 0, 0, 0), buffer, local_expert, Some(count))
}

/// An LL count signal that carries data: `len` bytes from `src_off` to
/// `dst_off`, as the last piece of a block, and "I sent `count` (at most
/// 255) *other* data writes for (`buffer`, `local_expert`)". Its own data
/// needs no fence (it is placed before its immediate is delivered), so a
/// block that fits one write costs one message, signal included.
pub fn ll_write_count(
    dst_rank: usize,
    src_off: u64,
    dst_off: u64,
    len: u32,
    buffer: u8,
    local_expert: u16,
    count: u16,
) -> Result<TransferCmd> {
    let to = (dst_rank, src_off, dst_off, len);
    ll(to, buffer, local_expert, Some(count))
}

/// An LL write to (`dst_rank`, `src_off`, `dst_off`, `len`): a data arrival, or
/// a count signal of `count`.
fn ll(
    (dst_rank, src_off, dst_off, len): (usize, u64, u64, u32),
    buffer: u8,
    local_expert: u16,
    count: Option<u16>,
) -> Result<TransferCmd> {
    check(
        "local_expert",
        local_expert.into(),
        MAX_LOCAL_EXPERTS as u64 - 1,
    )?;
    let (slot, value) = match count {
        None => (LL_BIT | local_expert, 0),
        Some(n) => {
            check("LL count", n.into(), MAX_LL_COUNT.into())?;
            // Checked above: at most 255.
            (LL_BIT | LL_COUNT_BIT | local_expert, n as u8)
        }
    };
    write(
        ll_flags(buffer)?,
        dst_rank,
        src_off,
        dst_off,
        len,
        slot,
        value,
    )
}

/// An emulated atomic add of `value` to `dst_rank`'s generic counter `slot`
/// (the command's target offset is taken from `counters`, which is the same
/// on every rank).
pub fn atomic(
    counters: &CounterLayout,
    dst_rank: usize,
    slot: u16,
    value: i16,
) -> Result<TransferCmd> {
    let dst_off = counters.atomic(slot.into())?;
    Ok(TransferCmd::encode(&Command::Atomic {
        flags: CmdFlags::default(),
        dst_rank: wire_rank(dst_rank)?,
        dst_off,
        slot,
        value: value.into(),
    })?)
}

/// A barrier across the peers in `scope`; `seq` numbers the barriers of
/// this rank, starting at 1 and increasing by one per barrier.
pub fn barrier(scope: BarrierScope, seq: u32) -> Result<TransferCmd> {
    if seq == 0 {
        return Err(ProxyError::Invalid(
            "barrier seq 0 is reserved (counters start at 0); number barriers from 1".into(),
        ));
    }
    Ok(TransferCmd::encode(&Command::Barrier { scope, seq })?)
}

/// A Quiet: popped only once every earlier command of its FIFO completed.
pub fn quiet() -> TransferCmd {
    // A Quiet has no fields: its encoding is just the kind (tested below).
    TransferCmd {
        word0: Kind::Quiet as u64,
        word1: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parts(cmd: TransferCmd) -> (CmdFlags, u16, u64, u64, u32, Option<Piggyback>) {
        match cmd.decode().unwrap() {
            Command::Write {
                flags,
                dst_rank,
                src_off,
                dst_off,
                len,
                piggyback,
            } => (flags, dst_rank, src_off, dst_off, len, piggyback),
            other => panic!("not a write: {other:?}"),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn normal_roundtrip(dst in 0usize..MAX_RANKS, src_off in 0u64..1 << 30, dst_off in 0u64..1 << 30,
                            len in 0u32..1 << 24, channel: u8, inc in 0u16..=255) {
            let cmd = normal_write(dst, src_off * 16, dst_off * 16, len, channel, inc).unwrap();
            let (flags, d, s, o, l, p) = parts(cmd);
            prop_assert_eq!((d as usize, s, o, l), (dst, src_off * 16, dst_off * 16, len));
            prop_assert_eq!(
                classify(flags, p),
                Ok(Signal::Normal { channel, tail_inc: inc })
            );
        }

        #[test]
        fn ll_roundtrip(dst in 0usize..MAX_RANKS, buffer in 0u8..2, expert in 0u16..1024,
                        count in 0..=MAX_LL_COUNT, len in 0u32..1 << 24) {
            let cmd = ll_write(dst, 32, 64, len, buffer, expert).unwrap();
            let (flags, d, s, o, l, p) = parts(cmd);
            prop_assert_eq!((d as usize, s, o, l), (dst, 32, 64, len));
            prop_assert_eq!(classify(flags, p), Ok(Signal::LlArrival { buffer, expert }));
            let cmd = ll_count(dst, buffer, expert, count).unwrap();
            let (flags, d, _, _, l, p) = parts(cmd);
            prop_assert_eq!((d as usize, l), (dst, 0));
            prop_assert_eq!(classify(flags, p), Ok(Signal::LlCount { buffer, expert, count }));
            let cmd = ll_write_count(dst, 32, 64, len, buffer, expert, count).unwrap();
            let (flags, d, s, o, l, p) = parts(cmd);
            prop_assert_eq!((d as usize, s, o, l), (dst, 32, 64, len));
            prop_assert_eq!(classify(flags, p), Ok(Signal::LlCount { buffer, expert, count }));
        }

        /// Any piggyback either classifies and re-encodes to itself through
        /// the helpers, or is rejected; never both readings.
        #[test]
        fn classify_is_unambiguous(slot in 0u16..0xFFFF, value: u8, combine: bool, buf in 0u8..2,
                                   len in 0u32..3) {
            let flags = CmdFlags { combine, ll_buffer: buf };
            let p = Some(Piggyback { slot, value });
            if let Ok(sig) = classify(flags, p) {
                let cmd = match sig {
                    Signal::Normal { channel, tail_inc } =>
                        normal_write(0, 0, 0, len, channel, tail_inc).unwrap(),
                    Signal::LlArrival { buffer, expert } => ll_write(0, 0, 0, len, buffer, expert).unwrap(),
                    Signal::LlCount { buffer, expert, count } =>
                        ll_write_count(0, 0, 0, len, buffer, expert, count).unwrap(),
                };
                let (_, _, _, _, _, p2) = parts(cmd);
                prop_assert_eq!(p2, p);
            }
        }
    }

    #[test]
    fn helpers_reject_out_of_range() {
        assert!(normal_write(MAX_RANKS - 1, 0, 0, 0, 0, 0).is_ok());
        assert!(normal_write(MAX_RANKS, 0, 0, 0, 0, 0).is_err());
        let msg = normal_write(0, 0, 0, 0, 0, 256).unwrap_err().to_string();
        assert!(
            msg.contains("tail_inc 256") && msg.contains("0..=255"),
            "{msg}"
        );
        // Every u8 channel encodes (the layout bounds it at the proxy).
        assert!(normal_write(0, 0, 0, 0, 255, 255).is_ok());
        assert!(normal_write(0, 8, 0, 16, 0, 0).is_err(), "misaligned src");
        assert!(ll_write(0, 0, 0, 0, 2, 0).is_err());
        assert!(ll_write(0, 0, 0, 0, 0, 1024).is_err());
        assert!(ll_count(0, 0, 0, MAX_LL_COUNT + 1).is_err());
        assert!(ll_count(MAX_RANKS - 1, 0, 0, MAX_LL_COUNT).is_ok());
        assert!(barrier(BarrierScope::AllPeers, 0).is_err());
        let l = CounterLayout {
            num_ranks: 1,
            num_atomic_slots: 2,
            atomic_base: 64,
            ..CounterLayout::default()
        };
        assert!(atomic(&l, 0, 2, 1).is_err());
        let a = atomic(&l, 0, 1, -3).unwrap().decode().unwrap();
        assert_eq!(
            a,
            Command::Atomic {
                flags: CmdFlags::default(),
                dst_rank: 0,
                dst_off: 72,
                slot: 1,
                value: -3
            }
        );
        assert_eq!(quiet().decode().unwrap(), Command::Quiet);
        assert_eq!(
            barrier(BarrierScope::SameRail, 7)
                .unwrap()
                .decode()
                .unwrap(),
            Command::Barrier {
                scope: BarrierScope::SameRail,
                seq: 7
            }
        );
    }

    #[test]
    fn classify_rejects_what_it_cannot_map() {
        let f = CmdFlags::default();
        assert!(classify(f, None).unwrap_err().contains("piggyback"));
        let p = |slot, value| Some(Piggyback { slot, value });
        assert!(classify(f, p(0x0100, 0)).is_err(), "normal reserved bit");
        assert!(classify(f, p(0x4000, 0)).is_err(), "normal reserved bit");
        assert!(classify(f, p(0xA000, 0)).is_err(), "LL reserved bit");
        assert!(classify(f, p(0x8000, 1)).is_err(), "arrival with count");
        // The paper's count bits 8..=9 (slot bits 11..=12) are reserved now.
        assert!(
            classify(f, p(0x8C00, 0)).is_err(),
            "LL count's old high bits"
        );
        let llb = CmdFlags {
            combine: false,
            ll_buffer: 1,
        };
        assert!(classify(llb, p(3, 1)).is_err(), "normal with LL buffer");
        let comb = CmdFlags {
            combine: true,
            ll_buffer: 0,
        };
        assert!(classify(comb, p(0x8000, 0)).is_err(), "LL with combine");
        assert!(
            classify(comb, p(3, 9)).unwrap_err().contains("combine"),
            "normal with combine"
        );
        assert_eq!(
            classify(f, p(200, 255)),
            Ok(Signal::Normal {
                channel: 200,
                tail_inc: 255
            })
        );
    }
}
