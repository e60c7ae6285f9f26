"""Where block blobs wait on the host before their copy into a GPU slot.

* :class:`PinnedArena` (``host="pinned"``): every blob in one page-locked buffer, copied once at load.
  A slot copy is then a single DMA at full PCIe speed (pageable memory copies at a sixth of it).
  ``host="shared"`` is the same buffer as one copy the processes of a host share (data-parallel ranks).
* :class:`DiskStaging` (``host="disk"``): blobs stay in the slab file; a reader thread takes each one,
  reads it into a small ring of page-locked staging buffers with several threads at once (each its own part of
  the blob), and issues its copy. Host memory stays at a few blocks, for machines whose RAM cannot hold the slab.
* :class:`StagingRing`, the ring under it: any blob made on demand into a staging buffer (a text encoder's block
  read from its memory-mapped weights file, squareq.runtime.module_stream).

All issue copies through :meth:`start_copy`, which returns a :class:`CopyTicket` the streamer waits on.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...slab import Slab
from .pinned import HostMemory


@dataclass
class CopyTicket:
    """One block copy into a slot. ``issued`` is set once the copy is enqueued (or, on CPU, done)."""

    block: int
    nbytes: int
    issued: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    marks: list = field(default_factory=list)  # (start, end) timing events around the copy, when tracing

    def wait_issued(self) -> None:
        self.issued.wait()
        if self.error is not None:
            raise self.error


def enqueue_copy(dst: torch.Tensor, src: torch.Tensor, stream, ready, free, marks: list | None = None) -> None:
    """Copy ``src`` into ``dst`` on ``stream`` after ``free`` (slot readers done); record ``ready`` after it.

    With ``marks`` (a list), a pair of timing marks around the copy itself is appended to it.
    """
    if stream is None:
        start = time.perf_counter()
        dst.copy_(src)
        if marks is not None:
            marks.append((start, time.perf_counter()))
        return
    with torch.cuda.stream(stream):
        stream.wait_event(free)
        start = torch.cuda.Event(enable_timing=True) if marks is not None else None
        if start is not None:
            start.record(stream)
        dst.copy_(src, non_blocking=True)
        ready.record(stream)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            marks.append((start, end))


class PinnedArena:
    """Every block blob in one page-locked host buffer (``shared``: one copy for all processes of the host)."""

    kind = "pinned"

    def __init__(self, sizes: list[int], fill: Callable[[int, torch.Tensor], None], device: torch.device,
                 share_key: str | None = None) -> None:
        self.offsets, total = [], 0
        for n in sizes:
            self.offsets.append(total)
            total += n
        self.sizes = list(sizes)
        self.device = device

        def fill_all(buffer: torch.Tensor) -> None:
            for i, off in enumerate(self.offsets):
                fill(i, buffer[off : off + self.sizes[i]])

        self.memory = HostMemory(total, device, fill_all, share_key)
        self.buffer = self.memory.tensor
        self.host_bytes = total

    @classmethod
    def for_slab(cls, slab: Slab, device: torch.device, shared: bool = False) -> PinnedArena:
        """The blobs of ``slab``; with ``shared``, the one copy the processes of this host share."""
        blocks = slab.manifest.blocks
        key = None
        if shared:
            key = hashlib.sha256(json.dumps([[b.nbytes, b.sha256] for b in blocks]).encode()).hexdigest()[:24]
        return cls([b.nbytes for b in blocks], lambda i, dst: dst.copy_(slab.block_bytes(i)), device, key)

    def blob(self, index: int) -> torch.Tensor:
        off = self.offsets[index]
        return self.buffer[off : off + self.sizes[index]]

    def start_copy(self, index: int, dst: torch.Tensor, stream, ready, free, trace: bool = False) -> CopyTicket:
        ticket = CopyTicket(index, self.sizes[index])
        enqueue_copy(dst[: self.sizes[index]], self.blob(index), stream, ready, free, ticket.marks if trace else None)
        ticket.issued.set()
        return ticket

    def close(self) -> None:
        """Unlock the buffer (after any copy out of it has finished); the last user removes a shared copy."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.memory.close()
        self.buffer = None


STAGES = 3  # staging buffers of a ring: one filling, one copying, one spare
READERS = 4  # threads reading parts of one blob at once (one thread read 5-6 GB/s even from the page cache)
PART_BYTES = 8 << 20  # the smallest part one reader takes


