"""``ElasticBuffer`` and ``EPHandle``: DeepEP v2's API on uep, for PyTorch CPU tensors.

A v2 dispatch is uep's normal dispatch (every token once to every rank that hosts one
of its experts) with v2's outputs around it:

* rows arrive ordered by (source rank, source token), so every call is what DeepEP
  calls ``deterministic``; the plain layout hands out the received rows without a copy,
  the expanded layout (``do_expand``: one row per (token, local expert), grouped by
  expert) is gathered from them on this rank;
* ``recv_topk_weights`` keep every lane of the source's row (uep's
  ``WeightLanes::All``); combine is the plain sum of the rows (no weights applied) plus
  the biases, in f32 over ranks in rank order, rounded once;
* without CPU sync the outputs have their worst-case sizes, as DeepEP's do; uep's calls
  still finish before they return, so only the sizes differ;
* across nodes uep always relays through one rank a node (its hierarchical path);
  ``allow_hybrid_mode`` chooses the domains reported, ``(nodes, ranks a node)`` or
  ``(1, ranks)``, and so how ``psum_num_recv_tokens_per_scaleup_rank`` groups sources.

DeepEP's host-side checks raise ``InvalidArgumentError`` on the rank whose input is bad
and ``PeerAbortedError`` on the others, promptly. See docs/python.md for every field.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _uep
from .buffer import Buffer, _all_gather_bytes, _capsule, _describe, topk_idx_t
from .utils import EventHandle, EventOverlap

InvalidArgumentError = _uep.InvalidArgumentError

#: DeepEP's ``get_elastic_buffer_alignment()``: sizes are multiples of 2 MiB.
_ALIGNMENT = 2 << 20
#: DeepEP v2's limits (its workspace layout and kernels).
_MAX_RANKS, _MAX_EXPERTS, _MAX_LOCAL_EXPERTS, _MAX_TOPK = 1024, 2048, 256, 32


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _domains(group: dist.ProcessGroup) -> Tuple[int, int]:
    """``(nodes, ranks a node)`` of `group` as a Buffer over it finds them (collective)."""
    hosts = [h.decode() for h in _all_gather_bytes(group, _uep.host_id().encode())]
    per_node = os.environ.get("UEP_RANKS_PER_NODE")
    ranks_per_node, nodes = _uep.nodes(hosts, int(per_node) if per_node else None)
    return nodes, ranks_per_node


def get_physical_domain_size(group: dist.ProcessGroup) -> Tuple[int, int]:
    """``(num_rdma_ranks, num_nvlink_ranks)``: the nodes of `group` and the ranks of one
    (ranks sharing a host, or ``UEP_RANKS_PER_NODE``). Collective."""
    return _domains(group)


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> Tuple[int, int]:
    """``(num_scaleout_ranks, num_scaleup_ranks)``: the physical domains in hybrid mode
    across nodes, else ``(1, ranks)``. Collective."""
    nodes, per_node = _domains(group)
    return (nodes, per_node) if allow_hybrid_mode and nodes > 1 else (1, nodes * per_node)


class EPHandle:
    """What a v2 dispatch learnt, for its combine and for cached dispatches: DeepEP's
    fields in DeepEP's constructor order (see docs/python.md for each)."""

    def __init__(self, do_expand: bool, num_experts: int, expert_alignment: int,
                 num_max_tokens_per_rank: int, num_sms: int, topk_idx: torch.Tensor,
                 num_recv_tokens: int, num_expanded_tokens: int,
                 num_recv_tokens_per_expert_list: List[int],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
                 psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor,
                 recv_src_metadata: torch.Tensor, dst_buffer_slot_idx: torch.Tensor,
                 token_metadata_at_forward: Optional[torch.Tensor] = None,
                 channel_linked_list: Optional[torch.Tensor] = None) -> None:
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        # Hybrid-mode bookkeeping of DeepEP's kernels; uep's relay needs none.
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        # uep's: the routing (a normal-mode handle), the received rows, the local expert
        # of each of their lanes ([rows, K], -1 elsewhere), and the ElasticBuffer that
        # made it.
        self._uep: Any = None
        self._num_rows = 0
        self._local_idx: Optional[torch.Tensor] = None
        self._owner: Any = None


