"""What every rank of a test job runs. DeepEP's own tests (intranode, internode,
low-latency) written again for CPU at small shapes, plus uep's edge cases.

Exactness: where uep's accumulation order is documented (combine sums rows in f32 in
source-rank order, then the biases; low-latency combine sums ``w * y`` over the slots in
order; one rounding to bf16), the checks compare bit for bit with torch doing the same
sums; DeepEP's ``calc_diff`` thresholds are checked as well.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import uep as deep_ep


# ---------------------------------------------------------------------- plumbing

class Ctx:
    """A rank's view of its job."""

    def __init__(self, rank: int, world: int, group: dist.ProcessGroup) -> None:
        self.rank, self.world, self.group = rank, world, group

    def buffer(self, num_nvl_bytes: int = int(2e9), num_rdma_bytes: int = 0, **kw: Any) -> deep_ep.Buffer:
        return deep_ep.Buffer(self.group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True, **kw)


def entry(rank: int, world: int, port: int, case: str, kwargs: Dict[str, Any], out: str,
          expect_failure: bool, env: Dict[str, str]) -> None:
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    torch.set_num_threads(1)
    result: Any = None
    try:
        group = dist.new_group(list(range(world)))
        result = globals()[case](Ctx(rank, world, group), **kwargs)
    except BaseException as e:  # noqa: B902 - reported to the parent
        if not expect_failure:
            raise
        result = e if isinstance(e, deep_ep.UepError) else RuntimeError(traceback.format_exc())
    finally:
        with open(os.path.join(out, f"result{rank}"), "wb") as f:
            pickle.dump(result if not isinstance(result, BaseException) else
                        {"error": type(result).__name__, "msg": str(result)}, f)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- helpers

