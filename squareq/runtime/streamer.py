"""The block streamer: a fixed ring of K device slots fed from host memory on a dedicated copy stream.

Invariants (each one is a bug if broken):

* A block is read only after its copy has finished: the compute stream waits on the slot's ``ready``
  event before the block's kernels are enqueued.
* A slot is overwritten only after every kernel that read it has finished: :meth:`Streamer.release`
  records the slot's ``free`` event on the compute stream after the block's last kernel is enqueued, and
  the copy stream waits on it before writing.
* Slots are allocated once; nothing is allocated per block, so reserved memory stays flat.

Prefetch follows the execution order the streamer observes (recorded over each forward pass; the
definition order is only the guess for the very first one). A training step runs the blocks forward,
then the checkpointed backward replays them in reverse; the streamer predicts both, so the backward
begins on the blocks the forward left in their slots and prefetches the rest in reverse.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .telemetry import Telemetry

FORWARD, BACKWARD = "forward", "backward"


@dataclass
class Slot:
    index: int
    buffer: torch.Tensor
    block: int | None = None
    users: int = 0
    ready: object = None  # CUDA event: the copy into this slot has finished
    free: object = None  # CUDA event: every kernel reading this slot has finished
    ticket: object = None  # the CopyTicket of the copy that filled it, until the block is first acquired
    started: object = None  # timing mark of the block's first kernel, when tracing


class StreamError(RuntimeError):
    """The streamer cannot serve a request (every slot is in use)."""


class Streamer:
    """Moves block blobs from a host source into ``slots`` device buffers, ahead of the compute."""

    def __init__(self, host, device: torch.device, slots: int, slot_bytes: int, block_sizes: list[int],
                 bind: Callable[[int, int, torch.Tensor], None], unbind: Callable[[int], None],
                 telemetry: Telemetry, forget: Callable[[int], None] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"prefetch={slots}: the ring needs at least one slot.")
        self.host = host
        self.device = device
        self.cuda = device.type == "cuda"
        self.block_sizes = block_sizes
        self.bind = bind  # bind(block, slot index, slot buffer): point the block's modules at the slot
        self.unbind = unbind  # unbind(block): the block left its slot
        self.forget = forget  # forget(slot index): a removed slot's buffer must not be bound again
        self.closed = False
        self.telemetry = telemetry
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.slot_bytes = slot_bytes
        self.slots: list[Slot] = []
        self._next_index = 0  # slot indices are never reused: bindings are cached per (block, slot index)
        self.add_slots(slots)
        self.order: list[int] = list(range(len(block_sizes)))  # guess until a pass is observed
        self._pos = {b: i for i, b in enumerate(self.order)}
        self._seen: list[int] = []

    # ------------------------------------------------------------------ order

    def _observe(self, block: int, phase: str) -> None:
        """Record forward acquisitions; a pass ends when a block repeats or the backward begins."""
        if phase == FORWARD and block not in self._seen:
            self._seen.append(block)
            return
        if self._seen:
            rest = [b for b in self.order if b not in self._seen]
            self.order = self._seen + rest
            self._pos = {b: i for i, b in enumerate(self.order)}
        self._seen = [block] if phase == FORWARD else []

    def upcoming(self, block: int, phase: str, training: bool):
        """Blocks expected after ``block``, nearest first (one cycle ahead)."""
        order, p = self.order, self._pos[block]
        if phase == FORWARD:
            yield from order[p + 1 :]
            yield from (reversed(order) if training else order)
        else:
            yield from reversed(order[:p])
            yield from order

    # ------------------------------------------------------------------ slots

    def _slot_of(self, block: int) -> Slot | None:
        for slot in self.slots:
            if slot.block == block:
                return slot
        return None

    def _victim(self, keep: set[int]) -> Slot | None:
        candidates = [s for s in self.slots if s.users == 0]
        for pick in ([s for s in candidates if s.block is None], [s for s in candidates if s.block not in keep]):
            if pick:
                return pick[0]
        return None

    def _fill(self, slot: Slot, block: int, demand: bool) -> None:
        if slot.block is not None and slot.block != block:
            self.unbind(slot.block)  # its layers must not read the next block's bytes
        slot.block = block
        slot.ticket = self.host.start_copy(block, slot.buffer, self.copy_stream, slot.ready, slot.free,
                                           trace=self.telemetry.tracing)
        self.telemetry.copy(self.block_sizes[block], demand)

    def _prefetch(self, block: int, phase: str, training: bool) -> None:
        busy = {s.block for s in self.slots if s.users > 0}
        room = len(self.slots) - len(busy)
        window: list[int] = []
        for b in self.upcoming(block, phase, training):
            if len(window) >= room:
                break
            if b not in busy and b not in window:
                window.append(b)
        keep = busy | set(window)
        for b in window:
            if self._slot_of(b) is None:
                victim = self._victim(keep)
                if victim is None:
                    return
                self._fill(victim, b, demand=False)

    def settle(self) -> None:
        """Wait until every copy into the ring has been issued (the disk reader's queue drained) and has finished,
        and every kernel reading a slot has finished; raises a failed copy's error."""
        for slot in self.slots:
            if slot.ticket is not None:
                slot.ticket.wait_issued()
        if self.cuda:
            for slot in self.slots:
                slot.ready.synchronize()
                slot.free.synchronize()

    def exclude(self, blocks) -> None:
        """Stop streaming ``blocks`` (they are kept on the device elsewhere): out of the order, out of idle slots."""
        gone = set(blocks)
        if not gone:
            return
        self.settle()
        for slot in self.slots:
            if slot.block in gone:
                if slot.users:
                    raise StreamError(f"block {slot.block} is running; change what streams between steps.")
                self.unbind(slot.block)
                slot.block = slot.ticket = None
        self.order = [b for b in self.order if b not in gone]
        self._pos = {b: i for i, b in enumerate(self.order)}
        self._seen = [b for b in self._seen if b not in gone]

    def add_slots(self, n: int) -> None:
        """``n`` more device slots for the ring, each ``slot_bytes`` large."""
        for _ in range(max(0, n)):
            slot = Slot(self._next_index, torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device))
            self._next_index += 1
            if self.cuda:
                slot.ready, slot.free = torch.cuda.Event(), torch.cuda.Event()
                slot.free.record(torch.cuda.current_stream(self.device))
            self.slots.append(slot)

    def remove_slots(self, n: int) -> None:
        """Give the last ``n`` slots back (between steps: they must be idle), keeping at least one."""
        n = min(max(0, n), len(self.slots) - 1)
        if n == 0:
            return
        if any(slot.users for slot in self.slots[-n:]):
            raise StreamError("a slot to remove is in use; remove slots between steps.")
        self.settle()  # the copies into them and the kernels reading them are done before their memory is reused
        for _ in range(n):
            slot = self.slots.pop()
            if slot.block is not None:
                self.unbind(slot.block)
            if self.forget is not None:
                self.forget(slot.index)  # drop the cached views, which would keep the buffer alive

    # ------------------------------------------------------------------ API

    def acquire(self, block: int, phase: str, training: bool) -> Slot:
        """Make ``block`` readable by the compute stream and bind its modules to its slot."""
        if self.closed:
            raise StreamError("this model's SquareQ runtime was closed, so its blocks can no longer stream; load the "
                              "slab again with squareq.runtime.load.")
        self._observe(block, phase)
        slot = self._slot_of(block)
        if slot is None:
            slot = self._victim({s.block for s in self.slots if s.users > 0} | {block})
            if slot is None:
                raise StreamError(f"all {len(self.slots)} block slots are in use; blocks nest more deeply than the "
                                  "ring allows, so load the model with a larger prefetch.")
            self._fill(slot, block, demand=True)
        try:
            self._await_copy(slot, block)
            self.bind(block, slot.index, slot.buffer)
        except BaseException:
            # The slot's contents are unknown (a failed read, an interrupt): forget them, so the next
            # acquisition copies the block again instead of failing the same way forever.
            slot.block = slot.ticket = None
            raise
        slot.users += 1
        try:
            self._prefetch(block, phase, training)
        except BaseException:
            slot.users -= 1
            raise
        slot.started = self.telemetry.clock.mark(self._stream()) if self.telemetry.tracing else None
        return slot

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _await_copy(self, slot: Slot, block: int) -> None:
        if slot.ticket is not None:
            if not slot.ticket.issued.is_set():
                start = time.perf_counter()
                slot.ticket.issued.wait()
                self.telemetry.read_wait_s += time.perf_counter() - start
            slot.ticket.wait_issued()  # raises the reader's error, if it had one
            for start, end in slot.ticket.marks:
                self.telemetry.span(f"copy block {block}", "copy", 1, start, end)
            slot.ticket = None
        if self.cuda:
            stream, clock = self._stream(), self.telemetry.clock
            before = clock.mark(stream)
            stream.wait_event(slot.ready)
            after = clock.mark(stream)
            self.telemetry.wait(before, after)
            self.telemetry.span("wait", "wait", 2, before, after)

    def release(self, slot: Slot, phase: str = FORWARD) -> None:
        """The compute stream has enqueued its last read of ``slot``; it may be refilled after that."""
        if self.cuda:
            slot.free.record(torch.cuda.current_stream(self.device))
        if self.telemetry.tracing and slot.started is not None:
            self.telemetry.span(f"{phase} block {slot.block}", phase, 0, slot.started,
                                self.telemetry.clock.mark(self._stream()))
        slot.users -= 1

    def close(self) -> None:
        """Stop the host side (the disk reader thread, its file); later acquisitions raise. Safe to repeat."""
        if not self.closed:
            self.closed = True
            self.host.close()
