"""What every recorded probe's JSON starts with: when, from which commit (marked -dirty when the
tree had changes), and the command that made it."""

import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def envelope(**fields) -> dict:
    dirty = "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD") + dirty,
        "command": " ".join(sys.argv),
        **fields,
    }
