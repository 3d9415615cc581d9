#!/usr/bin/env python3
"""One-off migration for the core's two front doors: rewrites paths to the
items that left the crate root of `oncely` (and the modules that merged) in
every .rs and .md file given (default: the workspace). Idempotent."""
import os, re, sys

BACKEND = ["Capabilities", "Ledger", "TransactionalLedger", "Claim", "Fingerprint", "Lease",
           "MAX_OUTCOME_BYTES", "Outcome", "Record", "RecordState", "StoredOutcome", "Watch",
           "MAX_KEY_BYTES", "MAX_KIND_BYTES", "MAX_TENANT_BYTES"]
ROOT_MOVES = {n: "backend" for n in BACKEND}
ROOT_MOVES.update({"Admin": "admin", "Pruner": "pruner", "PrunerHandle": "pruner",
                   "PrunerOptions": "pruner", "PrunerStats": "pruner"})
# module::item -> module
SUB_MOVES = {("watch", n): "backend" for n in ["Watch", "Notifier", "NOTIFIED_FALLBACK"]}
SUB_MOVES.update({("backend", n): "open" for n in ["FromUrl", "OpenOptions", "Access", "UrlParams", "split_hosts", "LedgerOptions"]})
SUB_MOVES[("admin", "forget_refusal")] = "backend"

def split_top(s):
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "{": depth += 1
        if ch == "}": depth -= 1
        if ch == "," and depth == 0:
            out.append(cur); cur = ""
        else:
            cur += ch
    if cur.strip(): out.append(cur)
    return [x.strip() for x in out if x.strip()]

def flatten(tree, prefix=()):
    tree = tree.strip()
    if tree.startswith("{") and tree.endswith("}"):
        res = []
        for item in split_top(tree[1:-1]):
            res += flatten(item, prefix)
        return res
    m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*::\s*(.*)$", tree, re.S)
    if m:
        return flatten(m.group(2), prefix + (m.group(1),))
    return [prefix + (tree,)]  # last segment, maybe "x as y" or "self" or "*"

def name_of(seg):
    return seg.split(" as ")[0].strip()

def map_path(p, root="oncely"):
    p = list(p)
    if len(p) >= 1 and name_of(p[0]) in ROOT_MOVES and len(p) >= 1:
        if len(p) == 1 or True:
            p = [ROOT_MOVES[name_of(p[0])]] + p
    if len(p) >= 2 and (p[0], name_of(p[1])) in SUB_MOVES and not (root == "crate" and p[0] == "watch"):
        p[0] = SUB_MOVES[(p[0], name_of(p[1]))]
    return tuple(p)

def render(paths):
    # group by all-but-last
    groups = {}
    for p in paths:
        groups.setdefault(p[:-1], []).append(p[-1])
    return groups

USE = re.compile(r"(?m)^([ \t]*(?:(?://[/!])[ \t]?(?:#[ \t])?)?)((?:pub(?:\([a-z]+\))?\s+)?use\s+)(oncely|crate)::([^;]*?);", re.S)

def rewrite_use(m, root):
    indent, kw, r, tree = m.group(1), m.group(2), m.group(3), m.group(4)
    if r != root:
        return m.group(0)
    tree = re.sub(r"\n[ \t]*(?://[/!])[ \t]?(?:#[ \t])?", " ", tree)
    paths = flatten(tree)
    mapped = [map_path(p, r) for p in paths]
    if mapped == paths:
        return m.group(0)
    groups = render(mapped)
    lines = []
    for mod, items in groups.items():
        base = "::".join((r,) + mod)
        if len(items) == 1:
            lines.append(f"{indent}{kw}{base}::{items[0]};")
        else:
            lines.append(f"{indent}{kw}{base}::{{{', '.join(items)}}};")
    return "\n".join(lines)

def rewrite_inline(text, root):
    def sub_root(m):
        return f"{m.group(1)}{root}::{ROOT_MOVES[m.group(2)]}::{m.group(2)}"
    names = "|".join(sorted(ROOT_MOVES, key=len, reverse=True))
    text = re.sub(rf"((?<![:\w]){'' if True else ''})" + re.escape(root) + rf"::({names})\b(?!\s*::\s*\{{)", lambda m: f"{root}::{ROOT_MOVES[m.group(2)]}::{m.group(2)}", text)
    for (mod, n), to in SUB_MOVES.items():
        if root == "crate" and mod == "watch":
            continue  # inside the core the private module is still there
        text = re.sub(rf"(?<![:\w]){re.escape(root)}::{mod}::{n}\b", f"{root}::{to}::{n}", text)
    return text

def rewrite(text, roots):
    for root in roots:
        text = USE.sub(lambda m: rewrite_use(m, root), text)
        text = rewrite_inline(text, root)
    return text

def files(args):
    if args:
        for a in args:
            if os.path.isdir(a):
                for root, dirs, fs in os.walk(a):
                    dirs[:] = [d for d in dirs if d not in ("target", ".git") and not d.startswith("target")]
                    for f in fs:
                        if f.endswith((".rs", ".md")):
                            yield os.path.join(root, f)
            else:
                yield a
    else:
        yield from files(["."])

changed = 0
for f in files(sys.argv[1:]):
    text = open(f).read()
    core = os.path.normpath(f).startswith(os.path.normpath("crates/oncely") + os.sep) and not f.endswith(".md")
    roots = ["oncely", "crate"] if core else ["oncely"]
    new = rewrite(text, roots)
    if new != text:
        open(f, "w").write(new)
        changed += 1
        print("rewrote", f)
print(changed, "files")
