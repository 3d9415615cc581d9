#!/usr/bin/env python3
"""Lists the files of each crate that import each other (directly or round a
longer circle): `use crate::a::b` in src/x.rs is an edge from x to a (to a/b
when a is a folder). Exits 1 when any crate has a circle. Usage:
scripts/module-cycles.py [crate-dir ...] (default: every crate under crates/)."""
import os, re, sys

def modules(src):
    """Maps a module path (tuple) to its file."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)[:-3].split(os.sep)
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            out[tuple(rel)] = os.path.join(root, f)
    return out

USE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+|::\{)")

def strip(text):
    # Comments and strings out, and #[cfg(test)] modules (tests import freely).
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    i = text.find("#[cfg(test)]\nmod tests")
    return text if i < 0 else text[:i]

def resolve(mods, here, kind, path):
    base = list(here) if kind == "crate" else None
    if kind == "crate":
        parts = []
    else:
        parts = list(here[:-1]) if not is_dir(mods, here) else list(here[:-1])
    names = [p for p in path.split("::") if p]
    cand = parts + names
    while cand and tuple(cand) not in mods:
        cand.pop()
    return tuple(cand)

def is_dir(mods, m):
    return any(k[: len(m)] == m and len(k) > len(m) for k in mods)

def graph(src):
    mods = modules(src)
    g = {m: set() for m in mods}
    for m, f in mods.items():
        text = strip(open(f).read())
        for kind, path in USE.findall(text):
            if path == "::{":
                # use crate::{a, b::c}: take each first segment
                j = text.find(kind + "::{")
                continue
            t = resolve(mods, m, kind, path)
            if t != m and t != () and t[: len(m)] != m:
                g[m].add(t)
        for group in re.findall(r"\bcrate::\{([^}]*)\}", text):
            for item in group.split(","):
                item = item.strip().split("::")
                t = resolve(mods, m, "crate", "::".join(item))
                if t != m and t != () and t[: len(m)] != m:
                    g[m].add(t)
    return mods, g

def cycles(g):
    """Strongly connected components of more than one module."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in g[v]:
            if w not in g:
                continue
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)
    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    return out

def main():
    crates = sys.argv[1:] or sorted(
        os.path.join("crates", c) for c in os.listdir("crates") if os.path.isdir(os.path.join("crates", c, "src")))
    bad = 0
    for c in crates:
        mods, g = graph(os.path.join(c, "src"))
        for comp in cycles(g):
            bad += 1
            names = sorted("::".join(m) or "(root)" for m in comp)
            pairs = sorted(f"{'::'.join(a)} -> {'::'.join(b)}" for a in comp for b in g[a] if b in comp)
            print(f"{c}: a circle of {len(comp)}: {', '.join(names)}")
            for p in pairs:
                print(f"    {p}")
    if bad:
        sys.exit(1)
    print("no module imports one that imports it back")

main()
