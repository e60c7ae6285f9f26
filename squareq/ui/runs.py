"""What the page shows of a run, read from the files the trainer writes (train/run_record.py's run.json, config.toml
and train.log; metrics.jsonl, validation.jsonl, samples/, checkpoints/, the LoRA files), so that a run started from a
terminal shows up as one started from the page does, and nothing is lost when the server restarts."""
from __future__ import annotations

import functools
import json
import os
import re
import socket
import tomllib
from pathlib import Path

from ..train.checkpoint import CHECKPOINTS_DIR, latest_checkpoint
from ..train.run_record import CONFIG_FILE, LOG_FILE, RUN_FILE, read_run_record
from ..train.sinks import METRICS_FILE
from ..train.validation import VALIDATION_FILE

SAMPLE = re.compile(r"step-(\d{8})-(\d+)\.(png|webp|gif|jpg)$")
LOG_LINES = 80
ETA_STEPS = 20  # the recent steps whose mean time gives the ETA


def pid_alive(pid: int | None, since: float | None = None) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie that no one has reaped yet does not) and, with
    ``since`` (when a record of it was written), is the process that wrote it: one started later is another process
    that was given the same number, and must not be sent a Stop."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = _boot_time()
    except (OSError, IndexError, ValueError, StopIteration):
        return True  # no /proc: kill's answer stands
    started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return fields[0] != "Z" and (since is None or started <= since + 2)  # btime is in whole seconds


@functools.cache
def _boot_time() -> float:
    """When this machine booted (``btime``, whole seconds): read once, as it holds until the next boot."""
    return next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))


def running_here(record: dict | None) -> bool:
    """Whether a run record says running, on this machine, and the process that wrote it still runs."""
    return bool(record) and record["status"] == "running" and record.get("host") == socket.gethostname() and \
        pid_alive(record.get("pid"), record.get("started"))


def is_run(folder: Path) -> bool:
    """A folder a training run wrote to: its record, its metrics or its checkpoints."""
    return any((folder / name).exists() for name in (RUN_FILE, METRICS_FILE, CHECKPOINTS_DIR))


def run_folders(runs: Path) -> list[Path]:
    """The run folders directly in ``runs`` (hidden ones and links that lead elsewhere left out), by name."""
    base = runs.resolve()
    found = []
    for entry in sorted(runs.iterdir()) if runs.is_dir() else []:
        if entry.name.startswith(".") or not entry.is_dir() or not entry.resolve().is_relative_to(base):
            continue
        if is_run(entry):
            found.append(entry)
    return found


