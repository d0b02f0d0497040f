"""A job as users start one: ``torchrun --nproc-per-node N torchrun_job.py``.

Every rank reads its place from torchrun's environment, joins gloo, and runs normal and
low-latency dispatch/combine through ``uep`` (imported as DeepEP code imports
``deep_ep``), checking every result exactly; it prints one line and exits 0 only if
every check held."""

import os

import torch
import torch.distributed as dist

import uep as deep_ep


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    torch.manual_seed(rank)
    N, H, K, E = 64, 512, 4, 4 * world
    buffer = deep_ep.Buffer(group, int(1e9), deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, world, E),
                            explicitly_destroy=True)
    x = torch.randn((N, H), dtype=torch.bfloat16)
    topk_idx = torch.topk(torch.randn((N, E)).abs() + 1, K, dim=-1, sorted=False)[1]
    weights = torch.rand((N, K))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, recv_w, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=topk_idx, topk_weights=weights)
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    assert torch.allclose(combined_w, weights)
    recv, count, ll_handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, N, E, use_fp8=False)
    out, _, _ = buffer.low_latency_combine(recv, topk_idx, weights, ll_handle)
    acc = torch.zeros((N, H))
    for k in range(K):
        acc += weights[:, k:k + 1] * x.float()
    assert torch.equal(out, acc.to(torch.bfloat16))
    nodes = buffer.runtime.topology()[3]
    buffer.destroy()
    dist.barrier()
    print(f"rank {rank}/{world} (local {os.environ.get('LOCAL_RANK')}): OK, received {recv_x.shape[0]} rows, "
          f"{nodes} node(s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
