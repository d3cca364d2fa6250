#!/usr/bin/env python3
"""Writes the workspace's dependency recipe into DIR: Cargo.toml, Cargo.lock, every member's
Cargo.toml, and an empty stand-in for every library, binary and build script, and for the tests,
benches and examples a manifest names (found ones are left out: adding a test file must not
invalidate the dependency layer).

The Dockerfile compiles the dependencies against this recipe in a layer of their own. A layer's
cache key is the content of what was copied into it, and the recipe changes only when a manifest
or Cargo.lock does, so a source edit rebuilds the workspace crates and not the ~200 dependencies.
The same idea as cargo-chef, in a page and without a tool to install.

    python3 docker/recipe.py DIR      (run at the workspace root; needs cargo, no network)
"""

import json
import os
import subprocess
import sys


def main() -> None:
    out = sys.argv[1]
    root = os.getcwd()
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--no-deps", "--offline", "--format-version", "1"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    files = {"Cargo.toml": None, "Cargo.lock": None}
    for package in meta["packages"]:
        manifest = package["manifest_path"]
        files[os.path.relpath(manifest, root)] = None
        with open(manifest) as f:
            manifest_text = f.read()
        for target in package["targets"]:
            kinds = set(target["kind"])
            own_path = os.path.relpath(target["src_path"], os.path.dirname(manifest))
            if kinds <= {"test", "bench", "example"} and own_path not in manifest_text:
                continue
            # A library may be empty; everything else that links needs a main.
            stub = "" if kinds & {"lib", "rlib", "proc-macro"} else "fn main() {}\n"
            files[os.path.relpath(target["src_path"], root)] = stub
    for rel, stub in sorted(files.items()):
        dest = os.path.join(out, rel)
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        if stub is None:
            with open(rel, "rb") as src, open(dest, "wb") as dst:
                dst.write(src.read())
        else:
            with open(dest, "w") as dst:
                dst.write(stub)


if __name__ == "__main__":
    main()
