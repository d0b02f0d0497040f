//! Property and layout tests of the wire format.

use proptest::prelude::*;
use uep_wire::*;

fn flags() -> impl Strategy<Value = CmdFlags> {
    (any::<bool>(), 0u8..=1).prop_map(|(combine, ll_buffer)| CmdFlags { combine, ll_buffer })
}

fn scope() -> impl Strategy<Value = BarrierScope> {
    prop_oneof![
        Just(BarrierScope::AllPeers),
        Just(BarrierScope::SameRail),
        Just(BarrierScope::NodeLeader)
    ]
}

/// Offsets biased towards the edges of the range as well as uniform.
fn write_off() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(MAX_OFFSET),
        (0..=MAX_OFFSET >> 4).prop_map(|x| x << 4)
    ]
}

/// Ranks, the edges of the 10-bit field as well as uniform.
fn rank() -> impl Strategy<Value = u16> {
    prop_oneof![Just(0u16), Just(MAX_RANKS as u16 - 1), 0..MAX_RANKS as u16]
}

fn command() -> impl Strategy<Value = Command> {
    let write = (
        flags(),
        rank(),
        write_off(),
        write_off(),
        prop_oneof![Just(0u32), Just(MAX_WRITE_LEN), 0..=MAX_WRITE_LEN],
        proptest::option::of((0..=MAX_PIGGYBACK_SLOT, any::<u8>())),
    )
        .prop_map(
            |(flags, dst_rank, src_off, dst_off, len, p)| Command::Write {
                flags,
                dst_rank,
                src_off,
                dst_off,
                len,
                piggyback: p.map(|(slot, value)| Piggyback { slot, value }),
            },
        );
    let atomic = (
        flags(),
        rank(),
        prop_oneof![
            Just(MAX_ATOMIC_OFFSET),
            (0..=MAX_ATOMIC_OFFSET >> 2).prop_map(|x| x << 2)
        ],
        any::<u16>(),
        any::<i32>(),
    )
        .prop_map(|(flags, dst_rank, dst_off, slot, value)| Command::Atomic {
            flags,
            dst_rank,
            dst_off,
            slot,
            value,
        });
    let barrier = (scope(), any::<u32>()).prop_map(|(scope, seq)| Command::Barrier { scope, seq });
    prop_oneof![4 => write, 3 => atomic, 1 => Just(Command::Quiet), 2 => barrier]
}

