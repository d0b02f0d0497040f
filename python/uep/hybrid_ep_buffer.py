"""``HybridEPBuffer``: the API of DeepEP's ``hybrid-ep`` branch (NVIDIA's backend, which
Megatron-core's ``fused_a2a`` calls), on uep, for PyTorch CPU tensors.

It is ``ElasticBuffer`` underneath: routing maps and dense probabilities become top-k
ids and weights (a token's experts in ascending order), ``dispatch_with_permute`` is an
expanded dispatch padded with zero rows to ``pad_multiple``, ``combine_with_unpermute``
the expanded combine, and the plain ``dispatch``/``combine`` the plain layout with
probabilities laid out over the experts of the NVLink domain. Calls are unweighted, as
hybrid-ep's: the probabilities travel beside the rows and come back dense.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from . import _uep
from .elastic_buffer import ElasticBuffer, EPHandle, _describe

InvalidArgumentError = _uep.InvalidArgumentError

#: Top-k lanes a routing map becomes: DeepEP v2's most (a token may pick fewer).
_LANES = 32


class _PermuteHandle(tuple):
    """hybrid-ep's 11-entry handle of ``dispatch_with_permute`` (7 of ``dispatch``),
    carrying uep's ``EPHandle`` (``_ep``), the routing's experts and the rows asked for."""
    _ep: EPHandle
    _num_experts: int
    _rows: int


class HybridEPBuffer:
    """hybrid-ep's buffer: dispatch and combine by routing map (or top-k), plain or with
    the expert-major permutation fused in.

    ``max_num_of_tokens_per_rank`` is where sizing starts; a call with more tokens is
    served (memory follows the shapes used). The SM and block counts, cached kernels,
    shared buffer, all-gather and MNNVL settings concern the GPU kernels and are kept
    as given. ``num_of_hybrid_ep_ranks_per_nvlink_domain`` (or the environment's
    ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``) defaults to the ranks of a node.
    """

    def __init__(self, group: dist.ProcessGroup, hidden_dim: int, max_num_of_tokens_per_rank: int,
                 num_local_experts: int, use_fp8: bool = False, num_sms_dispatch_api: Optional[int] = None,
                 num_sms_combine_api: Optional[int] = None, num_sms_preprocessing_api: Optional[int] = None,
                 num_blocks_permute: Optional[int] = None, num_blocks_unpermute: Optional[int] = None,
                 load_cached_kernels: bool = False, use_shared_buffer: bool = True,
                 enable_custom_allgather: bool = False,
                 num_of_hybrid_ep_ranks_per_nvlink_domain: Optional[int] = None,
                 use_mnnvl: Optional[bool] = None) -> None:
        if hidden_dim <= 0 or max_num_of_tokens_per_rank < 0 or num_local_experts <= 0:
            raise InvalidArgumentError("invalid argument: hidden_dim and num_local_experts must be positive, "
                                       "max_num_of_tokens_per_rank not negative")
        # A rank may start with no tokens (Megatron sizes from its first batch).
        max_num_of_tokens_per_rank = max(max_num_of_tokens_per_rank, 16)
        self._ep = ElasticBuffer(group, num_max_tokens_per_rank=max_num_of_tokens_per_rank, hidden=hidden_dim,
                                 explicitly_destroy=True)
        self.group, self.rank, self.group_size = group, self._ep.rank_idx, self._ep.num_ranks
        self.hidden_dim, self.use_fp8 = hidden_dim, use_fp8
        self.max_num_of_tokens_per_rank = max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts
        env = os.environ.get("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN")
        per_domain = num_of_hybrid_ep_ranks_per_nvlink_domain or (int(env) if env else self._ep.num_nvlink_ranks)
        if self.group_size % per_domain:
            raise InvalidArgumentError(f"invalid argument: {self.group_size} ranks do not split into NVLink "
                                       f"domains of {per_domain}")
        self.num_of_hybrid_ep_ranks_per_nvlink_domain = per_domain
        self.local_rank, self.node_rank = self.rank % per_domain, self.rank // per_domain
        self.num_sms_dispatch_api, self.num_sms_combine_api = num_sms_dispatch_api, num_sms_combine_api
        self.num_sms_preprocessing_api = num_sms_preprocessing_api
        self.num_blocks_permute, self.num_blocks_unpermute = num_blocks_permute, num_blocks_unpermute

    def destroy(self) -> None:
        """Free the buffer (collective)."""
        self._ep.destroy()

    # ------------------------------------------------------------------ routing

    def _routing(self, n: int, topk_idx: Any, topk_weights: Any, num_of_experts: Optional[int],
                 routing_map: Any, probs: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], int]:
        """``(topk_idx, topk_weights, num_experts)`` from a routing map and dense
        probabilities, or from top-k ids and weights."""
        if routing_map is None:
            if topk_idx is None or num_of_experts is None:
                self._fail("dispatch needs routing_map (and probs), or topk_idx with num_of_experts")
            return topk_idx, topk_weights, num_of_experts
        if (not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2
                or routing_map.shape[0] != n):
            self._fail(f"routing_map must be a bool [{n}, num_experts] tensor, got {_describe(routing_map)}")
        experts = routing_map.shape[1]
        if probs is not None and (not isinstance(probs, torch.Tensor) or probs.dtype != torch.float32
                                  or probs.shape != routing_map.shape):
            self._fail(f"probs must be float32 shaped like routing_map, got {_describe(probs)}")
        lanes = min(experts, _LANES)
        if n and int(routing_map.sum(1).max()) > lanes:
            self._fail(f"a token routed to more than {lanes} experts (DeepEP's top-k limit)")
        # A token's experts in ascending order, then -1: a stable sort brings the set
        # columns first, in column order.
        picked, idx = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
        idx, picked = idx[:, :lanes].contiguous(), picked[:, :lanes].bool()
        weights = None
        if probs is not None:
            weights = probs.gather(1, idx).masked_fill(~picked, 0.0).contiguous()
        return idx.masked_fill(~picked, -1).to(torch.int64), weights, experts

    def _fail(self, msg: str) -> None:
        self._ep._fail(msg)

    def _dense(self, handle: _PermuteHandle, combined_w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Combined per-lane weights back to dense ``[N, num_experts]`` probabilities."""
        if combined_w is None:
            return None
        idx = handle._ep.topk_idx
        dense = torch.zeros((idx.shape[0], handle._num_experts), dtype=torch.float32)
        return dense.scatter_add_(1, idx.clamp(min=0), combined_w.masked_fill(idx < 0, 0.0))

    def _num_max(self, n: int) -> int:
        """The tokens a rank the calls are sized for: grown (to a multiple of 16) when a
        call brings more, as hybrid-ep's buffer grows."""
        if n > self.max_num_of_tokens_per_rank:
            self.max_num_of_tokens_per_rank = (n + 15) // 16 * 16
        return self.max_num_of_tokens_per_rank

    # ------------------------------------------------------------------ permuted

    def dispatch_with_permute(self, *, hidden: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                              topk_weights: Optional[torch.Tensor] = None,
                              num_of_experts_per_rank: Optional[int] = None, num_of_experts: Optional[int] = None,
                              use_fp8: Optional[bool] = None, routing_map: Optional[torch.Tensor] = None,
                              probs: Optional[torch.Tensor] = None, scaling_factor: Optional[torch.Tensor] = None,
                              num_permuted_tokens: Optional[int] = None, pad_multiple: Optional[int] = None,
                              handle: Optional[_PermuteHandle] = None, non_blocking: bool = False,
                              fuse_permute_dispatch: bool = False, num_dispatched_tokens: Optional[int] = None,
                              use_host_meta: Optional[bool] = None):
        """Dispatch, and permute the received rows expert-major: ``(hidden, probs,
        scaling_factor, tokens_per_expert, handle)``. Local expert 0's rows first, each
        expert's in (source rank, token) order and padded with zero rows to a multiple of
        ``pad_multiple``; ``probs`` 1-D (0 on padding); ``tokens_per_expert`` the padded
        counts (int64). ``num_permuted_tokens`` (needed with ``non_blocking``) sets the
        rows returned, zero past the last expert's; with ``handle``, the routing of that
        dispatch again (combine's backward)."""
        align = pad_multiple or 1
        x = hidden if scaling_factor is None else (hidden, scaling_factor)
        n = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
        if non_blocking and num_permuted_tokens is None:
            self._fail("non_blocking needs num_permuted_tokens")
        if num_permuted_tokens is not None and num_permuted_tokens % align:
            self._fail(f"num_permuted_tokens = {num_permuted_tokens} must be a multiple of pad_multiple = {align}")
        if handle is not None:
            ep = getattr(handle, "_ep", None)
            if ep is None or not ep.do_expand:
                self._fail("handle must be the handle of a dispatch_with_permute")
            out = self._ep.dispatch(x, handle=ep, topk_weights=None, do_expand=True, do_zero_padding=True)
            experts = handle._num_experts
        else:
            idx, weights, experts = self._routing(n, topk_idx, topk_weights, num_of_experts, routing_map, probs)
            if num_of_experts_per_rank is not None and num_of_experts_per_rank * self.group_size != experts:
                self._fail(f"num_of_experts_per_rank = {num_of_experts_per_rank} on {self.group_size} ranks "
                           f"does not match {experts} experts")
            out = self._ep.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=experts,
                                    num_max_tokens_per_rank=self._num_max(n), expert_alignment=align,
                                    do_expand=True, do_zero_padding=True)
        recv_x, _, recv_w, ep, _ = out
        rows = ep.num_expanded_tokens if num_permuted_tokens is None else num_permuted_tokens
        if rows < ep.num_expanded_tokens:
            self._fail(f"num_permuted_tokens = {rows} is fewer than the {ep.num_expanded_tokens} rows received")
        data, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        data, sf, recv_w = (_pad_rows(t, rows) for t in (data, sf, recv_w))
        tokens_per_expert = torch.tensor(ep.num_recv_tokens_per_expert_list, dtype=torch.int64)
        if handle is None:
            handle = self._permute_handle(ep, experts, tokens_per_expert)
        return data, recv_w, sf, tokens_per_expert, handle

    def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None,
                               handle: Optional[_PermuteHandle] = None, pad_multiple: Optional[int] = None,
                               fuse_unpermute_combine: bool = False,
                               num_dispatched_tokens: Optional[int] = None) -> Tuple[torch.Tensor, Any]:
        """Each token's expert rows summed (unweighted) and back to its rank:
        ``(hidden [N, hidden_dim] bf16, probs [N, num_experts] f32 or None)``."""
        ep = getattr(handle, "_ep", None)
        if ep is None or not ep.do_expand:
            self._fail("combine_with_unpermute needs the handle of a dispatch_with_permute")
        rows = ep.num_expanded_tokens
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] < rows:
            self._fail(f"hidden must be [rows >= {rows}, hidden_dim], got {_describe(hidden)}")
        if probs is not None and (not isinstance(probs, torch.Tensor) or probs.dim() != 1 or probs.shape[0] < rows):
            self._fail(f"probs must be 1-D with at least {rows} values, got {_describe(probs)}")
        weights = None if probs is None else probs[:rows].float().contiguous()
        combined, combined_w, _ = self._ep.combine(hidden[:rows].contiguous(), ep, topk_weights=weights)
        return combined, self._dense(handle, combined_w)

    def _permute_handle(self, ep: EPHandle, experts: int, tokens_per_expert: torch.Tensor) -> _PermuteHandle:
        """hybrid-ep's 11 entries where uep has their content (None where they describe
        hybrid-ep's GPU chunks): the received tokens, each's local experts, the row of
        each (token, lane), the padded counts, the tokens from each rank, no overflow."""
        m = ep._num_rows
        h = _PermuteHandle((None, None, None, torch.tensor([m], dtype=torch.int32), _expert_map(ep), None,
                            ep.recv_src_metadata[:m, 2:], tokens_per_expert, _per_source(ep, self.group_size), None,
                            torch.zeros((), dtype=torch.bool)))
        h._ep, h._num_experts, h._rows = ep, experts, ep.num_expanded_tokens
        return h

    # ------------------------------------------------------------------ plain

    def dispatch(self, hidden: torch.Tensor, scaling_factor: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 num_of_experts: Optional[int] = None, probs: Optional[torch.Tensor] = None,
                 routing_map: Optional[torch.Tensor] = None, num_dispatched_tokens_tensor: Any = None,
                 num_dispatched_tokens: Optional[int] = None, handle: Optional[_PermuteHandle] = None):
        """Dispatch without permuting: ``(hidden, probs, scaling_factor, handle)``, one
        row per received token in (source rank, token) order; ``probs`` ``[rows, experts
        of the NVLink domain]`` with this rank's columns filled (0 elsewhere)."""
        x = hidden if scaling_factor is None else (hidden, scaling_factor)
        n = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
        if handle is not None:
            ep = getattr(handle, "_ep", None)
            if ep is None or ep.do_expand:
                self._fail("handle must be the handle of a plain dispatch")
            out = self._ep.dispatch(x, handle=ep)
            experts = handle._num_experts
        else:
            idx, weights, experts = self._routing(n, topk_idx, topk_weights, num_of_experts, routing_map, probs)
            out = self._ep.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=experts,
                                    num_max_tokens_per_rank=self._num_max(n))
        recv_x, recv_idx, recv_w, ep, _ = out
        data, sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        out_probs = None
        if recv_w is not None:
            out_probs = torch.zeros((ep._num_rows, self._domain_experts(experts)), dtype=torch.float32)
            local = recv_idx[:ep._num_rows]
            column = torch.where(local >= 0, local + self.local_rank * (experts // self.group_size), 0)
            out_probs.scatter_add_(1, column, recv_w[:ep._num_rows].masked_fill(local < 0, 0.0))
        if handle is None:
            handle = _PermuteHandle((None, None, None, torch.tensor([ep._num_rows], dtype=torch.int32),
                                     _expert_map(ep), _per_source(ep, self.group_size), None))
            handle._ep, handle._num_experts, handle._rows = ep, experts, ep._num_rows
        return data, out_probs, sf, handle

    def combine(self, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None,
                handle: Optional[_PermuteHandle] = None) -> Tuple[torch.Tensor, Any]:
        """Every received row back to its token, summed (unweighted): ``(hidden [N,
        hidden_dim] bf16, probs [N, num_experts] f32 or None)``; ``probs`` in is
        ``[rows, experts of the NVLink domain]`` as ``dispatch`` gave it."""
        ep = getattr(handle, "_ep", None)
        if ep is None or ep.do_expand:
            self._fail("combine needs the handle of a plain dispatch")
        m, experts = ep._num_rows, handle._num_experts
        weights = None
        if probs is not None:
            if (not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[0] < m
                    or probs.shape[1] != self._domain_experts(experts)):
                self._fail(f"probs must be [{m}, {self._domain_experts(experts)}], got {_describe(probs)}")
            local = ep._local_idx
            column = torch.where(local >= 0, local + self.local_rank * (experts // self.group_size), 0)
            weights = probs[:m].float().gather(1, column).masked_fill(local < 0, 0.0)
        combined, combined_w, _ = self._ep.combine(hidden[:m].contiguous(), ep, topk_weights=weights)
        return combined, self._dense(handle, combined_w)

    def _domain_experts(self, experts: int) -> int:
        """Experts of one NVLink domain (the columns of a plain dispatch's probs)."""
        return experts // self.group_size * self.num_of_hybrid_ep_ranks_per_nvlink_domain


def _pad_rows(t: Optional[torch.Tensor], rows: int) -> Optional[torch.Tensor]:
    """`t` with zero rows appended up to `rows` (as it is when it has them)."""
    if t is None or t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad])


def _expert_map(ep: EPHandle) -> torch.Tensor:
    """``[received tokens, local experts]`` bool: which local experts each token chose."""
    local = ep._local_idx
    experts = ep.num_unaligned_recv_tokens_per_expert.numel()
    hit = torch.zeros((local.shape[0], experts + 1), dtype=torch.bool)
    return hit.scatter_(1, torch.where(local >= 0, local, experts), True)[:, :experts]


def _per_source(ep: EPHandle, ranks: int) -> torch.Tensor:
    """Tokens received from each rank (int64 ``[ranks]``)."""
    src = ep.recv_src_metadata[:ep._num_rows, 0].to(torch.int64) // ep.num_max_tokens_per_rank
    return torch.bincount(src, minlength=ranks)
