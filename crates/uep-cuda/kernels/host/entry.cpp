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

extern "C" size_t uep_host_ll_pack_sink_bytes() { return sizeof(uep::LlPackSink); }
extern "C" size_t uep_host_ll_landed_bytes() { return sizeof(uep::LlLandedArgs); }
extern "C" size_t uep_host_ll_combine_sink_bytes() { return sizeof(uep::LlCombineSink); }
extern "C" size_t uep_host_return_sink_bytes() { return sizeof(uep::ReturnSinkArgs); }
extern "C" size_t uep_host_notify_sink_bytes() { return sizeof(uep::NotifySinkArgs); }
extern "C" size_t uep_host_normal_pack_dest_bytes() { return sizeof(uep::NormalPackDest); }
