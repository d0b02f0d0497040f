"""``python -m uep.bench``: uep's Python path timed the way ``uep bench`` times the Rust path.

Spawns ``--ranks`` processes on a gloo group, runs layout, normal dispatch and combine,
and low-latency dispatch and combine through ``uep.Buffer`` at the DeepSeek-V3 shape
(hidden 7168, top-8, 256 experts; 4096 tokens a rank in normal mode, 128 in low-latency
mode), checks every combine exactly, and prints the same table as ``uep bench``.

With ``--compare PATH`` (the ``uep`` binary) it runs ``uep bench`` at the same shape too,
alternating Rust and Python runs, and prints what the Python path costs over the Rust
path for each op::

    python -m uep.bench --compare target/release/uep

With ``--v2`` it also times DeepEP v2's ``ElasticBuffer`` dispatch and combine (plain
and expanded layouts) on the same tensors, in the same steps as v1's, and prints what
each costs over v1's.

With ``--peers`` it also times, step by step alternating with uep on the same tensors,
what a user would write without an EP library: a Megatron-style dispatcher over
``torch.distributed.all_to_all_single`` on gloo (count exchange, pack by destination,
all-to-all of rows, top-k ids and weights; back with one all-to-all and a per-token sum in
f32, rank order, rounded once), checked against uep's result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import uep

OPS = ["layout", "dispatch", "combine", "ll_dispatch", "ll_combine"]
PEER_OPS = ["gloo_dispatch", "gloo_combine"]
#: DeepEP v2's calls (``--v2``): plain and expanded layouts, CPU sync on.
V2_OPS = ["v2_dispatch", "v2_combine", "v2_dispatch_expanded", "v2_combine_expanded"]


def _gloo_dispatch(x, topk_idx, weights, epr: int, group):
    """The peer's dispatch: rows, ids and weights of each token to every rank holding one
    of its experts, grouped by source rank in token order (as DeepEP lays them out)."""
    T, R = x.shape[0], dist.get_world_size(group)
    in_rank = torch.zeros((T, R), dtype=torch.bool)
    valid = topk_idx >= 0
    in_rank[torch.arange(T).unsqueeze(1).expand_as(topk_idx)[valid], (topk_idx // epr)[valid]] = True
    send_n = in_rank.sum(0)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n, group=group)
    # Token indices by destination rank, token order inside.
    order = torch.cat([torch.nonzero(in_rank[:, r]).flatten() for r in range(R)])
    out_splits, in_splits = recv_n.tolist(), send_n.tolist()
    n = sum(out_splits)

    def a2a(t):
        out = torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
        return out
    # gloo moves bf16 as its bytes.
    recv_x = a2a(x[order].view(torch.uint8)).view(torch.bfloat16)
    return recv_x, a2a(topk_idx[order]), a2a(weights[order]), (order, in_splits, out_splits)


def _gloo_combine(y, state, T: int, group):
    """The peer's combine: each received row back to its source, summed per token over
    the ranks in rank order in f32, rounded once."""
    order, in_splits, out_splits = state
    back = torch.empty((sum(in_splits), 2 * y.shape[1]), dtype=torch.uint8)
    dist.all_to_all_single(back, y.contiguous().view(torch.uint8), in_splits, out_splits, group=group)
    acc = torch.zeros((T, y.shape[1]))
    acc.index_add_(0, order, back.view(torch.bfloat16).float())
    return acc.to(torch.bfloat16)


def _v2_bytes(group, tokens: int, hidden: int, topk: int) -> int:
    return uep.ElasticBuffer.get_buffer_size_hint(group, tokens, hidden, topk)


def _v2_step(v2, timed, step: int, x, topk_idx, weights, experts: int, in_rank) -> bool:
    """One step of DeepEP v2's calls: plain, then expanded; the identity experts return
    the rows they got. With `in_rank` (the last step) both combines are checked: plain
    gives x times the ranks a token went to; expanded first sums a token's local rows on
    each rank (rounded to bf16), then over ranks."""
    ok = True
    recv_x, _, _, handle, _ = timed("v2_dispatch", step, lambda: v2.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_experts=experts))
    combined, _, _ = timed("v2_combine", step, lambda: v2.combine(recv_x, handle))
    if in_rank is not None:
        ok &= torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    del recv_x, handle, combined
    recv_x, _, _, handle, _ = timed("v2_dispatch_expanded", step, lambda: v2.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_experts=experts, do_expand=True))
    combined, _, _ = timed("v2_combine_expanded", step, lambda: v2.combine(recv_x, handle))
    if in_rank is not None:
        owner = torch.where(topk_idx >= 0, topk_idx // (experts // v2.num_ranks), v2.num_ranks)
        lanes = torch.zeros((x.shape[0], v2.num_ranks + 1)).scatter_add_(1, owner, torch.ones(owner.shape))
        want = sum((x.float() * lanes[:, r:r + 1]).to(torch.bfloat16).float() for r in range(v2.num_ranks))
        ok &= torch.equal(combined, want.to(torch.bfloat16))
    return ok


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    torch.set_num_threads(1)
    group = dist.new_group(list(range(world)))
    H, K, E, T, M = args.hidden, args.topk, args.experts, args.tokens, args.ll_tokens
    buffer = uep.Buffer(group, int(8e9), uep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E),
                        explicitly_destroy=True)
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    weights = torch.rand((T, K), generator=g)
    ll_x, ll_idx, ll_w = x[:M].contiguous(), topk_idx[:M].contiguous(), weights[:M].contiguous()
    times: Dict[str, List[float]] = {op: [] for op in OPS + PEER_OPS + V2_OPS}
    v2 = uep.ElasticBuffer(group, num_bytes=_v2_bytes(group, T, H, K), num_max_tokens_per_rank=T,
                           explicitly_destroy=True) if args.v2 else None
    copies = {"normal": 0, "ll": 0}
    ok = True

    def timed(op: str, step: int, fn):
        buffer.barrier()
        t0 = time.perf_counter()
        out = fn()
        if step >= args.warmup:
            times[op].append((time.perf_counter() - t0) * 1e6)
        return out

    # As `uep bench`: every normal step, then every low-latency step.
    last = args.warmup + args.iters - 1
    for step in range(args.warmup + args.iters):
        per_rank, per_node, per_expert, in_rank, _ = timed(
            "layout", step, lambda: buffer.get_dispatch_layout(topk_idx, E))
        recv_x, _, recv_w, _, handle, _ = timed("dispatch", step, lambda: buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights))
        # The experts are identities, as in `uep bench`.
        combined, _, _ = timed("combine", step, lambda: buffer.combine(recv_x, handle, topk_weights=recv_w))
        if step == last:
            ok &= torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
        if step >= args.warmup:
            copies["normal"] += int(per_rank.sum())
        # A layer's tensors die with its call; so do these, before the next step.
        del recv_x, recv_w, handle
        if v2 is not None:
            ok &= _v2_step(v2, timed, step, x, topk_idx, weights, E, in_rank if step == last else None)
        if args.peers:
            # The same step through the peer, on the same tensors.
            def peer_dispatch():
                dist.barrier(group=group)
                return _gloo_dispatch(x, topk_idx, weights, E // world, group)
            t0 = time.perf_counter()
            g_x, _, _, state = peer_dispatch()
            if step >= args.warmup:
                times["gloo_dispatch"].append((time.perf_counter() - t0) * 1e6)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            g_out = _gloo_combine(g_x, state, T, group)
            if step >= args.warmup:
                times["gloo_combine"].append((time.perf_counter() - t0) * 1e6)
            ok &= torch.equal(g_out, combined)
            del g_x, g_out, state
        del combined
    for step in range(args.warmup + args.iters):
        recv, _, ll_handle, _, _ = timed("ll_dispatch", step, lambda: buffer.low_latency_dispatch(
            ll_x, ll_idx, M, E, use_fp8=False))
        # The identity expert writes its outputs into the combine buffer, which the
        # combine sends from (zero copy, as `uep bench`).
        buffer.get_next_low_latency_combine_buffer(ll_handle)[:] = recv
        out, _, _ = timed("ll_combine", step, lambda: buffer.low_latency_combine(
            recv, ll_idx, ll_w, ll_handle, zero_copy=True))
        if step == last:
            acc = torch.zeros((M, H))
            for k in range(K):
                acc += ll_w[:, k:k + 1] * ll_x.float()
            ok &= torch.equal(out, acc.to(torch.bfloat16))
        if step >= args.warmup:
            copies["ll"] += int((ll_idx >= 0).sum())
        del recv, ll_handle, out
    buffer.destroy()
    if v2 is not None:
        v2.destroy()
    results[rank] = {"times": times, "copies": copies, "ok": ok}
    dist.destroy_process_group()


def run_python(args: argparse.Namespace) -> List[dict]:
    """One run of the Python path; one report per op, as `uep bench --json` gives them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args.ranks, port, args, results), nprocs=args.ranks)
    H, R = args.hidden, args.ranks
    reports = []
    for op in OPS + (PEER_OPS if args.peers else []) + (V2_OPS if args.v2 else []):
        samples = [t for r in range(R) for t in results[r]["times"][op]]
        mode = "ll" if op.startswith("ll_") else "normal"  # v2 moves normal mode's rows
        copies = sum(results[r]["copies"][mode] for r in range(R)) / R / args.iters
        row = 2 * H
        nbytes = 0 if op == "layout" else int(copies * row)
        avg = statistics.fmean(samples)
        reports.append({"op": op, "dtype": "-" if op == "layout" else "bf16",
                        "tokens": args.ll_tokens if mode == "ll" else args.tokens, "hidden": H,
                        "ranks": R, "nodes": 1, "bytes_per_rank": nbytes,
                        "gbps": nbytes / (avg * 1e3) if nbytes else 0.0,
                        "avg_us": avg, "min_us": min(samples), "max_us": max(samples),
                        "verified": all(results[r]["ok"] for r in range(R))})
    return reports


