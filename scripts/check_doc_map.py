#!/usr/bin/env python3
"""Fails when a map of the code names something the code no longer has.

    python3 scripts/check_doc_map.py [DOC.md ...]      (default: docs/architecture.md)

Every `code span` of the document is checked:
- a path (it has a `/` or ends in a known extension) must exist, relative to the repository
  root, to `crates/`, or, for a bare file name, somewhere in the tree; `{a,b}` groups are
  expanded, and a trailing `/` names a folder;
- a Rust path or name (`Scheduler::schedule`, `StepLimits`, `run_eager`, `mla_core::step`) must
  be in the sources: each `::`-separated part that looks like a name (CamelCase, or snake_case
  with an underscore) must occur in crates/ or kernels/ as a word, or be a module file (a
  renamed or removed item no longer occurs anywhere; an item of a dependency occurs where it is
  used);
- anything else (flags like `--tp`, values like `0.9`, HTTP paths, prose in backticks) is
  skipped.
Prints each stale name with its line, and exits 1 if there is any.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTS = (".rs", ".md", ".cu", ".cuh", ".py", ".sh", ".json", ".toml", ".png", ".yml", ".yaml", ".txt")
SPAN = re.compile(r"`([^`\n]+)`")


def definitions() -> set:
    names = set()
    for path in list(ROOT.glob("crates/**/*.rs")) + list(ROOT.glob("kernels/*.cu*")):
        if "/target/" in str(path):
            continue
        names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", path.read_text(errors="replace")))
        names.add(path.stem)
        if path.stem == "mod":
            names.add(path.parent.name)
    for crate in ROOT.glob("crates/*"):
        names.add(crate.name.replace("-", "_"))
    return names


def expand(path: str) -> list:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    out = []
    for alt in m.group(1).split(","):
        out += expand(path[: m.start()] + alt.strip() + path[m.end():])
    return out


def path_exists(p: str) -> bool:
    """Relative to the root, to crates/, to a crate or its src/ (`routes/chat.rs`), or anywhere
    for a bare name; `*` globs."""
    p = p.strip().rstrip(".,;:").rstrip("/")
    for base in ("", "crates/", "crates/*/", "crates/*/src/", "**/"):
        if any(not str(m).count("/target/") for m in ROOT.glob(base + p)):
            return True
    return False


def looks_like_path(span: str) -> bool:
    # Flags, URLs, HTTP paths (`/metrics`), markup (`</think>`), placeholders (`runs/<date>.md`),
    # environment and home paths, and bare extensions are no files of the repository.
    if " " in span or span.startswith(("-", "/", "<", ".", "$", "~")) or "://" in span:
        return False
    if any(c in span for c in "<>$=~"):
        return False
    # A segment in capitals is a placeholder (`benches/results/DATE/RUN-COMMIT/`, `CUDA_HOME/bin`).
    if any(re.fullmatch(r"[A-Z][A-Z0-9_-]+", seg) for seg in span.split("/")):
        return False
    return "/" in span or span.endswith(EXTS)


def rust_parts(span: str) -> list:
    """The parts of a Rust path that look like items, or [] when the span is no Rust name."""
    span = re.sub(r"\(.*\)$", "", span)  # `foo()`, `step(plan)`
    span = re.sub(r"<.*>$", "", span)  # `Arc<StepPlan>`
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*", span):
        return []
    parts = span.split("::")
    wanted = [p for p in parts if re.fullmatch(r"[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+|[A-Z][a-z]+[A-Z]\w*", p)
              or re.fullmatch(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+", p)]
    if "::" in span:
        wanted = [p for p in parts if p not in ("crate", "self", "super", "std")]
    return wanted


def check(doc: Path, names: set) -> list:
    return check_text(str(doc.relative_to(ROOT)), doc.read_text(), names)


def check_text(label: str, text: str, names: set) -> list:
    stale = []
    for n, line in enumerate(text.splitlines(), 1):
        for span in SPAN.findall(line):
            if looks_like_path(span):
                # `routes/chat.rs::handle`: the file, then the item in it.
                path, _, item = span.partition(".rs::")
                path = path + ".rs" if item else span
                for p in expand(path):
                    if not path_exists(p):
                        stale.append(f"{label}:{n}: no such path: {p}")
                if item and item not in names:
                    stale.append(f"{label}:{n}: no such item: {item} (in `{span}`)")
                continue
            for part in rust_parts(span):
                if part not in names:
                    stale.append(f"{label}:{n}: no such item: {part} (in `{span}`)")
    return stale


def self_test(names: set) -> None:
    """The check must be able to fail: a renamed file, a removed item and a stale item after a
    file are caught, while flags, placeholders and existing names pass."""
    planted = "`crates/mla-core/src/plan.rs` `Scheduler::no_such_fn` `step/plan.rs::NoSuchItem`"
    fine = "`crates/mla-core/src/step/plan.rs` `StepPlan::validate` `--tp` `benches/results/DATE/` `/metrics`"
    assert len(check_text("planted", planted, names)) == 3, check_text("planted", planted, names)
    assert check_text("fine", fine, names) == [], check_text("fine", fine, names)


def main(argv):
    docs = [Path(a).resolve() for a in argv] or [ROOT / "docs" / "architecture.md"]
    names = definitions()
    self_test(names)
    stale = [s for d in docs for s in check(d, names)]
    for s in stale:
        print(s)
    if stale:
        print(f"{len(stale)} name(s) in the map that the code does not have")
        return 1
    print(f"every path and item named in {', '.join(str(d.relative_to(ROOT)) for d in docs)} exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
