"""DeepEP's intranode and internode tests, on CPU: layout, dispatch (bf16, FP8 with
column-major scales, with and without top-k, padded, cached), combine (with biases),
every event flag combination."""

import pytest

from conftest import launch


@pytest.mark.parametrize("world", [2, 4])
def test_intranode(world):
    results = launch("normal_mode", world, num_experts=4 * world)
    assert all(r["checked"] == 24 for r in results)


def test_internode_two_emulated_nodes_with_bias():
    # 4 ranks as 2 nodes of 2 (UEP_RANKS_PER_NODE): the relay path, handle[-4],
    # num_tokens_per_rdma_rank, and the biases.
    results = launch("normal_mode", 4, env={"UEP_RANKS_PER_NODE": "2"}, num_experts=16,
                     internode=True, with_bias=True, seed=3)
    assert all(r["checked"] == 24 for r in results)