def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity distance: 0 for equal tensors."""
    x, y = x.double() + 1, y.double() + 1
    denom = (x * x + y * y).sum()
    return (1 - 2 * (x * y).sum() / denom).item()


def per_token_cast_to_fp8(x: torch.Tensor):
    """FP8 e4m3 per 128-channel block of each token, with f32 scales ``amax / 448``."""
    m, n = x.shape
    v = x.float().view(m, n // 128, 128)
    amax = v.abs().amax(dim=2).clamp(1e-4)
    q = (v * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn)
    return q.view(m, n), (amax / 448.0).view(m, n // 128)


def per_token_cast_back(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise (f32 or int32 UE8M0 scales) to bf16."""
    if scales.dtype == torch.int32:
        # Four exponent bytes a word; flatten first (a size-1 dimension may have any stride).
        lead = scales.shape[:-1]
        exps = scales.contiguous().reshape(-1).view(torch.uint8).reshape(*lead, -1)
        scales = (exps.to(torch.int32) << 23).view(torch.float32)
    shape = q.shape
    v = q.float().view(*shape[:-1], shape[-1] // 128, 128)
    return (v * scales.reshape(*shape[:-1], shape[-1] // 128, 1)).view(shape).to(torch.bfloat16)


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Each row's distinct values, descending, padded with -1 (DeepEP's helper)."""
    assert x.dim() == 2
    mask = x < 0
    x_padded = x.masked_fill(mask, num_slots)
    bin_count = torch.zeros((x.size(0), num_slots + 1), dtype=x.dtype)
    bin_count.scatter_add_(1, x_padded, torch.ones_like(x_padded))
    bin_count = bin_count[:, :num_slots]
    sorted_bin_count, sorted_bin_idx = torch.sort(bin_count, dim=-1, descending=True)
    sorted_bin_idx.masked_fill_(sorted_bin_count == 0, -1)
    sorted_bin_idx = torch.sort(sorted_bin_idx, descending=True, dim=-1).values
    x[:, :].fill_(-1)
    valid_len = min(num_slots, x.size(1))
    x[:, :valid_len] = sorted_bin_idx[:, :valid_len]


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def all_gather(t: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    out = torch.empty((ctx.world * t.shape[0], *t.shape[1:]), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t.contiguous(), group=ctx.group)
    return out.view(ctx.world, *t.shape)


def check_rows_per_source(recv: torch.Tensor, prefix: torch.Tensor, rank: int) -> None:
    """Rows from source ``i`` (``[prefix[i-1][rank], prefix[i][rank])``) all equal ``i``,
    and every row is constant (DeepEP's ``check_data``)."""
    assert torch.equal(recv.float().amin(dim=1), recv.float().amax(dim=1))
    start = 0
    for i in range(prefix.size(0)):
        end = prefix[i][rank].item()
        assert (recv[start:end, :].float() == i).all(), f"rows from rank {i}"
        start = end


# ---------------------------------------------------------------------- normal mode

def normal_mode(ctx: Ctx, num_tokens: int = 96, hidden: int = 256, num_topk: int = 4,
                num_experts: int = 16, seed: int = 0, internode: bool = False,
                with_bias: bool = False) -> Dict[str, Any]:
    """DeepEP's test_intranode (and test_internode's checks), at a CPU-sized shape."""
    rank, R, group = ctx.rank, ctx.world, ctx.group
    buffer = ctx.buffer(int(2e9), int(1e9) if internode else 0)
    torch.manual_seed(rank + seed)
    N, H, K, E = num_tokens, hidden, num_topk, num_experts
    x = torch.ones((N, H), dtype=torch.bfloat16) * rank
    x_pure_rand = torch.randn((N, H), dtype=torch.bfloat16)
    x_e4m3 = per_token_cast_to_fp8(x)
    x_e4m3 = (x_e4m3[0], x_e4m3[1].T.contiguous().T)  # column-major scales, as DeepEP tests
    scores = torch.randn((N, E), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((N, K), dtype=torch.float32) * rank
    topk_weights_pure_rand = torch.randn((N, K), dtype=torch.float32)
    rank_idx = topk_idx // (E // R)
    rank_idx.masked_fill_(topk_idx == -1, -1)
    inplace_unique(rank_idx, R)

    # References of the layout.
    num_tokens_per_expert = torch.zeros((E,), dtype=torch.int32)
    for i in range(E):
        num_tokens_per_expert[i] = (topk_idx == i).sum()
    gbl_num_tokens_per_expert = all_reduce(num_tokens_per_expert, group)
    num_tokens_per_rank = torch.empty((R,), dtype=torch.int32)
    token_idx_in_rank = torch.full((R, N), -1, dtype=torch.long)
    for i in range(R):
        num_tokens_per_rank[i] = (rank_idx == i).sum()
        token_sel = (rank_idx == i).max(dim=-1)[0]
        count = token_sel.sum().item()
        tokens = torch.sort(token_sel.to(torch.int), descending=True)[1]
        tokens[:count] = torch.sort(tokens[:count])[0]
        token_idx_in_rank[i][tokens[:count]] = torch.arange(count, dtype=torch.long)
    token_idx_in_rank = token_idx_in_rank.T.contiguous().to(torch.int)
    is_token_in_rank = token_idx_in_rank >= 0
    gbl_num_tokens_per_rank = all_reduce(num_tokens_per_rank, group)

    ref_per_rank, ref_per_node, ref_per_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    assert torch.equal(ref_per_rank, num_tokens_per_rank)
    assert torch.equal(ref_per_expert, num_tokens_per_expert)
    assert torch.equal(ref_in_rank, is_token_in_rank)
    if internode:
        L = int(os.environ["UEP_RANKS_PER_NODE"])
        node_idx = rank_idx.clone()
        node_idx[node_idx >= 0] //= L
        inplace_unique(node_idx, R // L)
        ref_node = torch.tensor([(node_idx == n).sum().item() for n in range(R // L)], dtype=torch.int32)
        assert ref_per_node is not None and torch.equal(ref_per_node, ref_node)
    else:
        assert ref_per_node is None
    prefix_at = -4 if internode else 0

    checked = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_pure_rand, x, x_e4m3):
                for with_topk in (False, True):
                    config = deep_ep.Config(24, 6, 256, 6, 128)
                    args: Dict[str, Any] = {"x": current_x, "num_tokens_per_rank": num_tokens_per_rank,
                                            "is_token_in_rank": is_token_in_rank,
                                            "num_tokens_per_expert": num_tokens_per_expert,
                                            "config": config, "async_finish": async_mode}
                    if internode:
                        args["num_tokens_per_rdma_rank"] = ref_per_node
                    if with_topk:
                        args["topk_idx"] = topk_idx
                        args["topk_weights"] = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                    if previous_mode:
                        args["previous_event"] = buffer.capture()
                    recv_x, recv_topk_idx, recv_topk_weights, recv_list, handle, event = buffer.dispatch(**args)
                    if async_mode:
                        event.current_stream_wait()
                    recv_x = per_token_cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x
                    prefix = handle[prefix_at]
                    if internode:
                        # handle[-4]: inclusive prefix of rows received, by source rank.
                        column = torch.zeros((R, R), dtype=torch.int32)
                        column[:, rank] = prefix
                        prefix = column
                    assert gbl_num_tokens_per_rank[rank].item() == recv_x.size(0), (recv_x.shape, gbl_num_tokens_per_rank)
                    assert gbl_num_tokens_per_expert.view(R, -1)[rank].tolist() == recv_list
                    if current_x is not x_pure_rand:
                        check_rows_per_source(recv_x, prefix, rank)
                    if with_topk:
                        assert recv_topk_idx.eq(-1).logical_or(recv_topk_idx.ge(0).logical_and(recv_topk_idx.lt(E // R))).all()
                        for i, count in enumerate(recv_list):
                            assert recv_topk_idx.eq(i).sum().item() == count
                        # Weights travel unchanged where the expert is local, 0 elsewhere.
                        assert (recv_topk_weights[recv_topk_idx.eq(-1)] == 0).all()
                        recv_topk_weights_clone = recv_topk_weights.clone()
                        if current_x is not x_pure_rand:
                            # As DeepEP's test: fill the -1 slots with the row's value, in
                            # place (combine then returns it for every slot).
                            recv_topk_weights[recv_topk_idx.eq(-1)] = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(recv_topk_weights)[recv_topk_idx.eq(-1)]
                            check_rows_per_source(recv_topk_weights, prefix, rank)

                        # Padded to the worst case: the same rows first, -1 after.
                        worst = N * R
                        out_w = buffer.dispatch(**args, num_worst_tokens=worst)
                        wx, widx, ww, wlist = out_w[0], out_w[1], out_w[2], out_w[3]
                        wx = per_token_cast_back(*wx) if isinstance(wx, tuple) else wx
                        n = recv_x.size(0)
                        assert wlist == [] and wx.size(0) == worst and widx.size(0) == worst and ww.size(0) == worst
                        assert torch.equal(wx[:n], recv_x)
                        assert torch.equal(widx[:n], recv_topk_idx)
                        assert torch.equal(ww[:n], recv_topk_weights_clone)
                        assert (widx[n:] == -1).all()
                    else:
                        # Cached dispatch through the handle.
                        cached_args = {"x": current_x, "handle": handle, "config": config, "async_finish": async_mode}
                        if previous_mode:
                            cached_args["previous_event"] = buffer.capture()
                        cx, cidx, cw, clist, chandle, cevent = buffer.dispatch(**cached_args)
                        assert cidx is None and cw is None and clist is None and chandle is None
                        if async_mode:
                            cevent.current_stream_wait()
                        cx = per_token_cast_back(*cx) if isinstance(cx, tuple) else cx
                        assert torch.equal(cx, recv_x)

                    # Combine: the unweighted sum of the rows sent back, with the biases.
                    combine_args: Dict[str, Any] = {"x": recv_x, "handle": handle, "config": config,
                                                    "async_finish": async_mode}
                    if with_topk:
                        combine_args["topk_weights"] = recv_topk_weights
                    if previous_mode:
                        combine_args["previous_event"] = buffer.capture()
                    bias = None
                    if with_bias:
                        bias = (torch.ones((N, H), dtype=torch.bfloat16), torch.randn((N, H), dtype=torch.bfloat16))
                        combine_args["bias"] = bias
                    combined_x, combined_w, event = buffer.combine(**combine_args)
                    if async_mode:
                        event.current_stream_wait()
                    sent_to = is_token_in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_pure_rand if current_x is x_pure_rand else x
                    # Exact: each rank returns the row it got, and c equal rows sum to c
                    # times the row in f32 exactly (also as two nodes' bf16 partials of
                    # two rows each); then the biases, in order, and one rounding.
                    expect = ref_x.float() * sent_to
                    if bias is not None:
                        expect = expect + bias[0].float()
                        expect = expect + bias[1].float()
                    assert torch.equal(combined_x, expect.to(torch.bfloat16)), "combine is not bit-exact"
                    check_x = combined_x.float()
                    if bias is not None:
                        check_x = check_x - bias[0].float() - bias[1].float()
                    assert calc_diff(check_x / sent_to, ref_x) < (5e-4 if internode else 5e-6)
                    if with_topk:
                        ref_w = topk_weights_pure_rand if current_x is x_pure_rand else topk_weights
                        check_w = combined_w if current_x is x_pure_rand else combined_w / sent_to
                        assert calc_diff(check_w, ref_w) < 1e-9
                    checked += 1
    buffer.destroy()
    dist.barrier(group=group)
    return {"checked": checked}


# ---------------------------------------------------------------------- low latency

def low_latency(ctx: Ctx, num_tokens: int = 16, hidden: int = 512, num_topk: int = 4,
                num_experts: int = 16, seed: int = 1, buffer: Optional[deep_ep.Buffer] = None,
                destroy: bool = True) -> Dict[str, Any]:
    """DeepEP's test_low_latency, on CPU (without shrink and without the GPU benches)."""
    rank, R, group = ctx.rank, ctx.world, ctx.group
    N, H, K, E = num_tokens, hidden, num_topk, num_experts
    local = E // R
    if buffer is None:
        buffer = ctx.buffer(0, deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E),
                            low_latency_mode=True, num_qps_per_rank=E // R)
    torch.manual_seed(seed + rank)
    x = torch.ones((N, H), dtype=torch.bfloat16) * (rank - 128)
    x[:, -128:] = torch.arange(N, dtype=torch.bfloat16).view(-1, 1)
    x_list = [x, torch.randn((N, H), dtype=torch.bfloat16) * 0.1]
    scores = torch.randn((N, E), dtype=torch.float32).abs() + 1
    topk_idx = torch.topk(scores, K, dim=-1, largest=True, sorted=True)[1]
    topk_weights = torch.randn((N, K), dtype=torch.float32).abs()
    for _ in range(10):
        topk_idx[torch.randint(0, N, (1,)).item(), torch.randint(0, K, (1,)).item()] = -1
    all_topk_idx = all_gather(topk_idx, ctx)
    int_mask = (1 << 32) - 1
    checked = 0
    num_times = 0
    for current_x in x_list:
        do_check = current_x is x
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in ((False, True) if use_fp8 else (False,)):
                    for use_ue8m0 in ((False, True) if round_scale else (False,)):
                        # Dispatching twice before one combine is legal.
                        num_times += 1
                        for _ in range((num_times % 2) + 1):
                            stats = torch.zeros((local,), dtype=torch.int32)
                            wait_cost = torch.zeros((R,), dtype=torch.int64)
                            packed_recv_x, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                current_x, topk_idx, N, E, cumulative_local_expert_recv_stats=stats,
                                dispatch_wait_recv_cost_stats=wait_cost, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                        if use_fp8:
                            assert packed_recv_x[0].dtype == torch.float8_e4m3fn
                            scales = packed_recv_x[1]
                            g = H // 512 if use_ue8m0 else H // 128
                            assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
                            assert tuple(scales.shape) == (local, R * N, g)
                            # Column-major in the last two dimensions, as DeepEP returns them.
                            assert scales.stride() == (g * R * N, 1, R * N), scales.stride()
                            packed_recv_x = (packed_recv_x[0], scales.contiguous())
                            simulated = per_token_cast_back(packed_recv_x[0].view(-1, H),
                                                            packed_recv_x[1].view(-1, g)).view(local, R * N, H)
                        else:
                            simulated = packed_recv_x.clone()
                        assert tuple(handle[0].shape) == (local, R * N) and handle[2:] == (N, H, E)
                        for i in range(local):
                            expert_id = rank * local + i
                            if use_fp8:
                                recv_x = per_token_cast_back(packed_recv_x[0][i], packed_recv_x[1][i])
                            else:
                                recv_x = packed_recv_x[i]
                            recv_count, recv_src_info, recv_layout_range = packed_recv_count[i], handle[0][i], handle[1][i]
                            assert stats[i].item() == recv_count.item()
                            num_valid = (recv_layout_range & int_mask).sum().item()
                            assert recv_count.item() == num_valid
                            assert recv_count.item() == (all_topk_idx == expert_id).sum().item()
                            if not do_check:
                                continue
                            recv_x = recv_x[:num_valid]
                            recv_x_amin = recv_x[:, :-128].amin(dim=-1)
                            recv_src_info = recv_src_info[:num_valid]
                            assert torch.equal(recv_x_amin, recv_x[:, :-128].amax(dim=-1))
                            if round_scale:
                                assert calc_diff(recv_x[:, -1], recv_src_info.view(-1)) < 0.007, (return_recv_hook, use_ue8m0, i, recv_x[:, -1].tolist(), recv_src_info.tolist())
                            else:
                                # src_info is the token's index on its source.
                                assert (recv_x[:, -128:] - recv_src_info.view(-1, 1) % N).sum().item() == 0
                            for j in range(R):
                                begin, count = (recv_layout_range[j] >> 32).item(), (recv_layout_range[j] & int_mask).item()
                                assert count == (all_topk_idx[j] == expert_id).sum().item()
                                if not round_scale:
                                    assert (recv_x_amin == j - 128).sum().item() == count
                                    assert (recv_x[begin:begin + count, :-128] - (j - 128)).sum().item() == 0
                            checked += 1
                        for zero_copy in (False, True):
                            x_arg = simulated
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated
                                # The rows go from the buffer: x is not read (zeros here).
                                x_arg = torch.zeros_like(simulated)
                            out = torch.empty((N, H), dtype=torch.bfloat16)
                            combined_x, event, hook = buffer.low_latency_combine(
                                x_arg, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else event.current_stream_wait()
                            assert combined_x.data_ptr() == out.data_ptr()
                            assert torch.isnan(combined_x).sum().item() == 0
                            if do_check and not round_scale:
                                diff = calc_diff(current_x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1), combined_x)
                                assert diff < (9e-4 if use_fp8 else 1e-5), diff
                            if not use_fp8:
                                # Exact: sum of w * y over the slots in order, f32, one rounding.
                                acc = torch.zeros((N, H), dtype=torch.float32)
                                for k in range(K):
                                    valid = (topk_idx[:, k] >= 0).view(-1, 1)
                                    acc = torch.where(valid, acc + topk_weights[:, k:k + 1] * current_x.float(), acc)
                                assert torch.equal(combined_x, acc.to(torch.bfloat16)), "LL combine is not bit-exact"
    if destroy:
        buffer.destroy()
        dist.barrier(group=group)
    return {"checked": checked}


def nvfp4_reference(x: torch.Tensor, g: float, ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[N, H]`` bf16 -> (``[N, H/2]`` e2m1 pairs, ``[N, H/16]`` block scale bytes): the
    NVFP4 cast of DeepEP's hybrid-ep low-latency dispatch, written plainly in torch
    (f32 ops, as the kernels: ``sf = g * (amax * f32(1/6))``, e4m3 or rounded-up UE8M0
    scale, ``e2m1(v * (g / scale))`` to nearest even, saturating; a zero block is zeros)."""
    n, h = x.shape
    v = x.float().view(n, h // 16, 16)
    amax = v.abs().amax(dim=-1)
    gs = torch.tensor(g, dtype=torch.float32)
    sf = gs * (amax * torch.tensor(1 / 6, dtype=torch.float32))
    if ue8m0:
        bits = sf.view(torch.int32)
        byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
        byte = torch.where(sf > 0, byte, torch.zeros_like(byte)).clamp(0, 254)
        decoded = (byte << 23).view(torch.float32)
        byte = byte.to(torch.uint8)
    else:
        byte = sf.to(torch.float8_e4m3fn).view(torch.uint8)
        decoded = byte.view(torch.float8_e4m3fn).float()
    out = torch.where((amax == 0) | (decoded == 0), torch.zeros_like(amax), gs / decoded)
    y = v * out.unsqueeze(-1)
    m = y.abs()
    code = ((m > 0.25).int() + (m >= 0.75).int() + (m > 1.25).int() + (m >= 1.75).int()
            + (m > 2.5).int() + (m >= 3.5).int() + (m > 5).int())
    code = (code | (torch.signbit(y).int() << 3)).view(n, h)
    pairs = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return pairs, byte.view(n, h // 16)


def nvfp4_dequant(pairs: torch.Tensor, scales: torch.Tensor, g: float, ue8m0: bool) -> torch.Tensor:
    """The values NVFP4 codes stand for: ``e2m1 * scale / g`` (f32)."""
    table = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    codes = torch.stack((pairs & 0xF, pairs >> 4), dim=-1).reshape(pairs.shape[0], -1).long()
    if ue8m0:
        scale = (scales.to(torch.int32) << 23).view(torch.float32)
    else:
        scale = scales.view(torch.float8_e4m3fn).float()
    return table[codes] * (scale / g).repeat_interleave(16, dim=-1)


def low_latency_nvfp4(ctx: Ctx, num_tokens: int = 40, hidden: int = 256, num_topk: int = 4,
                      num_experts: int = 16, seed: int = 3) -> Dict[str, Any]:
    """NVFP4 low-latency dispatch as SGLang calls it (hybrid-ep's keywords), both block
    scale formats, hooks or not, one rank with no tokens: every received row's codes
    and swizzled scales equal the plain reference of its source token, bit for bit; the
    combine after it and SGLang's single-batch-overlap arguments give the exact sum."""
    rank, R = ctx.rank, ctx.world
    N, H, K, E = num_tokens, hidden, num_topk, num_experts
    L, M = E // R, N
    n_mine = 0 if rank == 1 else N - rank
    buffer = ctx.buffer(0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                        low_latency_mode=True, num_qps_per_rank=L)
    torch.manual_seed(seed + rank)
    x = (torch.randn((n_mine, H)) * torch.rand((n_mine, 1)) * 4).to(torch.bfloat16)
    x[:, :16] = 0  # a block of zeros on every token
    if n_mine:
        # With a global scale of 1, token 0's second block scales by exactly 1: every
        # e2m1 rounding tie, both signs.
        ties = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, 0.1]
        x[0, 16:32] = torch.tensor(ties, dtype=torch.bfloat16)
    topk_idx = torch.argsort(torch.rand((n_mine, E)), dim=1)[:, :K].contiguous()
    topk_idx[torch.rand((n_mine, K)) < 0.1] = -1
    topk_weights = torch.rand((n_mine, K), dtype=torch.float32)
    padded = torch.zeros((N, H), dtype=torch.bfloat16)
    padded[:n_mine] = x
    all_x = all_gather(padded, ctx)
    padded_idx = torch.full((N, K), -1, dtype=torch.int64)
    padded_idx[:n_mine] = topk_idx
    all_idx = all_gather(padded_idx, ctx)
    padded_w = torch.zeros((N, K), dtype=torch.float32)
    padded_w[:n_mine] = topk_weights
    all_w = all_gather(padded_w, ctx)
    amax = all_reduce(x.float().abs().amax().reshape(1) if n_mine else torch.zeros(1), ctx.group)
    fitted = 448.0 * 6.0 / amax.item()
    checked = 0
    cases = [(fitted, ue8m0, hook) for ue8m0 in (False, True) for hook in (False, True)]
    for g_value, ue8m0, return_recv_hook in cases + [(1.0, False, False), (1.0, True, True)]:
        g = torch.tensor(g_value, dtype=torch.float32)
        refs = [nvfp4_reference(all_x[j], g.item(), ue8m0) for j in range(R)]
        # SGLang's call: hybrid-ep's keywords, with the weights (seven values back).
        recv_x, recv_count, recv_w, recv_rank, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, M, E, use_fp8=False, use_nvfp4=True, x_global_scale=g,
            use_ue8m0_for_sf=ue8m0, return_recv_hook=return_recv_hook, topk_weights=topk_weights)
        hook()
        assert recv_w.dtype == torch.float32 and recv_rank.dtype == torch.int32
        assert tuple(recv_w.shape) == tuple(recv_rank.shape) == (L, R * M)
        data, scales = recv_x
        rm, rk = -(-R * M // 128), H // 64
        assert data.dtype == torch.uint8 and tuple(data.shape) == (R * M, H // 2, L)
        assert scales.dtype == (torch.int8 if ue8m0 else torch.float8_e4m3fn)
        assert tuple(scales.shape) == (32, 4, rm, 4, rk, L), scales.shape
        sf = scales.view(torch.uint8)
        y = torch.zeros((L, R * M, H), dtype=torch.bfloat16)
        for i in range(L):
            n = recv_count[i].item()
            rows = torch.arange(n)
            src = torch.repeat_interleave(torch.arange(R), (handle[1][i] & 0xFFFFFFFF))
            tok = handle[0][i][:n].long()
            if n:
                want_q = torch.stack([refs[j][0][t] for j, t in zip(src.tolist(), tok.tolist())])
                want_s = torch.stack([refs[j][1][t] for j, t in zip(src.tolist(), tok.tolist())])
                assert torch.equal(data[:n, :, i], want_q), f"codes of expert {i}"
                blocks = torch.arange(H // 16)
                got_s = sf[(rows % 32).view(-1, 1), ((rows % 128) // 32).view(-1, 1), (rows // 128).view(-1, 1),
                           (blocks % 4).view(1, -1), (blocks // 4).view(1, -1), i]
                assert torch.equal(got_s, want_s), f"block scales of expert {i}"
                y[i, :n] = nvfp4_dequant(want_q, want_s, g.item(), ue8m0).to(torch.bfloat16)
                # Each row's source rank and the weight of the slot naming this expert.
                expert = rank * L + i
                slot = (all_idx[src, tok] == expert).int().argmax(dim=1)
                assert torch.equal(recv_rank[i, :n], src.int()), f"source ranks of expert {i}"
                assert torch.equal(recv_w[i, :n], all_w[src, tok, slot]), f"weights of expert {i}"
            assert (recv_rank[i, n:] == -1).all() and (recv_w[i, n:] == 0).all()
            checked += 1
        # The combine of the dequantised rows, plainly and with SGLang's SBO keywords.
        plain, _, _ = buffer.low_latency_combine(y, topk_idx, topk_weights, handle)
        # Every copy of a token came back as its own dequantised row: sum w * y over
        # the slots in order, in f32, rounded once.
        mine = nvfp4_dequant(*refs[rank], g.item(), ue8m0)[:n_mine].to(torch.bfloat16).float()
        acc = torch.zeros((n_mine, H), dtype=torch.float32)
        for k in range(K):
            valid = (topk_idx[:, k] >= 0).view(-1, 1)
            acc = torch.where(valid, acc + topk_weights[:, k:k + 1] * mine, acc)
        assert torch.equal(plain, acc.to(torch.bfloat16)), "combine after an NVFP4 dispatch"
        blocks_m = L * -(-R * M // 64)
        hopper, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=True, overlap=True,
            packed_recv_count=recv_count, comp_signal=torch.zeros(blocks_m, dtype=torch.int32),
            block_m=64, threshold=7, num_sms=3)
        hook()
        blackwell, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, return_recv_hook=True, overlap=True,
            src_signals=torch.zeros(L, dtype=torch.uint32), src_signal_expect_value=1)
        hook()
        assert torch.equal(plain, hopper) and torch.equal(plain, blackwell)
    buffer.destroy()
    dist.barrier(group=ctx.group)
    return {"checked": checked}


def mixed_modes(ctx: Ctx) -> Dict[str, Any]:
    """One Buffer for normal and low-latency calls, interleaved, different hidden sizes
    (DeepEP's --test-ll-compatibility; UCCL cannot)."""
    R = ctx.world
    buffer = ctx.buffer(int(2e9), deep_ep.Buffer.get_low_latency_rdma_size_hint(16, 512, R, 16),
                        low_latency_mode=True)
    first = normal_step(ctx, buffer, tokens=40, hidden=256, experts=16)
    buffer.clean_low_latency_buffer(16, 512, 16)
    ll = low_latency(ctx, num_tokens=16, hidden=512, num_experts=16, buffer=buffer, destroy=False)
    second = normal_step(ctx, buffer, tokens=40, hidden=256, experts=16)
    ll2 = low_latency(ctx, num_tokens=16, hidden=512, num_experts=16, seed=7, buffer=buffer, destroy=False)
    assert first == second  # deterministic: same inputs, same bytes
    buffer.destroy()
    return {"checked": ll["checked"] + ll2["checked"]}


def normal_step(ctx: Ctx, buffer: deep_ep.Buffer, tokens: int, hidden: int, experts: int,
                seed: int = 5) -> float:
    """One normal dispatch and combine of random tokens, checked exactly; returns a hash."""
    torch.manual_seed(seed + ctx.rank)
    x = torch.randn((tokens, hidden), dtype=torch.bfloat16)
    topk_idx = torch.topk(torch.randn((tokens, experts)).abs() + 1, 4, dim=-1, sorted=False)[1]
    weights = torch.rand((tokens, 4))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=weights)
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    assert torch.allclose(combined_w, weights)
    return recv_x.float().sum().item()


# ---------------------------------------------------------------------- edge cases

def _layout(buffer: deep_ep.Buffer, topk_idx: torch.Tensor, experts: int):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def empty_ranks(ctx: Ctx, hidden: int = 256) -> Dict[str, Any]:
    """Rank 0 dispatches no tokens; nobody routes to the last rank; every -1 slot.
    Empty outputs keep their trailing shape."""
    rank, R = ctx.rank, ctx.world
    experts = 2 * R
    buffer = ctx.buffer(int(2e9), int(1e9))
    local = experts // R
    last = range((R - 1) * local, R * local)
    n = 0 if rank == 0 else 24
    torch.manual_seed(rank)
    x = torch.randn((n, hidden), dtype=torch.bfloat16)
    # Experts of every rank but the last, two slots each.
    choices = torch.tensor([e for e in range(experts) if e not in last])
    topk_idx = choices[torch.randint(0, len(choices), (n, 2))]
    weights = torch.rand((n, 2))
    layout = _layout(buffer, topk_idx, experts)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    if rank == R - 1:
        assert tuple(recv_x.shape) == (0, hidden) and tuple(recv_idx.shape) == (0, 2) and tuple(recv_w.shape) == (0, 2)
        assert counts == [0] * local
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    assert tuple(combined.shape) == (n, hidden) and tuple(combined_w.shape) == (n, 2)
    in_rank = layout["is_token_in_rank"]
    assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))
    # Every slot -1: nothing moves anywhere.
    none_idx = torch.full((n, 2), -1, dtype=torch.int64)
    recv_x, recv_idx, _, counts, handle, _ = buffer.dispatch(x, topk_idx=none_idx, topk_weights=weights,
                                                             **_layout(buffer, none_idx, experts))
    assert tuple(recv_x.shape) == (0, hidden) and counts == [0] * local
    combined, _, _ = buffer.combine(recv_x, handle)
    assert tuple(combined.shape) == (n, hidden) and (combined == 0).all()
    # Low-latency: a rank with no tokens, FP8 too.
    ll_n = 0 if rank == 0 else 8
    ll_x = torch.randn((ll_n, 512), dtype=torch.bfloat16)
    ll_idx = torch.randint(0, experts, (ll_n, 2))
    for fp8 in (False, True):
        rx, rc, h, _, _ = buffer.low_latency_dispatch(ll_x, ll_idx, 8, experts, use_fp8=fp8)
        y = per_token_cast_back(*rx) if fp8 else rx
        out, _, _ = buffer.low_latency_combine(y, ll_idx, torch.ones((ll_n, 2)), h)
        assert tuple(out.shape) == (ll_n, 512)
    buffer.destroy()
    return {"ok": True}


def growth(ctx: Ctx) -> Dict[str, Any]:
    """Memory is sized by the calls, not by num_nvl_bytes: 2 GB of capacity maps a few
    MB; more tokens on one rank than the Buffer holds grows it on every rank, and the
    dispatch still returns the right rows."""
    rank, R = ctx.rank, ctx.world
    buffer = ctx.buffer(int(2e9), 0)
    assert buffer.registered_bytes() == 0
    first = normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    small = buffer.registered_bytes()
    assert 0 < small < 64 << 20, small
    # Only rank 1 grows past the Buffer's room: all ranks learn it in the notify step.
    tokens = 200 if rank == 1 else 16
    normal_step(ctx, buffer, tokens=tokens, hidden=256, experts=8)
    grown = buffer.registered_bytes()
    assert grown > small, (small, grown)
    # And back: the Buffer keeps its room; the same call gives the same bytes.
    again = normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    assert again == first and buffer.registered_bytes() == grown
    buffer.destroy()
    return {"small": small, "grown": grown}


def capacity_error(ctx: Ctx) -> Dict[str, Any]:
    """A call that needs more than num_nvl_bytes + num_rdma_bytes raises on every rank,
    naming the bytes and the argument."""
    buffer = ctx.buffer(1 << 20, 0)
    x = torch.randn((4096, 1024), dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (4096, 2))
    try:
        buffer.dispatch(x, topk_idx=idx, topk_weights=torch.rand((4096, 2)), **_layout(buffer, idx, 8))
    except deep_ep.UepError as e:
        msg = str(e)
        assert "num_nvl_bytes" in msg and "bytes" in msg and "capacity" in msg, msg
        return {"msg": msg, "type": type(e).__name__}
    raise AssertionError("a dispatch past the capacity succeeded")


def bad_input(ctx: Ctx, what: str, first_call: bool) -> Dict[str, Any]:
    """Rank 1 passes `what` wrong; every rank must raise UepError, promptly."""
    rank = ctx.rank
    assert ctx.world in (2, 4, 8), "8 experts"
    buffer = ctx.buffer(int(2e9), int(1e9))
    if not first_call:
        normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    n, h = 16, 256
    x = torch.randn((n, h), dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (n, 2))
    w = torch.rand((n, 2))
    bad = rank == 1
    start = time.monotonic()
    try:
        if what == "dtype":
            buffer.dispatch(x.float() if bad else x, topk_idx=idx, topk_weights=w, **_layout(buffer, idx, 8))
        elif what == "ids":
            if bad:
                idx = idx.clone()
                idx[3, 1] = 8
                buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=torch.zeros(ctx.world, dtype=torch.int32),
                                is_token_in_rank=torch.zeros((n, ctx.world), dtype=torch.bool),
                                num_tokens_per_expert=torch.zeros(8, dtype=torch.int32))
            else:
                buffer.dispatch(x, topk_idx=idx, topk_weights=w, **_layout(buffer, idx, 8))
        elif what == "noncontiguous":
            xx = torch.randn((h, n), dtype=torch.bfloat16).T if bad else x
            buffer.dispatch(xx, topk_idx=idx, topk_weights=w, **_layout(buffer, idx, 8))
        elif what == "ll_hidden":
            hh = 200 if bad else 256
            buffer.low_latency_dispatch(torch.randn((n, hh), dtype=torch.bfloat16), idx, n, 8, use_fp8=False)
        elif what == "ll_nvfp4_no_scale":
            g = None if bad else torch.tensor(100.0)
            buffer.low_latency_dispatch(x, idx, n, 8, use_fp8=False, use_nvfp4=True, x_global_scale=g)
        elif what == "ll_comp_signal":
            # SGLang's single-batch-overlap keywords, with a float counter array on rank 1.
            recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, n, 8, use_fp8=False)
            signal = torch.zeros(8 // ctx.world * -(-ctx.world * n // 64), dtype=torch.float32 if bad else torch.int32)
            _, _, hook = buffer.low_latency_combine(recv_x, idx, w, handle, overlap=True, return_recv_hook=True,
                                                    packed_recv_count=count, comp_signal=signal, block_m=64,
                                                    threshold=1)
            hook()
        elif what == "ll_out_in_buffer":
            # A zero-copy combine whose output is the combine buffer it sends from.
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, n, 8, use_fp8=False)
            staged = buffer.get_next_low_latency_combine_buffer(handle)
            staged[:, :, :] = recv_x
            out = staged.view(-1, h)[:n] if bad else None
            buffer.low_latency_combine(recv_x, idx, w, handle, zero_copy=True, out=out)
        else:
            raise ValueError(what)
    except deep_ep.UepError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "bad": bad, "type": type(e).__name__,
                "value_error": isinstance(e, ValueError)}
    raise AssertionError(f"rank {rank}: the call with bad input on rank 1 succeeded")


def dead_peer(ctx: Ctx, mode: str) -> Dict[str, Any]:
    """The last rank is killed with SIGKILL while the others wait in a call: they raise
    UepError naming it, long before the deadline."""
    import signal
    rank, R = ctx.rank, ctx.world
    buffer = ctx.buffer(int(2e9), int(1e9))
    normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    buffer.clean_low_latency_buffer(16, 512, 8)
    dist.barrier(group=ctx.group)
    if rank == R - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if mode == "normal":
            normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
        else:
            buffer.low_latency_dispatch(torch.randn((16, 512), dtype=torch.bfloat16), torch.randint(0, 8, (16, 4)),
                                        16, 8, use_fp8=False)
    except deep_ep.UepError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "type": type(e).__name__}
    raise AssertionError("a call with a dead peer succeeded")


def timeout(ctx: Ctx) -> Dict[str, Any]:
    """The last rank is alive but never enters the call: the others raise a timeout
    naming whom they waited for, at the deadline (UEP_TIMEOUT_S)."""
    rank, R = ctx.rank, ctx.world
    buffer = ctx.buffer(int(2e9), 0)
    normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    if rank == R - 1:
        time.sleep(float(os.environ["UEP_TIMEOUT_S"]) + 2)
        return {"skipped": True}
    start = time.monotonic()
    try:
        normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    except deep_ep.UepError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "type": type(e).__name__,
                "timeout_error": isinstance(e, TimeoutError)}
    raise AssertionError("a call with an absent peer succeeded")


def gil_released(ctx: Ctx) -> Dict[str, Any]:
    """While a call waits for a peer, other Python threads of the rank run."""
    rank, R = ctx.rank, ctx.world
    buffer = ctx.buffer(int(2e9), 0)
    normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    ticks = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)
    t = threading.Thread(target=spin)
    if rank == 1:
        time.sleep(1.0)  # rank 0 waits in the dispatch meanwhile
    t.start()
    before = ticks[0]
    start = time.monotonic()
    normal_step(ctx, buffer, tokens=16, hidden=256, experts=8)
    waited = time.monotonic() - start
    stop.set()
    t.join()
    buffer.destroy()
    return {"ticks": ticks[0] - before, "waited": waited}


def events_and_flags(ctx: Ctx) -> Dict[str, Any]:
    """Every flag combination DeepEP accepts (Megatron passes async + comm stream)."""
    buffer = ctx.buffer(int(2e9), 0)
    x = torch.randn((16, 256), dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (16, 2))
    w = torch.rand((16, 2))
    n = 0
    for previous in (None, deep_ep.Buffer.capture()):
        for async_finish in (False, True):
            for on_comm in (False, True):
                flags = dict(previous_event=previous, async_finish=async_finish, allocate_on_comm_stream=on_comm)
                *layout, event = buffer.get_dispatch_layout(idx, 8, **flags)
                out = buffer.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=layout[0],
                                      is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], **flags)
                combined, _, event = buffer.combine(out[0], out[4], **flags)
                if async_finish:
                    assert event.event is not None
                    event.current_stream_wait()
                    with event:
                        pass
                else:
                    assert event.event is None
                n += 1
    buffer.destroy()
    return {"combos": n}


def elastic(ctx: Ctx, victims: Tuple[int, ...], kill_step: int, steps: int = 12,
            num_tokens: int = 16, hidden: int = 256, num_experts: int = 16, num_topk: int = 4,
            die_in_combine: bool = False) -> Dict[str, Any]:
    """Elastic low-latency mode: ``victims`` SIGKILL themselves at ``kill_step`` (with
    ``die_in_combine``, between that step's combine send and its receive: their expert
    outputs are out, their agreement message is not); the survivors go on, every step
    checked exactly against the reference without the ranks the mask read right after
    the call names (their tokens count 0, their experts contribute nothing), and
    ``active_ranks`` and the mask say who is gone."""
    import signal
    rank, R = ctx.rank, ctx.world
    epr = num_experts // R
    buffer = ctx.buffer(int(2e9), int(1e9), enable_shrink=True)
    buffer.clean_low_latency_buffer(num_tokens, hidden, num_experts)

    def inputs(r: int, step: int):
        g = torch.Generator().manual_seed(1000 * step + r)
        x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16)
        scores = torch.rand((num_tokens, num_experts), generator=g)
        idx = torch.topk(scores, num_topk, dim=-1, sorted=False)[1]
        w = torch.rand((num_tokens, num_topk), generator=g)
        return x, idx, w

    first_masked = None
    for step in range(steps):
        dies = rank in victims and step == kill_step
        if dies and not die_in_combine:
            os.kill(os.getpid(), signal.SIGKILL)
        x, idx, w = inputs(rank, step)
        active = torch.ones(R, dtype=torch.int32)
        recv, count, handle, _, _ = buffer.low_latency_dispatch(x, idx, num_tokens, num_experts,
                                                                use_fp8=False, active_ranks=active)
        status = torch.zeros(R, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(status)
        masked = {r for r in range(R) if status[r]}
        assert masked == {r for r in range(R) if not active[r]}, (masked, active)
        if masked and first_masked is None:
            first_masked = step
        # Rows per local expert: every unmasked source's copies, none from the masked.
        want = torch.zeros(epr, dtype=torch.int32)
        for s in range(R):
            if s in masked:
                continue
            _, sidx, _ = inputs(s, step)
            for le in range(epr):
                want[le] += int((sidx == rank * epr + le).sum())
        assert torch.equal(count, want), (step, count, want, masked)
        y = recv  # identity experts
        if dies:
            buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
            time.sleep(0.2)  # let the proxy post the rows to another node
            os.kill(os.getpid(), signal.SIGKILL)
        out, _, _ = buffer.low_latency_combine(y, idx, w, handle, active_ranks=active)
        buffer.low_latency_query_mask_buffer(status)
        masked = {r for r in range(R) if status[r]}
        acc = torch.zeros((num_tokens, hidden))
        for k in range(num_topk):
            kept = torch.tensor([int(e) // epr not in masked for e in idx[:, k]]).unsqueeze(1)
            acc += torch.where(kept, w[:, k:k + 1] * x.float(), torch.zeros(()))
        assert torch.equal(out, acc.to(torch.bfloat16)), (step, masked)
    reasons = buffer.low_latency_mask_reasons()
    buffer.destroy()
    return {"masked": sorted(masked), "first_masked": first_masked, "steps": steps, "reasons": reasons}


def elastic_normal(ctx: Ctx, victims: Tuple[int, ...], kill_step: int, steps: int = 10,
                   num_tokens: int = 32, hidden: int = 256, num_experts: int = 16, num_topk: int = 4,
                   die_after_dispatch: bool = False) -> Dict[str, Any]:
    """Elastic normal mode: ``victims`` SIGKILL themselves at ``kill_step`` (with
    ``die_after_dispatch``, once that step's dispatch returned: the survivors' combine
    loses their rows, and across nodes a relay); every survivor checks each dispatch and
    combine exactly against a torch reference without the ranks the mask read right
    after the call names; a cached dispatch through a handle made before the death is
    refused, and the Buffer goes on."""
    import signal
    rank, R = ctx.rank, ctx.world
    E, K, epr = num_experts, num_topk, num_experts // R
    buffer = ctx.buffer(int(2e9), int(1e9), enable_shrink=True)

    def inputs(r: int, step: int):
        g = torch.Generator().manual_seed(1000 * step + r)
        x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16)
        scores = torch.rand((num_tokens, E), generator=g)
        idx = torch.topk(scores, K, dim=-1, sorted=False)[1].to(deep_ep.topk_idx_t)
        idx[torch.rand((num_tokens, K), generator=g) < 0.1] = -1
        w = torch.rand((num_tokens, K), generator=g)
        return x, idx, w

    def masked_now() -> set:
        status = torch.zeros(R, dtype=torch.int32)
        buffer.low_latency_query_mask_buffer(status)
        return {r for r in range(R) if status[r]}

    def ranks_of(idx: torch.Tensor, r: int) -> torch.Tensor:
        """[T] whether each token has an expert on rank ``r``."""
        return ((idx >= 0) & (idx // epr == r)).any(dim=1)

    first_masked, refused, masked, handle = None, None, set(), None
    for step in range(steps):
        dies = rank in victims and step == kill_step
        if dies and not die_after_dispatch:
            os.kill(os.getpid(), signal.SIGKILL)
        x, idx, w = inputs(rank, step)
        per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        before = handle
        recv_x, _, recv_w, recv_list, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert)
        masked = masked_now()
        # Rows from every source not masked, by source rank then token; per local
        # expert, their (token, slot) pairs.
        want_x, want_list = [], [0] * epr
        for s in (s for s in range(R) if s not in masked):
            xs, idxs, _ = inputs(s, step)
            want_x.append(xs[ranks_of(idxs, rank)])
            for le in range(epr):
                want_list[le] += int((idxs == rank * epr + le).sum())
        assert torch.equal(recv_x, torch.cat(want_x)), (step, masked)
        assert recv_list == want_list, (step, recv_list, want_list, masked)
        if dies:
            os.kill(os.getpid(), signal.SIGKILL)
        if masked and first_masked is None:
            first_masked = step
            # The last step's handle still routes to the masked ranks: refused, alike
            # on every survivor, and the Buffer stays usable.
            try:
                buffer.dispatch(x, handle=before)
                refused = False
            except deep_ep.UepError as e:
                refused = "masked" in str(e) and "cached" in str(e)
        combined_x, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
        masked = masked_now()
        # Identity experts: each live rank that got a token returns it once. With at
        # most four ranks, and node partials of at most two, every sum is exact in f32
        # until the one rounding to bf16, so the order of the sum does not matter.
        live = [r for r in range(R) if r not in masked]
        count = sum(ranks_of(idx, r).to(torch.float32) for r in live)
        assert torch.equal(combined_x, (x.float() * count.unsqueeze(1)).to(torch.bfloat16)), (step, masked)
        kept = (idx >= 0) & torch.tensor([[int(e) // epr in live for e in row] for row in idx])
        assert torch.equal(combined_w, torch.where(kept, w, torch.zeros(()))), (step, masked)
    buffer.destroy()
    return {"masked": sorted(masked), "first_masked": first_masked, "refused": refused}


def mask_without_shrink(ctx: Ctx) -> Dict[str, Any]:
    buffer = ctx.buffer(int(2e9), int(1e9))
    try:
        buffer.low_latency_clean_mask_buffer()
    except deep_ep.UepError as e:
        buffer.destroy()
        return {"raised": "enable_shrink" in str(e)}
    buffer.destroy()
    return {"raised": False}


# ---------------------------------------------------------------------- CUDA tensors

def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes on the host (float8 has no torch.equal)."""
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same(want: Any, got: Any, what: str) -> int:
    """`got` (from CUDA tensors) has `want`'s structure and bits, tensors on the GPU."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.is_cuda, f"{what}: {type(got)} not on the GPU"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)}"
        assert got.stride() == want.stride(), f"{what}: strides {got.stride()} vs {want.stride()}"
        assert torch.equal(_bits(want), _bits(got)), f"{what}: values differ"
        return 1
    if isinstance(want, (tuple, list)):
        assert len(want) == len(got), what
        return sum(_same(w, g, f"{what}[{i}]") for i, (w, g) in enumerate(zip(want, got)))
    assert want == got, f"{what}: {want!r} vs {got!r}"
    return 0


def _ll_rows(recv: Any, count: torch.Tensor, handle: Any) -> Any:
    """A low-latency receive's valid rows per local expert, ordered by their source
    (arrival may order them differently from one call to the next)."""
    data = recv[0] if isinstance(recv, tuple) else recv
    out = []
    for e, n in enumerate(count.cpu().tolist()):
        src = handle[0][e, :n].cpu()
        order = torch.argsort(src)
        out.append((src[order], _bits(data[e, :n])[order]))
    return out


def _ll_case(buffer: deep_ep.Buffer, x: torch.Tensor, topk_idx: torch.Tensor, w: torch.Tensor,
             E: int, hook: bool, fp8: bool, g: Any) -> int:
    """One low-latency round trip with CPU and with CUDA tensors."""
    N, H = x.shape
    local = E // buffer.group_size

    def dispatch(on_gpu: bool) -> Any:
        stats = torch.zeros(local, dtype=torch.int32)
        stats = g(stats) if on_gpu else stats
        d = (g if on_gpu else (lambda t: t))
        r = buffer.low_latency_dispatch(d(x), d(topk_idx), N, E, cumulative_local_expert_recv_stats=stats,
                                        use_fp8=fp8, return_recv_hook=hook)
        if hook:
            r[4]()
        # Expert outputs: the received rows as bf16 (dequantised on the host).
        rows = tuple(t.cpu() for t in r[0]) if fp8 else r[0].cpu()
        y = per_token_cast_back(*rows) if fp8 else rows
        return r, stats, (g(y) if on_gpu else y)

    (want, stats, y), (got, gstats, gy) = dispatch(False), dispatch(True)
    checked = _same(want[1], got[1], "recv_count") + _same(stats, gstats, "stats")
    for (ws, wr), (gs, gr) in zip(_ll_rows(*want[:2], want[2]), _ll_rows(*got[:2], got[2])):
        assert torch.equal(ws, gs) and torch.equal(wr, gr), "low-latency rows differ"
        checked += 1
    # The combine sums each token's outputs in slot order: the same bits whatever order
    # the rows arrived in.
    dev = gy.device
    out = torch.empty((N, H), dtype=torch.bfloat16, device=dev)
    ref = buffer.low_latency_combine(y, topk_idx, w, want[2])[0]
    res = buffer.low_latency_combine(gy, g(topk_idx), g(w), got[2], out=out)[0]
    assert res is out, "out= must be returned as given"
    checked += _same(ref, res, "ll combine")
    again, _, gy2 = dispatch(True)
    zbuf = buffer.get_next_low_latency_combine_buffer(again[2])
    assert zbuf.is_cuda
    zbuf.copy_(gy2)
    zres = buffer.low_latency_combine(zbuf, g(topk_idx), g(w), again[2], zero_copy=True)[0]
    return checked + _same(ref, zres, "zero-copy ll combine")


def cuda_tensors(ctx: Ctx, num_tokens: int = 32, hidden: int = 512, num_topk: int = 4,
                 num_experts: int = 16) -> Dict[str, Any]:
    """DeepEP's API with CUDA tensors in and out, each call's outputs bit for bit those
    of the same call with CPU tensors; events are CUDA events on the comm stream."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    R, N, H, K, E = ctx.world, num_tokens, hidden, num_topk, num_experts
    buffer = ctx.buffer(int(2e9), deep_ep.Buffer.get_low_latency_rdma_size_hint(N, H, R, E))
    stream = buffer.get_comm_stream()
    assert isinstance(stream, torch.cuda.Stream), stream
    torch.manual_seed(ctx.rank + 7)
    x = torch.randn((N, H), dtype=torch.bfloat16)
    topk_idx = torch.topk(torch.randn((N, E)).abs(), K, dim=-1)[1]
    topk_idx[torch.randint(0, N, (4,)), torch.randint(0, K, (4,))] = -1
    w = torch.rand((N, K), dtype=torch.float32)
    g = lambda t: t.to(dev)  # noqa: E731
    checked = 0
    layout = buffer.get_dispatch_layout(topk_idx, E)
    got = buffer.get_dispatch_layout(g(topk_idx), E, previous_event=buffer.capture(), async_finish=True)
    assert isinstance(got[4].event.event, torch.cuda.Event)
    got[4].current_stream_wait()
    checked += _same(layout[:4], got[:4], "layout")
    per_rank, _, per_expert, in_rank = layout[:4]
    counts = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    q, s = per_token_cast_to_fp8(x)
    for data, gdata in ((x, g(x)), ((q, s.T.contiguous().T), (g(q), g(s).T.contiguous().T))):
        want = buffer.dispatch(data, topk_idx=topk_idx, topk_weights=w, **counts)
        got = buffer.dispatch(gdata, topk_idx=g(topk_idx), topk_weights=g(w), async_finish=True,
                              **{k: g(v) for k, v in counts.items()})
        got[5].current_stream_wait()
        checked += _same(want[:4], got[:4], "dispatch")
        checked += _same(buffer.dispatch(data, handle=want[4])[0], buffer.dispatch(gdata, handle=got[4])[0], "cached")
    y = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=w, **counts)
    gy = buffer.dispatch(g(x), topk_idx=g(topk_idx), topk_weights=g(w), **{k: g(v) for k, v in counts.items()})
    checked += _same(buffer.combine(y[0], y[4], topk_weights=y[2])[:2],
                     buffer.combine(gy[0], gy[4], topk_weights=gy[2])[:2], "combine")
    buffer.clean_low_latency_buffer(N, H, E)
    for hook in (False, True):
        for fp8 in (False, True):
            checked += _ll_case(buffer, x, topk_idx, w, E, hook, fp8, g)
    torch.cuda.synchronize()
    buffer.destroy()
    return {"checked": checked}


# ---------------------------------------------------------------------- stranded ranks

def stranded(ctx: Ctx, bad_rank: int, mode: str) -> Dict[str, Any]:
    """`bad_rank` rejects its input before the collective call the others are already in
    (an int16 ``topk_idx`` to ``get_dispatch_layout``, which raises at once), or with
    ``mode="other_op"`` makes a low-latency call where the others make a normal one; then
    it goes on as a serving loop that caught the error would. The others must raise
    within uep's deadline naming it; the caller's group must carry exactly the caller's
    own data afterwards; and a new Buffer on it must work."""
    rank, R = ctx.rank, ctx.world
    buffer = ctx.buffer(int(2e9), int(1e9))
    n, h, E = 16, 256, 8
    torch.manual_seed(rank)
    x = torch.randn((n, h), dtype=torch.bfloat16)
    idx = torch.randint(0, E, (n, 2))
    start = time.monotonic()
    error: Optional[Tuple[str, str]] = None
    try:
        if rank == bad_rank and mode == "other_op":
            buffer.low_latency_dispatch(x, idx, n, E, use_fp8=False)
        elif rank == bad_rank:
            buffer.get_dispatch_layout(idx.to(torch.int16), E)
        elif mode in ("normal", "other_op"):
            buffer.dispatch(x, topk_idx=idx, topk_weights=torch.rand((n, 2)), **_layout(buffer, idx, E))
        else:
            buffer.low_latency_dispatch(x, idx, n, E, use_fp8=False)
        raise AssertionError(f"rank {rank}: the call succeeded with rank {bad_rank} absent")
    except deep_ep.UepError as e:
        error = (type(e).__name__, str(e))
    seconds = time.monotonic() - start
    # The bad rank's next collective on the caller's group meets the others' own.
    out: List[Any] = [None] * R
    dist.all_gather_object(out, ("caller", rank, bad_rank), group=ctx.group)
    assert out == [("caller", r, bad_rank) for r in range(R)], f"cross-talk on the caller's group: {out}"
    del buffer
    fresh = ctx.buffer(int(2e9), int(1e9))
    normal_step(ctx, fresh, tokens=16, hidden=256, experts=E)
    fresh.destroy()
    return {"error": error, "seconds": seconds}


# ---------------------------------------------------------------------- corrupted calls

def _corrupt(kind: str, t: Any) -> Any:
    """`t` made wrong in way `kind`."""
    if kind == "none":
        return None
    if kind == "range":  # an expert id past the last expert, another below -1
        t = t.clone()
        t.view(-1)[0], t.view(-1)[-1] = 1 << 20, -7
        return t
    if kind == "too_many":  # more tokens than the call may take
        return torch.cat([t] * 4)
    if kind == "dtype":
        return t.to(torch.float32 if t.dtype != torch.float32 else torch.int32)
    if kind == "rank":
        return t.unsqueeze(0)
    if kind == "shape":
        return t[: max(t.shape[0] - 3, 0)]
    if kind == "strided":
        return t.t().contiguous().t() if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1 else t[::2]
    raise ValueError(kind)


#: (call, argument) pairs a case corrupts.
_TARGETS = [("layout", "topk_idx"), ("dispatch", "x"), ("dispatch", "topk_idx"), ("dispatch", "topk_weights"),
            ("dispatch", "num_tokens_per_rank"), ("dispatch", "is_token_in_rank"), ("combine", "x"),
            ("combine", "topk_weights"), ("cached", "x"), ("ll_dispatch", "x"), ("ll_dispatch", "topk_idx"),
            ("ll_combine", "x"), ("ll_combine", "topk_weights")]
_KINDS = ["none", "dtype", "rank", "shape", "strided"]
#: Cases that only some arguments have, each run once per fuzz: ids out of range, a
#: handle of another Buffer (one made and dropped before the cases), of an earlier call,
#: or of this Buffer before it grew, more tokens than the Buffer takes.
_SPECIAL = [("layout", "topk_idx", "range"), ("dispatch", "topk_idx", "range"),
            ("ll_dispatch", "topk_idx", "range"), ("combine", "handle", "foreign"),
            ("cached", "handle", "foreign"), ("ll_combine", "handle", "foreign"),
            ("ll_dispatch", "x", "too_many"), ("combine", "handle", "earlier"),
            ("cached", "handle", "earlier"), ("ll_combine", "handle", "stale")]


#: The fuzz's step: tokens a rank, hidden size, experts.
_FUZZ_N, _FUZZ_H, _FUZZ_E = 16, 256, 8


def _fuzz_inputs() -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's tokens, top-2 expert ids and weights, of the fuzz's shape."""
    x = torch.randn((_FUZZ_N, _FUZZ_H), dtype=torch.bfloat16)
    idx = torch.randint(0, _FUZZ_E, (_FUZZ_N, 2))
    return x, idx, torch.rand((_FUZZ_N, 2))


def _case(ctx: Ctx, buffer: deep_ep.Buffer, call: str, arg: str, kind: str, bad: bool,
          foreign: Dict[str, Any]) -> None:
    """Run one step of `call`, with `arg` corrupted on this rank if `bad`; `foreign`
    holds another Buffer's handles (see `_foreign_handles`), and gets this case's earlier
    or stale handle."""
    n, E = _FUZZ_N, _FUZZ_E
    x, idx, w = _fuzz_inputs()

    def c(name: str, t: Any) -> Any:
        # Too many tokens: x and topk_idx alike, so nothing but the count is wrong.
        hit = name == arg or (kind == "too_many" and name in ("x", "topk_idx"))
        if not bad or not hit:
            return t
        if kind == "foreign":
            return foreign[call.replace("cached", "combine")]
        if kind in ("earlier", "stale"):
            return foreign[kind]
        return _corrupt(kind, t)

    if call == "layout":
        buffer.get_dispatch_layout(c("topk_idx", idx), E)
        buffer.dispatch(x, topk_idx=idx, topk_weights=w, **_layout(buffer, idx, E))
    elif call in ("dispatch", "combine", "cached"):
        lay = _layout(buffer, idx, E)
        args = dict(topk_idx=idx, topk_weights=w, **lay)
        if call == "dispatch":
            args = {k: c(k, v) for k, v in args.items()}
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(c("x", x) if call == "dispatch" else x, **args)
        if kind == "earlier":  # every rank dispatches again; the bad one keeps its first handle
            foreign["earlier"] = handle
            x, idx, w = torch.cat([x] * 2), torch.cat([idx] * 2), torch.cat([w] * 2)
            args = dict(topk_idx=idx, topk_weights=w, **_layout(buffer, idx, E))
            recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, **args)
        if call == "combine":
            buffer.combine(c("x", recv_x), c("handle", handle), topk_weights=c("topk_weights", recv_w))
        elif call == "cached":
            buffer.dispatch(c("x", x), handle=c("handle", handle))
    else:
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(c("x", x) if call == "ll_dispatch" else x,
                                                             c("topk_idx", idx) if call == "ll_dispatch" else idx,
                                                             n, E, use_fp8=False)
        if kind == "stale":  # every rank grows the Buffer; the bad one keeps its old handle
            foreign["stale"] = handle
            recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, idx, 2 * n, E, use_fp8=False)
        if call == "ll_combine":
            buffer.low_latency_combine(c("x", recv_x), idx, c("topk_weights", w), c("handle", handle))


def _foreign_handles(ctx: Ctx) -> Dict[str, Any]:
    """A normal and an LL dispatch handle of a Buffer dropped before they are used, of
    the fuzz's shape. Made by a correct step of their own: an earlier case need not
    leave one on every rank, since a peer's abort may end a rank's dispatch before the
    corrupted call it answers."""
    buffer = ctx.buffer(int(2e9), int(1e9))
    x, idx, w = _fuzz_inputs()
    *_, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w, **_layout(buffer, idx, _FUZZ_E))
    _, _, ll_handle, _, _ = buffer.low_latency_dispatch(x, idx, _FUZZ_N, _FUZZ_E, use_fp8=False)
    del buffer
    return {"combine": handle, "ll_combine": ll_handle}


def corrupted_calls(ctx: Ctx, seed: int, cases: int, deadline: float) -> Dict[str, Any]:
    """A seeded fuzz: in each case one random rank corrupts one argument of one call (the
    others call correctly). Every rank must raise within the deadline plus 2 s (or, where
    the corruption is harmless, none may), the caller's group must then carry exactly
    the callers' data, and a fresh Buffer must pass a checked step."""
    import random
    rng = random.Random(seed)  # the same on every rank: they agree on each case
    rank, R = ctx.rank, ctx.world
    log = []
    # Two fixed cases, the special cases once each, then random (call, argument, kind)
    # triples.
    picks = list(_SPECIAL)
    rng.shuffle(picks)
    picks = [("combine", "x", "none"), ("ll_combine", "x", "shape")] + picks
    picks += [(*rng.choice(_TARGETS), rng.choice(_KINDS)) for _ in range(max(cases - len(picks), 0))]
    torch.manual_seed(seed + rank)
    foreign = _foreign_handles(ctx)
    for i, (call, arg, kind) in enumerate(picks):
        bad = rng.randrange(R)
        torch.manual_seed(seed + 101 * i + rank)
        buffer = ctx.buffer(int(2e9), int(1e9))
        start = time.monotonic()
        try:
            _case(ctx, buffer, call, arg, kind, rank == bad, foreign)
            error = None
        except deep_ep.UepError as e:  # anything else is a bug: it fails the test
            error = f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - start
        out: List[Any] = [None] * R
        dist.all_gather_object(out, ("caller", i, rank), group=ctx.group)
        assert out == [("caller", i, r) for r in range(R)], f"case {i}: cross-talk {out}"
        del buffer
        log.append({"case": (call, arg, kind, bad), "error": error, "seconds": seconds})
    fresh = ctx.buffer(int(2e9), int(1e9))
    normal_step(ctx, fresh, tokens=_FUZZ_N, hidden=_FUZZ_H, experts=_FUZZ_E)
    fresh.destroy()
    return {"log": log, "deadline": deadline}


# DeepEP v2's ElasticBuffer (its own module: workers_v2.py).
from workers_v2 import (elastic_v2, hybrid_ep_plain, megatron_hybrid_ep, v2_bad_input,  # noqa: E402,F401
                        megatron_deepep, v2_callers)