class StagingRing:
    """Blobs made on demand by a reader thread into ``stages`` page-locked staging buffers, each then copied into its
    device slot: ``fill(index, stage)`` writes blob ``index`` into ``stage`` (a uint8 tensor of the blob's size).
    Host memory stays at ``stages`` of the largest blob, whatever the number of blocks."""

    kind = "ring"

    def __init__(self, sizes: list[int], fill: Callable[[int, torch.Tensor], None], device: torch.device,
                 stages: int = STAGES, name: str = "squareq-stage-reader") -> None:
        self.sizes = list(sizes)
        self.fill = fill
        largest = max(self.sizes)
        self.device = device
        self.memory = [HostMemory(largest, device, lambda t: None) for _ in range(stages)]
        self.staging = [m.tensor for m in self.memory]
        self.staged = [None] * stages  # event recorded after the last copy out of each staging buffer
        self.host_bytes = largest * stages
        self.closed = False
        self._jobs: queue.Queue = queue.Queue()
        self._next = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def closed_error(self) -> RuntimeError:
        return RuntimeError("the staging ring was closed; load the model again.")

    def start_copy(self, index: int, dst: torch.Tensor, stream, ready, free, trace: bool = False) -> CopyTicket:
        ticket = CopyTicket(index, self.sizes[index])
        if self.closed:
            ticket.error = self.closed_error()
            ticket.issued.set()
            return ticket
        self._jobs.put((ticket, dst, stream, ready, free, trace))
        return ticket

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            ticket, dst, stream, ready, free, trace = job
            try:
                self._copy(ticket.block, dst, stream, ready, free, ticket.marks if trace else None)
            except BaseException as exc:  # handed to the training thread, which raises it
                ticket.error = exc
            ticket.issued.set()

    def _copy(self, index: int, dst: torch.Tensor, stream, ready, free, marks: list | None) -> None:
        nbytes = self.sizes[index]
        k = self._next
        self._next = (k + 1) % len(self.staging)
        if self.staged[k] is not None:
            self.staged[k].synchronize()  # the previous copy out of this buffer has finished
        stage = self.staging[k][:nbytes]
        self.fill(index, stage)
        enqueue_copy(dst[:nbytes], stage, stream, ready, free, marks)
        if stream is not None:
            ev = torch.cuda.Event(blocking=True)  # the reader sleeps on it rather than spinning a core
            ev.record(stream)
            self.staged[k] = ev

    def close(self) -> None:
        """Stop the reader thread and unlock the staging buffers; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._closed()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for m in self.memory:
            m.close()
        self.staging = []

    def _closed(self) -> None:
        """What a subclass releases once the reader has stopped."""


class DiskStaging(StagingRing):
    """Blobs read from the slab file through the staging ring, each blob by ``readers`` threads in parallel."""

    kind = "disk"

    def __init__(self, slab: Slab, device: torch.device, stages: int = STAGES, readers: int = READERS) -> None:
        self.path = slab.data_path
        self.ranges = [slab.blob_file_range(b.index) for b in slab.manifest.blocks]
        self.readers = max(1, readers)
        self._fd, self._pool = None, None
        # the ring first (its page-locked buffers may fail to allocate), then the file: nothing is left open
        super().__init__([n for _, n in self.ranges], self._read_blob, device, stages, "squareq-disk-reader")
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="squareq-disk-part")

    def closed_error(self) -> RuntimeError:
        return RuntimeError(f"the disk reader of {self.path} was closed; load the slab again.")

    def _read_blob(self, index: int, stage: torch.Tensor) -> None:
        offset, nbytes = self.ranges[index]
        view = memoryview(stage.numpy()).cast("B")
        part = max(PART_BYTES, -(-nbytes // self.readers))
        parts = [(start, min(start + part, nbytes)) for start in range(0, nbytes, part)]
        # preadv releases the GIL, so the parts are read at once; .result() re-raises a part's error here
        for future in [self._pool.submit(self._read, index, view, offset, a, b) for a, b in parts]:
            future.result()

    def _read(self, index: int, view: memoryview, offset: int, start: int, end: int) -> None:
        """Bytes [start, end) of block ``index``'s blob (at ``offset`` in the file) into ``view``."""
        while start < end:
            n = os.preadv(self._fd, [view[start:end]], offset + start)
            if n <= 0:
                raise OSError(f"{self.path} ended while reading block {index}; the slab is truncated, copy it again.")
            start += n

    def _closed(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
