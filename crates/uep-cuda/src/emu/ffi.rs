//! The host build's entry points (`kernels/host/entry.cpp`): each kernel of
//! `kernels/api.cuh` run on CPU threads as a GPU grid (`kernels/host/runtime.h`). The
//! only place the emulated device calls C++.

use std::ffi::{c_char, c_int};
use std::time::Duration;

use crate::api::{
    FifoPingArgs, FifoPushArgs, Fp8CastArgs, LayoutArgs, LlCombinePackArgs, LlPackArgs,
    LlPlaceArgs, LlSendArgs, LlUnpackArgs, NormalCombineSendArgs, NormalNotifyArgs, NormalPackArgs,
    Nvfp4CastArgs, ReduceArgs, RelayArgs, SelftestArgs,
};

/// A one-dimensional grid, and how long a spin in it may last (`uep_host_grid`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Blocks.
    pub blocks: u32,
    /// Threads a block (1 to 1024).
    pub threads: u32,
    /// A spin (`pause`) past this many nanoseconds after the launch ends it with an
    /// error; 0 for no deadline.
    pub timeout_ns: u64,
}

impl Grid {
    /// `blocks` blocks of `threads` threads, spins bounded by `timeout`.
    pub fn new(blocks: u32, threads: u32, timeout: Duration) -> Grid {
        Grid {
            blocks,
            threads,
            timeout_ns: u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX),
        }
    }
}

/// `uep_host_error`: where a failed launch writes why.
#[repr(C)]
struct HostError {
    msg: *mut c_char,
    len: usize,
}

/// A kernel's host entry point, its argument type `A`.
#[allow(unsafe_code)]
pub(crate) struct Entry<A> {
    /// The kernel's name, for errors.
    pub(crate) name: &'static str,
    run: unsafe extern "C" fn(*const Grid, *const A, *mut HostError) -> c_int,
}

// Each kernel's entry (`uep_host_<kernel>`, and `uep_host_<kernel>_args`: its argument's
// size in C++), then each struct an argument points to (`uep_host_<name>_bytes`): the
// list of sizes a test compares with Rust's is made from the same list.
macro_rules! entries {
    (
        kernels { $($konst:ident: $args:ty = $kernel:literal, $run:ident, $size:ident;)* }
        inside { $($inner:ident = $inner_size:ident;)* }
    ) => {
        #[allow(unsafe_code)]
        unsafe extern "C" {
            $(
                fn $run(grid: *const Grid, args: *const $args, err: *mut HostError) -> c_int;
                #[cfg(test)]
                safe fn $size() -> usize;
            )*
            $(
                #[cfg(test)]
                safe fn $inner_size() -> usize;
            )*
        }
        $(
            #[doc = concat!("`", $kernel, "` in the host build.")]
            // The bench kernels run in the tests only.
            #[cfg_attr(not(test), allow(dead_code))]
            pub(crate) const $konst: Entry<$args> = Entry {
                name: $kernel,
                run: $run,
            };
        )*

        /// Every kernel argument struct and every struct inside one, by name: its size
        /// in C++ and in Rust.
        #[cfg(test)]
        fn struct_sizes() -> Vec<(&'static str, usize, usize)> {
            vec![
                $(($kernel, $size(), std::mem::size_of::<$args>()),)*
                $((
                    stringify!($inner),
                    $inner_size(),
                    std::mem::size_of::<crate::api::$inner>(),
                ),)*
            ]
        }
    };
}

