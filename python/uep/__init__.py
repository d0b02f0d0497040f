"""uep: portable expert-parallel communication, with DeepEP v1's Python API.

``import uep as deep_ep`` and DeepEP code runs on PyTorch CPU tensors: ``Buffer``,
``Config``, ``EventOverlap``, ``EventHandle`` and ``topk_idx_t`` are here under DeepEP's
names. Errors raise ``UepError`` (a ``RuntimeError``).
"""

from ._uep import UepError, __version__
from .buffer import Buffer, topk_idx_t
from .config import Config
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "UepError", "topk_idx_t", "__version__"]
