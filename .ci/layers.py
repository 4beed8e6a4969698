#!/usr/bin/env python3
"""The module layers of src/ and the imports between them.

Each folder of src/ is a layer, lowest first; inside a folder, each file sits
on a sub-layer. A module may name modules on its own (sub-)layer or below,
never above. Reads every `crate::PATH` (and `super::NAME` inside a folder) in
src/ (unit-test files and `#[cfg(test)] mod tests` blocks excepted), then
prints the import cycles and the upward imports, and exits 1 if there is
either, or if a module is not placed. `-v` prints the graph.

    python3 .ci/layers.py [-v]
"""
import os
import re
import sys

# Folders lowest first. A folder given as None is one unit (its files are
# its own business); otherwise its files by sub-layer, lowest first.
LAYERS = [
    ("clock", None),
    ("ledger", None),
    ("domain", [["error", "canon", "codec", "credential"], ["binding", "manifest"], ["keyring"], ["token"], ["sealer"]]),
    ("net", [["conns"], ["limits"], ["accept", "budget", "serve"], ["tls"]]),
    ("ops", [["hardening"], ["kek", "audit"], ["reload"], ["metrics"]]),
    ("grpc", [["status"], ["auth", "canon_pool"], ["service"]]),
    ("cli", None),
    ("app", [["server"], ["build"]]),
]
RANK = {}
for i, (folder, subs) in enumerate(LAYERS):
    if subs is None:
        RANK[folder] = (i, 0)
    else:
        for j, files in enumerate(subs):
            for f in files:
                RANK[f"{folder}::{f}"] = (i, j)
FOLDERS = {f: subs for f, subs in LAYERS}


def unit_of(parts):
    """The unit a path (list of module names under the crate root) names."""
    if not parts or parts[0] not in FOLDERS and parts[0] != "proto":
        return parts[0] if parts else None
    if parts[0] == "proto":
        return None
    if FOLDERS[parts[0]] is None or len(parts) < 2:
        return parts[0]
    return f"{parts[0]}::{parts[1]}"


root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
edges = {}
for dirpath, _, files in os.walk(root):
    for f in files:
        if not f.endswith(".rs") or f == "tests.rs":
            continue
        rel = os.path.relpath(os.path.join(dirpath, f), root).removesuffix(".rs")
        parts = rel.split(os.sep)
        if parts in (["main"], ["lib"]) or parts[-1] == "mod" and len(parts) == 2 and FOLDERS.get(parts[0]) is not None:
            continue
        if parts[-1] == "mod":
            parts = parts[:-1]
        me = unit_of(parts)
        text = open(os.path.join(dirpath, f)).read()
        text = re.sub(r"#\[cfg\(test\)\]\s*mod tests\s*\{.*", "", text, flags=re.S)
        named = set()
        for m in re.finditer(r"\bcrate::((?:[a-z_]+::)*)(\{[^}]*\}|[a-z_]+)", text):
            prefix = [p for p in m.group(1).split("::") if p]
            tail = m.group(2)
            heads = re.findall(r"(?:^|[{,])\s*([a-z_]+)", tail) if tail.startswith("{") else [tail]
            named.add(unit_of(prefix))
            for h in heads:
                named.add(unit_of(prefix + [h]))
        if len(parts) >= 2:
            for m in re.finditer(r"\bsuper::([a-z_]+)", text):
                named.add(unit_of(parts[:-1] + [m.group(1)]))
        edges.setdefault(me, set()).update(n for n in named if n and n != me)

unplaced = sorted(set(edges) - set(RANK))
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
    if a in RANK and b in RANK and RANK[b] > RANK[a]
)
if "-v" in sys.argv:
    for u in sorted(edges, key=lambda u: RANK.get(u, (99, 99))):
        print(f"{RANK.get(u, '?')!s:8} {u:18} -> {' '.join(sorted(edges[u] & set(edges)))}")
n = sum(len(bs & set(edges)) for bs in edges.values())
print(f"modules {len(edges)}, imports {n}, cycles {len(cycles)} {cycles}, "
      f"upward imports {len(upward)} {upward}, unplaced {unplaced}")
sys.exit(1 if cycles or upward or unplaced else 0)