entries! {
    kernels {
        LAYOUT: LayoutArgs = "uep_dispatch_layout", uep_host_uep_dispatch_layout,
            uep_host_uep_dispatch_layout_args;
        FP8_CAST: Fp8CastArgs = "uep_fp8_quantize", uep_host_uep_fp8_quantize,
            uep_host_uep_fp8_quantize_args;
        FP8_CAST_X16: Fp8CastArgs = "uep_fp8_quantize_x16", uep_host_uep_fp8_quantize_x16,
            uep_host_uep_fp8_quantize_x16_args;
        NVFP4_CAST: Nvfp4CastArgs = "uep_nvfp4_quantize", uep_host_uep_nvfp4_quantize,
            uep_host_uep_nvfp4_quantize_args;
        REDUCE: ReduceArgs = "uep_reduce", uep_host_uep_reduce, uep_host_uep_reduce_args;
        LL_PLACE: LlPlaceArgs = "uep_ll_place", uep_host_uep_ll_place, uep_host_uep_ll_place_args;
        LL_PACK: LlPackArgs = "uep_ll_pack", uep_host_uep_ll_pack, uep_host_uep_ll_pack_args;
        LL_UNPACK: LlUnpackArgs = "uep_ll_unpack", uep_host_uep_ll_unpack,
            uep_host_uep_ll_unpack_args;
        LL_COMBINE_PACK: LlCombinePackArgs = "uep_ll_combine_pack", uep_host_uep_ll_combine_pack,
            uep_host_uep_ll_combine_pack_args;
        NORMAL_COMBINE_SEND: NormalCombineSendArgs = "uep_normal_combine_send",
            uep_host_uep_normal_combine_send, uep_host_uep_normal_combine_send_args;
        NORMAL_NOTIFY: NormalNotifyArgs = "uep_normal_notify", uep_host_uep_normal_notify,
            uep_host_uep_normal_notify_args;
        NORMAL_PACK: NormalPackArgs = "uep_normal_pack", uep_host_uep_normal_pack,
            uep_host_uep_normal_pack_args;
        RELAY: RelayArgs = "uep_relay", uep_host_uep_relay, uep_host_uep_relay_args;
        FIFO_PUSH: FifoPushArgs = "uep_fifo_push", uep_host_uep_fifo_push,
            uep_host_uep_fifo_push_args;
        FIFO_PING: FifoPingArgs = "uep_fifo_ping", uep_host_uep_fifo_ping,
            uep_host_uep_fifo_ping_args;
        LL_SEND: LlSendArgs = "uep_ll_send", uep_host_uep_ll_send, uep_host_uep_ll_send_args;
        SELFTEST: SelftestArgs = "uep_selftest", uep_host_uep_selftest, uep_host_uep_selftest_args;
    }
    inside {
        ChunkedPush = uep_host_chunked_push_bytes;
        LlPackSink = uep_host_ll_pack_sink_bytes;
        LlLandedArgs = uep_host_ll_landed_bytes;
        LlCombineSink = uep_host_ll_combine_sink_bytes;
        ReturnSinkArgs = uep_host_return_sink_bytes;
        NotifySinkArgs = uep_host_notify_sink_bytes;
        NormalPackDest = uep_host_normal_pack_dest_bytes;
    }
}

/// Runs `entry`'s kernel over `grid` with `args`; returns once every thread ended, or
/// with the host runtime's error (a misused collective, a deadlock, a spin past the
/// deadline).
///
/// # Safety
///
/// Every address in `args` is valid, for as long as the launch runs, for all that the
/// kernel reads and writes there (what `kernels/api.cuh` says of each field), and no
/// other thread writes what the kernel reads meanwhile unless the kernel reads it
/// atomically.
#[allow(unsafe_code)]
pub(crate) unsafe fn launch<A>(entry: &Entry<A>, grid: Grid, args: &A) -> Result<(), String> {
    let mut msg = vec![0u8; 1024];
    let mut err = HostError {
        msg: msg.as_mut_ptr().cast(),
        len: msg.len(),
    };
    // SAFETY: `grid` and `err` are live for the call and `err` names `msg`'s bytes; the
    // caller vouches for `args`.
    let rc = unsafe { (entry.run)(&grid, args, &mut err) };
    if rc == 0 {
        return Ok(());
    }
    let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
    Err(format!(
        "{} on the host grid ({} blocks of {} threads): {}",
        entry.name,
        grid.blocks,
        grid.threads,
        String::from_utf8_lossy(&msg[..end])
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_argument_struct_is_the_size_cxx_gives_it() {
        for (name, cxx, rust) in struct_sizes() {
            assert_eq!(cxx, rust, "{name}: C++ {cxx} bytes, Rust {rust}");
        }
        assert_eq!(
            std::mem::size_of::<uep_ep::device::Part>(),
            12,
            "uep::ReducePart is three 4-byte fields"
        );
    }
}
