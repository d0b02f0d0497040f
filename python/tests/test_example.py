"""examples/moe_layer.py: an MoE layer run expert-parallel through uep equals the same
layer run densely (calc_diff 5e-5 bf16, 2e-3 FP8), on one node and on two emulated nodes."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "moe_layer.py")


@pytest.mark.parametrize("ranks_per_node", [None, "2"])
def test_moe_layer_matches_the_dense_layer(ranks_per_node):
    env = dict(os.environ, OMP_NUM_THREADS="1", UEP_TIMEOUT_S="60")
    if ranks_per_node:
        env["UEP_RANKS_PER_NODE"] = ranks_per_node
    out = subprocess.run([sys.executable, EXAMPLE, "--ranks", "4"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [l for l in out.stdout.splitlines() if l.strip().endswith("ok")]
    assert len(lines) == 4, out.stdout
