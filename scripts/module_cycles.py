#!/usr/bin/env python3
"""Module import cycles of each crate: a module's imports are the `crate::a::b` paths
its files name in code (`use`, or paths; not comments or tests), folded to the crate's
top-level modules; prints
each cycle (a strongly connected set of two or more) and exits 1 if there is one.

    scripts/module_cycles.py [crates/uep-ep ...]   (default: every crate)
"""
import pathlib
import re
import sys


def top_modules(src: pathlib.Path):
    """Each top-level module of the crate and the files that make it up."""
    mods = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src).parts
        if rel[0] in ("lib.rs", "main.rs"):
            continue
        name = rel[0][:-3] if rel[0].endswith(".rs") else rel[0]
        mods.setdefault(name, []).append(f)
    return mods


def imports(files, names):
    """The crate's top-level modules these files name through `crate::`."""
    out = set()
    for f in files:
        text = re.sub(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", "", f.read_text(), flags=re.S)
        # Comments (doc links included) are not dependencies.
        text = re.sub(r"//.*", "", text)
        for m in re.finditer(r"crate::(\w+)", text):
            out.add(m.group(1))
        for m in re.finditer(r"use crate::\{([^}]*)\}", text):
            out.update(re.findall(r"(?:^|,)\s*(\w+)", m.group(1)))
    return {n for n in out if n in names}


def cycles(graph):
    """Strongly connected components of two or more modules (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    root = pathlib.Path(__file__).resolve().parent.parent
    crates = [pathlib.Path(a) for a in sys.argv[1:]] or sorted((root / "crates").iterdir())
    found = False
    for crate in crates:
        src = crate / "src"
        if not src.is_dir():
            continue
        mods = top_modules(src)
        graph = {m: imports(fs, set(mods)) - {m} for m, fs in mods.items()}
        for c in cycles(graph):
            found = True
            print(f"{crate.name}: cycle among {', '.join(c)}")
    if not found:
        print(f"no module cycle in {len(crates)} crate(s)")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
