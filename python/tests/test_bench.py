"""``python -m uep.bench --peers``: uep and the all_to_all_single dispatcher on gloo, on
the same tensors, both verified (the peer's combine must equal uep's)."""

import subprocess
import sys


def test_bench_with_the_gloo_peer():
    out = subprocess.run([sys.executable, "-m", "uep.bench", "--peers", "--json", "--ranks", "2",
                          "--tokens", "64", "--ll-tokens", "8", "--hidden", "256", "--experts", "16",
                          "--topk", "4", "--iters", "1", "--warmup", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    import json
    reports = {r["op"]: r for r in json.loads(out.stdout)}
    for op in ("dispatch", "combine", "gloo_dispatch", "gloo_combine"):
        assert reports[op]["verified"], reports[op]
        assert reports[op]["avg_us"] > 0
    assert reports["gloo_dispatch"]["bytes_per_rank"] == reports["dispatch"]["bytes_per_rank"]
