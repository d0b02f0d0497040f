"""uep.Buffer with CUDA tensors (staged through host memory, results on the comm
stream, CUDA events): every call's outputs equal the same call's with CPU tensors.
Needs a GPU: skipped, with the reason, where there is none."""

import pytest
import torch

from conftest import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here (torch.cuda.is_available() is False)")


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_tensors_match_cpu_tensors(world):
    results = launch("cuda_tensors", world)
    assert all(r["checked"] > 20 for r in results), results


def test_cuda_tensors_across_two_emulated_nodes():
    results = launch("cuda_tensors", 4, env={"UEP_RANKS_PER_NODE": "2"})
    assert all(r["checked"] > 20 for r in results), results
