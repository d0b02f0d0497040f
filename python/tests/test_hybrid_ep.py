"""hybrid-ep's ``HybridEPBuffer`` through its real caller: Megatron-core's
``fused_a2a.hybrid_ep_dispatch`` / ``hybrid_ep_combine`` from PyPI, unchanged, forward
and backward against the dense layer (``deep_ep`` is ``uep`` through ``sys.modules``;
nothing is monkeypatched)."""

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
