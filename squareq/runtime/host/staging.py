"""Where block blobs wait on the host before their copy into a GPU slot.

* :class:`PinnedArena` (``host="pinned"``): every blob in one page-locked buffer, copied once at load.
  A slot copy is then a single DMA at full PCIe speed (pageable memory copies at a sixth of it).
  ``host="shared"`` is the same buffer as one copy the processes of a host share (data-parallel ranks).
* :class:`DiskStaging` (``host="disk"``): blobs stay in the slab file; a reader thread takes each one,
  reads it into a small ring of page-locked staging buffers with several threads at once (each its own part of
  the blob), and issues its copy. Host memory stays at a few blocks, for machines whose RAM cannot hold the slab.

Both issue copies through :meth:`start_copy`, which returns a :class:`CopyTicket` the streamer waits on.
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


READERS = 4  # threads reading parts of one blob at once (one thread read 5-6 GB/s even from the page cache)
PART_BYTES = 8 << 20  # the smallest part one reader takes


class DiskStaging:
    """Blobs read from the slab file by a reader thread through ``stages`` page-locked staging buffers, each blob by
    ``readers`` threads in parallel."""

    kind = "disk"

    def __init__(self, slab: Slab, device: torch.device, stages: int = 3, readers: int = READERS) -> None:
        blocks = slab.manifest.blocks
        self.path = slab.data_path
        self.ranges = [slab.blob_file_range(b.index) for b in blocks]
        largest = max(b.nbytes for b in blocks)
        self.device = device
        self.memory = [HostMemory(largest, device, lambda t: None) for _ in range(stages)]
        self.staging = [m.tensor for m in self.memory]
        self.staged = [None] * stages  # event recorded after the last copy out of each staging buffer
        self.host_bytes = largest * stages
        self._fd = os.open(self.path, os.O_RDONLY)
        self._pool = ThreadPoolExecutor(max(1, readers), thread_name_prefix="squareq-disk-part")
        self.readers = max(1, readers)
        self._jobs: queue.Queue = queue.Queue()
        self._next = 0
        self._thread = threading.Thread(target=self._run, name="squareq-disk-reader", daemon=True)
        self._thread.start()

    def start_copy(self, index: int, dst: torch.Tensor, stream, ready, free, trace: bool = False) -> CopyTicket:
        ticket = CopyTicket(index, self.ranges[index][1])
        if self._fd is None:
            ticket.error = RuntimeError(f"the disk reader of {self.path} was closed; load the slab again.")
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
        offset, nbytes = self.ranges[index]
        k = self._next
        self._next = (k + 1) % len(self.staging)
        if self.staged[k] is not None:
            self.staged[k].synchronize()  # the previous copy out of this buffer has finished
        stage = self.staging[k][:nbytes]
        view = memoryview(stage.numpy()).cast("B")
        part = max(PART_BYTES, -(-nbytes // self.readers))
        parts = [(start, min(start + part, nbytes)) for start in range(0, nbytes, part)]
        # preadv releases the GIL, so the parts are read at once; .result() re-raises a part's error here
        for future in [self._pool.submit(self._read, index, view, offset, a, b) for a, b in parts]:
            future.result()
        enqueue_copy(dst[:nbytes], stage, stream, ready, free, marks)
        if stream is not None:
            ev = torch.cuda.Event(blocking=True)  # the reader sleeps on it rather than spinning a core
            ev.record(stream)
            self.staged[k] = ev

    def _read(self, index: int, view: memoryview, offset: int, start: int, end: int) -> None:
        """Bytes [start, end) of block ``index``'s blob (at ``offset`` in the file) into ``view``."""
        while start < end:
            n = os.preadv(self._fd, [view[start:end]], offset + start)
            if n <= 0:
                raise OSError(f"{self.path} ended while reading block {index}; the slab is truncated, copy it again.")
            start += n

    def close(self) -> None:
        """Stop the reader threads and close the file; safe to call more than once."""
        if self._fd is None:
            return
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._pool.shutdown(wait=True)
        os.close(self._fd)
        self._fd = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for m in self.memory:
            m.close()
