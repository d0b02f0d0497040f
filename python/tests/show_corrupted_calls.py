"""Print each case of the seeded fuzz of corrupted calls (``workers.corrupted_calls``):
what was corrupted on which rank, each rank's time to its error, the bad rank's error
and a good rank's. Run from this folder: ``../../.venv/bin/python show_corrupted_calls.py SEED``.
"""

import sys

from conftest import launch

if __name__ == "__main__":
    cases = 16
    rs = launch("corrupted_calls", 4, env={"UEP_TIMEOUT_S": "3"}, seed=int(sys.argv[1]), cases=cases, deadline=3.0)
    for i in range(len(rs[0]["log"])):
        case = [r["log"][i] for r in rs]
        bad = case[0]["case"][3]
        print(case[0]["case"], [round(c["seconds"], 2) for c in case], "|",
              (case[bad]["error"] or "-")[:60], "|", (case[(bad + 1) % 4]["error"] or "-")[:90])
