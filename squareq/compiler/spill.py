"""A scratch file for tensors that wait for a later step of the compile when host memory cannot hold them.

The host plan (compiler/host_plan.py) sends here what would pass ``--host-budget``: the effects pass's block inputs,
waiting for the backward pass, and the calibration pass's recorded layer inputs. A tensor is written with plain file
writes (from its own memory on the CPU, through one small reusable pinned buffer from a GPU) and read back with
``readinto`` into a fresh tensor when it is consumed, so only the part being consumed is in memory. A memory map
would not do: the touched pages of a map count in the process's resident memory until it is unmapped, and that is
what the budget limits. Every :data:`SEGMENT` bytes of a tensor carry a CRC-32, so a damaged or cut file is an error
sentence, never other numbers. A tensor comes back with the strides ``clone()`` would give it, so where it waited
never changes what is computed from it.

The recorded inputs go through :class:`KeepThenSpill`: as many of each block's first ones as the budget has room for
beside the spill stay in memory, and only the rest make the trip through the file (on the 12B model at
``--host-budget 16GB`` the trip cost more per block than the block's forward).

The file is scratch, not state: it is written in place (no atomic rename), never read by a later compile, deleted
when the pass that needed it ends, and :class:`~squareq.compiler.state.CompileState` deletes the leftovers of a
killed compile when it opens the folder.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .state import StateError

SEGMENT = 16 << 20  # bytes per checksum and per staged copy from a GPU


class SpillError(StateError):
    """A spill file does not hold what was written to it."""


class SpillFile:
    """One scratch file of spilled tensors, created at the first write; :meth:`put` returns a handle to read back."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.bytes_written = 0  # over the file's life, resets included
        self.bytes_read = 0
        self._file = None
        self._end = 0
        self._generation = 0
        self._stage: torch.Tensor | None = None
        self._lock = threading.Lock()  # the effects pass reads in the autograd engine's thread

    def put(self, t: torch.Tensor) -> Spilled:
        """Write ``t`` at the end of the file."""
        t = t.detach()
        order = _memory_order(t)
        data = t.permute(order) if order is not None else t.contiguous()
        flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
        crcs = []
        with self._lock:
            f = self._open()
            offset = self._end
            f.seek(offset)
            for a in range(0, flat.numel(), SEGMENT):
                piece = self._host(flat[a:a + SEGMENT])
                view = memoryview(piece.numpy())
                crcs.append(zlib.crc32(view))
                _write_all(f, view)
            self._end += flat.numel()
            self.bytes_written += flat.numel()
        return Spilled(self, offset, tuple(t.shape), t.dtype, tuple(data.shape), order, tuple(crcs),
                       flat.numel(), self._generation)

    def reset(self) -> None:
        """Forget everything written so far and give its disk space back (the handles to it can no longer be read)."""
        with self._lock:
            if self._file is not None:
                self._file.truncate(0)
            self._end = 0
            self._generation += 1

    def remove(self) -> None:
        """Close and delete the file."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self.path.unlink(missing_ok=True)
            self._end = 0
            self._generation += 1
            self._stage = None

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _open(self):
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w+b", buffering=0)  # noqa: SIM115 - kept open until remove()
        return self._file

    def _host(self, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` in host memory: itself on the CPU, else copied into the reusable staging buffer."""
        if piece.device.type == "cpu":
            return piece
        if self._stage is None:
            self._stage = torch.empty(SEGMENT, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        stage = self._stage[:piece.numel()]
        stage.copy_(piece)  # blocking: the bytes are in host memory before they are written
        return stage

    def _load(self, item: Spilled, start: int, stop: int, out: np.ndarray) -> None:
        """Bytes ``[start, stop)`` of ``item`` into ``out``, each segment checked against its checksum."""
        if item.generation != self._generation:
            raise SpillError(f"{self.path} no longer holds a tensor the compile asked for (it was reset after the "
                             "write); this is a bug in squareq's compiler.")
        scratch = None
        with self._lock:
            f = self._open()
            for i in range(start // SEGMENT, (stop - 1) // SEGMENT + 1):
                s, e = i * SEGMENT, min((i + 1) * SEGMENT, item.nbytes)
                inside = start <= s and e <= stop
                if inside:
                    dst = out[s - start:e - start]
                else:
                    if scratch is None or len(scratch) < e - s:
                        scratch = np.empty(e - s, dtype=np.uint8)
                    dst = scratch[:e - s]
                self._read_exact(f, item.offset + s, dst)
                if zlib.crc32(memoryview(dst)) != item.crcs[i]:
                    raise SpillError(f"{self.path} is damaged: bytes {item.offset + s:,} to {item.offset + e:,} are "
                                     "not what the compile wrote there; check the disk, then rerun the compile with "
                                     "--resume.")
                if not inside:
                    lo, hi = max(start, s), min(stop, e)
                    out[lo - start:hi - start] = scratch[lo - s:hi - s]
            self.bytes_read += stop - start

    def _read_exact(self, f, at: int, dst: np.ndarray) -> None:
        f.seek(at)
        view, got = memoryview(dst), 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise SpillError(f"{self.path} ends at byte {at + got:,}, before the {len(view):,} bytes the "
                                 "compile wrote there (the file was cut or the disk filled); free disk space, "
                                 "then rerun the compile with --resume.")
            got += n


@dataclass(frozen=True, eq=False)
class Spilled:
    """A tensor in a :class:`SpillFile`: ``load()`` reads it (or rows ``[start, stop)`` of its first axis) back."""

    file: SpillFile
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored_shape: tuple[int, ...]  # the shape as written: ``shape`` permuted by ``order``
    order: tuple[int, ...] | None  # the dimensions in memory order (None: written contiguous)
    crcs: tuple[int, ...]
    nbytes: int
    generation: int

    device = torch.device("cpu")

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def dim(self) -> int:
        return len(self.shape)

    def load(self, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor as written, in fresh host memory (rows ``[start, stop)`` of the first axis when given)."""
        rows = (start, stop) != (None, None)
        first = self.order is None or self.order[0] == 0
        if rows and not first:  # the first axis is not outermost in memory: its rows are not one byte range
            return self.load()[start:stop]
        n = self.shape[0] if self.shape else 1
        start, stop = (0, n) if not rows else slice(start, stop).indices(n)[:2]
        stop = max(stop, start)
        per_row = self.nbytes // n if n else 0
        shape = (stop - start, *self.stored_shape[1:]) if rows else self.stored_shape
        out = torch.empty(shape, dtype=self.dtype)
        if out.numel():
            self.file._load(self, start * per_row, stop * per_row, out.reshape(-1).view(torch.uint8).numpy())
        return out.permute(_inverse(self.order)) if self.order is not None else out

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        return self.load().to(device, non_blocking=non_blocking)


@dataclass(frozen=True, eq=False)
class SpilledRows:
    """Chunks of one tensor along its first axis (a block's output computed chunk by chunk), some or all of them
    spilled (the others kept in memory by :class:`KeepThenSpill`)."""

    parts: tuple[Spilled, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (sum(p.shape[0] for p in self.parts), *self.parts[0].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def to(self, device, non_blocking: bool = False) -> torch.Tensor:
        """The joined tensor on ``device``, read a chunk at a time (what ``torch.cat`` of the chunks gives)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=device)
        at = 0
        for p in self.parts:
            out[at:at + p.shape[0]].copy_(p.load() if is_spilled(p) else p)
            at += p.shape[0]
        return out


class KeepThenSpill:
    """A store that keeps tensors as ``keep`` copies them (in pinned host memory) while what it kept costs at most
    ``quota`` bytes (``cost``: a tensor's bytes as its copy takes them), and writes the rest to ``file``: the host
    budget's room beside a spill, spent on the first tensors so that fewer go through the file and back."""

    def __init__(self, file: SpillFile, keep, quota: int, cost) -> None:
        self.file, self.keep, self.quota, self.cost = file, keep, quota, cost
        self.kept = 0  # bytes kept so far, as ``cost`` counts them

    def __call__(self, t: torch.Tensor):
        c = self.cost(t)
        if self.kept + c <= self.quota:
            self.kept += c
            return self.keep(t)
        return self.file.put(t)


def is_spilled(x) -> bool:
    return isinstance(x, (Spilled, SpilledRows))


def join(parts) -> SpilledRows:
    """Chunks of one tensor, spilled one by one (or some kept), as one."""
    return SpilledRows(tuple(q for p in parts for q in (p.parts if isinstance(p, SpilledRows) else (p,))))


def fetch(x, device, non_blocking: bool = False):
    """A recorded tensor on ``device``, read back when it was spilled."""
    return x.to(device, non_blocking=non_blocking) if torch.is_tensor(x) or is_spilled(x) else x


def _memory_order(t: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions of a dense tensor from outermost to innermost in memory (``clone()`` keeps that layout), or
    None when it is not dense (``clone()`` makes it contiguous)."""
    if t.dim() == 0 or t.is_contiguous():
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d])))
    return order if t.permute(order).is_contiguous() else None


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return tuple(inv)


def _write_all(f, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += f.write(view[done:])
