"""Events, as DeepEP's ``deep_ep.utils`` has them.

With CPU tensors uep's calls are complete when they return, so an event is a completed
one; the classes exist so that DeepEP code that records, chains and waits on events
runs unchanged (``previous_event=``, ``async_finish=True``,
``event.current_stream_wait()``, ``with EventOverlap(...)``). With CUDA tensors an
event is a real ``torch.cuda.Event`` recorded on the Buffer's communication stream
after the call's results were placed there.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class EventHandle:
    """A recorded event: a CUDA event where one is given or CUDA is in use, else one
    that has always happened (CPU calls finish before they return)."""

    def __init__(self, event: Optional["torch.cuda.Event"] = None) -> None:
        if event is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            # As DeepEP's: an event on the current stream.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
        self.event = event
        self.completed = event is None

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (nothing to wait for on CPU)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the event has happened."""
        if self.event is not None:
            self.event.synchronize()


class EventOverlap:
    """DeepEP's event wrapper: an optional event and tensors to keep alive until it.

    ``current_stream_wait()`` requires an event (as DeepEP asserts); used as a context
    manager, it waits on exit when it has one.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._hooks: list = []

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event, then run the hooks registered
        after it (once). ``release_handle`` (DeepEP v2) is accepted."""
        assert self.event is not None, "EventOverlap.current_stream_wait() needs an event (pass async_finish=True)"
        self.event.current_stream_wait()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def register_hook_after_wait(self, hook: Any) -> None:
        """Run `hook` after the next wait (DeepEP v2)."""
        self._hooks.append(hook)

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """For ``with event(release_handle=True):`` (DeepEP v2)."""
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.current_stream_wait()
