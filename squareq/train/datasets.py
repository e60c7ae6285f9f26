"""Several datasets in one run: the ``[[datasets]]`` tables of kohya's and musubi-tuner's dataset configs, with
``[general]`` defaults and kohya's ``[[datasets.subsets]]``, in the ``--config`` file or in a file of their own
(``dataset_config``, kohya's and musubi's ``--dataset_config``).

Each table gives its own folder, resolution, batch size, repeats, caption extension and frame keys (the
``DATASET_KEYS``, under SquareQ's names or kohya's and musubi's). A key a table does not give comes from ``[general]``,
then from the run's own keys. A key SquareQ does not take is refused by name. The run trains each table as a group of
its own: its images at its resolutions, in batches of its size, a batch never mixing groups (train/data.py).
"""
from __future__ import annotations

import difflib
import math
import tomllib
from pathlib import Path
from typing import Any

from .config_file import ConfigError, shown
from .controls import ALIASES as CONTROL_ALIASES
from .controls import unsupported_key

# a dataset's own keys (train/config.py's names); the rest of a run's keys are the run's
DATASET_KEYS = ("data", "resolution", "batch_size", "num_repeats", "caption_ext", "target_frames",
                "frame_extraction", "frame_stride", "frame_sample", "max_frames", "source_fps", "control_dir",
                "control_resolution", "no_resize_control")
# kohya's, musubi-tuner's and ai-toolkit's names for them
ALIASES = {"image_directory": "data", "video_directory": "data", "image_dir": "data",
           "caption_extension": "caption_ext", **CONTROL_ALIASES}
# keys of theirs that name one thing for the whole run: taken where every table agrees (``run_keys``)
RUN_KEYS = {"cache_directory": "cache_dir", "bucket_no_upscale": "no_upscale"}
# what SquareQ always does: accepted where they ask for it
ALWAYS = {"enable_bucket": True}
HOW = "each [[datasets]] table takes " + ", ".join(DATASET_KEYS) + \
    " (or image_directory, video_directory, caption_extension, control_directory, control_path), cache_directory " \
    "and bucket_no_upscale"


def dataset_tables(data: dict[str, Any], where: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The ``[[datasets]]`` tables of a TOML document ``data`` (``[general]`` and subsets merged in), under SquareQ's
    key names, and the run-wide keys they set (``cache_dir``, ``no_upscale``); ([], {}) where it has none."""
    general = data.get("general", {})
    tables = data.get("datasets", [])
    if not isinstance(general, dict):
        raise ConfigError(f"{where}: general = {shown(general)} is not a table; write it as a [general] header.")
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{where}: datasets = {shown(tables)} is not a list of tables; write each as a "
                          "[[datasets]] header with its keys below it.")
    if general and not tables:
        raise ConfigError(f"{where}: [general] gives defaults for [[datasets]] tables, and there are none; add "
                          "[[datasets]] tables or move the keys into [train].")
    flat = []
    for n, table in enumerate(tables, 1):
        subsets = table.get("subsets")
        if subsets is None:
            flat.append((f"[[datasets]] table {n}", {**general, **table}))
            continue
        if not isinstance(subsets, list) or not subsets or not all(isinstance(s, dict) for s in subsets):
            raise ConfigError(f"{where}: [[datasets]] table {n}: subsets = {shown(subsets)} is not a list of "
                              "tables; write each as a [[datasets.subsets]] header.")
        outer = {k: v for k, v in table.items() if k != "subsets"}
        flat += [(f"[[datasets]] table {n}, subset {m}", {**general, **outer, **subset})
                 for m, subset in enumerate(subsets, 1)]
    named = [(name, _named(table, f"{where}: {name}")) for name, table in flat]
    run = run_keys(named, where)
    return [table for _, table in named], run


def _named(table: dict[str, Any], where: str) -> dict[str, Any]:
    """``table`` under SquareQ's key names; refused by name: keys it has no counterpart for."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if key in ALWAYS:
            if value != ALWAYS[key]:
                raise ConfigError(f"{where}: {key} = {shown(value)}: SquareQ always buckets by aspect ratio; remove "
                                  "the key.")
            continue
        if key in RUN_KEYS:
            out[RUN_KEYS[key]] = value
            continue
        name = ALIASES.get(key, key)
        if unsupported_key(key):
            raise ConfigError(f"{where}: {unsupported_key(key)}")
        if name not in DATASET_KEYS:
            close = difflib.get_close_matches(key, [*DATASET_KEYS, *ALIASES, *RUN_KEYS], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key}{hint}; {HOW}.")
        if name in out:
            raise ConfigError(f"{where}: {key} gives {name} a second time; keep one of the two keys.")
        out[name] = _resolution(value, where) if name == "resolution" else value
    if "data" not in out:
        raise ConfigError(f"{where} names no folder; give it as image_directory (or video_directory, image_dir, "
                          "data).")
    return out


def _resolution(value: Any, where: str) -> Any:
    """kohya's and musubi's resolution: one side, or ``[width, height]``, one bucket area (not two sizes, as in
    [train]); as the side of a square of that area, rounded to a multiple of 16."""
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                           for v in value):
        return [max(64, round(math.sqrt(value[0] * value[1]) / 16) * 16)]
    if isinstance(value, list) and len(value) == 1:  # one side, as --print-config writes it
        return value
    if isinstance(value, list):
        raise ConfigError(f"{where}: resolution = {shown(value)}: a [[datasets]] table's resolution is one side or "
                          "[width, height] (one bucket area, as in kohya and musubi-tuner); for several sizes give "
                          "the folder a table for each.")
    return value


def run_keys(named: list[tuple[str, dict[str, Any]]], where: str) -> dict[str, Any]:
    """The run-wide keys the tables set (popped from them); refused where two tables disagree."""
    found: dict[str, tuple[str, Any]] = {}
    for name, table in named:
        for key in RUN_KEYS.values():
            if key not in table:
                continue
            value = table.pop(key)
            if key in found and found[key][1] != value:
                raise ConfigError(f"{where}: {name} sets {key} = {shown(value)} and {found[key][0]} "
                                  f"{shown(found[key][1])}; SquareQ keeps one for the run: give the same, or one in "
                                  "[general].")
            found.setdefault(key, (name, value))
    return {key: value for key, (_, value) in found.items()}


def read_dataset_file(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``dataset_config``'s tables (:func:`dataset_tables`); a file with none, or with other tables, is refused."""
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ConfigError(f"dataset_config: {path} does not exist; pass an existing TOML file of [[datasets]] "
                          "tables.") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"dataset_config: {path} is not readable TOML ({exc}); fix the file.") from None
    other = sorted(set(data) - {"general", "datasets"})
    if other:
        raise ConfigError(f"dataset_config: {path} holds {', '.join(other)} beside [general] and [[datasets]]; a "
                          "dataset config holds those two only: move the training keys into --config.")
    tables, run = dataset_tables(data, f"dataset_config {path}")
    if not tables:
        raise ConfigError(f"dataset_config: {path} has no [[datasets]] table; add one per folder.")
    return tables, run
