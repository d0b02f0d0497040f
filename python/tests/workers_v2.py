"""DeepEP v2's test (``tests/elastic/test_ep.py``) on CPU: ``ElasticBuffer`` dispatch and
combine in every mode, checked bit for bit against a plain sequential reference.

Every rank draws every rank's inputs from the same seeds, so each can compute what it
must receive and get back. Rank 1 has no tokens; tokens have ``-1`` slots, some are routed
nowhere, many go to one rank several times. The reference of the combine follows uep's
documented order: on each rank an expanded token's local rows summed in f32 in lane
order and rounded to bf16; at the source, in f32 in rank order, the rows of its node's
ranks and each other node's partial (that node's rows summed in f32 in rank order,
rounded to bf16, in the place of the rank relaying it), then the biases; one rounding.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

import uep as deep_ep


class Inputs:
    """One rank's inputs: tokens, ids (-1 slots, some tokens routed nowhere), weights,
    FP8 data with f32 scales and int32 packs."""

    def __init__(self, r: int, seed: int, t_max: int, hidden: int, topk: int, experts: int) -> None:
        g = torch.Generator().manual_seed(seed * 1000 + r)
        n = 0 if r == 1 else int(torch.randint(1, t_max + 1, (1,), generator=g))
        self.n = n
        self.x = torch.randn((n, hidden), generator=g).to(torch.bfloat16)
        scores = torch.rand((n, experts), generator=g)
        idx = scores.topk(topk, dim=1).indices
        idx[torch.rand((n, topk), generator=g) < 0.2] = -1
        if n > 2:
            idx[1] = -1                                   # routed nowhere
        self.topk_idx = idx.to(deep_ep.topk_idx_t).contiguous()
        self.w = torch.randn((n, topk), generator=g)
        self.fp8 = (torch.randn((n, hidden), generator=g) * 8).to(torch.float8_e4m3fn)
        self.sf = torch.rand((n, hidden // 128), generator=g) + 0.5
        self.packs = torch.randint(-2**31, 2**31 - 1, (n, hidden // 512), generator=g, dtype=torch.int32)


class Reference:
    """What rank `me` receives and gets back, computed sequentially from every rank's
    inputs."""

    def __init__(self, inputs: List[Inputs], me: int, experts: int, per_node: int) -> None:
        self.inputs, self.me, self.R = inputs, me, len(inputs)
        self.L, self.per_node = experts // self.R, per_node
        # (source rank, token) pairs this rank receives, in order.
        self.rows = [(s, t) for s, inp in enumerate(inputs) for t in range(inp.n)
                     if any(self.owner(e) == me for e in inp.topk_idx[t].tolist())]

    def owner(self, e: int) -> int:
        return -1 if e < 0 else e // self.L

    def local_ids(self, s: int, t: int) -> List[int]:
        return [e - self.me * self.L if self.owner(e) == self.me else -1
                for e in self.inputs[s].topk_idx[t].tolist()]

    def expert_counts(self) -> List[int]:
        c = [0] * self.L
        for s, t in self.rows:
            for e in self.local_ids(s, t):
                if e >= 0:
                    c[e] += 1
        return c

    def combined(self, t: int, row_of: Any, bias: Tuple[Any, ...]) -> torch.Tensor:
        """Token t of rank me, combined: ``row_of(r)`` is rank r's returned row (f32) or
        None where t did not go to r."""
        rows = {r: row_of(r) for r in range(self.R)}
        node = lambda r: r // self.per_node  # noqa: E731
        acc = torch.zeros_like(self.inputs[self.me].x[t], dtype=torch.float32)
        for r in range(self.R):
            if node(r) == node(self.me):
                if rows[r] is not None:
                    acc += rows[r]
            elif r == node(r) * self.per_node + self.me % self.per_node:
                members = [rows[q] for q in range(node(r) * self.per_node, (node(r) + 1) * self.per_node)
                           if rows[q] is not None]
                if members:
                    part = torch.zeros_like(acc)
                    for m in members:
                        part += m
                    acc += part.to(torch.bfloat16).float()
        for b in bias:
            acc += b[t].float()
        return acc.to(torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    # A fresh dense copy: a size-1 dimension may carry any stride.
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what} differs"


def _check_handle(ref: Reference, h: Any, n_max: int, align: int, sync: bool, scaleup: int, k: int) -> None:
    """Every EPHandle field that depends on the routing."""
    m, c = len(ref.rows), ref.expert_counts()
    a = [(v + align - 1) // align * align for v in c]
    assert h.num_recv_tokens == (m if sync else ref.R * n_max)
    assert h.num_recv_tokens_per_expert_list == (a if sync else [])
    assert h.num_unaligned_recv_tokens_per_expert.tolist() == c
    per_up = [0] * scaleup
    for s, _ in ref.rows:
        per_up[s % scaleup] += 1
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == torch.tensor(per_up).cumsum(0).tolist()
    meta = h.recv_src_metadata
    assert tuple(meta.shape) == (h.num_recv_tokens, k + 2) and meta.dtype == torch.int32
    for i, (s, t) in enumerate(ref.rows):
        lanes = ref.local_ids(s, t)
        first = next(j for j, e in enumerate(lanes) if e >= 0)
        assert meta[i, :2].tolist() == [s * n_max + t, (s % scaleup) * k + first], (i, s, t)
    mine = ref.inputs[ref.me]
    sent = [0] * ref.R
    for t in range(mine.n):
        dests = [ref.owner(e) for e in mine.topk_idx[t].tolist()]
        want = [-1] * k
        for j, d in enumerate(dests):
            if d >= 0 and d not in dests[:j]:
                want[j] = ref.me * n_max + sent[d]
        for d in set(dests) - {-1}:
            sent[d] += 1
        assert h.dst_buffer_slot_idx[t].tolist() == want, (t, dests)


def _check_plain(ref: Reference, out: Tuple[Any, ...], fmt: str, tma: bool) -> None:
    recv_x, recv_idx, recv_w, h, _ = out
    m = len(ref.rows)
    data, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    for i, (s, t) in enumerate(ref.rows):
        inp = ref.inputs[s]
        _same(data[i], inp.x[t] if fmt == "bf16" else inp.fp8[t], f"row {i} (rank {s} token {t})")
        if sf is not None:
            _same(sf[i], inp.sf[t] if fmt == "fp8" else inp.packs[t], f"scales of row {i}")
        assert recv_idx[i].tolist() == ref.local_ids(s, t)
        _same(recv_w[i], inp.w[t], f"weights of row {i}")
    if sf is not None and tma:
        assert sf.stride() == (1, (sf.shape[0] + 3) // 4 * 4), sf.stride()
    assert (recv_idx[m:] == -1).all()


def _expanded_rows(ref: Reference, align: int) -> Dict[int, Tuple[int, int, int]]:
    """Expanded row -> (source, token, lane), expert by expert in receive order."""
    rows, start = {}, 0
    for e, c in enumerate(ref.expert_counts()):
        at = start
        for s, t in ref.rows:
            lanes = ref.local_ids(s, t)
            if e in lanes:
                rows[at] = (s, t, lanes.index(e))
                at += 1
        start += (c + align - 1) // align * align
    return rows


def _check_expanded(ref: Reference, out: Tuple[Any, ...], fmt: str, align: int, zero: bool) -> None:
    recv_x, recv_idx, recv_w, h, _ = out
    assert recv_idx is None and recv_w.dim() == 1
    data, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    rows = _expanded_rows(ref, align)
    for row, (s, t, lane) in rows.items():
        inp = ref.inputs[s]
        _same(data[row], inp.x[t] if fmt == "bf16" else inp.fp8[t], f"expanded row {row}")
        if sf is not None:
            _same(sf[row], inp.sf[t] if fmt == "fp8" else inp.packs[t], f"scales of expanded row {row}")
        _same(recv_w[row], inp.w[t, lane], f"weight of expanded row {row}")
    slots = h.recv_src_metadata[:len(ref.rows), 2:]
    for i, (s, t) in enumerate(ref.rows):
        for lane, e in enumerate(ref.local_ids(s, t)):
            assert (slots[i, lane] == -1) == (e < 0)
            if e >= 0:
                assert rows[int(slots[i, lane])] == (s, t, lane)
    c = ref.expert_counts()
    a = torch.tensor([(v + align - 1) // align * align for v in c])
    assert h.psum_num_recv_tokens_per_expert.tolist() == ((a.cumsum(0) - a) + torch.tensor(c)).tolist()
    if zero:
        used = torch.zeros(data.shape[0], dtype=torch.bool)
        used[list(rows)] = True
        end = int(a.sum())
        assert (data[:end][~used[:end]].view(torch.uint8) == 0).all() and (recv_w[:end][~used[:end]] == 0).all()


def _bias_arg(bias: Tuple[Any, ...]) -> Any:
    """DeepEP's forms: None, one tensor, or a pair."""
    return None if not bias else bias[0] if len(bias) == 1 else bias


