"""What a run says about itself in its output folder, so that anything reading the folder (``squareq ui``, a script,
a person) knows how the run stands without asking the process: ``run.json`` (its status: running, finished, stopped
or failed, with the process id, host, working folder, start and end, the step total and, when it failed, why),
``config.toml`` (the resolved configuration, as ``--print-config`` writes it, which ``--config`` reads back) and
``train.log`` (every line the run said, appended). ``run.json`` and ``config.toml`` are written atomically; the log is
appended line by line, as metrics.jsonl is."""
from __future__ import annotations

import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from ..slab.atomic import atomic_write_bytes
from .config import TrainConfig
from .errors import TrainInterrupted

RUN_FILE = "run.json"
CONFIG_FILE = "config.toml"
LOG_FILE = "train.log"
RECORD_FILES = (RUN_FILE, CONFIG_FILE, LOG_FILE)
STATUSES = ("running", "finished", "stopped", "failed")


class RunRecord:
    """The record of one run in ``out`` (rank 0's): written as running when made, updated as the run learns its
    total, and closed with how it ended (:func:`recorded`)."""

    def __init__(self, out: Path, cfg: TrainConfig) -> None:
        self.out = out
        atomic_write_bytes(out / CONFIG_FILE, cfg.to_toml().encode())
        self.state = {"status": "running", "pid": os.getpid(), "host": socket.gethostname(), "cwd": os.getcwd(),
                      "started": time.time(), "ended": None, "total": None, "first_step": None, "message": None,
                      "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        self.log = open(out / LOG_FILE, "a", encoding="utf-8")
        self.log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: run started (process {os.getpid()})\n")
        self.log.flush()
        self.update()

    def update(self, **fields) -> None:
        """``fields`` (``total``, ``first_step``, ...) into run.json, written whole under a temporary name."""
        self.state.update(fields)
        atomic_write_bytes(self.out / RUN_FILE, (json.dumps(self.state, indent=1) + "\n").encode())

    def tee(self, echo):
        """``echo`` that also appends each line to train.log."""
        def both(line: str) -> None:
            if not self.log.closed:
                self.log.write(f"{line}\n")
                self.log.flush()
            echo(line)
        return both

    def close(self, error: BaseException | None) -> None:
        """How the run ended: finished, stopped (Ctrl-C) or failed (with the error's sentence). A run that failed
        before writing anything else leaves no record either, so a command that made the folder can remove it."""
        if error is None:
            status, message = "finished", None
        elif isinstance(error, (TrainInterrupted, KeyboardInterrupt)):
            status, message = "stopped", str(error) or "Ctrl-C: stopped at once"
        else:
            status, message = "failed", str(error) or type(error).__name__
        self.log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {status}{': ' + message if message else ''}\n")
        self.log.close()
        if status == "failed" and all(p.name in RECORD_FILES for p in self.out.iterdir()):
            for name in RECORD_FILES:
                (self.out / name).unlink(missing_ok=True)
            return
        self.update(status=status, message=message, ended=time.time())


@contextmanager
def recorded(out: Path, cfg: TrainConfig, main: bool, echo):
    """The run's record around the ``with`` block (rank 0 alone writes one); yields the record (None on the other
    ranks) and the ``echo`` to use, which also writes train.log."""
    if not main:
        yield None, echo
        return
    record = RunRecord(out, cfg)
    try:
        yield record, record.tee(echo)
    except BaseException as exc:
        record.close(exc)
        raise
    record.close(None)


def read_run_record(folder: Path) -> dict | None:
    """``folder``'s run.json as written, or None where there is none or it cannot be read (a run of an older
    SquareQ; a file that is not this record)."""
    try:
        state = json.loads((Path(folder) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("status") in STATUSES else None
