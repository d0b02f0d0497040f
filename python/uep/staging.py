"""CUDA tensors through host memory.

uep's EP work runs on the host device (CPU threads and proxies) for now: uep-cuda's
kernels are not wired into ``Buffer`` yet. So that code written for DeepEP on GPUs runs
unchanged, a call given CUDA tensors is *staged*: its inputs are copied to host memory
(after ``previous_event``, or the current stream's work, has produced them), the call
runs as on CPU, and its results are copied to the GPU on the Buffer's communication
stream. Then, as in DeepEP:

* ``async_finish=True`` returns an ``EventOverlap`` holding a real CUDA event recorded
  on that stream after the copies; otherwise the current stream waits for them;
* tensors the call writes into (``out=``, the statistics, ``active_ranks``,
  ``mask_status``) are written on the GPU;
* a receive hook (``return_recv_hook=True``) receives, then refreshes the tensors the
  send half returned;
* the buffer of ``get_next_low_latency_combine_buffer`` is a GPU tensor whose contents
  a zero-copy combine sends.

Handles keep uep's own handle (``_uep``) across the copies. The copies cost what they
cost: this is a path for correctness and compatibility, not speed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .utils import EventHandle, EventOverlap

#: Arguments a call writes into.
IN_OUT = ("out", "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats",
          "combine_wait_recv_cost_stats", "active_ranks", "mask_status")


def cuda_device(values: Any) -> Optional[torch.device]:
    """The device of the first CUDA tensor in `values` (nested tuples and lists too)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_cuda:
                return v.device
        elif isinstance(v, (tuple, list)):
            found = cuda_device(v)
            if found is not None:
                return found
    return None


def _same_kind(template: tuple, items: List[Any]) -> tuple:
    """A tuple of `items` of `template`'s class, with its uep handle."""
    if type(template) is tuple:
        return tuple(items)
    out = type(template)(items)
    if hasattr(template, "_uep"):
        out._uep = template._uep
    return out


class Staging:
    """One device's staging: its communication stream and the copies of one call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        # id(uep handle) -> (GPU buffer, host buffer) of get_next_low_latency_combine_buffer.
        self.combine_buffers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def to_host(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu() if v.is_cuda else v
        if isinstance(v, tuple):
            return _same_kind(v, [self.to_host(x) for x in v])
        if isinstance(v, list):
            return [self.to_host(x) for x in v]
        return v

    def to_device(self, v: Any, pairs: List[Tuple[Any, Any]]) -> Any:
        """`v` with its host tensors copied to the device (on the comm stream); every
        (host, device) tensor and handle pair is added to `pairs`, for a hook."""
        if isinstance(v, torch.Tensor):
            d = v.to(self.device, non_blocking=False)
            pairs.append((v, d))
            return d
        if isinstance(v, tuple):
            d = _same_kind(v, [self.to_device(x, pairs) for x in v])
            if hasattr(v, "_uep"):
                pairs.append((v, d))
            return d
        if isinstance(v, list):
            return [self.to_device(x, pairs) for x in v]
        return v

    def refresh(self, pairs: List[Tuple[Any, Any]]) -> None:
        """Copy the host side of each pair into its device side again (after a hook
        filled them), and hand over uep handles set meanwhile."""
        with torch.cuda.stream(self.stream):
            for host, dev in pairs:
                if isinstance(host, torch.Tensor):
                    dev.copy_(host)
                else:
                    dev._uep = host._uep

    def finish(self, async_finish: bool, keep: Tuple[Any, ...]) -> Optional[EventOverlap]:
        """The call's results are queued on the comm stream: an event on it, or make
        the current stream wait."""
        if async_finish:
            event = torch.cuda.Event()
            event.record(self.stream)
            return EventOverlap(EventHandle(event), keep)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return None


def staged(method: Callable) -> Callable:
    """Runs a ``Buffer`` method given CUDA tensors through host memory (see the module
    docs); calls with CPU tensors pass straight through."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        device = cuda_device(list(args) + list(kwargs.values()))
        if device is None:
            return method(self, *args, **kwargs)
        return _call(self._staging(device), method, signature, self, args, kwargs)

    return call


def _call(st: Staging, method: Callable, signature: inspect.Signature, buffer: Any,
          args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    bound = signature.bind(buffer, *args, **kwargs)
    a = bound.arguments
    prev = a.get("previous_event")
    if isinstance(prev, EventOverlap) and prev.event is not None:
        prev.event.synchronize()
    # The call writes into host copies of these; they go back once it has.
    written = {name: a[name] for name in IN_OUT if isinstance(a.get(name), torch.Tensor) and a[name].is_cuda}
    for name in list(a):
        if name != "self" and not isinstance(a[name], EventOverlap):
            a[name] = st.to_host(a[name])
    if a.get("zero_copy"):
        _load_combine_buffer(st, a.get("handle"))
    result = method(*bound.args, **bound.kwargs)
    hosts = {id(a[name]): dev for name, dev in written.items()}
    return _results(st, method.__name__, result, hosts, written, a)


def _load_combine_buffer(st: Staging, handle: Any) -> None:
    """A zero-copy combine sends the host buffer: fill it from the GPU buffer the caller
    wrote."""
    pair = st.combine_buffers.get(id(getattr(handle, "_uep", None)))
    if pair is not None:
        pair[1].copy_(pair[0])


def _results(st: Staging, name: str, result: Any, hosts: Dict[int, torch.Tensor],
             written: Dict[str, torch.Tensor], a: Dict[str, Any]) -> Any:
    """The call's results on the device; written-into arguments copied back."""
    pairs: List[Tuple[Any, Any]] = []
    writebacks = [(a[n], dev) for n, dev in written.items()]
    with torch.cuda.stream(st.stream):
        out = _map_results(st, result, hosts, pairs)
        for host, dev in writebacks:
            dev.copy_(host)
    if name == "get_next_low_latency_combine_buffer":
        st.combine_buffers[id(getattr(a.get("handle"), "_uep", None))] = (out, result)
    items = list(out) if isinstance(out, tuple) else [out]
    keep = tuple(x for x in items if isinstance(x, torch.Tensor))
    event = st.finish(bool(a.get("async_finish")), keep)
    if not isinstance(out, tuple):
        return out
    for i, x in enumerate(items):
        if isinstance(x, EventOverlap):
            items[i] = event if event is not None else EventOverlap(None)
        elif callable(x) and not isinstance(x, torch.Tensor):
            items[i] = _hook(st, x, pairs + writebacks)
    return type(out)(items) if type(out) is tuple else _same_kind(out, items)


def _map_results(st: Staging, result: Any, hosts: Dict[int, torch.Tensor],
                 pairs: List[Tuple[Any, Any]]) -> Any:
    """Results to the device, except host copies of written-into arguments, which
    become the caller's own tensors."""
    if isinstance(result, torch.Tensor) and id(result) in hosts:
        return hosts[id(result)]
    if isinstance(result, tuple) and not hasattr(result, "_uep"):
        return tuple(_map_results(st, x, hosts, pairs) for x in result)
    return st.to_device(result, pairs)


def _hook(st: Staging, hook: Callable[[], None], pairs: List[Tuple[Any, Any]]) -> Callable[[], None]:
    """A receive hook that, once it has received, refreshes the device copies."""
    def received() -> None:
        hook()
        st.refresh(pairs)
        torch.cuda.current_stream(st.device).wait_stream(st.stream)
    return received
