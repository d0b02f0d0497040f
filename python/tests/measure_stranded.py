"""How soon every rank knows that one rank rejected its call (docs/performance.md).

Runs ``workers.stranded`` (4 ranks, ``UEP_TIMEOUT_S=4``) with the absent rank 0, 1 and 3,
in normal and low-latency mode, and prints each waiting rank's time from its call to
its error, then the median and the worst. Run from this folder:
``../../.venv/bin/python measure_stranded.py``.
"""

import statistics

from conftest import launch

if __name__ == "__main__":
    seconds = []
    for bad in (0, 1, 3):
        for mode in ("normal", "ll"):
            results = launch("stranded", 4, env={"UEP_TIMEOUT_S": "4"}, bad_rank=bad, mode=mode)
            waited = [r["seconds"] for rank, r in enumerate(results) if rank != bad]
            seconds += waited
            print(f"absent rank {bad}, {mode}: {[round(s, 2) for s in waited]} s;",
                  results[(bad + 1) % 4]["error"][1][-100:])
    print(f"median {statistics.median(seconds):.2f} s, worst {max(seconds):.2f} s, {len(seconds)} waits")
