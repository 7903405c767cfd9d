#!/usr/bin/env python3
"""The shape of the code, from its #include lines and function bodies (stdlib only).

  scripts/structure.py [--root DIR] [--top N]

Prints:
  * arrows that run back up: an #include from a folder to one above it in the layering
    (LAYERS below, the order of docs/ARCHITECTURE.md), file by file;
  * include cycles between files (strongly connected components of the quoted #include graph);
  * the longest functions (ctags gives where each starts and ends), and the longest files.
Used to compare a tree before and after a restructuring; never part of the build.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys

# Lower layers first; a folder may include from its own layer and the ones before it. Tools sit
# on the library (and on the torch-free store and base, which ddprun links directly).
LAYERS = [
    ["include/ddp/error.h", "include/ddp/env.h", "include/ddp/relayed_error.h",
     "include/ddp/threads.h", "include/ddp/allocator.h", "include/ddp/blas.h",
     "include/ddp/config.h", "include/ddp/reduce_op.h", "src/base"],
    ["src/c10d", "src/store"],
    ["src/rendezvous"],
    # runtime: what init_process_group() sets up for the process (default_group.cpp calls it)
    ["include/ddp/process_group.h", "include/ddp/distributed.h", "src/process_group",
     "src/runtime"],
    ["include/ddp/comm_hooks.h", "include/ddp/distributed_data_parallel.h", "include/ddp/join.h",
     "src/parallel", "include/ddp/sync_batch_norm.h", "src/nn", "include/ddp/sampler.h",
     "include/ddp/datasets.h", "include/ddp/data_loader.h", "include/ddp/metrics.h",
     "src/data"],
    ["include/ddp/zero_redundancy_optimizer.h", "src/optim"],
    ["include/ddp/stateful.h", "include/ddp/training_state.h", "src/state"],
    ["include/ddp/checkpoint.h", "src/checkpoint"],
    # per-step fault tolerance: quorums over the store, groups, states healed through checkpoints
    ["include/ddp/fault_tolerance.h", "src/ft"],
    ["include/ddp/ddp.h", "include/ddp/runtime.h"],
    ["tools", "examples", "benchmarks", "tests"],
]
SOURCE = (".h", ".cpp", ".cc", ".hpp")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(path):
    best, level = None, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (path == name or path.startswith(name + "/")) and (
                    best is None or len(name) > len(best)):
                best, level = name, i
    return best, level


def files(root):
    out = []
    for top in ("include", "src", "tools"):
        for d, _, names in os.walk(os.path.join(root, top)):
            out += [os.path.relpath(os.path.join(d, n), root) for n in names
                    if n.endswith(SOURCE)]
    return sorted(out)


def resolve(root, src, inc, known):
    """The file an include names: beside the includer, then under src/ and include/."""
    for base in (os.path.dirname(src), "src", "include"):
        cand = os.path.normpath(os.path.join(base, inc))
        if cand in known:
            return cand
    if inc.endswith("config.h") and inc.startswith("ddp/"):
        return "include/ddp/config.h"
    return None


def graph(root):
    known = set(files(root))
    edges = collections.defaultdict(set)
    for f in sorted(known):
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            for line in fh:
                m = INCLUDE.match(line)
                if m:
                    target = resolve(root, f, m.group(1), known)
                    if target and target != f:
                        edges[f].add(target)
    return known, edges


def back_arrows(edges):
    out = []
    for src, targets in sorted(edges.items()):
        _, ls = layer_of(src)
        for t in sorted(targets):
            _, lt = layer_of(t)
            if ls is not None and lt is not None and lt > ls:
                out.append((src, t))
    return out


def cycles(nodes, edges):
    """Tarjan's strongly connected components of more than one file."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
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

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def functions(root, paths):
    """(lines, file:line, name) of every function ctags finds with an end line."""
    cmd = ["ctags", "--output-format=json", "--fields=+ne", "--kinds-C++=f", "--language-force=C++",
           "-f", "-"] + [p for p in paths if p.endswith((".cpp", ".cc", ".h"))]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False)
    out = []
    for line in res.stdout.splitlines():
        try:
            tag = json.loads(line)
        except ValueError:
            continue
        if "end" in tag and "line" in tag:
            scope = tag.get("scope", "")
            name = f"{scope}::{tag['name']}" if scope else tag["name"]
            out.append((tag["end"] - tag["line"] + 1, f"{tag['path']}:{tag['line']}", name))
    return sorted(out, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    root = os.path.abspath(a.root)
    nodes, edges = graph(root)
    arrows = back_arrows(edges)
    print(f"arrows running back up: {len(arrows)}")
    for s, t in arrows:
        print(f"  {s} -> {t}")
    # A header and its .cpp are one component: rounds.cpp -> elastic.h -> rounds.h is a cycle.
    comp = lambda f: os.path.splitext(f)[0]
    cedges = collections.defaultdict(set)
    for s, ts in edges.items():
        cedges[comp(s)].update(comp(t) for t in ts if comp(t) != comp(s))
    cyc = cycles({comp(f) for f in nodes}, cedges)
    print(f"include cycles (a header and its .cpp as one component): {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    fns = functions(root, sorted(nodes))
    print(f"longest functions (of {len(fns)}):")
    for n, where, name in fns[:a.top]:
        print(f"  {n:4d} lines  {name}  ({where})")
    sizes = []
    for f in nodes:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fh:
            sizes.append((sum(1 for _ in fh), f))
    print("longest files:")
    for n, f in sorted(sizes, reverse=True)[:a.top]:
        print(f"  {n:4d} lines  {f}")
    print(f"functions over 50 lines: {sum(1 for f in fns if f[0] > 50)}, over 100: "
          f"{sum(1 for f in fns if f[0] > 100)}")


if __name__ == "__main__":
    main()
