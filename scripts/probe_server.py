"""The server a probe script starts and talks to: the flags every such script takes (the binary,
the served model's name, its length limit, server flags after `--`) and the start itself, with the
e2e suite's `Server` (the demo model unless the flags name another)."""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--bin", required=True, help="the mla-serve binary to start")
    ap.add_argument("--model-name", default="demo", help="the served model name the requests use")
    ap.add_argument("--max-model-len", default="4096")
    ap.add_argument("flags", nargs="*", help="extra server flags, after --")


def start_server(args: argparse.Namespace):
    """A running `Server` for `args` (from `add_server_args`); the caller stops it."""
    os.environ["MLA_SERVE_BIN"] = str(Path(args.bin).resolve())
    sys.path.insert(0, str(ROOT / "tests" / "e2e"))
    from server import Server  # noqa: E402  (reads MLA_SERVE_BIN)

    return Server("--max-model-len", args.max_model_len, *args.flags)
