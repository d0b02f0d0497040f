"""``Buffer``: DeepEP v1's ``deep_ep.Buffer`` on uep, for PyTorch CPU tensors.

Every method has DeepEP's name, arguments, defaults and return tuples; what differs is
below the surface:

* the Buffer bootstraps over the caller's ``torch.distributed`` group (only
  ``group.rank()``, ``group.size()`` and, once, two ``dist.all_gather`` of rank 0's
  invitation to a group of uep's own, which every later exchange uses);
* ``num_nvl_bytes`` and ``num_rdma_bytes`` are a capacity, not an allocation: memory
  grows with the shapes the calls use, and a call that does not fit raises an error
  naming the bytes it needs;
* received rows are handed out without copying (tensors over uep's registered memory,
  kept valid for as long as they are held);
* calls run on the CPU and are complete when they return; events are completed ones;
* CUDA tensors are accepted and returned: the call is staged through host memory, its
  results placed on the Buffer's communication stream, events are CUDA events there
  (``uep.staging``).
"""

from __future__ import annotations

import datetime
import math
import os
import time
import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _uep
from .config import Config
from .staging import Staging, staged
from .utils import EventHandle, EventOverlap

#: DeepEP's type of top-k expert ids.
topk_idx_t = torch.int64

UepError = _uep.UepError
InvalidArgumentError = _uep.InvalidArgumentError

_DEFAULT_TIMEOUT_S = 100.0
# (ranks) -> (num_sms-independent) chunking of DeepEP's tuned configs; uep does not use
# chunking, these keep DeepEP code that asks for them working.
_DISPATCH_CONFIGS = {r: (6, 256, 6, 128) if r <= 8 else (36, 288, 20, 128)
                     for r in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)}
_COMBINE_CONFIGS = {r: (4, 256, 6, 128) if r <= 8 else (4, 288, 12, 128)
                    for r in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)}


class _NormalHandle(tuple):
    """DeepEP's normal-mode handle tuple, carrying uep's own handle beside it."""
    _uep: Any


class _LlHandle(tuple):
    """DeepEP's low-latency handle ``(src_info, layout_range, num_max, hidden,
    num_experts)``, carrying uep's own handle (set once the receive ran)."""
    _uep: Any


def _capsule(t: torch.Tensor) -> Any:
    """A DLPack capsule of ``t`` (detached: uep does not track gradients)."""
    return t.detach().__dlpack__()


def _describe(t: Any) -> str:
    """What was passed where a tensor was expected, for messages."""
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)}"
    return type(t).__name__


def _noop() -> None:
    return None


def _event(async_finish: bool, *tensors: Any) -> EventOverlap:
    if async_finish:
        return EventOverlap(EventHandle(), tuple(t for t in tensors if t is not None))
    return EventOverlap(None)


