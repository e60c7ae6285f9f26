"""Byte sizes as people write them on a command line: 12GB, 11.5GiB, 800MB."""
from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class SizeError(ValueError):
    """A size cannot be read."""


# more bytes than any memory or disk holds (16 EiB): a size past it is a typo, and past a float's range an overflow
LARGEST = 2**64


def parse_size(text: str, flag: str | None = None) -> int:
    """'12GB', '11.5GiB', '800MB', '123456' -> bytes (decimal units for KB/MB/GB, binary for KiB/MiB/GiB). ``flag``:
    the option or key the size was given as, named in the error."""
    where = f"{flag}: " if flag else ""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise SizeError(f"{where}cannot read the size {str(text)[:40]!r}; write it like 12GB, 11.5GiB or 800MB.")
    value = float(m.group(1)) * _UNITS[unit]
    if not value < LARGEST:  # inf included
        raise SizeError(f"{where}the size {str(text)[:40]!r} is more than any memory or disk holds; write it like "
                        "12GB, 11.5GiB or 800MB.")
    return int(value)


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
