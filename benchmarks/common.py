"""What the benchmark scripts share: one JSON line per measurement (kept for the final table and the --out file),
progress on stderr, and the commit measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS: list[dict] = []


def emit(rec: dict) -> dict:
    """Print ``rec`` as one JSON line and keep it."""
    RECORDS.append(rec)
    print(json.dumps(rec, sort_keys=True), flush=True)
    return rec


def write_records(out, name: str) -> None:
    """With ``--out DIR``: every kept line to ``DIR/name`` (nothing without it)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in RECORDS))


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def git_commit() -> str:
    """``SQUAREQ_COMMIT`` when set (the device receives a working tree whose git history is stale), else the
    checkout's short commit."""
    if os.environ.get("SQUAREQ_COMMIT"):
        return os.environ["SQUAREQ_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
