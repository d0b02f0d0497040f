"""An MoE layer run expert-parallel through uep, checked against the same layer run densely.

The layer is the usual one: a router, softmax top-k gating, SwiGLU experts. Each of
``--ranks`` processes holds ``experts / ranks`` of the experts and its own batch of
tokens, and runs the layer four ways through ``uep.Buffer`` (imported the way DeepEP code
imports ``deep_ep``):

* normal mode (``dispatch`` / ``combine``), tokens sent as bf16 and as FP8;
* low-latency mode (``low_latency_dispatch`` / ``low_latency_combine``), bf16 and FP8.

Every rank also runs its batch through the whole layer on its own (every expert,
dense), and the expert-parallel result must match it within ``calc_diff`` 5e-5 (bf16)
or 2e-3 (FP8)::

    python examples/moe_layer.py --ranks 4

It prints one line per variant and exits non-zero if any variant is off.
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import uep as deep_ep

THRESHOLD = {"bf16": 5e-5, "fp8": 2e-3}


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


def to_fp8(x: torch.Tensor):
    """Per-token, per-128-channel FP8 e4m3 with f32 scales."""
    m, n = x.shape
    v = x.float().view(m, n // 128, 128)
    amax = v.abs().amax(2).clamp(1e-4)
    return (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(m, n), amax / 448.0


def from_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    shape = q.shape
    v = q.float().view(*shape[:-1], shape[-1] // 128, 128)
    return (v * scales.reshape(*shape[:-1], shape[-1] // 128, 1)).view(shape).to(torch.bfloat16)


class MoE:
    """Router + softmax top-k + SwiGLU experts, weights drawn from `seed` (the same on
    every rank)."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.hidden, self.ffn, self.experts, self.topk = hidden, ffn, experts, topk
        self.router = torch.randn((hidden, experts), generator=g) / hidden ** 0.5
        self.w_in = torch.randn((experts, hidden, 2 * ffn), generator=g) / hidden ** 0.5
        self.w_out = torch.randn((experts, ffn, hidden), generator=g) / ffn ** 0.5

    def route(self, x: torch.Tensor):
        probs = torch.softmax(x.float() @ self.router, dim=-1)
        w, idx = torch.topk(probs, self.topk, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows.float() @ self.w_in[e]).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ self.w_out[e]

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The whole layer on one rank: every token through each of its experts."""
        idx, w = self.route(x)
        out = torch.zeros((x.shape[0], self.hidden))
        for k in range(self.topk):
            for e in idx[:, k].unique().tolist():
                sel = idx[:, k] == e
                out[sel] += w[sel, k:k + 1] * self.expert(e, x[sel])
        return out


def normal_mode(moe: MoE, buffer: deep_ep.Buffer, x: torch.Tensor, fp8: bool, rank: int, world: int) -> torch.Tensor:
    local = moe.experts // world
    idx, w = moe.route(x)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, moe.experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        to_fp8(x) if fp8 else x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    rows = from_fp8(*recv_x) if fp8 else recv_x
    # Each received token, through each of its local experts, weighted; combine sums.
    y = torch.zeros((rows.shape[0], moe.hidden))
    for j in range(local):
        sel = (recv_idx == j).any(1)
        if sel.any():
            weight = (recv_w * (recv_idx == j)).sum(1, keepdim=True)[sel]
            y[sel] += weight * moe.expert(rank * local + j, rows[sel])
    out, _, _ = buffer.combine(y.to(torch.bfloat16), handle)
    return out.float()


def low_latency_mode(moe: MoE, buffer: deep_ep.Buffer, x: torch.Tensor, fp8: bool, rank: int, world: int,
                     max_tokens: int) -> torch.Tensor:
    local = moe.experts // world
    idx, w = moe.route(x)
    recv, counts, handle, _, _ = buffer.low_latency_dispatch(x, idx, max_tokens, moe.experts, use_fp8=fp8)
    rows = from_fp8(*recv) if fp8 else recv
    y = torch.zeros((local, world * max_tokens, moe.hidden), dtype=torch.bfloat16)
    for j in range(local):
        n = counts[j].item()
        if n:
            y[j, :n] = moe.expert(rank * local + j, rows[j, :n]).to(torch.bfloat16)
    out, _, _ = buffer.low_latency_combine(y, idx, w, handle)
    return out.float()


def run(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    moe = MoE(args.hidden, args.ffn, args.experts, args.topk)
    buffer = deep_ep.Buffer(group, int(1e9), deep_ep.Buffer.get_low_latency_rdma_size_hint(
        args.tokens, args.hidden, world, args.experts), explicitly_destroy=True)
    x = (torch.randn((args.tokens - rank, args.hidden), generator=torch.Generator().manual_seed(100 + rank))
         ).to(torch.bfloat16)
    want = moe.dense(x)
    diffs = {}
    for fp8 in (False, True):
        name = "fp8" if fp8 else "bf16"
        diffs[f"normal {name}"] = calc_diff(normal_mode(moe, buffer, x, fp8, rank, world), want)
        diffs[f"low-latency {name}"] = calc_diff(
            low_latency_mode(moe, buffer, x, fp8, rank, world, args.tokens), want)
    buffer.destroy()
    results[rank] = diffs
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank (rank r has tokens - r)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(run, args=(args.ranks, port, args, results), nprocs=args.ranks)
    ok = True
    print(f"MoE layer, {args.ranks} ranks x {args.tokens} tokens, hidden {args.hidden}, "
          f"{args.experts} experts, top-{args.topk}: expert-parallel vs dense, calc_diff")
    for variant in results[0]:
        worst = max(results[r][variant] for r in range(args.ranks))
        limit = THRESHOLD[variant.split()[-1]]
        good = worst < limit
        ok &= good
        print(f"  {variant:<16} {worst:.2e}  (limit {limit:.0e})  {'ok' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
