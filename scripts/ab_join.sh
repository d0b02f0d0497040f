#!/usr/bin/env bash
# How long a rejoin takes, two `uep` binaries alternating: the joiners' "joined:" lines
# of an 8-rank, 4-node elastic soak with two kills and replacements, ROUNDS rounds
# (default 10), then the medians. Extra `uep bench` flags go after the binaries
# (`--door-in-shm` for the door in shared memory).
#   scripts/ab_join.sh OLD_UEP NEW_UEP [uep bench flags]
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,6p "$0" >&2; exit 2; }
old=$1 new=$2
shift 2
args=(--tokens 64 --elastic --soak 300 --experts 16 --ll-tokens 24 --hidden 256 --topk 4
    --ranks 8 --nodes 4 --mode all --kill 2@20 --rejoin 2@40 --kill 5@100 --rejoin 5@120)
log=$(mktemp)
for _ in $(seq "${ROUNDS:-10}"); do
    for which in old new; do
        bin=$old
        [ $which = new ] && bin=$new
        "$bin" bench "${args[@]}" "$@" 2>&1 | grep "joined:" | sed "s/^/$which /" >>"$log"
    done
done
python3 - "$log" <<'PY'
import re, statistics as st, sys
runs = {"old": ([], []), "new": ([], [])}
for line in open(sys.argv[1]):
    m = re.match(r"(old|new) .*let in (\d+) ms \(waited at the door ([\d.]+) ms\)", line)
    if m:
        runs[m[1]][0].append(float(m[2]))
        runs[m[1]][1].append(float(m[3]))
print("| binary | joins | process started → let in, median | waited at the door, median (min–max) |")
print("|---|---:|---:|---:|")
for k, (start, door) in runs.items():
    if start:
        print(f"| {k} | {len(start)} | {st.median(start):.0f} ms | "
              f"{st.median(door):.1f} ms ({min(door):.1f}–{max(door):.1f}) |")
PY
rm -f "$log"
