"""Atomic creation of an output directory: build it under a temporary name, rename when complete."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import SlabError


class OutputError(ValueError):
    """An output path cannot be used or written; the message names it and says what to do."""


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_IN_THE_WAY = {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY}


def os_error_sentence(exc: OSError, doing: str, then: str = "run the command again") -> str:
    """One sentence for an OSError while ``doing`` (e.g. "saving the LoRA"): the path, the cause, and what to do
    (``then``: how to continue once the cause is fixed)."""
    where = exc.filename if exc.filename is not None else "the output"
    cause = exc.strerror or type(exc).__name__
    if exc.errno in _FULL:
        return f"{doing} failed because the disk holding {where} is full ({cause}); free space or choose another " \
               f"folder on a larger disk, then {then}."
    if exc.errno in _DENIED:
        return f"{doing} failed because {where} is not writable ({cause}); choose another folder or fix its " \
               f"permissions, then {then}."
    if exc.errno in _IN_THE_WAY:
        return f"{doing} failed because {where} is in the way ({cause}); remove it or choose another path, then {then}."
    return f"{doing} failed at {where} ({cause}); fix that, then {then}."


def ensure_output_dir(path: Path, flag: str = "-o") -> Path:
    """Create the output folder ``path`` (given by ``flag``) or raise :class:`OutputError` if it is a file or cannot
    be written, before any work whose result would then be lost."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path} is a file, not a folder; choose a folder for the output.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: " + os_error_sentence(exc, "creating the folder")) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{flag} {path} is not writable; choose another folder or fix its permissions.")
    return path


# hidden siblings a writer of ``name`` builds in: atomic_directory's (.tmp-, .old-), the slab writers' (.blobs-,
# .blocks-), atomic_write_bytes' (.<hex>.tmp) and prune_checkpoints' (.del-)
_DEBRIS = (".tmp-*", ".old-*", ".blobs-*", ".blocks-*", ".del-*", ".*.tmp")


def restore_replaced(final: Path) -> Path | None:
    """Put back the previous output that a replace killed between its two renames left hidden (``.<name>.old-*``,
    where the system cannot swap two folders in one step), when ``final`` itself is missing: the hidden copy it came
    from, or None when there is nothing to restore."""
    final = Path(final)
    if final.exists() or final.is_symlink() or not final.parent.is_dir():
        return None
    hidden = sorted(final.parent.glob(f".{glob_escape(final.name)}.old-*"), key=lambda p: p.stat().st_mtime)
    if not hidden:
        return None
    os.replace(hidden[-1], final)
    return hidden[-1]


def remove_debris(final: Path, pattern: bool = False) -> list[Path]:
    """Remove what a killed writer of ``final`` left beside it (Python's cleanup never ran: SIGKILL, power loss);
    call it before writing ``final`` again. A previous output a killed replace left hidden is put back first
    (:func:`restore_replaced`). With ``pattern``, ``final``'s name is a glob (``step-[0-9]*``): the debris of every
    output it matches goes. Returns what was removed."""
    final = Path(final)
    if not final.parent.is_dir():
        return []
    if not pattern:
        restore_replaced(final)
    name = final.name if pattern else glob_escape(final.name)
    found = sorted({p for suffix in _DEBRIS for p in final.parent.glob(f".{name}{suffix}")})
    for p in found:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return found


def glob_escape(name: str) -> str:
    """``name`` with glob's special characters taken literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def atomic_write_bytes(path: Path, data) -> None:
    """Write ``data`` (bytes or a buffer) to ``path`` through a temporary name, fsynced, then renamed; on any failure
    the temporary is removed and ``path`` is untouched."""
    atomic_write_parts(path, [data])


def atomic_write_parts(path: Path, parts) -> None:
    """:func:`atomic_write_bytes` for a file given as buffers written one after another (no joined copy)."""
    path = Path(path)
    # a name of its own, so that processes writing the same file (ranks, two runs) never share a temporary
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
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
        if final.exists() and swap_paths(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # it holds the previous output now
        elif final.exists():
            # two renames: a kill between them leaves the previous output hidden, and the next writer of ``final``
            # puts it back (restore_replaced) before anything else
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def swap_paths(a: Path, b: Path) -> bool:
    """Exchange two paths in one step (Linux's ``renameat2`` with ``RENAME_EXCHANGE``), so that no moment has neither
    in place; False where the system or the file system has no such call (the caller renames twice)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(str(a)), at_cwd, os.fsencode(str(b)), exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))
