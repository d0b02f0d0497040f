//! The kernels' headers, built for the host, against the Rust definitions they must
//! equal: the FP8 and NVFP4 numerics (`uep_ep::quant`), bf16 rounding, the command
//! encoding (`uep_wire`) and the FIFO layout (`uep_fifo`). No GPU needed; the device
//! build of the same headers is compared on a GPU by `uep gpu check` and `uep gpu fifo`.

use proptest::prelude::*;
use uep_cuda::host_check as dev;
use uep_ep::quant;
use uep_wire::{CmdFlags, Command, TransferCmd};

#[test]
fn e4m3_equals_quant_on_every_bf16_times_scales() {
    // Every bf16 input times inverse scales that cover normal, subnormal, saturating
    // and power-of-two products.
    let invs = [
        1.0f32,
        0.5,
        3.0,
        1.0 / 0.007,
        448.0 / 3.1,
        1e-3,
        7.5e4,
        2f32.powi(-9),
    ];
    for bits in 0..=u16::MAX {
        let x = dev::bf16_to_f32(bits);
        assert_eq!(x.to_bits(), quant::bf16_bits_to_f32(bits).to_bits());
        for inv in invs {
            let v = x * inv;
            assert_eq!(dev::e4m3(v), quant::e4m3_from_f32(v), "x {x:e} * {inv:e}");
        }
    }
}

#[test]
fn e4m3_equals_quant_on_f32_edges() {
    let edges = [
        0.0f32,
        -0.0,
        448.0,
        -448.0,
        464.0,
        480.0,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        2f32.powi(-6),
        2f32.powi(-9),
        2f32.powi(-10),
        1e-45,
    ];
    for x in edges {
        assert_eq!(dev::e4m3(x), quant::e4m3_from_f32(x), "{x:e}");
        assert_eq!(dev::e4m3(-x), quant::e4m3_from_f32(-x), "{:e}", -x);
    }
}

#[test]
fn e4m3_decodes_every_byte_as_quant() {
    for b in 0..=u8::MAX {
        assert_eq!(
            dev::e4m3_to_f32(b).to_bits(),
            quant::e4m3_to_f32(b).to_bits(),
            "{b:#04x}"
        );
    }
}

#[test]
fn nvfp4_numerics_equal_quant_on_edges() {
    let edges = [
        0.0f32,
        0.25,
        0.2500001,
        0.75,
        1.25,
        1.75,
        2.5,
        3.5,
        5.0,
        5.0001,
        6.0,
        f32::MAX,
        f32::INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        f32::from_bits(1 << 22),
        f32::from_bits((1 << 22) + 1),
        1e-45,
    ];
    for x in edges.into_iter().flat_map(|x| [x, -x]) {
        assert_eq!(dev::e2m1(x), quant::e2m1_from_f32(x), "{x:e}");
        assert_eq!(dev::ue8m0_round_up(x), quant::ue8m0_round_up(x), "{x:e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(20_000))]

    #[test]
    fn nvfp4_numerics_equal_quant_on_any_f32(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assert_eq!(dev::e2m1(x), quant::e2m1_from_f32(x));
        prop_assert_eq!(dev::ue8m0_round_up(x), quant::ue8m0_round_up(x));
    }

    #[test]
    fn bf16_rounding_equals_quant_on_any_f32(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assert_eq!(dev::bf16_from_f32(x), quant::bf16_bits_from_f32(x));
    }

    #[test]
    fn e4m3_equals_quant_on_any_f32(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assert_eq!(dev::e4m3(x), quant::e4m3_from_f32(x));
    }

    #[test]
    fn scale_equals_quant(bits in any::<u32>(), round in any::<bool>()) {
        let amax = f32::from_bits(bits & 0x7fff_ffff);
        prop_assert_eq!(
            dev::fp8_scale(amax, round).to_bits(),
            quant::fp8_scale(amax, round).to_bits()
        );
    }

    #[test]
    fn write_cmd_equals_the_wire_encoder(
        rank in 0..uep_wire::MAX_RANKS as u16,
        src in 0u64..(1 << 32),
        dst in 0u64..(1 << 32),
        len in 0u32..(1 << 24),
        combine in any::<bool>(),
        ll_buffer in any::<bool>(),
    ) {
        let flags = CmdFlags { combine, ll_buffer: u8::from(ll_buffer) };
        let want = TransferCmd::encode(&Command::Write {
            flags,
            dst_rank: rank,
            src_off: src << 4,
            dst_off: dst << 4,
            len,
            piggyback: None,
        })
        .unwrap();
        let bits = u64::from(combine) << 4 | u64::from(ll_buffer) << 5;
        let got = dev::write_cmd(rank.into(), src << 4, dst << 4, len, bits);
        prop_assert_eq!(got, (want.word0, want.word1));
    }
}

proptest! {
    #[test]
    fn ll_write_cmd_equals_the_proxys_encoder(
        rank in 0..uep_wire::MAX_RANKS,
        src in 0u64..(1 << 32),
        dst in 0u64..(1 << 32),
        len in 0u32..(1 << 24),
        kind in 0u8..2,
        key in 0u16..uep_wire::MAX_LOCAL_EXPERTS as u16,
    ) {
        let want = uep_proxy::cmds::ll_write(rank, src << 4, dst << 4, len, kind, key).unwrap();
        let got = dev::ll_write_cmd(rank as u32, (src << 4, dst << 4, len), kind.into(), key.into());
        prop_assert_eq!(got, (want.word0, want.word1));
    }
}

proptest! {
    #[test]
    fn normal_write_cmd_equals_the_proxys_encoder(
        rank in 0..uep_wire::MAX_RANKS,
        src in 0u64..(1 << 32),
        dst in 0u64..(1 << 32),
        len in 0u32..(1 << 24),
        channel in any::<u8>(),
        inc in 0u16..256,
    ) {
        let want = uep_proxy::cmds::normal_write(rank, src << 4, dst << 4, len, channel, inc).unwrap();
        let got = dev::normal_write_cmd(rank as u32, (src << 4, dst << 4, len), channel.into(), inc.into());
        prop_assert_eq!(got, (want.word0, want.word1));
    }
}

#[test]
fn fifo_layout_is_uep_fifos() {
    let want = [
        uep_fifo::HEAD_OFFSET,
        uep_fifo::TAIL_OFFSET,
        uep_fifo::HEADER_BYTES,
    ];
    assert_eq!(dev::fifo_layout(), want.map(|v| v as u64));
}
