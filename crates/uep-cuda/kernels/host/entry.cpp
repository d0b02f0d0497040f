// The host build's entry points: each kernel of api.cuh launched on the host grid
// (runtime.h), as C for the Rust side (src/emu/ffi.rs). `uep_host_<kernel>` runs the
// kernel; `uep_host_<kernel>_args` gives its argument's size, which a test compares
// with the Rust mirror's.
#include "../api.cuh"

#define UEP_HOST_ENTRY(kernel, Args)                                                        \
    extern "C" int uep_host_##kernel(const uep_host_grid *grid, const uep::Args *args,      \
                                     uep_host_error *err) {                                 \
        const uep::Args a = *args;                                                          \
        return uep::host::launch(*grid, [&a] { kernel(a); }, err);                         \
    }                                                                                       \
    extern "C" size_t uep_host_##kernel##_args() { return sizeof(uep::Args); }

UEP_HOST_ENTRY(uep_dispatch_layout, LayoutArgs)
UEP_HOST_ENTRY(uep_fp8_quantize, Fp8CastArgs)
UEP_HOST_ENTRY(uep_fp8_quantize_x16, Fp8CastArgs)
UEP_HOST_ENTRY(uep_nvfp4_quantize, Nvfp4CastArgs)
UEP_HOST_ENTRY(uep_reduce, ReduceArgs)
UEP_HOST_ENTRY(uep_fifo_push, FifoPushArgs)
UEP_HOST_ENTRY(uep_fifo_ping, FifoPingArgs)
UEP_HOST_ENTRY(uep_ll_send, LlSendArgs)
UEP_HOST_ENTRY(uep_ll_place, LlPlaceArgs)
UEP_HOST_ENTRY(uep_ll_pack, LlPackArgs)
UEP_HOST_ENTRY(uep_ll_unpack, LlUnpackArgs)
UEP_HOST_ENTRY(uep_ll_combine_pack, LlCombinePackArgs)
UEP_HOST_ENTRY(uep_normal_combine_send, NormalCombineSendArgs)
UEP_HOST_ENTRY(uep_normal_notify, NormalNotifyArgs)
UEP_HOST_ENTRY(uep_normal_pack, NormalPackArgs)
UEP_HOST_ENTRY(uep_relay, RelayArgs)
UEP_HOST_ENTRY(uep_selftest, SelftestArgs)

// The structs an argument points to, for the same comparison.
#define UEP_HOST_SIZE(name, Type) \
    extern "C" size_t uep_host_##name##_bytes() { return sizeof(uep::Type); }

UEP_HOST_SIZE(chunked_push, ChunkedPush)
UEP_HOST_SIZE(ll_pack_sink, LlPackSink)
UEP_HOST_SIZE(ll_landed, LlLandedArgs)
UEP_HOST_SIZE(ll_combine_sink, LlCombineSink)
UEP_HOST_SIZE(return_sink, ReturnSinkArgs)
UEP_HOST_SIZE(notify_sink, NotifySinkArgs)
UEP_HOST_SIZE(normal_pack_dest, NormalPackDest)