def _factor(r: int) -> float:
    return 1 + r / 8


def _combine_plain(ref: Reference, buffer: Any, out: Tuple[Any, ...], bias: Tuple[Any, ...]) -> None:
    """Each rank returns its rows scaled by its factor, and its weights."""
    recv_x, _, recv_w, h, _ = out
    y = (recv_x.float() * _factor(ref.me)).to(torch.bfloat16)
    combined, combined_w, _ = buffer.combine(y, h, topk_weights=recv_w, bias=_bias_arg(bias))
    mine = ref.inputs[ref.me]
    for t in range(mine.n):
        def row(r: int) -> Any:
            hit = any(ref.owner(e) == r for e in mine.topk_idx[t].tolist())
            return (mine.x[t].float() * _factor(r)).to(torch.bfloat16).float() if hit else None
        _same(combined[t], ref.combined(t, row, bias), f"combined token {t}")
    _same(combined_w, mine.w.masked_fill(mine.topk_idx < 0, 0.0), "combined weights")


def _combine_expanded(ref: Reference, buffer: Any, out: Tuple[Any, ...], bias: Tuple[Any, ...]) -> None:
    """Each expert's rows scaled by a factor of the expert, summed over its token's local
    experts on each rank."""
    recv_x, _, recv_w, h, _ = out
    y = torch.zeros_like(recv_x)
    for e, (start, end) in enumerate(_expert_ranges(h)):
        y[start:end] = (recv_x[start:end].float() * _factor(ref.me * ref.L + e)).to(torch.bfloat16)
    combined, combined_w, _ = buffer.combine(y, h, topk_weights=recv_w, bias=_bias_arg(bias))
    mine = ref.inputs[ref.me]
    for t in range(mine.n):
        ids = mine.topk_idx[t].tolist()

        def row(r: int) -> Any:
            lanes = [e for e in ids if ref.owner(e) == r]
            if not lanes:
                return None
            acc = torch.zeros_like(mine.x[t], dtype=torch.float32)
            for e in lanes:
                acc += (mine.x[t].float() * _factor(e)).to(torch.bfloat16).float()
            return acc.to(torch.bfloat16).float()
        _same(combined[t], ref.combined(t, row, bias), f"combined token {t} (expanded)")
    _same(combined_w, mine.w.masked_fill(mine.topk_idx < 0, 0.0), "combined weights (expanded)")


