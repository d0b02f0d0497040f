//! The kernels' headers compiled for the host (`kernels/host_check.cpp`), wrapped
//! safely, so tests compare the device code's numerics and command encoding with the
//! Rust definitions on any machine.

mod ffi {
    extern "C" {
        pub fn uep_cuda_host_e4m3(x: f32) -> u8;
        pub fn uep_cuda_host_fp8_scale(amax: f32, round_scale: i32) -> f32;
        pub fn uep_cuda_host_bf16_to_f32(bits: u16) -> f32;
        pub fn uep_cuda_host_write_cmd(
            dst_rank: u32,
            src_off: u64,
            dst_off: u64,
            len: u32,
            flags: u64,
            out: *mut u64,
        );
        pub fn uep_cuda_host_fifo_layout(out: *mut u64);
    }
}

/// `fp8.cuh`'s `e4m3_from_f32`.
pub fn e4m3(x: f32) -> u8 {
    // SAFETY: a pure function of its argument.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_e4m3(x)
    }
}

/// `fp8.cuh`'s `fp8_scale`.
pub fn fp8_scale(amax: f32, round_scale: bool) -> f32 {
    // SAFETY: a pure function of its arguments.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_fp8_scale(amax, i32::from(round_scale))
    }
}

/// `fp8.cuh`'s `bf16_to_f32`.
pub fn bf16_to_f32(bits: u16) -> f32 {
    // SAFETY: a pure function of its argument.
    #[allow(unsafe_code)]
    unsafe {
        ffi::uep_cuda_host_bf16_to_f32(bits)
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
