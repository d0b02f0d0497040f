"""uep: portable expert-parallel communication, with DeepEP's Python APIs.

``import uep as deep_ep`` and DeepEP code runs on PyTorch CPU tensors: v1's ``Buffer``,
``Config``, ``EventOverlap``, ``EventHandle`` and ``topk_idx_t``; v2's ``ElasticBuffer``,
``EPHandle``, ``get_physical_domain_size`` and ``get_logical_domain_size``; and
hybrid-ep's ``HybridEPBuffer`` (Megatron's), under DeepEP's names. Errors raise a
subclass of ``UepError`` (a ``RuntimeError``) by kind: ``InvalidArgumentError`` (also a
``ValueError``), ``CapacityError``, ``UepTimeoutError`` (also a ``TimeoutError``),
``PeerLostError``, ``PeerAbortedError``, ``ProtocolError``, ``ResourceError``,
``ControlPlaneError`` and ``InternalError``.
"""

import os as _os

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
    fabric_env_defaults as _fabric_env_defaults,
)

# libfabric reads its settings at its first use in the process, which comes later (a
# Buffer's first call): uep's preferred ones, where the caller has not set them.
for _name, _value in _fabric_env_defaults():
    _os.environ.setdefault(_name, _value)
from .buffer import Buffer, topk_idx_t
from .elastic_buffer import EPHandle, ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from .hybrid_ep_buffer import HybridEPBuffer
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = [
    "Buffer",
    "CapacityError",
    "Config",
    "EPHandle",
    "ElasticBuffer",
    "ControlPlaneError",
    "EventHandle",
    "EventOverlap",
    "HybridEPBuffer",
    "InternalError",
    "InvalidArgumentError",
    "PeerAbortedError",
    "PeerLostError",
    "ProtocolError",
    "ResourceError",
    "UepError",
    "UepTimeoutError",
    "get_logical_domain_size",
    "get_physical_domain_size",
    "topk_idx_t",
    "__version__",
]