def _ue8m0_to_f32(scales: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 scales holding four UE8M0 exponent bytes each -> f32 powers of two."""
    # Flatten before viewing the bytes: a size-1 dimension may carry any stride.
    exps = scales.contiguous().reshape(-1).view(torch.uint8).reshape(scales.shape[0], -1)[:, :groups]
    return (exps.to(torch.int32) << 23).view(torch.float32)


def _f32_to_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """f32 power-of-two scales -> int32 words of four UE8M0 exponent bytes (the last
    dimension shrinks by four)."""
    lead = scales.shape[:-1]
    exps = (scales.contiguous().reshape(-1).view(torch.int32) >> 23).to(torch.uint8)
    return exps.view(torch.int32).reshape(*lead, -1)


def _door(timeout: float) -> Tuple[Optional[str], Optional[Any]]:
    """The door of this job (where a replacement rank finds it) and the store that keeps
    it: named after the launcher's rendezvous (``MASTER_ADDR``, ``MASTER_PORT``), which a
    process started to replace a rank is given too, and kept in the ``TCPStore`` there
    (torchrun's agent keeps it, so it outlives every worker, and every host reaches it).
    ``(None, None)`` without them; the name without a store if none answers there (the
    door is then shared memory, for jobs on one host)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None, None
    name = _uep.door_name(f"{addr}:{port}")
    try:
        # A launcher's store is up before its workers start: connect within seconds
        # (torch's client retries for twice its timeout), then wait as long as uep.
        # Not a plain socket probe: torch's libuv server stalls its clients after
        # connections that close without its handshake.
        store = dist.TCPStore(addr, int(port), is_master=False,
                              timeout=datetime.timedelta(seconds=min(timeout, 3.0)))
        store.set_timeout(datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as e:  # no store answers there
        warnings.warn(f"uep: no store at {addr}:{port} ({e}); the door is shared memory on this host")
        store = None
    return name, store


def _all_gather_bytes(group: dist.ProcessGroup, data: bytes) -> List[bytes]:
    """Every rank's ``data``, by two tensor all-gathers over ``group`` (the lengths, then
    the bytes padded to the longest). Not ``all_gather_object``: recent torch needs
    numpy for it, and torch does not install numpy."""
    size = group.size()
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(size)]
    dist.all_gather(gathered, mine.to(device), group=group)
    return [bytes(t[:int(n)].cpu().tolist()) for t, n in zip(gathered, lengths)]


def _ll_returns(recv_x: Any, recv_count: torch.Tensor, weighted: Optional[Tuple[torch.Tensor, torch.Tensor]],
                handle: Any, event: EventOverlap, hook: Callable[[], None]) -> Tuple[Any, ...]:
    """A low-latency dispatch's return: DeepEP's five values, or hybrid-ep's seven when
    the call passed ``topk_weights``."""
    if weighted is None:
        return recv_x, recv_count, handle, event, hook
    return recv_x, recv_count, weighted[0], weighted[1], handle, event, hook


def _nvfp4_args(fail: Callable[[str], None], use_fp8: bool, use_nvfp4: bool,
                x_global_scale: Any, use_ue8m0_for_sf: bool) -> Optional[Tuple[float, bool]]:
    """The NVFP4 cast's ``(global scale, UE8M0 block scales)``, checked as DeepEP's
    hybrid-ep branch does; None without ``use_nvfp4``."""
    if not use_nvfp4:
        if use_ue8m0_for_sf:
            fail("use_ue8m0_for_sf chooses NVFP4's block scales: it needs use_nvfp4")
        return None
    if use_fp8:
        fail("use_fp8 and use_nvfp4 exclude each other (pass use_fp8=False)")
    if (not isinstance(x_global_scale, torch.Tensor) or x_global_scale.dtype != torch.float32
            or x_global_scale.numel() != 1):
        fail(f"use_nvfp4 needs x_global_scale as a one-element float32 tensor, got {_describe(x_global_scale)}")
    g = float(x_global_scale.reshape(-1)[0])
    if not (math.isfinite(g) and g > 0):
        fail(f"x_global_scale must be finite and positive, got {g}")
    return g, bool(use_ue8m0_for_sf)


def _check_overlap(fail: Callable[[str], None], ranks: int, num_experts: int, num_max: int,
                   return_recv_hook: bool, overlap: bool, packed_recv_count: Any, comp_signal: Any,
                   block_m: int, num_sms: int, src_signals: Any) -> None:
    """DeepEP's checks of the single-batch-overlap arguments of a low-latency combine
    (the Hopper branch's ``comp_signal`` of one int32 counter per (local expert, 64
    rows), the Blackwell branch's ``src_signals`` of one per local expert)."""
    local = num_experts // ranks
    if overlap and not return_recv_hook:
        fail("overlap needs return_recv_hook=True (the receive runs in the hook)")
    if overlap and comp_signal is None and src_signals is None:
        fail("overlap needs comp_signal (with packed_recv_count) or src_signals")
    if comp_signal is not None:
        # DeepEP sizes it with 64 rows a block whatever block_m is.
        want = local * -(-ranks * num_max // 64)
        if (not isinstance(comp_signal, torch.Tensor) or comp_signal.dtype != torch.int32
                or comp_signal.dim() != 1 or comp_signal.numel() < want):
            fail(f"comp_signal must be a 1-D int32 tensor of at least {want} counters, got {_describe(comp_signal)}")
        if (not isinstance(packed_recv_count, torch.Tensor) or packed_recv_count.dtype != torch.int32
                or tuple(packed_recv_count.shape) != (local,)):
            fail(f"comp_signal needs packed_recv_count as a [{local}] int32 tensor, got {_describe(packed_recv_count)}")
        if block_m <= 0 or num_sms <= 0:
            fail(f"block_m and num_sms must be positive, got {block_m} and {num_sms}")
    if src_signals is not None and (not isinstance(src_signals, torch.Tensor)
                                    or src_signals.dtype not in (torch.int32, torch.uint32)
                                    or src_signals.numel() < local):
        fail(f"src_signals must be a 32-bit tensor of at least {local} signals, got {_describe(src_signals)}")


class _LlCast:
    """How a low-latency dispatch's received rows and scales become DeepEP's outputs:
    bf16 as they are; FP8 codes with their column-major scales (UE8M0 words packed
    from them once received); NVFP4 codes permuted to ``[R*M, H/2, E/R]`` and block
    scales swizzled 128x4 once received."""

    def __init__(self, local: int, rows: int, hidden: int, ue8m0: bool,
                 nvfp4: Optional[Tuple[float, bool]]) -> None:
        self.nvfp4 = nvfp4
        self.packed = None
        self.swizzled = None
        if ue8m0:
            self.packed = torch.empty((local, hidden // 512, rows), dtype=torch.int32).transpose(1, 2)
        if nvfp4 is not None:
            # [E/R, rm, rk, 32, 4, 4]: token t, block j at [t/128][j/4][t%32][(t%128)/32][j%4].
            rm = -(-rows // 128)
            self.swizzled = torch.zeros((local, rm, hidden // 64, 32, 4, 4), dtype=torch.uint8)

    def outputs(self, x_cap: Any, s_cap: Any) -> Tuple[Any, Any]:
        """``(recv_x as returned, the raw scales to finish from)``."""
        recv = torch.from_dlpack(x_cap)
        if s_cap is None:
            return recv, None
        scales = torch.from_dlpack(s_cap)
        if self.swizzled is not None:
            sf_dtype = torch.int8 if self.nvfp4[1] else torch.float8_e4m3fn
            return (recv.permute(1, 2, 0), self.swizzled.view(sf_dtype).permute(3, 4, 1, 5, 2, 0)), scales
        recv = recv.view(torch.float8_e4m3fn)
        return (recv, self.packed if self.packed is not None else scales), scales

    def received(self, scales: Any) -> None:
        """Fill the outputs made from the scales, now that they are there."""
        if self.packed is not None:
            self.packed.copy_(_f32_to_ue8m0(scales))
        if self.swizzled is not None:
            local, rm, words = self.swizzled.shape[:3]
            rows = scales.shape[1]
            # Column-major words [E/R, W, rows] -> their bytes [E/R, W, rows, 4].
            raw = scales.transpose(1, 2).contiguous().view(torch.uint8).view(local, words, rows, 4)
            padded = torch.zeros((local, words, rm * 128, 4), dtype=torch.uint8)
            padded[:, :, :rows] = raw
            tiles = padded.view(local, words, rm, 4, 32, 4).permute(0, 2, 1, 4, 3, 5)
            self.swizzled.copy_(tiles)


class Buffer:
    """A communication buffer for expert parallelism: DeepEP v1's ``Buffer`` on uep.

    Args:
        group: the ``torch.distributed`` process group of the expert-parallel ranks
            (gloo on CPU). Two ``all_gather`` of rank 0's invitation are the only
            collectives uep runs on it; everything else moves through uep itself.
        num_nvl_bytes, num_rdma_bytes: a capacity: uep uses at most their sum (plus
            32 MiB of fixed areas) and raises an error naming the bytes it needs if a
            call needs more. Memory is only taken as the shapes of the calls need it.
        low_latency_mode, num_qps_per_rank, allow_nvlink_for_low_latency_mode,
        allow_mnnvl, use_fabric: accepted for compatibility (one uep Buffer serves
            normal and low-latency calls alike; the rest concern NVSHMEM and NVLink).
        explicitly_destroy: whether ``destroy()`` must be called (collectively).
        enable_shrink: elastic mode (DeepEP's shrink mode): a rank found dead or
            unreachable is masked on every survivor and the calls of both modes go on
            without it (its tokens count 0, its experts contribute nothing; a normal call
            that loses a rank runs again without it, and a cached dispatch through a
            handle made before the loss is refused); see the three
            ``low_latency_*_mask_buffer`` methods (the mask read right after a call is
            the one it used) and the ``active_ranks`` keyword of the low-latency calls.
        comm: an mpi4py communicator to bootstrap over instead of ``group``.
        max_group_size: with ``enable_shrink``, room for this many ranks (Mooncake's
            name): the ranks past the group's are *reserved*, whole nodes of the group's
            node size, masked until a process joins as one (:meth:`join_group`, with
            ``WORLD_SIZE`` this size) and the survivors let it in. ``group_size``, the
            masks and the expert placement (``num_experts`` a multiple of it) count them.

    Rejoin (elastic mode, under a launcher that sets ``MASTER_ADDR`` and
    ``MASTER_PORT`` and keeps its store there): a process started to replace a dead
    rank, or to take a reserved one, calls :meth:`Buffer.join_group` instead of the
    constructor; the survivors let it in (:meth:`recover_ranks`, Mooncake's name) at a
    step boundary they all agree on, and ``active_ranks`` turns to 1 for it.

    Environment: ``UEP_TIMEOUT_S`` (deadline of every wait, default 100 s),
    ``UEP_RANKS_PER_NODE`` (emulate nodes of that many ranks on one host),
    ``UEP_DEVICE_THREADS`` (kernel threads a rank; default: the host's cores over a node's
    ranks).
    """

    #: DeepEP's SM count for normal-mode kernels (kept for its config helpers).
    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[Any] = None, *, max_group_size: Optional[int] = None) -> None:
        if group is None and comm is None:
            raise ValueError("Buffer needs a torch.distributed group or an mpi4py comm")
        for name, v in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(v, int) or v < 0 or v % 128 != 0:
                raise InvalidArgumentError(f"invalid argument: {name} = {v!r} must be a non-negative multiple of 128")
        if group is not None:
            self.rank, self.group_size = group.rank(), group.size()

            def all_gather(data: bytes) -> List[bytes]:
                return _all_gather_bytes(group, data)
        else:
            self.rank, self.group_size = comm.Get_rank(), comm.Get_size()

            def all_gather(data: bytes) -> List[bytes]:
                return comm.allgather(data)
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        timeout = float(os.environ.get("UEP_TIMEOUT_S", _DEFAULT_TIMEOUT_S))
        per_node = os.environ.get("UEP_RANKS_PER_NODE")
        threads = int(os.environ.get("UEP_DEVICE_THREADS", "0"))
        door, store = _door(timeout) if enable_shrink else (None, None)
        self.runtime = _uep.Runtime(self.rank, self.group_size, all_gather,
                                    num_nvl_bytes + num_rdma_bytes, timeout, threads,
                                    int(per_node) if per_node else None, bool(enable_shrink),
                                    door, store, max_group_size)
        # With reserved ranks the job's room is larger than the group.
        _, self.group_size, self._ranks_per_node, self._num_nodes = self.runtime.topology()
        #: Where this Buffer joined a running job (``join_group``): ``(step, first call)``.
        self.joined_at: Optional[Tuple[int, str]] = None
        self._recovering: List[int] = []
        self._first_barrier = False

    @classmethod
    def join_group(cls, rank: Optional[int] = None, world_size: Optional[int] = None,
                   explicitly_destroy: bool = False) -> "Buffer":
        """Take the place of masked rank ``rank`` (default ``RANK``) of the running
        elastic job of ``world_size`` ranks (default ``WORLD_SIZE``), on the same host or
        another, as a process started to replace it (Mooncake's ``join_group``). It
        finds the job at the launcher's store, ``MASTER_ADDR``/``MASTER_PORT`` (no
        process group: the old one died with the rank), waits until the survivors let it in (their
        ``recover_ranks``; at most ``UEP_TIMEOUT_S``), and returns a Buffer sized as
        theirs. ``joined_at`` says where the job is: the survivors' step
        (:meth:`set_step`) and the call to make first with them (``"low_latency_dispatch"``,
        ``"dispatch"`` or ``"barrier"``, as in :meth:`update_ep_member`)."""
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        timeout = float(os.environ.get("UEP_TIMEOUT_S", _DEFAULT_TIMEOUT_S))
        door, store = _door(timeout)
        if door is None:
            raise InvalidArgumentError("invalid argument: join_group needs MASTER_ADDR and MASTER_PORT "
                                       "(the launcher's rendezvous) to find the job")
        threads = int(os.environ.get("UEP_DEVICE_THREADS", "0"))
        runtime, step, first = _uep.Runtime.join(rank, world_size, door, store, timeout, threads)
        self = cls.__new__(cls)
        self.rank, self.group_size, self.group, self.comm = rank, world_size, None, None
        self.num_nvl_bytes = self.num_rdma_bytes = 0
        self.low_latency_mode, self.num_qps_per_rank = True, 24
        self.explicitly_destroy, self.enable_shrink = explicitly_destroy, True
        self.runtime = runtime
        _, _, self._ranks_per_node, self._num_nodes = runtime.topology()
        self.joined_at = (step, first)
        self._recovering = []
        self._first_barrier = first == "barrier"
        return self

    # ------------------------------------------------------------------ statics

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (a CUDA event where CUDA is in use; else a
        completed one: uep's CPU calls are)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: uep runs DeepEP's FP8 paths on any machine."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM count DeepEP's config helpers use (even, as DeepEP asserts)."""
        assert new_num_sms % 2 == 0, "the SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's tuned dispatch config for ``num_ranks`` ranks."""
        assert num_ranks in _DISPATCH_CONFIGS, f"no dispatch config for {num_ranks} ranks"
        return Config(Buffer.num_sms, *_DISPATCH_CONFIGS[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's tuned combine config for ``num_ranks`` ranks."""
        assert num_ranks in _COMBINE_CONFIGS, f"no combine config for {num_ranks} ranks"
        return Config(Buffer.num_sms, *_COMBINE_CONFIGS[num_ranks])

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's RDMA bytes for low-latency mode at this shape; enough for uep's
        low-latency buffers too."""
        t, s = num_max_dispatch_tokens_per_rank, hidden // 128
        dispatch_msg = 16 + max(2 * hidden, hidden + 4 * s)
        combine_msg = 4 * s + 2 * hidden
        send = max(t * dispatch_msg, num_experts * t * combine_msg)
        recv = max(num_experts * t * dispatch_msg, num_experts * t * combine_msg)
        signals = (4 * num_experts + 127) // 128 * 128
        return (2 * send + 2 * recv + 2 * signals + 128) // 128 * 128

    # ------------------------------------------------------------------ misc

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream: where calls given CUDA tensors place their results
        (the current device's); ``None`` where CUDA is not available (CPU calls are
        synchronous)."""
        if not torch.cuda.is_available():
            return None
        return self._staging(torch.device("cuda", torch.cuda.current_device())).stream

    def _staging(self, device: torch.device) -> Staging:
        """The staging of CUDA tensors on `device` (see ``uep.staging``)."""
        stagings = self.__dict__.setdefault("_stagings", {})
        if device not in stagings:
            stagings[device] = Staging(device)
        return stagings[device]

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not available: uep has no single raw buffer (its memory is laid out per shape)."""
        raise NotImplementedError("uep has no raw NVL/RDMA buffer to view: its registered memory is laid out per call shape")

    def set_timeout(self, seconds: float) -> None:
        """The deadline of every wait (uep extension; default ``UEP_TIMEOUT_S`` or 100 s)."""
        self.runtime.set_timeout(seconds)

    def registered_bytes(self) -> int:
        """Bytes of registered memory this rank holds now (uep extension)."""
        return self.runtime.bytes()

    def barrier(self) -> None:
        """A barrier over the Buffer's ranks (uep extension)."""
        self.runtime.barrier()

    # ------------------------------------------------------------- elastic mode

    def _shrink(self) -> Any:
        if not self.enable_shrink:
            raise InvalidArgumentError("invalid argument: the mask needs Buffer(..., enable_shrink=True)")
        return self._rt()

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask ``rank_to_mask`` (``mask=True``: nothing is sent to or awaited from it in
        low-latency calls), or unmask it. A rank found dead stays masked."""
        self._shrink().mask_update(rank_to_mask, mask)

    @staged
    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write 1 into ``mask_status`` (``[num_ranks]`` int32) for every rank the last
        low-latency call left out (and those masked by the caller since), 0 for the
        others. A rank that died during a call's agreement round counted in that call;
        it shows from the next call on."""
        status = self._shrink().mask_query()
        if tuple(mask_status.shape) != (self.group_size,):
            raise InvalidArgumentError(f"invalid argument: mask_status must have shape ({self.group_size},)")
        mask_status.copy_(torch.tensor(status, dtype=mask_status.dtype))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank that was not found dead or unreachable."""
        self._shrink().mask_clean()

    def low_latency_mask_reasons(self) -> List[Optional[str]]:
        """Why each rank is masked (``None`` where it is not): how its loss was known."""
        return self._shrink().mask_reasons()

    def recover_ranks(self, ranks: Union[int, List[int], torch.Tensor]) -> None:
        """Let replacements of the masked ``ranks`` in once they ask (Mooncake's
        ``recover_ranks``; every survivor calls it). A replacement takes part from the
        first dispatch (or barrier) after the survivors have all mapped its memory and
        agreed; until then the calls go on without it."""
        if isinstance(ranks, torch.Tensor):
            ranks = ranks.flatten().tolist()
        elif isinstance(ranks, int):
            ranks = [ranks]
        rt = self._shrink()
        for r in ranks:
            rt.admit(int(r))
            self._recovering.append(int(r))

    #: Mooncake's other name for :meth:`recover_ranks`.
    activate_ranks = recover_ranks

    def update_ep_member(self) -> List[int]:
        """Bring the ranks given to :meth:`recover_ranks` back now (Mooncake's name;
        collective over the survivors and the replacements): barriers, at which
        replacements are let in, until every one of them takes part (or the deadline).
        A replacement whose first call is a barrier (``joined_at``) makes it here.
        Returns the ranks that came back."""
        rt = self._shrink()
        if self._first_barrier:
            self._first_barrier = False
            rt.barrier()
        deadline = time.monotonic() + float(os.environ.get("UEP_TIMEOUT_S", _DEFAULT_TIMEOUT_S))
        while any(rt.mask_query()[r] for r in self._recovering) and time.monotonic() < deadline:
            rt.barrier()
        back = [r for r in self._recovering if not rt.mask_query()[r]]
        self._recovering = [r for r in self._recovering if r not in back]
        return back

    def set_step(self, step: int) -> None:
        """The caller's step number, told to a replacement let in at the next dispatch
        (its ``joined_at``). uep extension: survivors set it before each step."""
        self._rt().set_step(int(step))

    def _apply_active_ranks(self, active_ranks: Optional[torch.Tensor]) -> None:
        """Mooncake's ``active_ranks`` on the way in: a 0 masks that rank."""
        if active_ranks is None:
            return
        rt = self._shrink()
        if tuple(active_ranks.shape) != (self.group_size,):
            raise InvalidArgumentError(f"invalid argument: active_ranks must have shape ({self.group_size},)")
        for r, alive in enumerate(active_ranks.tolist()):
            if not alive and r != self.rank:
                rt.mask_update(r, True)

    def _report_active_ranks(self, active_ranks: Optional[torch.Tensor]) -> None:
        """... and on the way out: 0 for every masked rank, 1 for the others (a rank
        that rejoined turns back to 1)."""
        if active_ranks is not None:
            masked = torch.tensor(self._rt().mask_query(), dtype=torch.bool)
            active_ranks.copy_((~masked).to(active_ranks.dtype))

    def destroy(self) -> None:
        """Free the Buffer; collective (a barrier first). Needs ``explicitly_destroy``."""
        assert self.explicitly_destroy, "destroy() needs explicitly_destroy=True"
        assert self.runtime is not None, "destroy() was called already"
        self.runtime.destroy()
        self.runtime = None

    def _rt(self) -> Any:
        if self.runtime is None:
            raise InvalidArgumentError("invalid argument: this Buffer was destroyed")
        return self.runtime

    def _fail(self, msg: str, mode: Optional[str] = None, *shape: int) -> None:
        """Reject this rank's input to a call of `mode` whose shape (experts, hidden,
        top-k, tokens) is as far as known (0: unknown): tell the other ranks the way
        that call would have met them (so none waits), and raise."""
        self._rt().reject_call(msg, mode, *[int(v) for v in shape])
        raise InvalidArgumentError(f"invalid argument: {msg}")

    # ------------------------------------------------------------------ normal mode

    @staged
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                       torch.Tensor, EventOverlap]:
        """Which ranks, nodes and experts each token goes to: ``(num_tokens_per_rank
        [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None on one node,
        num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``."""
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2:
            raise InvalidArgumentError(f"invalid argument: topk_idx must be a 2-D {topk_idx_t} tensor, got {_describe(topk_idx)}")
        per_rank, per_node, per_expert, in_rank = self._rt().layout(_capsule(topk_idx.contiguous()), num_experts)
        out = (torch.from_dlpack(per_rank),
               None if per_node is None else torch.from_dlpack(per_node),
               torch.from_dlpack(per_expert), torch.from_dlpack(in_rank))
        return (*out, _event(async_finish, *out))

    @staged
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]],
                 handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Normal dispatch: every token once to every rank that hosts one of its experts.

        ``x`` is bf16 ``[N, H]`` or ``(float8_e4m3fn [N, H], scales [N, H/128] f32 or
        [N, H/512] int32 UE8M0)``. Returns ``(recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event)``; rows are ordered by source
        rank, then source token; a cached dispatch (``handle``) returns ``(recv_x,
        None, None, None, None, event)``."""
        rt = self._rt()
        fp8 = isinstance(x, tuple)
        ue8m0 = False

        def fail(msg: str) -> None:
            data = x[0] if fp8 else x
            hidden = data.shape[-1] if isinstance(data, torch.Tensor) and data.dim() > 0 else 0
            experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else 0
            topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
            if handle is not None and getattr(handle, "_uep", None) is not None:
                topk = handle._uep.topk
            self._fail(msg, "normal", experts, hidden, topk, 0)

        if fp8:
            x_data, x_scales = x
            if x_data.dtype != torch.float8_e4m3fn:
                fail(f"FP8 x must be float8_e4m3fn, got {x_data.dtype}")
            groups = x_data.shape[-1] // 128 if x_data.dim() == 2 else 0
            if x_scales.dtype == torch.int32:
                ue8m0 = True
                x_scales = _ue8m0_to_f32(x_scales, groups)
            elif x_scales.dtype != torch.float32:
                fail(f"FP8 scales must be float32 (or int32 UE8M0), got {x_scales.dtype}")
            x_cap, s_cap = _capsule(x_data.contiguous().view(torch.uint8)), _capsule(x_scales.contiguous())
        else:
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
                fail(f"x must be bf16 (or an FP8 pair), got {getattr(x, 'dtype', type(x).__name__)}")
            x_cap, s_cap = _capsule(x), None
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                fail("a cached dispatch (with handle) takes no topk_idx and no topk_weights")
            h = handle._uep
            layout = (None, None, None)
        else:
            h = None
            if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                fail("dispatch needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert (from get_dispatch_layout), or a handle")
            if (topk_idx is None) != (topk_weights is None):
                fail("topk_idx and topk_weights go together")
            layout = (_capsule(num_tokens_per_rank), _capsule(num_tokens_per_expert), _capsule(is_token_in_rank))
        recv_x, recv_s, recv_idx, recv_w, counts, uh = rt.dispatch(
            x_cap, s_cap,
            None if topk_idx is None else _capsule(topk_idx),
            None if topk_weights is None else _capsule(topk_weights),
            *layout, h, expert_alignment, num_worst_tokens)
        recv_x = torch.from_dlpack(recv_x)
        if fp8:
            recv_x = recv_x.view(torch.float8_e4m3fn)
            recv_s = torch.from_dlpack(recv_s)
            if ue8m0:
                recv_s = _f32_to_ue8m0(recv_s)
            recv_x = (recv_x, recv_s)
        if handle is not None:
            return recv_x, None, None, None, None, _event(async_finish, recv_x)
        recv_idx = None if recv_idx is None else torch.from_dlpack(recv_idx)
        recv_w = None if recv_w is None else torch.from_dlpack(recv_w)
        new_handle = self._normal_handle(uh)
        counts = [] if num_worst_tokens > 0 else list(counts)
        return recv_x, recv_idx, recv_w, counts, new_handle, _event(async_finish, recv_x, recv_idx, recv_w)

    # DeepEP exposes its two-level kernels too; uep's dispatch picks its path itself.
    internode_dispatch = dispatch

    def _normal_handle(self, uh: Any) -> _NormalHandle:
        """DeepEP's handle tuple, with uep's handle attached: 6 entries on one node
        (``handle[0]``: the inclusive rank prefix matrix), 10 across nodes
        (``handle[-4]``: the inclusive prefix of rows received by source rank). Where
        DeepEP's entries describe its GPU channels, uep's have one channel."""
        R, rank = self.group_size, self.rank
        rpm = torch.from_dlpack(uh.rank_prefix_matrix())
        src_idx = torch.from_dlpack(uh.recv_src_idx())
        in_rank = torch.from_dlpack(uh.is_token_in_rank())
        per_rank = torch.from_dlpack(uh.num_tokens_per_rank())
        zero = torch.zeros(1, R, dtype=torch.int32)
        # Where this rank's rows start at each destination, and each token's row there.
        start = torch.cat([zero, rpm[:-1]])[rank]
        pos = in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
        send_head = torch.where(in_rank, pos + start, torch.full_like(pos, -1))
        recv_prefix = rpm[:, rank].contiguous()
        recv_start = torch.cat([zero[0, :1], recv_prefix[:-1]])
        if self._num_nodes == 1:
            t = _NormalHandle((rpm, per_rank.view(R, 1).clone(), recv_start.view(R, 1).clone(),
                               src_idx, in_rank, send_head))
        else:
            L, nodes = self._ranks_per_node, self._num_nodes
            recv_counts = recv_prefix - recv_start
            in_node = in_rank.view(-1, nodes, L).any(2)
            node_pos = in_node.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
            send_node_head = torch.where(in_node, node_pos, torch.full_like(node_pos, -1))
            recv_node = recv_counts.view(nodes, L).sum(1, dtype=torch.int32)
            src_rank = torch.repeat_interleave(torch.arange(R, dtype=torch.int32), recv_counts.to(torch.int64))
            src_meta = torch.zeros((src_idx.shape[0], 8), dtype=torch.uint8)
            src_meta.view(torch.int32)[:, 0] = src_rank // L
            t = _NormalHandle((in_rank, in_node.sum(0, dtype=torch.int32).view(nodes, 1),
                               per_rank.view(R, 1).clone(), recv_node.view(nodes, 1).clone(),
                               recv_node.cumsum(0, dtype=torch.int32), recv_counts.view(R, 1).clone(),
                               recv_prefix, src_meta, send_node_head,
                               torch.full((src_idx.shape[0], L), -1, dtype=torch.int32)))
        t._uep = uh
        return t

    @staged
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Normal combine: every received row back to its source, summed there in f32
        (rank order) with the biases, rounded once: ``(combined_x [N, H],
        combined_topk_weights [N, K] or None, event)``."""
        rt = self._rt()
        uh = getattr(handle, "_uep", None)
        if uh is None:
            self._fail("combine needs the handle a normal dispatch of this Buffer returned")
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            self._fail(f"combine x must be a 2-D bf16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        bias0, bias1 = (bias if isinstance(bias, tuple) else (bias, None)) if bias is not None else (None, None)
        cap = lambda t: None if t is None else _capsule(t)  # noqa: E731
        combined_x, combined_w = rt.combine(_capsule(x), uh, cap(topk_weights), cap(bias0), cap(bias1))
        combined_x = torch.from_dlpack(combined_x)
        combined_w = None if combined_w is None else torch.from_dlpack(combined_w)
        return combined_x, combined_w, _event(async_finish, combined_x, combined_w)

    internode_combine = combine

    # ------------------------------------------------------------------ low latency

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Make low-latency mode ready for this shape on every rank (collective).

        uep's signals carry epochs, so nothing needs zeroing; this sets up the buffers
        (top-k as last used, or 8) and synchronises, as DeepEP's does."""
        topk = self._rt().ll_topk() or 8
        self._rt().prepare_ll(num_max_dispatch_tokens_per_rank, hidden, num_experts, topk)

    @staged
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             *, active_ranks: Optional[torch.Tensor] = None,
                             topk_weights: Optional[torch.Tensor] = None,
                             x_global_scale: Optional[torch.Tensor] = None, use_nvfp4: bool = False,
                             use_ue8m0_for_sf: bool = False):
        """Low-latency dispatch: each token to each of its top-k experts, into the fixed
        layout ``[E/R, R * num_max, H]``. Returns ``(recv_x, recv_count, handle, event,
        hook)``; ``recv_x`` is bf16, or ``(float8_e4m3fn, scales)`` with scales
        ``[E/R, R*num_max, H/128]`` f32 (``[.., H/512]`` int32 with ``use_ue8m0``),
        column-major in their last two dimensions. ``use_nvfp4`` (with ``use_fp8=False``
        and ``x_global_scale``, DeepEP's hybrid-ep branch) casts to NVFP4 instead:
        ``(data, scales)`` with data uint8 ``[R*num_max, H/2, E/R]`` (e2m1 pairs) and
        block scales ``[32, 4, rm, 4, rk, E/R]`` in the 128x4 swizzle FP4 GEMMs read,
        float8_e4m3fn (int8 UE8M0 exponents with ``use_ue8m0_for_sf``). With
        ``topk_weights`` (``[T, K]`` f32, as hybrid-ep takes it) it returns seven values,
        ``(recv_x, recv_count, recv_topk_weights, recv_rank_info, handle, event, hook)``:
        each received row's gate weight and source rank, ``[E/R, R*num_max]`` f32 and
        int32 (0 and -1 past the count). With
        ``return_recv_hook`` only the send half runs; ``hook()`` receives.
        ``active_ranks`` (elastic mode, Mooncake's ``[num_ranks]`` int32, in/out): a 0
        masks that rank first; afterwards every masked rank reads 0."""
        rt = self._rt()
        self._apply_active_ranks(active_ranks)

        def fail(msg: str) -> None:
            hidden = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() > 0 else 0
            topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
            self._fail(msg, "ll", num_experts, hidden, topk, num_max_dispatch_tokens_per_rank)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2:
            fail(f"low-latency x must be a 2-D bf16 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        hidden = x.shape[1]
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            fail(f"x has {x.shape[0]} tokens, more than num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank}")
        if hidden % 128 != 0:
            fail(f"low-latency mode needs hidden to be a multiple of 128, got {hidden}")
        if use_ue8m0 and not round_scale:
            fail("use_ue8m0 needs round_scale")
        if use_ue8m0 and hidden % 512 != 0:
            fail(f"use_ue8m0 packs four scales a word: hidden must be a multiple of 512, got {hidden}")
        if async_finish and return_recv_hook:
            fail("async_finish and return_recv_hook exclude each other")
        nvfp4 = _nvfp4_args(fail, use_fp8, use_nvfp4, x_global_scale, use_ue8m0_for_sf)
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2
                or topk_idx.shape[0] != x.shape[0]):
            fail(f"topk_idx must be a [{x.shape[0]}, K] {topk_idx_t} tensor, got {_describe(topk_idx)}")
        if topk_weights is not None and (not isinstance(topk_weights, torch.Tensor)
                                         or topk_weights.dtype != torch.float32
                                         or topk_weights.shape != topk_idx.shape):
            fail(f"topk_weights must be a float32 tensor shaped like topk_idx, got {_describe(topk_weights)}")
        if num_experts % self.group_size != 0:
            fail(f"num_experts = {num_experts} must be a multiple of the number of ranks ({self.group_size})")
        w_cap = None if topk_weights is None else _capsule(topk_weights.contiguous())
        pending = rt.ll_dispatch_send(_capsule(x), _capsule(topk_idx), num_max_dispatch_tokens_per_rank,
                                      num_experts, use_fp8, round_scale, nvfp4, w_cap)
        local = num_experts // self.group_size
        rows = self.group_size * num_max_dispatch_tokens_per_rank
        cast = _LlCast(local, rows, hidden, use_fp8 and use_ue8m0, nvfp4)

        # hybrid-ep's extra outputs, filled once received.
        weighted = None
        if topk_weights is not None:
            weighted = (torch.zeros((local, rows), dtype=torch.float32),
                        torch.full((local, rows), -1, dtype=torch.int32))

        def finish(counts, uh, src_info, layout_range, wait_ns, recv_count, handle, raw_scales):
            recv_count.copy_(torch.tensor(counts, dtype=torch.int32))
            handle[0].copy_(torch.from_dlpack(src_info))
            handle[1].copy_(torch.from_dlpack(layout_range))
            handle._uep = uh
            cast.received(raw_scales)
            if weighted is not None:
                weighted[0].copy_(torch.from_dlpack(rt.ll_src_weights(uh)))
                for i in range(local):
                    ranks = torch.repeat_interleave(torch.arange(self.group_size, dtype=torch.int32),
                                                    handle[1][i] & 0xFFFFFFFF)
                    weighted[1][i, :ranks.numel()] = ranks
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count)
            if dispatch_wait_recv_cost_stats is not None:
                dispatch_wait_recv_cost_stats.add_(torch.tensor(wait_ns, dtype=dispatch_wait_recv_cost_stats.dtype))

        recv_count = torch.empty(local, dtype=torch.int32)
        handle = _LlHandle((torch.empty((local, rows), dtype=torch.int32),
                            torch.empty((local, self.group_size), dtype=torch.int64),
                            num_max_dispatch_tokens_per_rank, hidden, num_experts))
        handle._uep = None
        if return_recv_hook:
            recv_x, raw_scales = cast.outputs(*rt.ll_outputs(pending, None))

            def hook() -> None:
                finish(*rt.ll_dispatch_recv(pending), recv_count, handle, raw_scales)
                self._report_active_ranks(active_ranks)
            return _ll_returns(recv_x, recv_count, weighted, handle, EventOverlap(None), hook)
        received = rt.ll_dispatch_recv(pending)
        recv_x, raw_scales = cast.outputs(*rt.ll_outputs(pending, received[1]))
        finish(*received, recv_count, handle, raw_scales)
        self._report_active_ranks(active_ranks)
        return _ll_returns(recv_x, recv_count, weighted, handle, _event(async_finish, recv_x, recv_count), _noop)

    @staged
    def get_next_low_latency_combine_buffer(self, handle: Tuple) -> torch.Tensor:
        """The next combine's send buffer, a ``[E/R, R*num_max, H]`` bf16 view of the
        Buffer's registered memory: write the expert outputs into it, then call
        ``low_latency_combine(..., zero_copy=True)``, which sends them from there with
        no staging copy. As in DeepEP, write it only before that combine; the next
        call returns the other of the two buffers."""
        uh = getattr(handle, "_uep", None)
        if uh is None:
            self._fail("get_next_low_latency_combine_buffer needs the handle of a received low-latency dispatch")
        return torch.from_dlpack(self._rt().ll_combine_buffer(uh))

    @staged
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: Tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                            *, active_ranks: Optional[torch.Tensor] = None, overlap: bool = False,
                            packed_recv_count: Optional[torch.Tensor] = None,
                            comp_signal: Optional[torch.Tensor] = None, block_m: int = 64,
                            threshold: int = 0, num_sms: int = 3,
                            src_signals: Optional[torch.Tensor] = None, src_signal_expect_value: int = 0):
        """Low-latency combine: each expert output back to its token, weighted:
        ``combined_x[t] = sum_k w[t,k] * y_{idx[t,k]}`` in f32, rounded once. Returns
        ``(combined_x, event, hook)``. ``zero_copy`` sends the expert outputs from
        ``get_next_low_latency_combine_buffer`` (``x`` is ignored) with no staging copy;
        ``use_logfmt`` is accepted, and the
        outputs travel as bf16, which is at least as exact. ``active_ranks`` as in
        ``low_latency_dispatch``.

        Single-batch overlap (SGLang's arguments: ``overlap``, ``packed_recv_count``,
        ``comp_signal``, ``block_m``, ``threshold``, ``num_sms`` on Hopper; ``overlap``,
        ``src_signals``, ``src_signal_expect_value`` on Blackwell) are checked as DeepEP
        checks them and give the same output: their signals say when a GEMM still
        running on the GPU has written rows, and here every row is written before the
        call, so nothing waits on them."""
        rt = self._rt()
        self._apply_active_ranks(active_ranks)
        uh = getattr(handle, "_uep", None)
        if uh is None:
            self._fail("low_latency_combine needs the handle of a received low-latency dispatch (call its hook first)")
        _, _, num_max, hidden, num_experts = handle

        def fail(msg: str) -> None:
            # Named as a low-latency call of this shape, so the peers' waits end at once.
            topk = topk_idx.shape[-1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() > 0 else 0
            self._fail(msg, "ll", num_experts, hidden, topk, num_max)
        _check_overlap(fail, self.group_size, num_experts, num_max, return_recv_hook, overlap,
                       packed_recv_count, comp_signal, block_m, num_sms, src_signals)
        for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                fail(f"low-latency combine needs {name} as a tensor, got {_describe(t)}")
        if use_logfmt and zero_copy:
            fail("use_logfmt and zero_copy exclude each other")
        if async_finish and return_recv_hook:
            fail("async_finish and return_recv_hook exclude each other")
        if zero_copy:
            src = None
        else:
            if x is None or x.dtype != torch.bfloat16 or x.dim() != 3:
                fail("low-latency combine input must be a 3-D bf16 tensor [E/R, R*num_max, H]")
            src = x.contiguous()
        n = uh.num_tokens
        if out is None:
            out = torch.empty((n, hidden), dtype=torch.bfloat16)
        elif out.dtype != torch.bfloat16 or tuple(out.shape) != (n, hidden) or not out.is_contiguous():
            fail(f"out must be a contiguous bf16 tensor of shape ({n}, {hidden})")
        else:
            start, end = rt.memory_span()
            if out.numel() and start < out.data_ptr() + out.numel() * 2 and out.data_ptr() < end:
                fail("out lies in the Buffer's own memory (the combine buffer?): pass a tensor of its own")
        src_cap = None if src is None else _capsule(src)
        pending = rt.ll_combine_send(src_cap, _capsule(topk_idx), _capsule(topk_weights), uh)

        def hook() -> None:
            rt.ll_combine_recv(pending, None if src is None else _capsule(src), _capsule(out))
            self._report_active_ranks(active_ranks)
        if return_recv_hook:
            return out, EventOverlap(None), hook
        hook()
        return out, _event(async_finish, out), _noop
