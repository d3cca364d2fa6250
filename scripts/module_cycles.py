#!/usr/bin/env python3
"""Fails when the modules of a crate import each other in a circle.

    python3 scripts/module_cycles.py [CRATE_SRC_DIR ...]     (default: every crates/*/src)

A module is a source file (`a/b.rs` or `a/b/mod.rs` is module `a::b`). Module A depends on B when
A names an item through `crate::b::...`, `super::...` or `self::...` (in `use` lines and in
paths inside the code) that resolves to B or to something inside B. A parent that declares its
children (`mod b;`) or re-exports their items (`pub use b::X;`) does not depend on them by that
alone; the code inside `#[cfg(test)]` blocks is ignored (tests may look anywhere). Each circle is printed with the names that tie it,
and the exit status is 1 if there is any.
"""

import re
import sys
from pathlib import Path

PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::\w+)*)::\{([^;]*)\}\s*;", re.S)


def module_of(src: Path, file: Path) -> tuple:
    rel = file.relative_to(src).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text: str) -> str:
    """Drops `#[cfg(test)]` items (a module or a function) by brace matching, and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    while True:
        j = text.find("#[cfg(test)]", i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = text.find("{", j)
        semi = text.find(";", j)
        if k < 0 or (0 <= semi < k):
            i = semi + 1
            continue
        depth = 0
        for m in range(k, len(text)):
            if text[m] == "{":
                depth += 1
            elif text[m] == "}":
                depth -= 1
                if depth == 0:
                    i = m + 1
                    break
        else:
            return "".join(out)


def resolve(modules: set, here: tuple, root: str, rest: list) -> tuple | None:
    if root == "crate":
        base = []
    elif root == "super":
        base = list(here[:-1])
        while rest and rest[0] == "super":
            base, rest = base[:-1], rest[1:]
    else:
        base = list(here)
    path = base + rest
    # The longest prefix that is a module: `crate::a::b::Item` is module a::b if it exists.
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in modules:
            return tuple(path[:n])
    return None


def crate_graph(src: Path):
    files = {module_of(src, f): f for f in src.rglob("*.rs")}
    modules = set(files)
    edges = {}
    for mod, file in files.items():
        # `pub use` re-exports what a module offers; it is not a dependency of the module.
        text = re.sub(r"\bpub(\([^)]*\))?\s+use\b[^;]*;", "", strip_tests(file.read_text()))
        refs = []
        for m in USE_GROUP.finditer(text):
            prefix = [p for p in m.group(2).split("::") if p]
            for item in re.split(r",", m.group(3)):
                item = item.strip().split(" as ")[0].strip()
                if not item or item == "self":
                    refs.append((m.group(1), prefix, "self"))
                    continue
                refs.append((m.group(1), prefix + [p for p in re.split(r"::", item) if p and p != "{"][:1], item))
        for m in PATH.finditer(text):
            parts = [p for p in m.group(2).split("::") if p]
            refs.append((m.group(1), parts, parts[-1]))
        for root, parts, name in refs:
            target = resolve(modules, mod, root, list(parts))
            if target is None or target == mod:
                continue
            edges.setdefault(mod, {}).setdefault(target, set()).add(name)
    return files, edges


def cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {t for ts in edges.values() for t in ts}

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
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

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main(argv):
    root = Path(__file__).resolve().parents[1]
    srcs = [Path(a) for a in argv] or sorted(root.glob("crates/*/src"))
    found = 0
    for src in srcs:
        files, edges = crate_graph(src)
        for comp in cycles(edges):
            found += 1
            name = lambda m: "::".join(m) or "(crate root)"
            print(f"{src}: modules in a circle: {', '.join(name(m) for m in comp)}")
            for a in comp:
                for b in comp:
                    if b in edges.get(a, {}):
                        print(f"  {name(a)} -> {name(b)}: {', '.join(sorted(edges[a][b]))}")
    if found:
        print(f"{found} circle(s) of imports; break each by moving the items that tie it")
        return 1
    print(f"no import circles in {len(srcs)} crate(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