def tail_lines(path: Path, count: int, block: int = 1 << 16) -> list[str]:
    """The last ``count`` lines of ``path`` (read from the end: a log or metrics file may be long)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            data = b""
            while end > 0 and data.count(b"\n") <= count:
                start = max(0, end - block)
                f.seek(start)
                data = f.read(end - start) + data
                end = start
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-count:]


def _rows(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written now, or one a killed run cut short
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def status(folder: Path, record: dict | None) -> tuple[str, str | None]:
    """running, finished, stopped or failed, and what the record says about it. A record of a process that is gone
    without saying how it ended is a run that was killed; a folder without a record (an older SquareQ's) is judged by
    its files."""
    if record is None:
        if any(folder.glob("*.safetensors")):
            return "finished", None
        return ("stopped", None) if latest_checkpoint(folder) else ("failed", None)
    if record["status"] != "running":
        return record["status"], record.get("message")
    if record.get("host") != socket.gethostname():
        return "running", f"on {record.get('host')}"
    if running_here(record):
        return "running", None
    return "failed", "the process ended without saying how (killed?); Resume continues from the last checkpoint"


def eta_seconds(rows: list[dict], record: dict | None, step: int) -> float | None:
    """Seconds left at the mean time of the recent steps (the first step of a session, which compiles and
    allocates, and torch.compile's seconds left out)."""
    if not record or not record.get("total"):
        return None
    first = record.get("first_step") or 0
    times = [r.get("seconds", 0) - r.get("compile_s", 0) for r in rows if r["step"] > first + 1][-ETA_STEPS:]
    if not times:
        return None
    return max(0, record["total"] - step) * sum(times) / len(times)


def config_text(folder: Path) -> str | None:
    try:
        return (folder / CONFIG_FILE).read_text()
    except OSError:
        return None


def summary(folder: Path) -> dict:
    """One row of the runs list."""
    record = read_run_record(folder)
    rows = _rows(tail_lines(folder / METRICS_FILE, ETA_STEPS + 2))
    step = rows[-1]["step"] if rows else 0
    state, message = status(folder, record)
    last = latest_checkpoint(folder)
    return {"name": folder.name, "status": state, "message": message, "step": step,
            "total": (record or {}).get("total"), "eta_s": eta_seconds(rows, record, step) if state == "running"
            else None, "started": (record or {}).get("started"), "ended": (record or {}).get("ended"),
            "pid": (record or {}).get("pid"), "config": config_text(folder), "checkpoint": last.name if last else None,
            "resumable": (folder / CONFIG_FILE).is_file() and state in ("stopped", "failed")}


def _jsonl(path: Path) -> list[dict]:
    try:
        return _rows(path.read_text().splitlines())
    except OSError:
        return []


def metrics(folder: Path, since: int = 0) -> dict:
    """metrics.jsonl's rows after step ``since``, and how many rows it holds (a resumed run rewrites the file
    without the steps it redoes: a page whose count disagrees reads it again from the start)."""
    rows = _jsonl(folder / METRICS_FILE)
    return {"rows": [r for r in rows if r["step"] > since], "count": len(rows)}


def _prompts(config: str | None) -> list[str]:
    try:
        prompts = tomllib.loads(config or "").get("sample_prompts", [])
    except tomllib.TOMLDecodeError:
        return []
    return [str(p) for p in prompts] if isinstance(prompts, list) else []


def samples(folder: Path, name: str) -> list[dict]:
    """Each sample image by step and prompt, the grids left out (the page lays out its own)."""
    found = []
    for path in (folder / "samples").iterdir() if (folder / "samples").is_dir() else []:
        match = SAMPLE.match(path.name)
        if match:
            found.append({"step": int(match[1]), "prompt": int(match[2]), "url": f"/files/{name}/samples/{path.name}"})
    return sorted(found, key=lambda s: (s["step"], s["prompt"]))


def files(folder: Path, name: str) -> list[dict]:
    """Links to the LoRA files, each checkpoint's LoRA, loss.png and the run's own records."""
    links = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors" and path.is_file():
            links.append({"kind": "LoRA", "name": path.name, "url": f"/files/{name}/{path.name}"})
        elif path.name.endswith("_peft") and (path / "adapter_model.safetensors").is_file():
            links.append({"kind": "LoRA (PEFT)", "name": f"{path.name}/adapter_model.safetensors",
                          "url": f"/files/{name}/{path.name}/adapter_model.safetensors"})
    checkpoints = folder / "checkpoints"
    for path in sorted(checkpoints.glob("step-*")) if checkpoints.is_dir() else []:
        if (path / "lora.safetensors").is_file():
            links.append({"kind": "checkpoint", "name": path.name,
                          "url": f"/files/{name}/checkpoints/{path.name}/lora.safetensors"})
    for extra in ("loss.png", CONFIG_FILE, LOG_FILE, METRICS_FILE):
        if (folder / extra).is_file():
            links.append({"kind": "file", "name": extra, "url": f"/files/{name}/{extra}"})
    return links


def detail(folder: Path) -> dict:
    """Everything the run's page shows but its per-step figures (:func:`metrics`)."""
    row = summary(folder)
    return {**row, "validation": _jsonl(folder / VALIDATION_FILE), "samples": samples(folder, folder.name),
            "prompts": _prompts(row["config"]), "files": files(folder, folder.name),
            "log": tail_lines(folder / LOG_FILE, LOG_LINES)}
