"""uep: portable expert-parallel communication, with DeepEP v1's Python API.

``import uep as deep_ep`` and DeepEP code runs on PyTorch CPU tensors: ``Buffer``,
``Config``, ``EventOverlap``, ``EventHandle`` and ``topk_idx_t`` are here under DeepEP's
names. Errors raise a subclass of ``UepError`` (a ``RuntimeError``) by kind:
``InvalidArgumentError`` (also a ``ValueError``), ``CapacityError``,
``UepTimeoutError`` (also a ``TimeoutError``), ``PeerLostError``, ``PeerAbortedError``,
``ProtocolError``, ``ResourceError``, ``ControlPlaneError`` and ``InternalError``.
"""

from ._uep import (
    CapacityError,
    ControlPlaneError,
    InternalError,
    InvalidArgumentError,
    PeerAbortedError,
    PeerLostError,
    ProtocolError,
    ResourceError,
    UepError,
    UepTimeoutError,
    __version__,
)
from .buffer import Buffer, topk_idx_t
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "CapacityError",
    "Config",
    "ControlPlaneError",
    "EventHandle",
    "EventOverlap",
    "InternalError",
    "InvalidArgumentError",
    "PeerAbortedError",
    "PeerLostError",
    "ProtocolError",
    "ResourceError",
    "UepError",
    "UepTimeoutError",
    "topk_idx_t",
    "__version__",
]
