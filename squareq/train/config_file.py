"""A `squareq train` configuration as text: reading a ``--config`` TOML file (its ``[train]`` table, kohya's key names
translated), turning file and flag values into each key's type, and writing the TOML ``--print-config`` prints; and
:class:`ConfigError`, which every configuration problem raises.
"""
from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .kohya_keys import KohyaKeyError
from .kohya_keys import translate as translate_kohya_keys
from .prompt_options import PromptError, read_prompt_file


class ConfigError(ValueError):
    """A configuration value cannot be used; the message names the file or flag."""


def read_table(path: str | Path, known: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training keys (``known``) of the TOML file ``path`` (its ``[train]`` table, or its top level without one),
    kohya's names translated, and its ``datasets`` and ``general`` as written (for train/datasets.py); anything else
    in the file is refused, since ignoring it would train with a setting unmade."""

    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; pass an existing TOML file to --config.") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid TOML ({exc}); fix the file.") from None
    except RecursionError:
        raise ConfigError(f"{path} is not valid TOML (its arrays or tables nest too deeply to read); fix the "
                          "file.") from None
    parts = {k: data[k] for k in ("datasets", "general") if k in data}  # [[datasets]] tables: train/datasets.py
    data = {k: v for k, v in data.items() if k not in parts}
    table = data.get("train", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: train = {shown(table)} is not a table; put the training keys under a [train] "
                          "header, or at the top level without one.")
    outside = sorted(set(data) - {"train"}) if table is not data else []
    if outside:
        them = "it" if len(outside) == 1 else "them"
        raise ConfigError(f"{path}: {_names(data, outside)} outside the [train] table would be ignored; move {them} "
                          f"into [train] or remove {them}.")
    try:
        table = translate_kohya_keys(table, str(path), known)
    except KohyaKeyError as exc:
        raise ConfigError(str(exc)) from None
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key{'s' if len(unknown) > 1 else ''} {_names(table, unknown, known)}; "
                          "`squareq train --print-config` lists every key.")
    return table, parts


def _names(table: dict[str, Any], keys: list[str], known: set[str] | None = None) -> str:
    """``keys`` of ``table`` for a message: a table as ``[name]``, with the closest of the ``known`` keys if given."""
    named = []
    for key in keys:
        close = difflib.get_close_matches(key, known, n=1) if known else []
        named.append((f"[{key}]" if isinstance(table[key], dict) else key)
                     + (f" (did you mean {close[0]}?)" if close else ""))
    return ", ".join(named)


def coerce(name: str, value: Any, kind: str, where: str) -> Any:
    """A value of key ``name`` from TOML or a flag (``where`` names which) in the key's type ``kind``, the field's
    annotation as text (ints stay ints, a float field accepts an int)."""
    if value is None:
        return None
    if name == "cuda_graphs":
        value = graphs_word(value)
    try:
        if kind == "int | str":  # a count or a word (prefetch: "auto")
            if isinstance(value, (bool, dict, list)) or isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value) if isinstance(value, (int, float)) or str(value).strip().isdigit() else str(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            raise ValueError
        if "list[int]" in kind:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()) for v in values):
                raise ValueError
            return [int(v) for v in values]
        if name == "sample_prompts" and isinstance(value, str):  # kohya's prompt file, or one prompt (commas and all)
            path = Path(value).expanduser()
            if path.suffix != ".txt" or not path.is_file():
                return [value]
            try:
                return read_prompt_file(path)
            except PromptError as exc:
                raise ConfigError(f"{where}: sample_prompts: {exc}") from None
        if "list" in kind:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError  # a table or a number is no list of names, and iterating it would make one up
            return list(value)
        if "float" in kind and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # a TOML integer of 400 digits: infinite, which the range checks name
                return math.inf if value > 0 else -math.inf
        if "int" in kind and not isinstance(value, bool):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if "str" in kind and not isinstance(value, (bool, dict, list)):
            return str(value)
    except (TypeError, ValueError):
        pass
    words = _KIND_WORDS[kind.replace(" | None", "")]
    raise ConfigError(f"{where}: {name} = {shown(value)} must be {words}.") from None


_KIND_WORDS = {"int": "a whole number, e.g. 8", "float": "a number, e.g. 0.5", "bool": "a bool, true or false",
               "str": 'text in quotes, e.g. "sks"', "int | str": "auto or a whole number, e.g. 3",
               "list[str]": 'a list of text, e.g. ["to_q", "to_k"]',
               "list[int]": "a whole number or a list of them, e.g. [512, 1024]"}


def shown(value: Any) -> str:
    """``value`` as an error message quotes it: its repr (a bool as TOML writes it), cut short where it would fill
    the line."""
    text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
    return text if len(text) <= 80 else text[:60] + "…"


def graphs_word(value: Any) -> Any:
    """``cuda_graphs`` as a word: true and false (a config file of the days when it was a switch) are on and off."""
    return ("on" if value else "off") if isinstance(value, bool) else value


def toml_text(items: Iterable[tuple[str, Any]]) -> str:
    """``squareq train --print-config``'s TOML of the (key, value) pairs ``items``, which ``--config`` reads back
    unchanged (keys left unset are written as comments, since TOML has no null)."""
    lines = ["# squareq train configuration (squareq train --print-config)"]
    tables: list[dict[str, Any]] = []
    for name, value in items:
        if name == "datasets" and value:
            tables = value  # tables go after every key, which TOML would read as theirs
            continue
        lines.append(f"# {name} = (unset)" if value is None else f"{name} = {_toml_value(value)}")
    for table in tables:
        lines += ["", "[[datasets]]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
