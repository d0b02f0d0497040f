//! The kernels' arguments as `kernels/api.cuh` defines them: one `#[repr(C)]` struct a
//! kernel, of addresses and sizes, passed by value. The same struct launches a kernel
//! on a GPU (its addresses the device's) and in the host build (host addresses); a test
//! compares each size with the C++ one (`emu::ffi`).
//!
//! Addresses are `u64`: a device pointer on a GPU, a host pointer in the host build.

/// `uep::LayoutArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LayoutArgs {
    pub(crate) topk_idx: u64,
    pub(crate) per_rank: u64,
    pub(crate) per_node: u64,
    pub(crate) per_expert: u64,
    pub(crate) in_rank: u64,
    pub(crate) first_bad: u64,
    pub(crate) tokens: u32,
    pub(crate) topk: u32,
    pub(crate) experts: u32,
    pub(crate) ranks: u32,
    pub(crate) ranks_per_node: u32,
    pub(crate) pad: u32,
}

/// `uep::Fp8CastArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fp8CastArgs {
    pub(crate) x: u64,
    pub(crate) q: u64,
    pub(crate) scales: u64,
    pub(crate) groups: u64,
    pub(crate) round_scale: u32,
    pub(crate) pad: u32,
}

/// `uep::Nvfp4CastArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Nvfp4CastArgs {
    pub(crate) x: u64,
    pub(crate) q: u64,
    pub(crate) sf: u64,
    pub(crate) groups: u64,
    pub(crate) global_scale: f32,
    pub(crate) ue8m0: u32,
}

/// `uep::ReduceArgs`; its parts are `uep_ep::device::Part`s, whose layout is
/// `uep::ReducePart`'s.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReduceArgs {
    pub(crate) sources: u64,
    pub(crate) starts: u64,
    pub(crate) parts: u64,
    pub(crate) out: u64,
    pub(crate) tokens: u32,
    pub(crate) hidden: u32,
    pub(crate) weighted: u32,
    pub(crate) pad: u32,
}

/// `uep::FifoPushArgs`.
#[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FifoPushArgs {
    pub(crate) rings: u64,
    pub(crate) ns: u64,
    pub(crate) count: u64,
    pub(crate) batch: u32,
    pub(crate) pad: u32,
}

/// `uep::FifoPingArgs`.
#[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FifoPingArgs {
    pub(crate) rings: u64,
    pub(crate) ns: u64,
    pub(crate) rounds: u32,
    pub(crate) pad: u32,
}

/// `uep::LlSendArgs`.
#[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlSendArgs {
    pub(crate) x: u64,
    pub(crate) topk_idx: u64,
    pub(crate) rings: u64,
    pub(crate) ns: u64,
    pub(crate) staged: u64,
    pub(crate) staged_off: u64,
    pub(crate) recv_off: u64,
    pub(crate) src_rank: u32,
    pub(crate) max_tokens: u32,
    pub(crate) tokens: u32,
    pub(crate) topk: u32,
    pub(crate) hidden: u32,
    pub(crate) experts: u32,
    pub(crate) ranks: u32,
    pub(crate) round_scale: u32,
}

/// `uep::LlPlaceArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlPlaceArgs {
    pub(crate) topk_idx: u64,
    pub(crate) per_expert: u64,
    pub(crate) pos: u64,
    pub(crate) row_of: u64,
    pub(crate) rows: u64,
    pub(crate) first_bad: u64,
    pub(crate) fingerprint: u64,
    pub(crate) tokens: u32,
    pub(crate) topk: u32,
    pub(crate) experts: u32,
    pub(crate) ranks: u32,
}

/// `uep::ChunkedPush`: rows pushed by the kernels that store them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ChunkedPush {
    pub(crate) src_off: u64,
    pub(crate) dst_off: u64,
    pub(crate) scales_src_off: u64,
    pub(crate) scales_dst_off: u64,
    pub(crate) rows: u32,
    pub(crate) chunk_rows: u32,
    pub(crate) row_bytes: u32,
    pub(crate) scale_bytes: u32,
    pub(crate) chunk_done: u64,
    pub(crate) ring_base: u64,
    pub(crate) ring_capacity: u64,
    pub(crate) writes: u64,
    pub(crate) sent_bytes: u64,
    pub(crate) kernel_cmds: u64,
    pub(crate) dst_rank: u32,
    pub(crate) ordered: u32,
    pub(crate) key_kind: u32,
    pub(crate) key: u32,
}

/// `uep::LlPackSink`: where the LL dispatch's pack puts one rank's copies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlPackSink {
    pub(crate) kind: u32,
    pub(crate) packet_rows: u32,
    pub(crate) region: u64,
    pub(crate) row_of: u64,
    pub(crate) rows_off: u64,
    pub(crate) scales_off: u64,
    pub(crate) ids_off: u64,
    pub(crate) slots_off: u64,
    pub(crate) weights_off: u64,
    pub(crate) push: ChunkedPush,
}

