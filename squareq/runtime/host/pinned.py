"""Page-locked host memory for block blobs: private to one process, or one copy shared by the processes of a host.

Memory is allocated as ordinary (or file-mapped) pages and then page-locked with ``cudaHostRegister``,
rather than taken from torch's pinned allocator, which rounds every request up to a power of two (a
6.6 GB arena would lock 8 GB).

A shared copy is a file in a RAM file system (``/dev/shm``, or ``SQUAREQ_SHM_DIR``) named by the slab's
content, so the data-parallel ranks of one host map the same pages: eight ranks of a 12B model hold
one 6.6 GB copy instead of eight. The first process to arrive fills it (under an exclusive lock, through
a temporary name, so a crash mid-fill leaves nothing another process would trust); every user holds a
shared lock on a second file, and the last one to leave removes the copy. A copy left by a killed job
is reused by the next job on the same slab, and removed when that one ends.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import shutil
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from ... import settings

log = logging.getLogger("squareq.runtime")

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


class HostMemoryError(RuntimeError):
    """Host memory for the blobs cannot be allocated, shared or page-locked; the message says what to do."""


def _register(buffer: torch.Tensor) -> Callable[[], None]:
    """Page-lock ``buffer``'s pages for DMA; returns the undo (call it before the pages are freed)."""
    cudart = torch.cuda.cudart()
    nbytes = buffer.numel()
    err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, _PORTABLE)
    if int(err) != 0:
        raise HostMemoryError(
            f"cannot page-lock {nbytes / 1e9:.2f} GB of host memory for the block blobs (CUDA error {int(err)}); "
            "raise the locked-memory limit (ulimit -l unlimited, or --ulimit memlock=-1 for docker), or load "
            'with host="disk", which locks two blocks only.')
    ptr = buffer.data_ptr()
    return lambda: cudart.cudaHostUnregister(ptr)


_held = [0]  # bytes of live HostMemory buffers in this process


def held_bytes() -> int:
    """Bytes of the :class:`HostMemory` buffers of this process not yet closed (page-locked on a GPU machine), as
    asked for (torch's fallback allocator rounds up to a power of two); what the tests count. A closed buffer's pages
    go with the last view of them."""
    return _held[0]


class HostMemory:
    """``nbytes`` of host memory as a uint8 tensor, page-locked when ``device`` is a GPU.

    With ``share_key``, the memory is the shared copy of that name (see the module docstring) and
    ``fill(tensor)`` is called only by the process that creates it; otherwise ``fill`` always runs.
    """

    def __init__(self, nbytes: int, device: torch.device, fill: Callable[[torch.Tensor], None],
                 share_key: str | None = None) -> None:
        self.nbytes = nbytes
        self.created = True  # whether this process filled the memory
        self._share: _SharedFile | None = None
        self._undo = None
        if share_key is None:
            self.tensor = _page_aligned(nbytes)
            # Filled before it is locked: pages appear as they are written, so a caller that moves tensors in one
            # at a time (a streamed text encoder) never holds two copies.
            fill(self.tensor)
            if device.type == "cuda":
                try:
                    self._undo = _register(self.tensor)
                except HostMemoryError as exc:
                    # torch's pinned allocator locks pages its own way; it rounds up, but the blobs stay page-locked
                    log.warning("%s Using torch's pinned allocator instead.", exc)
                    self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).copy_(self.tensor)
        else:
            self._share = _SharedFile(share_key, nbytes, fill)
            self.tensor, self.created = self._share.tensor, self._share.created
            if device.type == "cuda":
                try:
                    self._undo = _register(self.tensor)
                except BaseException:
                    self._share.close()
                    raise
        # Unlock before the pages go (torch frees them once the last view is dropped), even without close().
        _held[0] += nbytes
        self._finalizer = weakref.finalize(self, _release, self._undo, self._share, self.tensor, nbytes)

    @property
    def path(self) -> Path | None:
        """The shared file, for a shared copy."""
        return self._share.path if self._share else None

    def close(self) -> None:
        """Unlock the pages and, for the last user of a shared copy, remove it; the pages go with the last view of
        them (a closed runtime holds none, so a finished training run gives them back at once, not at a later
        garbage collection). Safe to call more than once."""
        self._finalizer()
        self.tensor = None


