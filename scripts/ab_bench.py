#!/usr/bin/env python3
"""Two `uep` binaries side by side: round by round, each configuration runs on the old
binary, then on the new one (the order alternates between rounds), and the table gives
the median over the rounds of each op's p50, with new/old. Every run must verify.

    scripts/ab_bench.py OLD NEW [--rounds 3] [--iters 6] [--only LABELS] [-- uep bench flags]
"""
import argparse
import json
import statistics
import subprocess
import sys

CONFIGS = [  # (label, flags)
    ("1 × 2", ["--ranks", "2"]),
    ("1 × 4", ["--ranks", "4"]),
    ("2 × 2", ["--ranks", "4", "--nodes", "2"]),
    ("4 × 1", ["--ranks", "4", "--nodes", "4"]),
    ("1 × 2 fp8", ["--ranks", "2", "--mode", "ll", "--fp8"]),
    ("2 × 2 fp8", ["--ranks", "4", "--nodes", "2", "--mode", "ll", "--fp8"]),
    ("1 × 2 fp8 2 lanes", ["--ranks", "2", "--mode", "ll", "--fp8", "--threads", "2"]),
]


def run(binary, flags, iters, extra):
    cmd = [binary, "bench", *flags, "--iters", str(iters), "--no-limits", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
    reports = json.loads(out.stdout)
    if not all(r["verified"] for r in reports):
        sys.exit(f"{' '.join(cmd)}: an output did not verify")
    return {r["op"]: r["p50_us"] / 1e3 for r in reports if r["op"] != "layout"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--only", help="labels to run, comma-separated")
    # Everything after `--` goes to `uep bench`; the script's own options may stand
    # anywhere before it (a remainder argument would swallow those after OLD NEW).
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.extra = argv[cut + 1 :]
    configs = [c for c in CONFIGS if not a.only or c[0] in a.only.split(",")]
    samples = {}  # (label, op, side) -> [ms]
    for rnd in range(a.rounds):
        for label, flags in configs:
            sides = [("old", a.old), ("new", a.new)]
            for side, binary in sides if rnd % 2 == 0 else sides[::-1]:
                for op, ms in run(binary, flags, a.iters, a.extra).items():
                    samples.setdefault((label, op, side), []).append(ms)
            print(f"round {rnd + 1}/{a.rounds}: {label} done", file=sys.stderr)
    print("| nodes × ranks a node | op | old ms | new ms | new/old |")
    print("|---|---|---:|---:|---:|")
    for label, _ in configs:
        ops = [op for (l, op, s) in samples if l == label and s == "old"]
        for op in ops:
            old = statistics.median(samples[(label, op, "old")])
            new = statistics.median(samples[(label, op, "new")])
            print(f"| {label} | {op} | {old:.2f} | {new:.2f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