/// `uep::LlCombineSink`: where the LL combine's pack returns one source's rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlCombineSink {
    pub(crate) kind: u32,
    pub(crate) groups: u32,
    pub(crate) region: u64,
    pub(crate) rows_off: u64,
    pub(crate) first: u64,
    pub(crate) group_of: u64,
    pub(crate) pushes: u64,
}

/// `uep::LlCombinePackArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlCombinePackArgs {
    pub(crate) y: u64,
    pub(crate) layout_range: u64,
    pub(crate) src_info: u64,
    pub(crate) src_slot: u64,
    pub(crate) sinks: u64,
    pub(crate) experts: u32,
    pub(crate) ranks: u32,
    pub(crate) max_tokens: u32,
    pub(crate) hidden: u32,
    pub(crate) topk: u32,
    pub(crate) rank: u32,
}

/// `uep::LlSinkKind`.
pub(crate) const LL_SKIP: u32 = 0;
/// `uep::LlSinkKind`: a same-node rank.
pub(crate) const LL_PEER: u32 = 1;
/// `uep::LlSinkKind`: a packet for a rank of another node.
pub(crate) const LL_PACKET: u32 = 2;

/// `uep::LlPackArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlPackArgs {
    pub(crate) x: u64,
    pub(crate) scales: u64,
    pub(crate) topk_idx: u64,
    pub(crate) weights: u64,
    pub(crate) pos: u64,
    pub(crate) sinks: u64,
    pub(crate) recv_x_off: u64,
    pub(crate) recv_scales_off: u64,
    pub(crate) recv_src_off: u64,
    pub(crate) recv_weight_off: u64,
    pub(crate) tokens: u32,
    pub(crate) row_bytes: u32,
    pub(crate) scale_words: u32,
    pub(crate) topk: u32,
    pub(crate) rank: u32,
    pub(crate) ranks: u32,
    pub(crate) experts_per_rank: u32,
    pub(crate) max_tokens: u32,
}

/// `uep::LlLandedArgs`: a packet that landed from a source on another node.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlLandedArgs {
    pub(crate) present: u32,
    pub(crate) pad: u32,
    pub(crate) rows_off: u64,
    pub(crate) starts: u64,
    pub(crate) rows: u64,
    pub(crate) codes: u64,
    pub(crate) scales: u64,
    pub(crate) weights: u64,
}

/// `uep::LlUnpackArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LlUnpackArgs {
    pub(crate) region: u64,
    pub(crate) counts: u64,
    pub(crate) landed: u64,
    pub(crate) recv_x_off: u64,
    pub(crate) out_scales_off: u64,
    pub(crate) recv_scales_off: u64,
    pub(crate) recv_src_off: u64,
    pub(crate) recv_weight_off: u64,
    pub(crate) layout_range: u64,
    pub(crate) recv_count: u64,
    pub(crate) src_info: u64,
    pub(crate) src_slot: u64,
    pub(crate) src_weight: u64,
    pub(crate) experts: u32,
    pub(crate) ranks: u32,
    pub(crate) max_tokens: u32,
    pub(crate) row_bytes: u32,
    pub(crate) scale_words: u32,
    pub(crate) topk: u32,
}

/// `uep::ReturnSinkArgs`: where the normal combine returns one source's rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ReturnSinkArgs {
    pub(crate) region: u64,
    pub(crate) x_off: u64,
    pub(crate) weights_off: u64,
}

/// `uep::NormalCombineSendArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormalCombineSendArgs {
    pub(crate) x: u64,
    pub(crate) weights: u64,
    pub(crate) src_rank: u64,
    pub(crate) src_idx: u64,
    pub(crate) sinks: u64,
    pub(crate) rows: u32,
    pub(crate) hidden: u32,
    pub(crate) topk: u32,
    pub(crate) pad: u32,
}

/// `uep::NotifySinkArgs`: where the normal notify puts this rank's counts for one rank.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NotifySinkArgs {
    pub(crate) kind: u32,
    pub(crate) pad: u32,
    pub(crate) region: u64,
    pub(crate) head_off: u64,
    pub(crate) counts_off: u64,
    pub(crate) epoch_off: u64,
}

/// `uep::NotifySinkKind`: a same-node rank's slot.
pub(crate) const NOTIFY_SLOT: u32 = 1;
/// `uep::NotifySinkKind`: the packet to a rank of another node.
pub(crate) const NOTIFY_PACKET: u32 = 2;