def _release(undo, share, tensor, nbytes: int) -> None:
    _held[0] -= nbytes
    if undo is not None:
        undo()
    if share is not None:
        share.close()


def _page_aligned(nbytes: int) -> torch.Tensor:
    """Anonymous, page-aligned memory, so two small buffers never share a page (each is locked on its own)."""
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]


def _shm_dir() -> Path:
    return settings.shm_dir()


class _SharedFile:
    """A file-backed shared mapping with create-once and last-user-removes semantics (see module docstring)."""

    def __init__(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], None]) -> None:
        directory = _shm_dir()
        if not directory.is_dir():
            raise HostMemoryError(f"{directory} does not exist, so the ranks of this host cannot share one copy of the "
                                  "slab; set SQUAREQ_SHM_DIR to a RAM file system (tmpfs) folder.")
        base = directory / f"squareq-{os.getuid()}-{key}"
        self.path = base.with_name(base.name + ".blobs")
        self._create_fd = os.open(base.with_name(base.name + ".create.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._users_fd = os.open(base.with_name(base.name + ".users.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self._lock_paths = [base.with_name(base.name + s) for s in (".create.lock", ".users.lock")]
        self.created = False
        try:
            fcntl.flock(self._create_fd, fcntl.LOCK_EX)
            try:
                # Becoming a user inside the creation lock: the last user removes the file only while holding
                # that lock, so it cannot remove a copy another process is about to map.
                fcntl.flock(self._users_fd, fcntl.LOCK_SH)
                for stale in directory.glob(base.name + ".*.part"):  # a creator that died mid-fill
                    stale.unlink(missing_ok=True)
                if self.path.is_file() and self.path.stat().st_uid != os.getuid():
                    raise HostMemoryError(f"{self.path} belongs to another user; remove it or set SQUAREQ_SHM_DIR to a "
                                          "folder of your own.")
                if not (self.path.is_file() and self.path.stat().st_size == nbytes):
                    self._create(base, nbytes, fill)
                    self.created = True
                self.tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
            finally:
                fcntl.flock(self._create_fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(self._create_fd)
            os.close(self._users_fd)
            raise

    def _create(self, base: Path, nbytes: int, fill: Callable[[torch.Tensor], None]) -> None:
        _remove_unused_copies(base)
        free = shutil.disk_usage(base.parent).free
        if free < nbytes:
            raise HostMemoryError(
                f"{base.parent} has {free / 1e9:.2f} GB free but one shared copy of the slab needs {nbytes / 1e9:.2f} "
                "GB; enlarge it (docker: --shm-size), point SQUAREQ_SHM_DIR at a larger tmpfs, or run with --host disk "
                "(copies no job is using any more were already removed).")
        part = base.with_name(f"{base.name}.{os.getpid()}.part")
        try:
            os.close(os.open(part, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))  # readable by this user only
            tensor = torch.from_file(str(part), shared=True, size=nbytes, dtype=torch.uint8)
            fill(tensor)
            del tensor
            os.replace(part, self.path)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        log.info("shared host copy of the block blobs: %s (%.2f GB)", self.path, nbytes / 1e9)

    def close(self) -> None:
        if self._users_fd is None:
            return
        self.tensor = None
        fcntl.flock(self._create_fd, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._users_fd, fcntl.LOCK_UN)
            try:
                fcntl.flock(self._users_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                last = True
            except BlockingIOError:
                last = False
            if last:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._users_fd)
            fcntl.flock(self._create_fd, fcntl.LOCK_UN)
            os.close(self._create_fd)
            self._users_fd = self._create_fd = None


def _remove_unused_copies(keep: Path) -> None:
    """Delete this user's shared copies of other slabs that no process maps any more (left by killed jobs)."""
    for lock in keep.parent.glob(f"squareq-{os.getuid()}-*.users.lock"):
        base = lock.name[: -len(".users.lock")]
        blobs = lock.with_name(base + ".blobs")
        if base == keep.name or not blobs.exists():
            continue
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # granted only when no process holds the copy
            blobs.unlink(missing_ok=True)
            log.info("removed %s, a shared copy no running job uses", blobs)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
