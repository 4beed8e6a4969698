#!/usr/bin/env python3
"""The module layers of src/ and the imports between them.

Each top-level module of the library sits on one layer; a module may name
modules on its own layer or below, never above. Reads every `crate::NAME`
in src/ (unit-test files and `#[cfg(test)] mod tests` blocks excepted), then
prints the import cycles and the upward imports, and exits 1 if there is
either. `-v` prints the graph.

    python3 .ci/layers.py [-v]
"""
import os
import re
import sys

# Lowest first. A module missing here fails the check: place it.
LAYERS = [
    ("foundation", ["error", "canon", "clock", "conns", "hardening", "status"]),
    ("binding and keys", ["binding", "manifest", "keyring"]),
    ("token format", ["token"]),
    ("ledgers", ["ledger"]),
    ("domain core", ["sealer"]),
    ("transport and callers", ["limits", "tls", "auth", "reload"]),
    ("operations", ["metrics"]),
    ("gRPC face", ["service"]),
    ("server", ["server"]),
    ("composition root", ["config"]),
]
LAYER = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
edges = {}
for dirpath, _, files in os.walk(root):
    for f in files:
        if not f.endswith(".rs") or f == "tests.rs":
            continue
        rel = os.path.relpath(os.path.join(dirpath, f), root)
        top = rel.split(os.sep)[0].removesuffix(".rs")
        if top in ("main", "lib"):
            continue
        text = open(os.path.join(dirpath, f)).read()
        text = re.sub(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", "", text, flags=re.S)
        names = set(re.findall(r"\bcrate::([a-z_]+)", text)) - {top, "proto"}
        edges.setdefault(top, set()).update(names)

unplaced = sorted(set(edges) - set(LAYER))
# Strongly connected components (Tarjan) = import cycles.
index, low, stack, on, sccs = {}, {}, [], set(), []
def visit(v, counter=[0]):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
        if w not in edges:
            continue
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
        sccs.append(sorted(comp))
for v in sorted(edges):
    if v not in index:
        visit(v)
cycles = [c for c in sccs if len(c) > 1]
upward = sorted(
    (a, b)
    for a, bs in edges.items()
    for b in bs
    if a in LAYER and b in LAYER and LAYER[b] > LAYER[a]
)
if "-v" in sys.argv:
    for i, (name, ms) in enumerate(LAYERS):
        for m in ms:
            if m in edges:
                print(f"{i} {name:22} {m:10} -> {' '.join(sorted(edges[m] & set(edges)))}")
n = sum(len(bs & set(edges)) for bs in edges.values())
print(f"modules {len(edges)}, imports {n}, cycles {len(cycles)} {cycles}, "
      f"upward imports {len(upward)} {upward}, unplaced {unplaced}")
sys.exit(1 if cycles or upward or unplaced else 0)
