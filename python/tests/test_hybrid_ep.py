"""Megatron-core's two EP backends through their real caller, Megatron-core 0.16.1's
own ``fused_a2a`` from PyPI, unchanged: ``hybrid_ep_dispatch`` / ``hybrid_ep_combine``
over ``HybridEPBuffer`` and ``fused_dispatch`` / ``fused_combine`` over DeepEP v1's
``Buffer``, forward and backward against the dense layer (``deep_ep`` is ``uep``
through ``sys.modules``; nothing is monkeypatched). Also hybrid-ep's plain calls, bit
for bit."""

import pytest

from conftest import launch


@pytest.mark.parametrize("pad_multiple,give_rows", [(None, False), (4, True)])
def test_megatron_fused_a2a_hybrid_ep(pad_multiple, give_rows):
    results = launch("megatron_hybrid_ep", 4, env={"UEP_RANKS_PER_NODE": "2"}, timeout=300,
                     pad_multiple=pad_multiple, give_rows=give_rows)
    assert all(max(r["diffs"].values()) < 1e-4 for r in results), results


@pytest.mark.parametrize("per_node", [None, "2"])
def test_plain_dispatch_and_combine_by_routing_map(per_node):
    env = {"UEP_RANKS_PER_NODE": per_node} if per_node else {}
    results = launch("hybrid_ep_plain", 4, env=env)
    assert results[1]["rows"] > 0


@pytest.mark.parametrize("async_finish", [False, True])
def test_megatron_fused_a2a_deepep_v1_path(async_finish):
    # The same package's other backend: fused_dispatch / fused_combine over uep.Buffer.
    results = launch("megatron_deepep", 4, env={"UEP_RANKS_PER_NODE": "2"}, timeout=300,
                     async_finish=async_finish)
    assert all(max(r["diffs"].values()) < 1e-4 for r in results), results
