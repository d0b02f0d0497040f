"""A real ``torchrun`` starts the job (its own rendezvous, its own store): uep takes the
group it is given and needs no port or setting of its own."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_torchrun_launches_a_job():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", UEP_TIMEOUT_S="60")
    out = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "4", os.path.join(HERE, "torchrun_job.py")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for r in range(4):
        assert f"rank {r}/4 (local {r}): OK" in out.stdout, out.stdout + out.stderr
