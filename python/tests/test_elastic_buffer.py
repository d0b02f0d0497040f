"""DeepEP v2's ``ElasticBuffer`` (its ``tests/elastic/test_ep.py`` on CPU): every
dispatch mode and combine, bit for bit against a sequential reference, on one node and
on two emulated nodes, hybrid or direct."""

import pytest

from conftest import launch


@pytest.mark.parametrize("world", [2, 4])
def test_one_node(world):
    results = launch("elastic_v2", world, experts=4 * world)
    assert all(r["checked"] == 12 for r in results)


@pytest.mark.parametrize("hybrid", [True, False])
def test_two_emulated_nodes(hybrid):
    results = launch("elastic_v2", 4, env={"UEP_RANKS_PER_NODE": "2"}, experts=16, hybrid=hybrid, seed=5)
    assert all(r["checked"] == 12 for r in results)
    assert results[1]["rows"] > 0


@pytest.mark.parametrize("caller", ["sglang", "vllm"])
def test_framework_call_sequences(caller):
    # SGLang's and vLLM's v2 prepare/finalize, their exact keywords, on 2 emulated nodes.
    results = launch("v2_callers", 4, env={"UEP_RANKS_PER_NODE": "2"}, caller=caller)
    assert all(len(r["steps"]) == 4 for r in results)


@pytest.mark.parametrize("what", ["duplicate", "num_max", "cached_sync", "combine_rows"])
def test_bad_input_on_one_rank_raises_everywhere(what):
    for rank, r in enumerate(launch("v2_bad_input", 4, what=what)):
        assert r["seconds"] < 10, r
        if rank == 1:
            assert r["type"] == "InvalidArgumentError" and "invalid argument" in r["error"], r
        else:
            assert r["type"] == "PeerAbortedError" and "rank 1" in r["error"], r
