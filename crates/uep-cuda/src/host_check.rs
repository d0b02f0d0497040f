//! The kernels' headers compiled for the host (`kernels/host_check.cpp`), wrapped
//! safely, so tests compare the device code's numerics and command encoding with the
//! Rust definitions on any machine.

mod ffi {
    extern "C" {
        pub fn uep_cuda_host_e4m3(x: f32) -> u8;
        pub fn uep_cuda_host_e4m3_to_f32(b: u8) -> f32;
        pub fn uep_cuda_host_fp8_scale(amax: f32, round_scale: i32) -> f32;
        pub fn uep_cuda_host_bf16_to_f32(bits: u16) -> f32;
        pub fn uep_cuda_host_bf16_from_f32(x: f32) -> u16;
        pub fn uep_cuda_host_e2m1(x: f32) -> u8;
        pub fn uep_cuda_host_ue8m0_round_up(x: f32) -> u8;
        pub fn uep_cuda_host_write_cmd(
            dst_rank: u32,
            src_off: u64,
            dst_off: u64,
            len: u32,
            flags: u64,
            out: *mut u64,
        );
        pub fn uep_cuda_host_ll_write_cmd(
            dst_rank: u32,
            src_off: u64,
            dst_off: u64,
            len: u32,
            kind: u32,
            key: u32,
            out: *mut u64,
        );
        pub fn uep_cuda_host_normal_write_cmd(
            dst_rank: u32,
            src_off: u64,
            dst_off: u64,
            len: u32,
            channel: u32,
            tail_inc: u32,
            out: *mut u64,
        );
        pub fn uep_cuda_host_fifo_layout(out: *mut u64);
    }
}

/// Safe wrappers of the header functions that are pure functions of their arguments.
macro_rules! pure {
    ($($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $ffi:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: a pure function of its arguments, which are plain values.
            #[allow(unsafe_code)]
            unsafe { ffi::$ffi($($arg),*) }
        }
    )*};
}

pure! {
    /// `numerics.cuh`'s `e4m3_from_f32`.
    e4m3(x: f32) -> u8 = uep_cuda_host_e4m3;
    /// `numerics.cuh`'s `e4m3_to_f32`.
    e4m3_to_f32(b: u8) -> f32 = uep_cuda_host_e4m3_to_f32;
    /// `numerics.cuh`'s `bf16_to_f32`.
    bf16_to_f32(bits: u16) -> f32 = uep_cuda_host_bf16_to_f32;
    /// `numerics.cuh`'s `bf16_from_f32`.
    bf16_from_f32(x: f32) -> u16 = uep_cuda_host_bf16_from_f32;
    /// `numerics.cuh`'s `e2m1_from_f32`.
    e2m1(x: f32) -> u8 = uep_cuda_host_e2m1;
    /// `numerics.cuh`'s `ue8m0_round_up`.
    ue8m0_round_up(x: f32) -> u8 = uep_cuda_host_ue8m0_round_up;
}

/// `numerics.cuh`'s `fp8_scale`.
pub fn fp8_scale(amax: f32, round_scale: bool) -> f32 {
    // SAFETY: a pure function of its arguments.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_fp8_scale(amax, i32::from(round_scale))
    }
}

/// `cmd.cuh`'s `write_cmd`, as `(word0, word1)`.
pub fn write_cmd(dst_rank: u32, src_off: u64, dst_off: u64, len: u32, flags: u64) -> (u64, u64) {
    let mut out = [0u64; 2];
    // SAFETY: writes exactly two u64s into `out`.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_write_cmd(dst_rank, src_off, dst_off, len, flags, out.as_mut_ptr())
    };
    (out[0], out[1])
}

/// `cmd.cuh`'s `ll_write_cmd`, as `(word0, word1)`.
pub fn ll_write_cmd(
    dst_rank: u32,
    (src_off, dst_off, len): (u64, u64, u32),
    kind: u32,
    key: u32,
) -> (u64, u64) {
    let mut out = [0u64; 2];
    // SAFETY: writes exactly two u64s into `out`.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_ll_write_cmd(
            dst_rank,
            src_off,
            dst_off,
            len,
            kind,
            key,
            out.as_mut_ptr(),
        )
    };
    (out[0], out[1])
}

/// `cmd.cuh`'s `normal_write_cmd`, as `(word0, word1)`.
pub fn normal_write_cmd(
    dst_rank: u32,
    (src_off, dst_off, len): (u64, u64, u32),
    channel: u32,
    tail_inc: u32,
) -> (u64, u64) {
    let mut out = [0u64; 2];
    // SAFETY: writes exactly two u64s into `out`.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_normal_write_cmd(
            dst_rank,
            src_off,
            dst_off,
            len,
            channel,
            tail_inc,
            out.as_mut_ptr(),
        )
    };
    (out[0], out[1])
}

/// `cmd.cuh`'s FIFO offsets: head, tail, first slot.
pub fn fifo_layout() -> [u64; 3] {
    let mut out = [0u64; 3];
    // SAFETY: writes exactly three u64s into `out`.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_fifo_layout(out.as_mut_ptr())
    };
    out
}
