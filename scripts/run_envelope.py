"""What every recorded probe's JSON starts with: when, from which commit (marked -dirty when the
tree had changes), and the command that made it."""

import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    """`git args` in the repository, or "unknown" where git or the repository is missing."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def envelope(**fields) -> dict:
    dirty = "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "--short", "HEAD") + dirty,
        "command": " ".join(sys.argv),
        **fields,
    }
