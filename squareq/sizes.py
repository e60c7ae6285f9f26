"""Byte sizes as people write them on a command line: 12GB, 11.5GiB, 800MB."""
from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class SizeError(ValueError):
    """A size cannot be read."""


def parse_size(text: str) -> int:
    """'12GB', '11.5GiB', '800MB', '123456' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise SizeError(f"cannot read the size {text!r}; write it like 12GB, 11.5GiB or 800MB.")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(nbytes: int) -> str:
    """Bytes in decimal units as parse_size reads them: 6636243120 -> '6.64 GB', 2000000 -> '2.00 MB'."""
    for unit in ("TB", "GB", "MB", "KB"):
        if abs(nbytes) >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.2f} {unit}"
    return f"{nbytes} B"


def format_size_up(nbytes: int) -> str:
    """Like :func:`format_size`, rounded up, so that the size it prints is never less than ``nbytes`` (for a
    "give it at least" sentence)."""
    import math

    for unit in ("TB", "GB", "MB", "KB"):
        if abs(nbytes) >= _UNITS[unit]:
            return f"{math.ceil(nbytes * 100 / _UNITS[unit]) / 100:.2f} {unit}"
    return f"{nbytes} B"