def _expert_ranges(h: Any) -> List[Tuple[int, int]]:
    """[start_e, start_e + c_e) of each local expert, from the handle's psum (v2's rule)."""
    psum, align, out, prev = h.psum_num_recv_tokens_per_expert.tolist(), h.expert_alignment, [], 0
    for e, end in enumerate(psum):
        start = (prev + align - 1) // align * align if e else 0
        out.append((start, end))
        prev = end
    return out


def elastic_v2(ctx: Any, t_max: int = 24, hidden: int = 512, topk: int = 4, experts: int = 16,
               seed: int = 0, hybrid: bool = True) -> Dict[str, Any]:
    """Every mode of a v2 dispatch and combine: plain and expanded, with and without CPU
    sync, bf16 and FP8 (f32 scales, int32 packs, row- or column-major), alignments 1 and
    4, zero padding, biases, cached dispatch, the statistics."""
    R, me = ctx.world, ctx.rank
    # Deterministic: the reference's order is (source rank, token), DeepEP's sorted order.
    buffer = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=t_max, hidden=hidden, num_topk=topk,
                                   allow_hybrid_mode=hybrid, deterministic=True, explicitly_destroy=True)
    nodes, per_node = buffer.get_physical_domain_size()
    assert (nodes, per_node) == deep_ep.get_physical_domain_size(ctx.group)
    assert buffer.get_logical_domain_size() == deep_ep.get_logical_domain_size(ctx.group, hybrid)
    scaleup = buffer.num_scaleup_ranks
    assert scaleup == (per_node if hybrid and nodes > 1 else R)
    inputs = [Inputs(r, seed, t_max, hidden, topk, experts) for r in range(R)]
    ref, mine = Reference(inputs, me, experts, per_node), inputs[me]
    stats = torch.zeros(experts // R, dtype=torch.int32)
    checked = 0
    for fmt in ("bf16", "fp8", "packs"):
        x = {"bf16": mine.x, "fp8": (mine.fp8, mine.sf), "packs": (mine.fp8, mine.packs)}[fmt]
        for expand in (False, True):
            for sync in (True, False):
                align = 4 if sync != expand else 1
                tma = fmt == "packs" and not expand
                zero = expand and not sync
                out = buffer.dispatch(x, topk_idx=mine.topk_idx, topk_weights=mine.w, num_experts=experts,
                                      expert_alignment=align, num_sms=buffer.get_theoretical_num_sms(experts, topk),
                                      do_cpu_sync=sync, do_expand=expand, do_zero_padding=zero,
                                      use_tma_aligned_col_major_sf=tma,
                                      cumulative_local_expert_recv_stats=stats)
                h = out[3]
                _check_handle(ref, h, t_max, align, sync, scaleup, topk)
                if expand:
                    _check_expanded(ref, out, fmt, align, zero)
                else:
                    _check_plain(ref, out, fmt, tma)
                # The cached dispatch: the same rows, the same handle object back.
                again = buffer.dispatch(x, handle=h, topk_weights=mine.w, do_expand=expand)
                assert again[3] is h
                if expand:
                    _check_expanded(ref, again, fmt, align, False)
                else:
                    _check_plain(ref, again, fmt, False)
                if fmt == "bf16":
                    bias = (torch.randn((mine.n, hidden)).to(torch.bfloat16),) * (1 + expand) if sync else ()
                    (_combine_expanded if expand else _combine_plain)(ref, buffer, out, bias)
                checked += 1
    assert stats.tolist() == [12 * c for c in ref.expert_counts()]
    buffer.destroy()
    dist.barrier(group=ctx.group)
    return {"checked": checked, "rows": len(ref.rows), "env": os.environ.get("UEP_RANKS_PER_NODE")}


# ------------------------------------------------------------- the frameworks' calls

def _expert(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Expert e of the toy MoE: a per-expert scale (rows [n, H], ids [n])."""
    return (v.float() * (1 + e.float().unsqueeze(1) / 16)).to(torch.bfloat16)


def _dense(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The MoE layer without communication: sum_k w[t, k] * expert_{idx[t, k]}(x[t])."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for k in range(idx.shape[1]):
        valid = idx[:, k] >= 0
        out[valid] += w[valid, k].unsqueeze(1) * _expert(x[valid], idx[valid, k]).float()
    return out.to(torch.bfloat16)


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator) if denominator else 0.0


def _fp8_groups(x: torch.Tensor, ue8m0: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token groups of 128 to e4m3: (data, column-major scales as the callers pass
    them: f32, or int32 of four UE8M0 exponents; the dequantised x)."""
    n, h = x.shape
    v = x.float().view(n, h // 128, 128)
    scale = v.abs().amax(2).clamp(1e-4) / 448
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    data = (v / scale.unsqueeze(2)).to(torch.float8_e4m3fn)
    back = (data.float() * scale.unsqueeze(2)).view(n, h).to(torch.bfloat16)
    sf = scale
    if ue8m0:
        exps = (scale.view(torch.int32) >> 23).to(torch.uint8).contiguous()
        sf = exps.view(torch.int32)
    return data.view(n, h), sf.t().contiguous().t(), back


def _dequant(data: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    n, h = data.shape
    if sf.dtype == torch.int32:
        exps = torch.empty(sf.shape, dtype=torch.int32).copy_(sf).view(torch.uint8).view(n, -1)
        sf = (exps.to(torch.int32) << 23).view(torch.float32)
    return (data.float().view(n, h // 128, 128) * sf.unsqueeze(2)).view(n, h).to(torch.bfloat16)


def v2_callers(ctx: Any, caller: str, t_max: int = 12, hidden: int = 512, topk: int = 4,
               experts: int = 16, seed: int = 7) -> Dict[str, Any]:
    """SGLang's and vLLM's v2 backends, as their prepare/finalize call ElasticBuffer
    (keywords as in the facts file), each step of a toy MoE against the dense layer."""
    R, me = ctx.world, ctx.rank
    inputs = Inputs(me, seed, t_max, hidden, topk, experts)
    x, idx, w = inputs.x, inputs.topk_idx, inputs.w.abs()
    want = _dense(x, idx, w)
    L = experts // R
    if caller == "sglang":
        buffer = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=t_max, hidden=hidden, num_topk=topk,
                                       use_fp8_dispatch=True, allow_hybrid_mode=True, sl_idx=0,
                                       prefer_overlap_with_compute=False, explicitly_destroy=True)
    else:
        buffer = deep_ep.ElasticBuffer(group=ctx.group, num_max_tokens_per_rank=t_max, hidden=hidden,
                                       num_topk=topk, use_fp8_dispatch=False, allow_hybrid_mode=False,
                                       prefer_overlap_with_compute=True, allow_multiple_reduction=True,
                                       explicitly_destroy=True)
    num_sms = buffer.get_theoretical_num_sms(experts, topk)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    assert num_sms >= 4 and num_sms % 2 == 0 and 0 < num_qps <= buffer.num_allocated_qps
    steps = []
    for step in ("decode", "prefill"):
        for fp8 in (False, True):
            data, sf, xq = _fp8_groups(x, ue8m0=fp8 and caller == "vllm")
            src = (data, sf) if fp8 else x
            ref = _dense(xq, idx, w) if fp8 else want
            run = _sglang_step if caller == "sglang" else _vllm_step
            got = run(buffer, step, src, idx, w, experts, t_max, num_sms, num_qps, L, me)
            diff = _calc_diff(got, ref)
            assert got.shape == ref.shape and diff < 1e-4, (caller, step, fp8, diff)
            steps.append((step, fp8, diff))
    buffer.destroy()
    dist.barrier(group=ctx.group)
    return {"steps": steps}


def _received_x(recv_x: Any) -> torch.Tensor:
    return _dequant(*recv_x) if isinstance(recv_x, tuple) else recv_x


def _sglang_step(buffer: Any, step: str, src: Any, idx: torch.Tensor, w: torch.Tensor, experts: int,
                 t_max: int, num_sms: int, num_qps: int, L: int, me: int) -> torch.Tensor:
    """SGLang's deepep_v2.py: decode = expanded without CPU sync (masked GEMM by the
    per-expert psum), prefill = plain with CPU sync, sliced to the psum's last entry."""
    decode = step == "decode"
    recv_x, recv_idx, recv_w, h, event = buffer.dispatch(
        src, topk_idx=idx, topk_weights=w, num_experts=experts, num_max_tokens_per_rank=t_max,
        expert_alignment=4 if decode else 1, num_sms=num_sms, num_qps=num_qps,
        use_tma_aligned_col_major_sf=isinstance(src, tuple), do_cpu_sync=not decode, do_expand=decode)
    if event.event is not None:
        event.current_stream_wait()
    rows = _received_x(recv_x)
    if decode:
        total_expanded = rows.shape[0]
        out = torch.zeros((total_expanded, rows.shape[1]), dtype=torch.bfloat16)
        psum, prev = h.psum_num_recv_tokens_per_expert.tolist(), 0
        for e, end in enumerate(psum):   # the masked GEMM: expert e's valid rows
            start = (prev + 3) // 4 * 4 if e else 0
            ids = torch.full((end - start,), me * L + e)
            out[start:end] = (_expert(rows[start:end], ids).float() * recv_w[start:end].unsqueeze(1)).to(torch.bfloat16)
            prev = end
    else:
        n = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
        rows, recv_idx, recv_w = rows[:n], recv_idx[:n], recv_w[:n]
        assert sum(h.num_recv_tokens_per_expert_list) == int((recv_idx >= 0).sum())
        out = _local_moe(rows, recv_idx, recv_w, me * L)
    combined, _, event = buffer.combine(out, handle=h, topk_weights=None, num_sms=num_sms, num_qps=num_qps)
    return combined


def _local_moe(rows: torch.Tensor, local_idx: torch.Tensor, w: torch.Tensor, first: int) -> torch.Tensor:
    """Per received token, its local experts' outputs weighted and summed (f32)."""
    acc = torch.zeros(rows.shape, dtype=torch.float32)
    for k in range(local_idx.shape[1]):
        valid = local_idx[:, k] >= 0
        acc[valid] += w[valid, k].unsqueeze(1) * _expert(rows[valid], local_idx[valid, k] + first).float()
    return acc.to(torch.bfloat16)


def _vllm_step(buffer: Any, step: str, src: Any, idx: torch.Tensor, w: torch.Tensor, experts: int,
               t_max: int, num_sms: int, num_qps: int, L: int, me: int) -> torch.Tensor:
    """vLLM's deepep_v2.py: decode = plain without CPU sync, a per-call
    num_max_tokens_per_rank of the next power of two, rows past the psum masked; prefill
    = expanded with CPU sync, expert ids rebuilt by repeat_interleave over
    num_recv_tokens_per_expert_list, weights as [rows, 1]."""
    decode = step == "decode"
    pow2 = 1 << (t_max - 1).bit_length()
    recv_x, recv_idx, recv_w, h, event = buffer.dispatch(
        x=src, topk_idx=idx, topk_weights=w, num_experts=experts,
        num_max_tokens_per_rank=pow2 if decode else None, do_expand=not decode, do_cpu_sync=not decode,
        async_with_compute_stream=False)
    rows = _received_x(recv_x)
    if decode:
        n = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
        assert rows.shape[0] == buffer.num_ranks * pow2
        recv_idx = recv_idx.clone()
        recv_idx[n:] = -1
        out = _local_moe(rows, recv_idx, recv_w, me * L)
    else:
        counts = torch.tensor(h.num_recv_tokens_per_expert_list)
        expert_ids = torch.repeat_interleave(torch.arange(L) + me * L, counts)
        weights = recv_w.view(-1, 1)
        out = (_expert(rows, expert_ids).float() * weights).to(torch.bfloat16)
    combined, _, _ = buffer.combine(x=out, handle=h, topk_weights=None, async_with_compute_stream=False,
                                    allocate_on_comm_stream=False)
    return combined


def v2_bad_input(ctx: Any, what: str) -> Dict[str, Any]:
    """Rank 1 breaks one of DeepEP's host-side rules; every rank must raise, promptly
    (rank 1 InvalidArgumentError, the others PeerAbortedError naming it)."""
    import time
    buffer = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=16, hidden=256, num_topk=2,
                                   explicitly_destroy=True)
    bad = ctx.rank == 1
    n, experts = 16, 4 * ctx.world
    x = torch.randn((n, 256)).to(torch.bfloat16)
    idx = torch.stack([torch.arange(n) % experts, (torch.arange(n) + 1) % experts], 1)
    x_first, idx_first = x, idx
    if bad and what == "duplicate":
        idx_first = idx.clone()
        idx_first[5, 1] = idx_first[5, 0]
    if bad and what == "num_max":
        x_first, idx_first = torch.cat([x, x[:1]]), torch.cat([idx, idx[:1]])
    start = time.monotonic()
    try:
        out = buffer.dispatch(x_first, topk_idx=idx_first, num_experts=experts)
        if what == "cached_sync":
            buffer.dispatch(x, handle=out[3], do_cpu_sync=True if bad else None)
        if what == "combine_rows":
            rows = out[0][:-1] if bad else out[0]
            buffer.combine(rows, out[3])
    except deep_ep.UepError as e:
        return {"error": str(e), "seconds": time.monotonic() - start, "type": type(e).__name__}
    raise AssertionError(f"rank {ctx.rank}: the call with bad input on rank 1 succeeded")


# ------------------------------------------------------------- Megatron's HybridEP path

def megatron_hybrid_ep(ctx: Any, pad_multiple: Any = None, give_rows: bool = False, tokens: int = 24,
                       hidden: int = 256, experts: int = 16, topk: int = 4, seed: int = 3) -> Dict[str, Any]:
    """Megatron-core's own ``fused_a2a.hybrid_ep_dispatch`` / ``hybrid_ep_combine``
    (PyPI megatron-core, unchanged; ``deep_ep`` is uep through ``sys.modules``, nothing
    else is patched), forward and autograd backward through a toy MoE, against the dense
    layer's outputs and gradients. Rank 1 has no tokens."""
    import sys
    import uep
    import uep.utils
    sys.modules["deep_ep"], sys.modules["deep_ep.utils"] = uep, uep.utils
    from megatron.core.transformer.moe import fused_a2a
    assert fused_a2a.HAVE_HYBRIDEP
    fused_a2a.reset_hybrid_ep_buffer()
    R, me, L = ctx.world, ctx.rank, experts // ctx.world
    g = torch.Generator().manual_seed(seed * 100 + me)
    n = 0 if me == 1 else tokens
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn((n, experts), generator=g)
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros((n, experts), dtype=torch.bool).scatter_(1, top, True)
    probs = (torch.softmax(logits, 1) * routing_map).requires_grad_()
    factor = 1 + torch.arange(experts, dtype=torch.float32) / 16

    rows = None
    if give_rows:
        align = pad_multiple or 1
        rows = (R * tokens * min(topk, L) + (align - 1) * L + align - 1) // align * align
    hidden_e, probs_e, _, per_expert, handle = fused_a2a.hybrid_ep_dispatch(
        x, routing_map, probs, ctx.group, L, num_permuted_tokens=rows, pad_multiple=pad_multiple)
    # The toy experts: expert e scales its rows by factor[e], weighted by the probs.
    expert_of = torch.repeat_interleave(torch.arange(L) + me * L, per_expert)
    scale = torch.zeros(hidden_e.shape[0])
    scale[:expert_of.numel()] = factor[expert_of]
    y = (hidden_e.float() * (scale * probs_e).unsqueeze(1)).to(torch.bfloat16)
    out = fused_a2a.hybrid_ep_combine(y, handle, rows, pad_multiple)
    grad = torch.randn((n, hidden), generator=g)
    (out.float() * grad).sum().backward()

    xr = x.detach().clone().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    want = (xr.float().unsqueeze(1) * (pr * factor).unsqueeze(2)).sum(1).to(torch.bfloat16)
    (want.float() * grad).sum().backward()
    diffs = {"out": _calc_diff(out.detach(), want.detach()), "x_grad": _calc_diff(x.grad, xr.grad),
             "probs_grad": _calc_diff(probs.grad * routing_map, pr.grad * routing_map)}
    assert out.shape == (n, hidden) and all(d < 1e-4 for d in diffs.values()), diffs
    assert per_expert.dtype == torch.int64 and (pad_multiple is None or (per_expert % pad_multiple == 0).all())
    fused_a2a._hybrid_ep_buffer.destroy()
    fused_a2a.reset_hybrid_ep_buffer()
    dist.barrier(group=ctx.group)
    return {"diffs": diffs, "rows": int(hidden_e.shape[0])}


def hybrid_ep_plain(ctx: Any, t_max: int = 20, hidden: int = 256, topk: int = 4, experts: int = 16,
                    seed: int = 11) -> Dict[str, Any]:
    """hybrid-ep's plain ``dispatch``/``combine`` by routing map: the rows of every token
    that hits a local expert in (source rank, token) order, bit for bit; probs over the
    NVLink domain's experts with this rank's columns; the unweighted combine and the
    dense probs back, against the sequential reference."""
    R, me = ctx.world, ctx.rank
    inputs = [Inputs(r, seed, t_max, hidden, topk, experts) for r in range(R)]
    per_node = int(os.environ.get("UEP_RANKS_PER_NODE", R))
    ref, mine = Reference(inputs, me, experts, per_node), inputs[me]
    buffer = deep_ep.HybridEPBuffer(ctx.group, hidden, t_max, experts // R)
    assert buffer.num_of_hybrid_ep_ranks_per_nvlink_domain == per_node

    def dense(inp: Inputs) -> Tuple[torch.Tensor, torch.Tensor]:
        routing = torch.zeros((inp.n, experts + 1), dtype=torch.bool)
        routing.scatter_(1, torch.where(inp.topk_idx >= 0, inp.topk_idx, experts), True)
        probs = torch.zeros((inp.n, experts + 1)).scatter_(1, torch.where(inp.topk_idx >= 0, inp.topk_idx, experts),
                                                           inp.w)
        return routing[:, :experts].contiguous(), probs[:, :experts].contiguous()
    routing_map, probs = dense(mine)
    recv, recv_probs, sf, handle = buffer.dispatch(mine.x, routing_map=routing_map, probs=probs)
    assert sf is None and recv.shape[0] == len(ref.rows)
    L, local = experts // R, me % per_node
    for i, (s, t) in enumerate(ref.rows):
        _same(recv[i], inputs[s].x[t], f"row {i}")
        want = torch.zeros(L * per_node)
        for lane, e in enumerate(ref.local_ids(s, t)):
            if e >= 0:
                want[local * L + e] = inputs[s].w[t, lane]
        _same(recv_probs[i], want, f"probs of row {i}")
    combined, combined_probs = buffer.combine(recv, probs=recv_probs, handle=handle)
    for t in range(mine.n):
        def row(r: int) -> Any:
            hit = any(ref.owner(e) == r for e in mine.topk_idx[t].tolist())
            return mine.x[t].float() if hit else None
        _same(combined[t], ref.combined(t, row, ()), f"combined token {t}")
    _same(combined_probs, probs, "combined probs")
    buffer.destroy()
    dist.barrier(group=ctx.group)
    return {"rows": len(ref.rows)}


def megatron_deepep(ctx: Any, async_finish: bool = False, tokens: int = 24, hidden: int = 256,
                    experts: int = 16, topk: int = 4, seed: int = 4) -> Dict[str, Any]:
    """Megatron-core's own ``fused_a2a.fused_dispatch`` / ``fused_combine`` (its DeepEP
    v1 path, from PyPI, unchanged; ``deep_ep`` is uep through ``sys.modules``), forward
    and backward through a toy MoE, against the dense layer. Rank 1 has no tokens."""
    import sys
    import uep
    import uep.utils
    sys.modules["deep_ep"], sys.modules["deep_ep.utils"] = uep, uep.utils
    from megatron.core.transformer.moe import fused_a2a
    assert fused_a2a.HAVE_DEEP_EP
    R, me, L = ctx.world, ctx.rank, experts // ctx.world
    g = torch.Generator().manual_seed(seed * 100 + me)
    n = 0 if me == 1 else tokens
    x = torch.randn((n, hidden), generator=g).to(torch.bfloat16).requires_grad_()
    logits = torch.randn((n, experts), generator=g)
    weights, idx = torch.softmax(logits, 1).topk(topk, dim=1)
    weights = weights.detach().requires_grad_()
    factor = 1 + torch.arange(experts, dtype=torch.float32) / 16
    recv_x, recv_idx, recv_w, per_expert, handle = fused_a2a.fused_dispatch(
        x, idx, weights, experts, ctx.group, async_finish=async_finish, allocate_on_comm_stream=async_finish)
    assert per_expert.sum() == (recv_idx >= 0).sum()
    # Each received token: its local experts' outputs, weighted, summed.
    local = (recv_idx >= 0).float()
    scale = (factor[recv_idx.clamp(min=0) + me * L] * recv_w * local).sum(1, keepdim=True)
    y = (recv_x.float() * scale).to(torch.bfloat16)
    out, _ = fused_a2a.fused_combine(y, ctx.group, handle, async_finish=async_finish,
                                     allocate_on_comm_stream=async_finish)
    grad = torch.randn((n, hidden), generator=g)
    (out.float() * grad).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    want = (xr.float().unsqueeze(1) * (wr * factor[idx]).unsqueeze(2)).sum(1).to(torch.bfloat16)
    (want.float() * grad).sum().backward()
    diffs = {"out": _calc_diff(out.detach(), want.detach()), "x_grad": _calc_diff(x.grad, xr.grad),
             "weights_grad": _calc_diff(weights.grad, wr.grad)}
    assert out.shape == (n, hidden) and all(d < 1e-4 for d in diffs.values()), diffs
    fused_a2a._buffer = None   # Megatron's Buffer frees itself (no explicitly_destroy)
    dist.barrier(group=ctx.group)
    return {"diffs": diffs}
