"""Starting and resuming runs from the page. A start takes an example config (a clone's examples/) or an uploaded
TOML, with the dataset folder (under a dataset root) and the output folder's name (in the runs folder) chosen on the
page; the configuration is read by ``squareq train``'s own loader (train/config.py's ``load_config``), with the same
flags the job will pass, so a file ``squareq train --config`` refuses is refused here in the same words and no job is
queued. Beyond that, the page writes only inside the runs folder and reads data only inside the roots it was given."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..slab.atomic import atomic_write_bytes
from ..train.config import load_config
from ..train.run_record import CONFIG_FILE, read_run_record
from .paths import Roots, UiError, within
from .queue import Queue, new_id
from .runs import status

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"  # a clone's examples/ (a wheel has none)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
MAX_CONFIG_BYTES = 256 * 1024
MAX_FOLDERS = 300
WRITTEN_KEYS = ("output", "cache_dir")  # must be inside the runs folder
READ_KEYS = ("data", "validation_data", "reg_data", "mask_dir", "control_dir")  # inside a dataset root (or the runs)


def examples() -> list[str]:
    """The example configurations' file names."""
    return sorted(p.name for p in EXAMPLES.glob("*.toml")) if EXAMPLES.is_dir() else []


def data_folders(root: Path, runs: Path, depth: int = 2) -> list[str]:
    """The folders under ``root`` (``.`` first, then up to ``depth`` levels, hidden ones and the runs folder left
    out) the page offers as dataset folders."""
    found, level = ["."], [root]
    for _ in range(depth):
        below = []
        for folder in level:
            try:
                entries = sorted(folder.iterdir())
            except OSError:
                continue
            for entry in entries:
                if entry.name.startswith(".") or not entry.is_dir() or entry.resolve() == runs.resolve():
                    continue
                below.append(entry)
                found.append(entry.relative_to(root).as_posix())
                if len(found) >= MAX_FOLDERS:
                    return found
        level = below
    return found


def start_options(roots: Roots) -> dict:
    """What the start form offers."""
    return {"examples": examples(),
            "data_roots": [{"index": i, "path": str(root), "folders": data_folders(root, roots.runs)}
                           for i, root in enumerate(roots.data)]}


def _config(roots: Roots, job_id: str, body: dict) -> tuple[Path, str]:
    """The job's copy of the chosen configuration, and the name the page knows it by."""
    example, text = body.get("example"), body.get("config_text")
    if example:
        if example not in examples():
            raise UiError(f"{example!r} is not one of the example configs; pick one from the list.")
        name, text = example, (EXAMPLES / example).read_text()
    elif isinstance(text, str):
        name = Path(str(body.get("config_name") or "uploaded.toml")).name
        if len(text.encode()) > MAX_CONFIG_BYTES:
            raise UiError(f"{name} is over {MAX_CONFIG_BYTES // 1024} KB; a training config is a few lines.")
    else:
        raise UiError("no config was given; pick an example config or upload a TOML file.")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    path = roots.state / "jobs" / job_id / (safe if safe.endswith(".toml") else safe + ".toml")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())
    return path, name


def _check_paths(cfg, roots: Roots) -> None:
    """Written folders inside the runs folder, data folders inside a dataset root (or the runs folder)."""
    for key in WRITTEN_KEYS:
        value = getattr(cfg, key)
        if value and not within(value, [roots.runs]):
            raise UiError(f"{key} = {value!r} is outside the runs folder {roots.runs}; the page writes only there, so "
                          f"remove {key} from the config or point it inside.")
    tables = [vars(cfg)] + list(cfg.datasets or [])
    for table in tables:
        for key in READ_KEYS:
            values = table.get(key)
            for value in [values] if isinstance(values, str) else values or []:
                if value and not within(value, [*roots.data, roots.runs]):
                    raise UiError(f"{key} = {value!r} is outside the dataset roots ({', '.join(map(str, roots.data))})"
                                  "; start squareq ui with --data-root naming its folder, or move the data.")


def start(roots: Roots, queue: Queue, body: dict) -> dict:
    """Check the page's start request as ``squareq train`` would, then queue it; the job."""
    name = str(body.get("output") or "")
    if not NAME.fullmatch(name):
        raise UiError(f"the output name {name!r} must be one folder name of letters, digits, '.', '_' or '-'; it is "
                      "made in the runs folder.")
    out = roots.run(name)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UiError(f"{out} already exists; choose another output name, or Resume that run.")
    data = roots.data_folder(int(body.get("data_root") or 0), str(body.get("data") or "."))
    slab = str(body.get("slab") or "").strip() or None
    job_id = new_id()
    path, shown = _config(roots, job_id, body)
    try:
        try:
            cfg = load_config(path, {"slab": slab, "data": str(data), "output": str(out)})
        except ValueError as exc:  # ConfigError and the value errors it wraps: the sentence squareq train prints
            raise UiError(str(exc).replace(str(path), shown)) from None
        if not cfg.slab:
            raise UiError(f"{shown} names no slab; give the slab's path on the page.")
        if not Path(cfg.slab).expanduser().is_dir():
            raise UiError(f"the slab {cfg.slab} does not exist (relative paths start at {os.getcwd()}); compile it "
                          "first (squareq compile), or give its path on the page.")
        _check_paths(cfg, roots)
        argv = ([slab] if slab else []) + ["--config", str(path), "--data", str(data), "-o", str(out)]
        return queue.add(name, "start", argv, os.getcwd(), job_id)
    except BaseException:
        for leftover in path.parent.iterdir():
            leftover.unlink()
        path.parent.rmdir()
        raise


def resume(roots: Roots, queue: Queue, name: str) -> dict:
    """Queue ``--resume latest`` for the run folder ``name``, with the configuration it recorded, in the folder it
    was started from (its relative paths mean what they meant then). A run stopped before its first checkpoint
    starts over, on the cache it filled."""
    folder = roots.run(name)
    record = read_run_record(folder) if folder.is_dir() else None
    state = status(folder, record)[0] if folder.is_dir() else "missing"
    if state not in ("stopped", "failed"):
        raise UiError(f"{name} is {state}; only a stopped or failed run resumes.")
    if not (folder / CONFIG_FILE).is_file():
        raise UiError(f"{name} has no {CONFIG_FILE} (a run of an older SquareQ) to resume with; resume it with "
                      "squareq train --resume latest and its own flags.")
    cwd = (record or {}).get("cwd") or os.getcwd()
    argv = ["--config", str(folder / CONFIG_FILE), "-o", str(folder), "--resume", "latest"]
    return queue.add(name, "resume", argv, cwd)
