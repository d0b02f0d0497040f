"""Events, as DeepEP's ``deep_ep.utils`` has them, for a device that finishes every call
before it returns.

uep's calls run on the CPU and are complete when they return, so an event is always a
completed one; the classes exist so that DeepEP code that records, chains and waits on
events runs unchanged (``previous_event=``, ``async_finish=True``,
``event.current_stream_wait()``, ``with EventOverlap(...)``).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


class EventHandle:
    """A recorded event; on CPU it has always happened."""

    def __init__(self) -> None:
        self.completed = True

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event: nothing to wait for on CPU."""


class EventOverlap:
    """DeepEP's event wrapper: an optional event and tensors to keep alive until it.

    ``current_stream_wait()`` requires an event (as DeepEP asserts); used as a context
    manager, it waits on exit when it has one.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[Any, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None, "EventOverlap.current_stream_wait() needs an event (pass async_finish=True)"
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