def run_rust(args: argparse.Namespace) -> List[dict]:
    cmd = [args.compare, "bench", "--json", "--no-limits", "--ranks", str(args.ranks), "--tokens", str(args.tokens),
           "--ll-tokens", str(args.ll_tokens), "--hidden", str(args.hidden), "--topk", str(args.topk),
           "--experts", str(args.experts), "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--drop-prob", "0"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"uep bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return json.loads(out.stdout)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def table(reports: List[dict], title: str) -> str:
    head = ["op", "dtype", "tokens", "hidden", "ranks×nodes", "bytes/rank", "GB/s", "avg µs", "min µs", "max µs",
            "verified"]
    rows = [[r["op"], r["dtype"], str(r["tokens"]), str(r["hidden"]), f"{r['ranks']}×{r['nodes']}",
             human(r["bytes_per_rank"]), f"{r['gbps']:.2f}" if r["bytes_per_rank"] else "-",
             f"{r['avg_us']:.2f}", f"{r['min_us']:.2f}", f"{r['max_us']:.2f}", "✓" if r["verified"] else "✗"]
            for r in reports]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([title, fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m uep.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--ll-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (3 touch every buffer once)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="with --compare: Rust/Python pairs, alternating")
    p.add_argument("--compare", metavar="UEP", help="the uep binary: run `uep bench` beside it")
    p.add_argument("--peers", action="store_true",
                   help="also time the all_to_all_single dispatcher on gloo, alternating with uep")
    p.add_argument("--v2", action="store_true",
                   help="also time DeepEP v2's ElasticBuffer calls beside v1's, in the same steps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.compare:
        reports = run_python(args)
        print(json.dumps(reports) if args.json else table(reports, f"uep Python bench: {args.ranks} ranks"))
        if args.peers and not args.json:
            by = {r["op"]: r for r in reports}
            print()
            print("uep vs torch.distributed.all_to_all_single on gloo, same steps alternating, same bytes:")
            for op in ("dispatch", "combine"):
                u, g = by[op]["avg_us"], by["gloo_" + op]["avg_us"]
                print(f"  {op:<9} uep {u:>12.0f} µs   gloo {g:>12.0f} µs   speedup {g / u:.2f}x")
        if args.v2 and not args.json:
            by = {r["op"]: r for r in reports}
            print()
            print("DeepEP v2's calls beside v1's, same steps, same tensors:")
            for op in V2_OPS:
                v1 = "dispatch" if "dispatch" in op else "combine"
                u, g = by[op]["avg_us"], by[v1]["avg_us"]
                print(f"  {op:<21} {u:>12.0f} µs   v1 {v1:<8} {g:>12.0f} µs   {u / g:.2f}x")
        return 0 if all(r["verified"] for r in reports) else 1
    rust: Dict[str, List[float]] = {op: [] for op in OPS}
    py: Dict[str, List[float]] = {op: [] for op in OPS}
    last = {}
    for _ in range(args.rounds):
        for r in run_rust(args):
            rust[r["op"]].append(r["avg_us"])
        last = {r["op"]: r for r in run_python(args)}
        for op, r in last.items():
            py[op].append(r["avg_us"])
    verified = all(r["verified"] for r in last.values())
    print(table(list(last.values()), f"uep Python bench: {args.ranks} ranks (last round)"))
    print()
    print(f"Python path vs Rust path, {args.rounds} alternating rounds (median of per-round averages):")
    print(f"{'op':<12} {'rust µs':>12} {'python µs':>12} {'python/rust':>12}")
    for op in OPS:
        r, q = statistics.median(rust[op]), statistics.median(py[op])
        print(f"{op:<12} {r:>12.1f} {q:>12.1f} {q / r:>11.3f}x")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