/// `uep::NormalNotifyArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormalNotifyArgs {
    pub(crate) counts: u64,
    pub(crate) sinks: u64,
    pub(crate) ranks: u32,
    pub(crate) counts_len: u32,
    pub(crate) tokens: u32,
    pub(crate) flags: u32,
    pub(crate) seq: u64,
}

/// `uep::NormalPackDest`: where the normal dispatch's pack stores one destination's rows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormalPackDest {
    pub(crate) region: u64,
    pub(crate) rank: u32,
    pub(crate) node: u32,
    pub(crate) x_off: u64,
    pub(crate) scales_off: u64,
    pub(crate) topk_off: u64,
    pub(crate) weights_off: u64,
    pub(crate) src_off: u64,
    pub(crate) mask_off: u64,
    pub(crate) direct_x_off: u64,
    pub(crate) direct_scales_off: u64,
    pub(crate) push: ChunkedPush,
}

/// `uep::kNormalPackRank`: the destination is a rank of this node.
pub(crate) const NORMAL_PACK_RANK: u32 = u32::MAX;

/// `uep::NormalPackArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NormalPackArgs {
    pub(crate) x: u64,
    pub(crate) scales: u64,
    pub(crate) topk_idx: u64,
    pub(crate) weights: u64,
    pub(crate) hit: u64,
    pub(crate) direct: u64,
    pub(crate) starts: u64,
    pub(crate) in_rank: u64,
    pub(crate) dests: u64,
    pub(crate) tokens: u32,
    pub(crate) block_tokens: u32,
    pub(crate) blocks: u32,
    pub(crate) dests_n: u32,
    pub(crate) row_bytes: u32,
    pub(crate) groups: u32,
    pub(crate) topk: u32,
    pub(crate) with_topk: u32,
    pub(crate) with_weights: u32,
    pub(crate) all_weights: u32,
    pub(crate) ranks: u32,
    pub(crate) ranks_per_node: u32,
    pub(crate) experts_per_rank: u32,
    pub(crate) quantum: u32,
}

/// `uep::RelayArgs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RelayArgs {
    pub(crate) local: u64,
    pub(crate) regions: u64,
    pub(crate) packet_x_off: u64,
    pub(crate) packet_scales_off: u64,
    pub(crate) recv_x_off: u64,
    pub(crate) recv_scales_off: u64,
    pub(crate) recv_topk_idx_off: u64,
    pub(crate) recv_topk_weights_off: u64,
    pub(crate) recv_src_off: u64,
    pub(crate) idx: u64,
    pub(crate) weights: u64,
    pub(crate) tokens: u64,
    pub(crate) from: u64,
    pub(crate) rows: u64,
    pub(crate) n: u32,
    pub(crate) ranks_per_node: u32,
    pub(crate) local_rank: u32,
    pub(crate) node: u32,
    pub(crate) row_bytes: u32,
    pub(crate) groups: u32,
    pub(crate) topk: u32,
    pub(crate) experts_per_rank: u32,
    pub(crate) all_weights: u32,
    pub(crate) pad: u32,
}

/// `uep::SelftestArgs`.
#[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SelftestArgs {
    pub(crate) out: u64,
    pub(crate) flags: u64,
    pub(crate) which: u32,
    pub(crate) pad: u32,
}

/// The address of a slice's first element, as a kernel argument.
pub(crate) fn addr<T>(s: &[T]) -> u64 {
    s.as_ptr() as u64
}

/// The address of a mutable slice's first element, as a kernel argument.
pub(crate) fn addr_mut<T>(s: &mut [T]) -> u64 {
    s.as_mut_ptr() as u64
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;

    /// Each argument struct is plain data (integers and floats, `#[repr(C)]`, no
    /// pointers the driver must know of), which is what `DeviceRepr` asks.
    macro_rules! device_repr {
        ($($t:ty),*) => {$(
            // SAFETY: `#[repr(C)]` plain data whose layout is the C++ struct's.
            #[allow(unsafe_code)]
            unsafe impl cudarc::driver::DeviceRepr for $t {}
        )*};
    }

    device_repr!(
        LayoutArgs,
        Fp8CastArgs,
        Nvfp4CastArgs,
        ReduceArgs,
        LlPlaceArgs,
        ChunkedPush,
        LlPackSink,
        LlPackArgs,
        LlCombineSink,
        LlCombinePackArgs,
        ReturnSinkArgs,
        NormalCombineSendArgs,
        NotifySinkArgs,
        NormalNotifyArgs,
        NormalPackDest,
        NormalPackArgs,
        RelayArgs,
        LlLandedArgs,
        LlUnpackArgs,
        FifoPushArgs,
        FifoPingArgs,
        LlSendArgs,
        SelftestArgs
    );
}
