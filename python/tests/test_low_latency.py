"""DeepEP's low-latency test, on CPU: counts, src_info, layout_range, rows by source,
FP8 with column-major scales, round_scale, UE8M0 packing, hooks, dispatching twice
before one combine, zero-copy combine, ``out=``, the statistics; and one Buffer
serving both modes."""

import pytest

from conftest import launch


@pytest.mark.parametrize("world", [2, 4])
def test_low_latency(world):
    results = launch("low_latency", world, num_experts=4 * world)
    # Every local expert (4) of every checked configuration (2 hook modes x 4 casts).
    assert all(r["checked"] == 2 * 4 * 4 for r in results), results


def test_low_latency_two_emulated_nodes():
    results = launch("low_latency", 4, env={"UEP_RANKS_PER_NODE": "2"}, num_experts=16)
    assert all(r["checked"] == 2 * 4 * 4 for r in results), results


def test_one_buffer_serves_both_modes():
    results = launch("mixed_modes", 4, env={"UEP_RANKS_PER_NODE": "2"})
    assert all(r["checked"] > 0 for r in results)


@pytest.mark.parametrize("world,per_node", [(2, "2"), (4, "2")])
def test_nvfp4_dispatch_and_overlap_arguments(world, per_node):
    """NVFP4 rows and swizzled block scales bit for bit against a plain torch
    reference, on one node and on two emulated nodes (the packets path); SGLang's
    single-batch-overlap keywords give the plain combine's output."""
    results = launch("low_latency_nvfp4", world, env={"UEP_RANKS_PER_NODE": per_node})
    assert all(r["checked"] == 6 * 16 // world for r in results), results
