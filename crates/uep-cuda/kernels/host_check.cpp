// The kernels' headers built for the host: tests/host_check.rs compares these with
// uep-ep's quant.rs and quant/nvfp4.rs, uep-wire's encoder and uep-fifo's layout,
// without a GPU.
#include "cmd.cuh"
#include "numerics.cuh"

extern "C" {

uint8_t uep_cuda_host_e4m3(float x) { return uep::e4m3_from_f32(x); }

float uep_cuda_host_e4m3_to_f32(uint8_t b) { return uep::e4m3_to_f32(b); }

float uep_cuda_host_fp8_scale(float amax, int round_scale) {
    return uep::fp8_scale(amax, round_scale != 0);
}

float uep_cuda_host_bf16_to_f32(uint16_t b) { return uep::bf16_to_f32(b); }

uint16_t uep_cuda_host_bf16_from_f32(float x) { return uep::bf16_from_f32(x); }

uint8_t uep_cuda_host_e2m1(float x) { return uep::e2m1_from_f32(x); }

uint8_t uep_cuda_host_ue8m0_round_up(float x) { return uep::ue8m0_round_up(x); }

void uep_cuda_host_write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off,
                             uint32_t len, uint64_t flags, uint64_t out[2]) {
    const uep::Cmd c = uep::write_cmd(dst_rank, src_off, dst_off, len, flags);
    out[0] = c.word0;
    out[1] = c.word1;
}

void uep_cuda_host_ll_write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off,
                                uint32_t len, uint32_t kind, uint32_t key, uint64_t out[2]) {
    const uep::Cmd c = uep::ll_write_cmd(dst_rank, src_off, dst_off, len, kind, key);
    out[0] = c.word0;
    out[1] = c.word1;
}

void uep_cuda_host_normal_write_cmd(uint32_t dst_rank, uint64_t src_off, uint64_t dst_off,
                                    uint32_t len, uint32_t channel, uint32_t tail_inc,
                                    uint64_t out[2]) {
    const uep::Cmd c = uep::normal_write_cmd(dst_rank, src_off, dst_off, len, channel, tail_inc);
    out[0] = c.word0;
    out[1] = c.word1;
}

void uep_cuda_host_fifo_layout(uint64_t out[3]) {
    out[0] = uep::kFifoHeadOff;
    out[1] = uep::kFifoTailOff;
    out[2] = uep::kFifoSlotsOff;
}

}  // extern "C"