class _Received:
    """One v2 dispatch's rows as uep's normal dispatch returned them (plain layout)."""

    def __init__(self, x: Any, sf: Optional[torch.Tensor], idx: torch.Tensor, w: Optional[torch.Tensor],
                 uh: Any, rows: int) -> None:
        self.x, self.sf, self.idx, self.w, self.uh = x, sf, idx, w, uh
        self.m = int(uh.num_recv_tokens)
        self.rows = rows


class _Dispatch:
    """A v2 dispatch's arguments, checked: what is sent and the outputs' form."""
    data: torch.Tensor          # bf16 view of x, or its bytes (FP8)
    x_dtype: torch.dtype
    sf: Optional[torch.Tensor]  # f32 view of the scale packs, padded to H/128 columns
    sf_dtype: Optional[torch.dtype]
    packs: int
    topk_idx: torch.Tensor
    weights: Optional[torch.Tensor]
    experts: int
    num_max: int
    alignment: int
    sync: bool


class ElasticBuffer:
    """DeepEP v2's ``ElasticBuffer`` on uep: expert-parallel dispatch and combine of
    CPU tensors over the caller's ``torch.distributed`` group.

    ``num_bytes`` (or the size the MoE settings give, ``get_buffer_size_hint``) is a
    capacity: uep takes memory as the calls' shapes need it, and a call that needs more
    raises ``CapacityError`` naming the bytes. The GPU settings (``sl_idx``, QPs, SM
    counts, GPU timeout) are accepted and reported; ``num_cpu_timeout_secs`` is the
    deadline of every wait unless ``UEP_TIMEOUT_S`` is set.

    Example (every rank of a gloo group)::

        buffer = uep.ElasticBuffer(group, num_max_tokens_per_rank=128, hidden=7168, num_topk=8)
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(x, topk_idx=idx, topk_weights=w,
                                                              num_experts=256)
        y = experts(recv_x, recv_idx, recv_w)        # weighted by the caller
        out, _, _ = buffer.combine(y, handle)         # [N, hidden] bf16
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False) -> None:
        if num_bytes is None:
            if num_cpu_bytes:
                raise InvalidArgumentError("invalid argument: num_cpu_bytes needs num_bytes")
            num_bytes = ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden, num_topk,
                                                           use_fp8_dispatch, allow_hybrid_mode)
        if not isinstance(num_bytes, int) or num_bytes <= 0 or num_bytes % _ALIGNMENT:
            raise InvalidArgumentError(f"invalid argument: num_bytes = {num_bytes!r} must be a positive multiple of 2 MiB")
        if group.size() > _MAX_RANKS:
            raise InvalidArgumentError(f"invalid argument: {group.size()} ranks: DeepEP v2 allows at most {_MAX_RANKS}")
        self._buffer = Buffer(group, num_nvl_bytes=num_bytes, explicitly_destroy=True)
        if "UEP_TIMEOUT_S" not in os.environ:
            self._buffer.set_timeout(float(num_cpu_timeout_secs))
        self.group, self.runtime = group, self._buffer.runtime
        self.rank_idx, self.num_ranks = self._buffer.rank, self._buffer.group_size
        self.num_rdma_ranks, self.num_nvlink_ranks = self._buffer._num_nodes, self._buffer._ranks_per_node
        self.allow_hybrid_mode = allow_hybrid_mode
        hybrid = allow_hybrid_mode and self.num_rdma_ranks > 1
        self.num_scaleout_ranks, self.num_scaleup_ranks = (
            (self.num_rdma_ranks, self.num_nvlink_ranks) if hybrid else (1, self.num_ranks))
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.nccl_comm_handle = None
        self.num_bytes, self.num_cpu_bytes = num_bytes, num_cpu_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        # DeepEP's defaults: 129 QPs in hybrid mode without fast RDMA atomics (uep emulates
        # atomics in immediates), 17 direct.
        self.num_allocated_qps = num_allocated_qps or (129 if hybrid else 17)
        self.sl_idx, self.num_gpu_timeout_secs = sl_idx, num_gpu_timeout_secs
        self.explicitly_destroy = explicitly_destroy
        # Threads of the work done here (as the Buffer's kernels: UEP_DEVICE_THREADS).
        self._threads = int(os.environ.get("UEP_DEVICE_THREADS", "0")) or max(
            1, (os.cpu_count() or 1) // self.num_nvlink_ranks)
        self._scratch = torch.empty(0, dtype=torch.bfloat16)
        self._buffer.barrier()

    # ------------------------------------------------------------------ statics

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes (a multiple of 2 MiB) for dispatches of up to ``num_max_tokens_per_rank``
        tokens a rank at this hidden size and top-k (0: 32) on `group`'s ranks, on one
        node or several; not collective."""
        if num_max_tokens_per_rank <= 0 or hidden <= 0:
            raise InvalidArgumentError("invalid argument: the size hint needs num_max_tokens_per_rank > 0 and hidden > 0")
        ranks, topk = group.size(), num_topk or _MAX_TOPK
        # bf16 rows are the larger; the multi-node map adds the relay's areas.
        shape = (_align(_MAX_EXPERTS, ranks), hidden, topk, num_max_tokens_per_rank)
        need = max(_uep.normal_bytes(ranks, n, shape) for n in (1, 2) if ranks % n == 0)
        return _align(need, _ALIGNMENT)

    @staticmethod
    def capture() -> EventHandle:
        """An event on the current stream (a completed one for CPU work)."""
        return EventHandle()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The "SMs" of a call: uep's kernel threads a rank, as DeepEP reports SMs (even,
        at least 4). uep's calls use their threads whatever is passed."""
        if num_experts % self.num_ranks:
            raise InvalidArgumentError(f"invalid argument: num_experts = {num_experts} must be a multiple of {self.num_ranks} ranks")
        return max(4, _align(self._threads, 2))

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's QP count for `num_sms`: ``min(num_sms, 9)`` direct, ``16 num_sms + 1``
        hybrid, at most ``num_allocated_qps``."""
        want = num_sms * 16 + 1 if self.num_scaleout_ranks > 1 else min(num_sms, 9)
        return min(want, self.num_allocated_qps)

    # ------------------------------------------------------------------ misc

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """``(num_rdma_ranks, num_nvlink_ranks)``: nodes, and ranks a node."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """``(num_scaleout_ranks, num_scaleup_ranks)``."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream (``None`` without CUDA)."""
        return self._buffer.get_comm_stream()

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """A barrier over the buffer's ranks."""
        self._buffer.barrier()

    def destroy(self) -> None:
        """Free the buffer; collective. Needs ``explicitly_destroy``."""
        assert self.explicitly_destroy, "destroy() needs explicitly_destroy=True"
        self._buffer.destroy()
        self.runtime = None

    def _fail(self, msg: str, shape: Tuple[int, int, int] = (0, 0, 0)) -> None:
        """Reject this rank's input to a normal-mode call of `shape` (experts, hidden,
        top-k): the peers' waits end at once."""
        self._buffer._fail(msg, "normal", *shape, 0)

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event: Optional[EventHandle] = None,
                 previous_event_before_epilogue: Optional[EventHandle] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False, do_zero_padding: bool = False,
                 use_tma_aligned_col_major_sf: bool = False):
        """Every token once to every rank that hosts one of its experts: ``(recv_x,
        recv_topk_idx, recv_topk_weights, handle, event)``.

        ``x`` is ``[N, hidden]`` (2 bytes an element, moved as they are), or ``(data,
        sf)``: 1-byte data with ``[N, packs]`` 4-byte scale packs (``packs <=
        hidden / 128``), moved bit for bit. Plain layout: one row per received token,
        ordered by (source rank, source token), ``recv_topk_idx`` the local expert of
        each lane (-1 elsewhere), ``recv_topk_weights`` the source's whole weight row.
        Expanded (``do_expand``): one row per (token, local expert), expert ``e`` owning
        rows ``[start_e, start_e + c_e)`` with ``start_e`` the aligned prefix;
        ``recv_topk_idx`` is None and the weights 1-D. Without CPU sync the outputs have
        their worst-case rows (``handle`` says which are written). With ``handle``:
        that dispatch's routing again, and the same handle back."""
        call = self._check_dispatch(x, topk_idx, topk_weights, cumulative_local_expert_recv_stats,
                                    num_experts, num_max_tokens_per_rank, expert_alignment, previous_event,
                                    allocate_on_comm_stream, handle, do_cpu_sync, do_expand, do_zero_padding,
                                    num_qps)
        in_rank, received = self._send(call, handle)
        counts = self._recv_counts(received, call)
        new = handle is None
        if new:
            handle = self._new_handle(call, received, counts, in_rank, do_expand,
                                      num_sms or self.get_theoretical_num_sms(call.experts, call.topk_idx.shape[1]),
                                      call.topk_idx.clone() if do_handle_copy else call.topk_idx)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(counts[1])
        if do_expand:
            outputs = self._expand(call, received, counts, handle, do_zero_padding, use_tma_aligned_col_major_sf, new)
        else:
            outputs = self._plain(call, received, use_tma_aligned_col_major_sf)
        event = EventOverlap(EventHandle() if async_with_compute_stream else None)
        return (*outputs, handle, event)

    def _check_dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, stats: Any, num_experts: Any,
                        num_max: Any, alignment: Any, previous_event: Any, allocate_on_comm_stream: bool,
                        handle: Optional[EPHandle], do_cpu_sync: Optional[bool], do_expand: bool,
                        do_zero_padding: bool, num_qps: int) -> _Dispatch:
        """DeepEP's host-side checks of a dispatch, and what it sends."""
        call = _Dispatch()
        data = x[0] if isinstance(x, tuple) else x
        hidden = data.shape[-1] if isinstance(data, torch.Tensor) and data.dim() == 2 else 0
        if handle is not None:
            topk_idx = getattr(handle, "topk_idx", None) if topk_idx is None else topk_idx
            num_experts = num_experts or getattr(handle, "num_experts", None)
        topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0

        def fail(msg: str) -> None:
            self._fail(msg, (num_experts if isinstance(num_experts, int) else 0, hidden, topk))
        if handle is not None:
            self._check_cached(fail, handle, topk_idx, stats, num_experts, num_max, alignment, do_cpu_sync, do_expand)
            num_max, alignment, do_cpu_sync = handle.num_max_tokens_per_rank, handle.expert_alignment, False
        call.experts = num_experts
        call.num_max = num_max if num_max is not None else self.num_max_tokens_per_rank
        call.alignment = 1 if alignment is None else alignment
        call.sync = True if do_cpu_sync is None else do_cpu_sync
        if previous_event is not None and not allocate_on_comm_stream:
            fail("previous_event needs allocate_on_comm_stream=True")
        if do_zero_padding and not do_expand:
            fail("do_zero_padding needs do_expand=True")
        if num_qps > self.num_allocated_qps:
            fail(f"num_qps = {num_qps} exceeds num_allocated_qps = {self.num_allocated_qps}")
        self._check_x(fail, call, x, data, hidden)
        self._check_routing(fail, call, topk_idx, topk_weights, stats, data.shape[0])
        return call

    def _check_cached(self, fail: Any, handle: EPHandle, topk_idx: Any, stats: Any, num_experts: int,
                      num_max: Any, alignment: Any, do_cpu_sync: Optional[bool], do_expand: bool) -> None:
        """A cached dispatch: this buffer's handle, its settings, nothing it recomputes."""
        if not isinstance(handle, EPHandle) or handle._owner is not self:
            fail("handle must be an EPHandle a dispatch of this buffer returned")
        if topk_idx is not handle.topk_idx:
            fail("a cached dispatch takes its topk_idx from the handle: pass topk_idx=None")
        if stats is not None:
            fail("cumulative_local_expert_recv_stats cannot be given with a cached handle")
        if do_cpu_sync:
            fail("a cached dispatch has no CPU sync: do_cpu_sync must be None or False")
        if do_expand and not handle.do_expand:
            fail("an expanded cached dispatch needs the handle of an expanded dispatch")
        for name, given, mine in (("num_experts", num_experts, handle.num_experts),
                                  ("num_max_tokens_per_rank", num_max, handle.num_max_tokens_per_rank),
                                  ("expert_alignment", alignment, handle.expert_alignment)):
            if given is not None and given != mine:
                fail(f"{name} = {given} differs from the handle's {mine}")

    def _check_x(self, fail: Any, call: _Dispatch, x: Any, data: Any, hidden: int) -> None:
        """x: 2-byte elements, or 1-byte data with 4-byte scale packs."""
        if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.is_cuda:
            fail(f"x must be a 2-D CPU tensor (or a (data, sf) pair of them), got {_describe(data)}")
        if not data.is_contiguous() or hidden * data.element_size() % 16:
            fail(f"x must be contiguous with hidden * element size a multiple of 16 bytes, got {_describe(data)}")
        call.x_dtype, call.sf, call.sf_dtype, call.packs = data.dtype, None, None, 0
        if not isinstance(x, tuple):
            if data.element_size() != 2:
                fail(f"x must have 2-byte elements (bf16), or be a (1-byte data, sf) pair; got {data.dtype}")
            call.data = data.view(torch.bfloat16)
            return
        sf = x[1]
        if data.element_size() != 1:
            fail(f"FP8 data must have 1-byte elements, got {data.dtype}")
        if (not isinstance(sf, torch.Tensor) or sf.dim() != 2 or sf.element_size() != 4
                or sf.shape[0] != data.shape[0] or not sf.dtype.is_floating_point and sf.dtype != torch.int32):
            fail(f"sf must be [{data.shape[0]}, packs] of 4-byte elements (float32 or int32), got {_describe(sf)}")
        groups = hidden // 128
        if sf.shape[1] > groups:
            fail(f"sf has {sf.shape[1]} packs a token; uep carries at most hidden / 128 = {groups}")
        padded = torch.zeros((data.shape[0], groups), dtype=torch.float32)
        padded[:, :sf.shape[1]] = sf.view(torch.float32)
        call.data, call.sf, call.sf_dtype, call.packs = data.view(torch.uint8), padded, sf.dtype, sf.shape[1]

    def _check_routing(self, fail: Any, call: _Dispatch, topk_idx: Any, topk_weights: Any, stats: Any,
                       n: int) -> None:
        """Ids, weights, statistics and the MoE settings."""
        if not isinstance(call.experts, int) or call.experts <= 0 or call.experts % self.num_ranks:
            fail(f"num_experts = {call.experts!r} must be a positive multiple of {self.num_ranks} ranks")
        local = call.experts // self.num_ranks
        if call.experts > _MAX_EXPERTS or local > _MAX_LOCAL_EXPERTS:
            fail(f"{call.experts} experts ({local} a rank): DeepEP v2 allows {_MAX_EXPERTS} ({_MAX_LOCAL_EXPERTS} a rank)")
        if not isinstance(call.num_max, int) or call.num_max <= 0 or n > call.num_max:
            fail(f"x has {n} tokens: num_max_tokens_per_rank = {call.num_max!r} must be positive and at least that")
        if not isinstance(call.alignment, int) or call.alignment < 1:
            fail(f"expert_alignment must be a positive int, got {call.alignment!r}")
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2
                or topk_idx.shape[0] != n or not topk_idx.is_contiguous()):
            fail(f"topk_idx must be a contiguous [{n}, K] {topk_idx_t} tensor, got {_describe(topk_idx)}")
        k = topk_idx.shape[1]
        if not 0 < k <= _MAX_TOPK:
            fail(f"top-k = {k} must be in 1..{_MAX_TOPK}")
        bad = (topk_idx < -1) | (topk_idx >= call.experts)
        if bad.any():
            fail(f"topk_idx holds {int(topk_idx[bad][0])}: ids must be -1 or below num_experts = {call.experts}")
        ids = topk_idx.sort(1).values
        if ((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] >= 0)).any():
            fail("a token selects the same expert twice (DeepEP's kernel faults on it)")
        if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                         or topk_weights.dtype != torch.float32
                                         or topk_weights.shape != topk_idx.shape
                                         or not topk_weights.is_contiguous()):
            fail(f"topk_weights must be a contiguous float32 [{n}, {k}] tensor, got {_describe(topk_weights)}")
        if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                                  or tuple(stats.shape) != (local,)):
            fail(f"cumulative_local_expert_recv_stats must be int32 [{local}], got {_describe(stats)}")
        call.topk_idx, call.weights = topk_idx, topk_weights

    def _send(self, call: _Dispatch, handle: Optional[EPHandle]) -> Tuple[torch.Tensor, _Received]:
        """uep's normal dispatch of the call, every weight lane kept: ``(is_token_in_rank,
        the received rows)``, padded to the worst case without CPU sync."""
        rt = self._buffer._rt()
        per_rank, _, per_expert, in_rank = (None if c is None else torch.from_dlpack(c)
                                            for c in rt.layout(_capsule(call.topk_idx), call.experts))
        if handle is not None:
            worst = handle.num_recv_tokens
        else:
            worst = 0 if call.sync else self.num_ranks * call.num_max
        cap = lambda t: None if t is None else _capsule(t)  # noqa: E731
        rx, rs, ridx, rw, _, uh = rt.dispatch(
            _capsule(call.data), cap(call.sf), _capsule(call.topk_idx), cap(call.weights),
            _capsule(per_rank), _capsule(per_expert), _capsule(in_rank), None, 1, worst, True)
        tensor = lambda c: None if c is None else torch.from_dlpack(c)  # noqa: E731
        received = _Received(tensor(rx), tensor(rs), tensor(ridx), tensor(rw), uh, uh.num_rows)
        return in_rank, received

    def _recv_counts(self, rec: _Received, call: _Dispatch) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(local lanes [M, K] bool, c_e, a_e)``: which received lanes are this rank's,
        each local expert's (token, slot) pairs and that count aligned (int64)."""
        local_experts = call.experts // self.num_ranks
        idx = rec.idx[:rec.m]
        local = idx >= 0
        c = torch.bincount(idx[local], minlength=local_experts)
        a = (c + call.alignment - 1) // call.alignment * call.alignment
        return local, c, a

    def _new_handle(self, call: _Dispatch, rec: _Received, counts: Tuple[torch.Tensor, ...],
                    in_rank: torch.Tensor, do_expand: bool, num_sms: int, topk_idx: torch.Tensor) -> EPHandle:
        """The handle of a dispatch with fresh routing: DeepEP's fields from uep's."""
        R, me, k = self.num_ranks, self.rank_idx, call.topk_idx.shape[1]
        local, c, a = counts
        m, scaleup = rec.m, self.num_scaleup_ranks
        # Rows by source rank (the inclusive prefix of rank_prefix_matrix's column).
        col = torch.from_dlpack(rec.uh.rank_prefix_matrix())[:, me].to(torch.int64)
        per_src = col - torch.cat([col.new_zeros(1), col[:-1]])
        src_rank = torch.repeat_interleave(torch.arange(R), per_src)
        src_tok = torch.from_dlpack(rec.uh.recv_src_idx())[:m].to(torch.int64)
        meta = torch.full((rec.rows, k + 2), -1, dtype=torch.int32)
        meta[:m, 0] = src_rank * call.num_max + src_tok
        meta[:m, 1] = (src_rank % scaleup) * k + local.to(torch.int8).argmax(1)
        psum_up = torch.zeros(scaleup, dtype=torch.int64).index_add_(0, torch.arange(R) % scaleup, per_src)
        worst_e = _align(R * call.num_max * min(k, call.experts // R) + (call.alignment - 1) * c.numel(),
                         call.alignment)
        psum_e = a.cumsum(0) - a + c if do_expand else a.cumsum(0)
        handle = EPHandle(do_expand, call.experts, call.alignment, call.num_max, num_sms, topk_idx,
                          rec.rows, int(a.sum()) if call.sync else worst_e, a.tolist() if call.sync else [],
                          psum_up.cumsum(0).to(torch.int32), psum_e.to(torch.int32), c.to(torch.int32),
                          meta, self._dst_slots(call, in_rank))
        handle._uep, handle._num_rows, handle._local_idx, handle._owner = rec.uh, m, rec.idx[:m], self
        return handle

    def _dst_slots(self, call: _Dispatch, in_rank: torch.Tensor) -> torch.Tensor:
        """DeepEP's ``dst_buffer_slot_idx`` ``[N, K]``: on the first lane of each
        destination rank, the token's row there (``rank * num_max + slot``), else -1."""
        idx, k = call.topk_idx, call.topk_idx.shape[1]
        dest = torch.where(idx >= 0, idx // (call.experts // self.num_ranks), -1)
        earlier = torch.ones((k, k), dtype=torch.bool).tril(-1)
        repeat = ((dest.unsqueeze(2) == dest.unsqueeze(1)) & earlier).any(2)
        slot = in_rank.to(torch.int64).cumsum(0) - 1
        slot = slot.gather(1, dest.clamp(min=0))
        return torch.where((dest >= 0) & ~repeat, self.rank_idx * call.num_max + slot, -1).to(torch.int32)

    @staticmethod
    def _sf_out(sf: torch.Tensor, dtype: torch.dtype, tma: bool) -> torch.Tensor:
        """Received scale packs in the caller's dtype: row-major, or column-major with
        columns of 16-byte multiples (``use_tma_aligned_col_major_sf``)."""
        sf = sf.view(dtype)
        if not tma:
            return sf.contiguous()
        rows, packs = sf.shape
        out = torch.empty_strided((rows, packs), (1, _align(rows, 4)), dtype=dtype)
        out.copy_(sf)
        return out

    def _plain(self, call: _Dispatch, rec: _Received, tma: bool) -> Tuple[Any, ...]:
        """The plain layout: the received rows as they are (no copy but the scales')."""
        x = rec.x.view(call.x_dtype)
        if call.sf is not None:
            x = (x, self._sf_out(rec.sf[:, :call.packs], call.sf_dtype, tma))
        return x, rec.idx, rec.w

    def _expand(self, call: _Dispatch, rec: _Received, counts: Tuple[torch.Tensor, ...], handle: EPHandle,
                zero: bool, tma: bool, new: bool) -> Tuple[Any, ...]:
        """The expanded layout: lane k of received token i to its expert's next row
        (the rows of an expert in received order)."""
        m, k = rec.m, call.topk_idx.shape[1]
        _, c, a = counts
        lanes = rec.idx[:m].reshape(-1)
        sel = (lanes >= 0).nonzero().squeeze(1)   # (token, lane) pairs, token ascending
        experts = lanes[sel]
        order = torch.argsort(experts, stable=True)
        by_expert = experts[order]
        row = torch.empty_like(sel)
        row[order] = (a.cumsum(0) - a)[by_expert] + torch.arange(sel.numel()) - (c.cumsum(0) - c)[by_expert]
        tok = sel // k
        make = torch.zeros if zero else torch.empty
        rows = handle.num_expanded_tokens
        # In memory uep reuses once the caller lets go: fresh pages cost more than the copy.
        x = torch.from_dlpack(self._buffer._rt().gather_rows(
            _capsule(rec.x.view(torch.uint8)), _capsule(tok), _capsule(row), rows, zero)).view(rec.x.dtype)
        x = x.view(call.x_dtype)
        if call.sf is not None:
            sf = make((rows, rec.sf.shape[1]), dtype=torch.float32)
            sf.index_copy_(0, row, rec.sf.index_select(0, tok))
            x = (x, self._sf_out(sf[:, :call.packs], call.sf_dtype, tma))
        w = None
        if rec.w is not None:
            w = make(rows, dtype=torch.float32).index_copy_(0, row, rec.w[:m].reshape(-1)[sel])
        if new:
            slots = torch.full((m * k,), -1, dtype=torch.int64)
            slots[sel] = row
            handle.recv_src_metadata[:m, 2:] = slots.view(m, k)
        return x, None, w

    # ------------------------------------------------------------------ combine

    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                num_sms: int = 0, num_qps: int = 0, previous_event: Optional[EventHandle] = None,
                previous_event_before_epilogue: Optional[EventHandle] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Every received row back to its source, summed there: ``(combined_x [N, hidden]
        bf16, combined_topk_weights [N, K] f32 or None, event)``.

        No weight is applied: the caller weights the rows first. ``combined_x[t]`` is the
        sum over destination ranks (rank order, f32) of their row for token t, plus
        ``bias`` (one tensor or two, bf16 ``[N, hidden]``), rounded once; an expanded
        ``x`` is first summed over each token's local experts on its rank (f32, lane
        order, rounded to bf16). ``combined_topk_weights`` lane k is what the rank of
        expert ``topk_idx[t, k]`` passed in that lane (0 for -1 lanes)."""
        rows, weights, (b0, b1) = self._check_combine(x, handle, topk_weights, bias, previous_event,
                                                      allocate_on_comm_stream, num_qps)
        if handle.do_expand:
            rows, weights = self._reduce_local(x, handle, topk_weights)
        cap = lambda t: None if t is None else _capsule(t)  # noqa: E731
        out, out_w = self._buffer._rt().combine(_capsule(rows), handle._uep, cap(weights), cap(b0), cap(b1))
        event = EventOverlap(EventHandle() if async_with_compute_stream else None)
        return torch.from_dlpack(out), None if out_w is None else torch.from_dlpack(out_w), event

    def _check_combine(self, x: Any, handle: Any, topk_weights: Any, bias: Any, previous_event: Any,
                       allocate_on_comm_stream: bool, num_qps: int) -> Tuple[Any, ...]:
        """DeepEP's checks of a combine: ``(the rows to send, their weights with only
        local lanes, the two biases)`` (rows and weights of the plain layout)."""
        hidden = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
        mine = isinstance(handle, EPHandle) and handle._owner is self
        topk = handle.topk_idx.shape[1] if mine else 0

        def fail(msg: str) -> None:
            self._fail(msg, (handle.num_experts if mine else 0, hidden, topk))
        if not mine:
            fail("combine needs the EPHandle a dispatch of this buffer returned")
        want = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or x.is_cuda
                or not x.is_contiguous() or x.shape[0] != want or hidden % 8):
            fail(f"combine x must be a contiguous CPU bf16 [{want}, hidden] tensor (hidden a multiple of 8), got {_describe(x)}")
        m = handle._num_rows
        if topk_weights is not None:
            shape = (want,) if handle.do_expand else (want, topk)
            if (not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32
                    or tuple(topk_weights.shape) != shape):
                fail(f"combine topk_weights must be float32 {list(shape)}, got {_describe(topk_weights)}")
            if handle.do_expand and not self.allow_multiple_reduction:
                fail("an expanded combine with topk_weights needs allow_multiple_reduction=True")
        biases = bias if isinstance(bias, tuple) else (bias, None)
        n = handle.topk_idx.shape[0]
        if len(biases) != 2 or any(b is not None and (not isinstance(b, torch.Tensor) or b.dtype != torch.bfloat16
                                                      or tuple(b.shape) != (n, hidden) or not b.is_contiguous())
                                   for b in biases):
            fail(f"bias must be None, or one or two contiguous bf16 [{n}, {hidden}] tensors")
        if previous_event is not None and not allocate_on_comm_stream:
            fail("previous_event needs allocate_on_comm_stream=True")
        if num_qps > self.num_allocated_qps:
            fail(f"num_qps = {num_qps} exceeds num_allocated_qps = {self.num_allocated_qps}")
        weights = None
        if topk_weights is not None and not handle.do_expand:
            weights = torch.where(handle._local_idx >= 0, topk_weights[:m], 0.0)
        return x[:m], weights, biases

    def _reduce_local(self, x: torch.Tensor, handle: EPHandle,
                      topk_weights: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """An expanded combine's rows, one per received token: the sum of its local
        experts' rows (f32, lane order, rounded to bf16), and its lanes' weights."""
        m = handle._num_rows
        slots = handle.recv_src_metadata[:m, 2:].to(torch.int64)
        # Scratch this buffer keeps: the rows live only until the combine has sent them.
        need = m * x.shape[1]
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.bfloat16)
        rows = self._scratch[:need].view(m, x.shape[1])
        _uep.sum_slots(_capsule(x), _capsule(slots), _capsule(rows), self._threads)
        weights = None
        if topk_weights is not None:
            weights = torch.zeros(slots.shape, dtype=torch.float32)
            weights[slots >= 0] = topk_weights[slots[slots >= 0]]
        return rows, weights
