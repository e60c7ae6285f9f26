"""Atomic creation of an output directory: build it under a temporary name, rename when complete."""
from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from .errors import SlabError


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data) -> None:
    """Write ``data`` (bytes or a buffer) to ``path`` through a temporary name, fsynced, then renamed; on any failure
    the temporary is removed and ``path`` is untouched."""
    path = Path(path)
    # a name of its own, so that processes writing the same file (ranks, two runs) never share a temporary
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        # a full disk or a kill mid-write must not leave a partial temporary behind to fill the disk or block a retry
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``final``; on success it replaces ``final``.

    If the body raises, the temporary directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise SlabError(f"{final} already exists; choose another output path or pass overwrite (--force).")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