fn imm() -> impl Strategy<Value = Imm> {
    // Edges of every field as well as uniform values.
    let write = (
        prop_oneof![
            Just(0u16),
            Just(MAX_STREAMS as u16 - 1),
            0..MAX_STREAMS as u16
        ],
        prop_oneof![
            Just(WRITE_SEQ_MODULUS as u16 - 1),
            0..WRITE_SEQ_MODULUS as u16
        ],
        prop_oneof![Just(MAX_WRITE_COUNT), 0..=MAX_WRITE_COUNT],
    )
        .prop_map(|(stream, seq, count)| Imm::Write(WriteImm { stream, seq, count }));
    let signal = prop_oneof![
        Just(LlSignal::Arrival),
        (0..=MAX_LL_COUNT).prop_map(LlSignal::Count)
    ];
    let ll = (0u8..=1, 0..MAX_LOCAL_EXPERTS as u16, rank(), signal).prop_map(
        |(buffer, expert, src_rank, signal)| {
            Imm::Ll(LlImm {
                buffer,
                expert,
                src_rank,
                signal,
            })
        },
    );
    let atomic = (0..MAX_ATOMIC_SLOTS as u16, any::<i16>())
        .prop_map(|(slot, value)| Imm::Atomic(AtomicImm { slot, value }));
    let barrier = (scope(), rank(), 0..BARRIER_SEQ_MODULUS).prop_map(|(scope, src_rank, seq)| {
        Imm::Barrier(BarrierImm {
            scope,
            src_rank,
            seq,
        })
    });
    prop_oneof![write, ll, atomic, barrier]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn command_round_trips(cmd in command()) {
        let t = TransferCmd::encode(&cmd).unwrap();
        prop_assert_ne!(t.word0, 0, "a valid command's word0 is never zero");
        prop_assert_eq!(t.kind(), Some(cmd.kind()));
        if let Command::Write { dst_rank, .. } | Command::Atomic { dst_rank, .. } = cmd {
            prop_assert_eq!(t.rank_field(), dst_rank);
        }
        prop_assert_eq!(t.decode().unwrap(), cmd);
        prop_assert_eq!(TransferCmd::from_bytes(t.to_bytes()), t);
        prop_assert_eq!(TransferCmd::from_u128(t.to_u128()), t);
        prop_assert_eq!(Command::try_from(t).unwrap(), cmd);
    }

    #[test]
    fn arbitrary_words_decode_canonically(w in any::<u128>()) {
        let t = TransferCmd::from_u128(w);
        if let Ok(cmd) = t.decode() {
            prop_assert_eq!(TransferCmd::encode(&cmd).unwrap(), t);
        }
    }

    /// Random words rarely decode; flipping a few bits of valid commands
    /// exercises the reserved-bit checks near the valid set.
    #[test]
    fn mutated_words_decode_canonically(cmd in command(), flips in proptest::collection::vec(0u32..128, 1..4)) {
        let mut w = TransferCmd::encode(&cmd).unwrap().to_u128();
        for bit in flips {
            w ^= 1u128 << bit;
        }
        let t = TransferCmd::from_u128(w);
        match t.decode() {
            Ok(c) => prop_assert_eq!(TransferCmd::encode(&c).unwrap(), t),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn misaligned_or_large_offsets_are_rejected(
        off in prop_oneof![any::<u64>(), any::<u64>().prop_map(|x| x & !15), 0..=MAX_OFFSET + 64],
        rank in rank(),
    ) {
        let write = Command::Write {
            flags: CmdFlags::default(), dst_rank: rank, src_off: 0, dst_off: off, len: 1, piggyback: None,
        };
        let r = TransferCmd::encode(&write);
        if off % 16 != 0 {
            prop_assert!(matches!(r, Err(WireError::Misaligned { field: "dst_off", align: 16, .. })), "{:?}", r);
        } else if off > MAX_OFFSET {
            prop_assert!(matches!(r, Err(WireError::OutOfRange { field: "dst_off", .. })), "{:?}", r);
        } else {
            prop_assert_eq!(r.unwrap().decode().unwrap(), write);
        }
        let atomic = Command::Atomic { flags: CmdFlags::default(), dst_rank: rank, dst_off: off, slot: 0, value: -1 };
        let r = TransferCmd::encode(&atomic);
        if off % 4 != 0 {
            prop_assert!(matches!(r, Err(WireError::Misaligned { field: "dst_off", align: 4, .. })), "{:?}", r);
        } else if off > MAX_ATOMIC_OFFSET {
            prop_assert!(matches!(r, Err(WireError::OutOfRange { field: "dst_off", .. })), "{:?}", r);
        } else {
            prop_assert_eq!(r.unwrap().decode().unwrap(), atomic);
        }
    }

    #[test]
    fn large_lengths_are_rejected(len in MAX_WRITE_LEN + 1..=u32::MAX) {
        let write = Command::Write {
            flags: CmdFlags::default(), dst_rank: 0, src_off: 0, dst_off: 0, len, piggyback: None,
        };
        let err = TransferCmd::encode(&write).unwrap_err();
        prop_assert_eq!(err, WireError::OutOfRange {
            field: "len", value: len.into(), min: 0, max: MAX_WRITE_LEN.into(),
        });
    }

    #[test]
    fn ranks_past_the_field_are_rejected(rank in MAX_RANKS as u16.., cmd in command()) {
        fn field_of<T: std::fmt::Debug>(r: Result<T, WireError>) -> (&'static str, i128) {
            match r {
                Err(WireError::OutOfRange { field, max, .. }) => (field, max),
                other => panic!("expected OutOfRange, got {other:?}"),
            }
        }
        let top = MAX_RANKS as i128 - 1;
        match cmd {
            Command::Write { .. } | Command::Atomic { .. } => {
                let mut c = cmd;
                if let Command::Write { dst_rank, .. } | Command::Atomic { dst_rank, .. } = &mut c {
                    *dst_rank = rank;
                }
                prop_assert_eq!(field_of(TransferCmd::encode(&c)), ("dst_rank", top));
            }
            _ => {}
        }
        let ll = LlImm { buffer: 0, expert: 0, src_rank: rank, signal: LlSignal::Arrival };
        prop_assert_eq!(field_of(ll.encode()), ("LlImm.src_rank", top));
        let b = BarrierImm { scope: BarrierScope::AllPeers, src_rank: rank, seq: 0 };
        prop_assert_eq!(field_of(b.encode()), ("BarrierImm.src_rank", top));
    }

    #[test]
    fn imm_round_trips(i in imm()) {
        let w = i.encode().unwrap();
        prop_assert_eq!(Imm::decode(w).unwrap(), i);
        // The typed decoders agree with the dispatcher and reject other tags.
        prop_assert_eq!(WriteImm::decode(w).ok().map(Imm::Write).is_some(), matches!(i, Imm::Write(_)));
        prop_assert_eq!(LlImm::decode(w).ok().map(Imm::Ll).is_some(), matches!(i, Imm::Ll(_)));
        prop_assert_eq!(AtomicImm::decode(w).ok().map(Imm::Atomic).is_some(), matches!(i, Imm::Atomic(_)));
        prop_assert_eq!(BarrierImm::decode(w).ok().map(Imm::Barrier).is_some(), matches!(i, Imm::Barrier(_)));
        match i {
            Imm::Write(x) => prop_assert_eq!(x.encode().unwrap(), w),
            Imm::Ll(x) => prop_assert_eq!(x.encode().unwrap(), w),
            Imm::Atomic(x) => prop_assert_eq!(x.encode().unwrap(), w),
            Imm::Barrier(x) => prop_assert_eq!(x.encode().unwrap(), w),
        }
    }

    #[test]
    fn arbitrary_imms_decode_canonically(w in any::<u32>()) {
        if let Ok(i) = Imm::decode(w) {
            prop_assert_eq!(i.encode().unwrap(), w);
        }
        for i in [
            WriteImm::decode(w).map(Imm::from),
            LlImm::decode(w).map(Imm::from),
            AtomicImm::decode(w).map(Imm::from),
            BarrierImm::decode(w).map(Imm::from),
        ]
        .into_iter()
        .flatten()
        {
            prop_assert_eq!(i.encode().unwrap(), w);
            prop_assert_eq!(Imm::decode(w).unwrap(), i);
        }
    }

    #[test]
    fn out_of_range_imm_fields_are_rejected(
        stream in MAX_STREAMS as u16..,
        seq in WRITE_SEQ_MODULUS as u16..,
        count in MAX_WRITE_COUNT + 1..,
        expert in MAX_LOCAL_EXPERTS as u16..,
        ll_count in MAX_LL_COUNT + 1..,
        buffer in 2u8..,
        slot in MAX_ATOMIC_SLOTS as u16..,
        bseq in BARRIER_SEQ_MODULUS..,
    ) {
        let ok_w = WriteImm { stream: 0, seq: 0, count: 0 };
        let field_of = |r: Result<u32, WireError>| match r {
            Err(WireError::OutOfRange { field, .. }) => field,
            other => panic!("expected OutOfRange, got {other:?}"),
        };
        prop_assert_eq!(field_of(WriteImm { stream, ..ok_w }.encode()), "WriteImm.stream");
        prop_assert_eq!(field_of(WriteImm { seq, ..ok_w }.encode()), "WriteImm.seq");
        prop_assert_eq!(field_of(WriteImm { count, ..ok_w }.encode()), "WriteImm.count");
        let ok_l = LlImm { buffer: 0, expert: 0, src_rank: 0, signal: LlSignal::Arrival };
        prop_assert_eq!(field_of(LlImm { expert, ..ok_l }.encode()), "LlImm.expert");
        prop_assert_eq!(field_of(LlImm { buffer, ..ok_l }.encode()), "LlImm.buffer");
        prop_assert_eq!(field_of(LlImm { signal: LlSignal::Count(ll_count), ..ok_l }.encode()), "LlImm.count");
        prop_assert_eq!(field_of(AtomicImm { slot, value: 0 }.encode()), "AtomicImm.slot");
        prop_assert_eq!(
            field_of(BarrierImm { scope: BarrierScope::AllPeers, src_rank: 0, seq: bseq }.encode()),
            "BarrierImm.seq"
        );
        prop_assert_eq!(WriteImm::wrap_seq(u64::from(seq)), seq % WRITE_SEQ_MODULUS as u16);
        prop_assert!(u32::from(WriteImm::wrap_seq(u64::from(seq))) < WRITE_SEQ_MODULUS);
        prop_assert!(BarrierImm::wrap_seq(u64::from(bseq)) < BARRIER_SEQ_MODULUS);
    }
}

/// Pins the documented layout: a change to the bit layout must fail here.
// Binary literals are grouped by field (tag, flags, ...), not by nibble.
#[allow(clippy::unusual_byte_groupings)]
#[test]
fn golden_words() {
    let write = Command::Write {
        flags: CmdFlags {
            combine: true,
            ll_buffer: 1,
        },
        dst_rank: 0x2AB,
        src_off: 0x1234_5670,
        dst_off: 0xF_FFFF_FFF0,
        len: 0x00AB_CDEF,
        piggyback: Some(Piggyback {
            slot: 0x0102,
            value: 0x7F,
        }),
    };
    let t = TransferCmd::encode(&write).unwrap();
    // Type byte 0x31 (kind 1, combine, LL buffer 1) | 0x2AB << 6.
    assert_eq!(t.word0, 0x7FAB_CDEF_0102_AAF1);
    assert_eq!(t.word1, 0x0123_4567_FFFF_FFFF);
    assert_eq!(
        t.to_bytes(),
        [
            0xF1, 0xAA, 0x02, 0x01, 0xEF, 0xCD, 0xAB, 0x7F, 0xFF, 0xFF, 0xFF, 0xFF, 0x67, 0x45,
            0x23, 0x01
        ]
    );

    let no_piggy = Command::Write {
        flags: CmdFlags::default(),
        dst_rank: 3,
        src_off: 16,
        dst_off: 32,
        len: 0,
        piggyback: None,
    };
    let t = TransferCmd::encode(&no_piggy).unwrap();
    assert_eq!(
        (t.word0, t.word1),
        (0x0000_0000_FFFF_00C1, 0x0000_0001_0000_0002)
    );

    let atomic = Command::Atomic {
        flags: CmdFlags {
            combine: false,
            ll_buffer: 1,
        },
        dst_rank: 7,
        dst_off: MAX_ATOMIC_OFFSET,
        slot: 0xBEEF,
        value: -2,
    };
    let t = TransferCmd::encode(&atomic).unwrap();
    assert_eq!(
        (t.word0, t.word1),
        (0xFFFF_FFFE_BEEF_01E2, 0x0000_0003_FFFF_FFFF)
    );

    let t = TransferCmd::encode(&Command::Quiet).unwrap();
    assert_eq!((t.word0, t.word1), (3, 0));

    let barrier = Command::Barrier {
        scope: BarrierScope::SameRail,
        seq: 0xDEAD_BEEF,
    };
    let t = TransferCmd::encode(&barrier).unwrap();
    assert_eq!((t.word0, t.word1), (0xDEAD_BEEF_0000_0044, 0));
    // The last rank a command can address.
    let last = Command::Write {
        flags: CmdFlags::default(),
        dst_rank: 1023,
        src_off: 0,
        dst_off: 0,
        len: 0,
        piggyback: None,
    };
    let t = TransferCmd::encode(&last).unwrap();
    assert_eq!(t.word0, 0x0000_0000_FFFF_FFC1);

    let w = WriteImm {
        stream: 1023,
        seq: 0xABC,
        count: 0xFF,
    }
    .encode()
    .unwrap();
    assert_eq!(w, 0b00_1111111111_101010111100_11111111);
    // A stream above the old 6-bit channel field (64 ranks x channels).
    let w = WriteImm {
        stream: 0x2A5,
        seq: 1,
        count: 1,
    }
    .encode()
    .unwrap();
    assert_eq!(w, 0b00_1010100101_000000000001_00000001);
    assert_eq!(
        WriteImm::decode(w).unwrap(),
        WriteImm {
            stream: 0x2A5,
            seq: 1,
            count: 1
        }
    );
    let l = LlImm {
        buffer: 1,
        expert: 1023,
        src_rank: 0x2A5,
        signal: LlSignal::Count(255),
    }
    .encode()
    .unwrap();
    assert_eq!(l, 0b01_1_1_1111111111_1010100101_11111111);
    let l = LlImm {
        buffer: 0,
        expert: 1,
        src_rank: 2,
        signal: LlSignal::Arrival,
    }
    .encode()
    .unwrap();
    assert_eq!(l, 0b01_0_0_0000000001_0000000010_00000000);
    let a = AtomicImm {
        slot: 0x3FFF,
        value: -1,
    }
    .encode()
    .unwrap();
    assert_eq!(a, 0xBFFF_FFFF);
    let b = BarrierImm {
        scope: BarrierScope::NodeLeader,
        src_rank: 0x2A5,
        seq: 0x3_FFFF,
    }
    .encode()
    .unwrap();
    assert_eq!(b, 0b11_10_1010100101_111111111111111111);
}

#[test]
fn invalid_words_are_rejected_with_reasons() {
    assert_eq!(
        TransferCmd { word0: 0, word1: 5 }.decode(),
        Err(WireError::ZeroWord0)
    );
    for kind in [0u64, 5, 0xF] {
        let t = TransferCmd {
            word0: kind | 0x100,
            word1: 0,
        };
        assert_eq!(t.decode(), Err(WireError::UnknownKind { kind: kind as u8 }));
    }
    // Quiet: every bit but the kind is reserved.
    for bit in 4..128u32 {
        let t = TransferCmd::from_u128(3 | 1u128 << bit);
        assert!(
            matches!(
                t.decode(),
                Err(WireError::ReservedBits { kind: "Quiet", .. })
            ),
            "bit {bit}"
        );
    }
    // Barrier: flags, bits 16..=31 and word1 are reserved; scope 3.. invalid.
    for bit in [4u32, 5, 16, 31, 64, 127] {
        let t = TransferCmd::from_u128(4 | 1u128 << bit);
        assert!(
            matches!(
                t.decode(),
                Err(WireError::ReservedBits {
                    kind: "Barrier",
                    ..
                })
            ),
            "bit {bit}"
        );
    }
    let t = TransferCmd {
        word0: 4 | 3 << 6,
        word1: 0,
    };
    assert!(matches!(
        t.decode(),
        Err(WireError::InvalidValue {
            field: "barrier scope",
            value: 3,
            ..
        })
    ));
    // Atomic: word1 bits 34.. reserved.
    let t = TransferCmd {
        word0: 2,
        word1: 1 << 34,
    };
    assert_eq!(
        t.decode(),
        Err(WireError::ReservedBits {
            kind: "Atomic",
            word: 1,
            bits: 1 << 34
        })
    );
    // Write without piggyback must have a zero piggyback value.
    let t = TransferCmd {
        word0: 1 | 0xFFFF << 16 | 1 << 56,
        word1: 0,
    };
    assert_eq!(
        t.decode(),
        Err(WireError::ReservedBits {
            kind: "Write",
            word: 0,
            bits: 1 << 56
        })
    );
    // Encoder-side enum-ish limits.
    let bad_flags = Command::Atomic {
        flags: CmdFlags {
            combine: false,
            ll_buffer: 2,
        },
        dst_rank: 0,
        dst_off: 0,
        slot: 0,
        value: 0,
    };
    assert!(matches!(
        TransferCmd::encode(&bad_flags),
        Err(WireError::OutOfRange {
            field: "ll_buffer",
            value: 2,
            max: 1,
            ..
        })
    ));
    let bad_slot = Command::Write {
        flags: CmdFlags::default(),
        dst_rank: 0,
        src_off: 0,
        dst_off: 0,
        len: 0,
        piggyback: Some(Piggyback {
            slot: PIGGYBACK_NONE,
            value: 0,
        }),
    };
    let err = TransferCmd::encode(&bad_slot).unwrap_err();
    assert_eq!(
        err.to_string(),
        "piggyback.slot = 65535 is out of range (allowed 0..=65534)"
    );
    // Immediates: tags and reserved bits.
    let w = WriteImm {
        stream: 1,
        seq: 2,
        count: 3,
    }
    .encode()
    .unwrap();
    let err = LlImm::decode(w).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("immediate {w:#010x} has tag 0 (WriteImm), expected tag 1 (LlImm)")
    );
    assert!(matches!(
        LlImm::decode(1 << 30 | 5),
        Err(WireError::ReservedImmBits { bits: 5, .. })
    ));
    assert!(matches!(
        BarrierImm::decode(0xF000_0000),
        Err(WireError::InvalidValue {
            field: "BarrierImm.scope",
            value: 3,
            ..
        })
    ));
    assert!(Imm::decode(0xF000_0000).is_err());
}

/// The documented `WriteImm` limits, and the errors just past them.
#[test]
fn write_imm_limits() {
    assert_eq!(
        (
            MAX_STREAMS,
            WRITE_SEQ_BITS,
            WRITE_SEQ_MODULUS,
            MAX_WRITE_COUNT
        ),
        (1024, 12, 4096, 255)
    );
    let ok = WriteImm {
        stream: MAX_STREAMS as u16 - 1,
        seq: WRITE_SEQ_MODULUS as u16 - 1,
        count: MAX_WRITE_COUNT,
    };
    assert_eq!(ok.encode().unwrap(), 0x3FFF_FFFF);
    let err = |w: WriteImm| w.encode().unwrap_err().to_string();
    assert_eq!(
        err(WriteImm { count: 256, ..ok }),
        "WriteImm.count = 256 is out of range (allowed 0..=255)"
    );
    assert_eq!(
        err(WriteImm { stream: 1024, ..ok }),
        "WriteImm.stream = 1024 is out of range (allowed 0..=1023)"
    );
    assert_eq!(
        err(WriteImm { seq: 4096, ..ok }),
        "WriteImm.seq = 4096 is out of range (allowed 0..=4095)"
    );
}
