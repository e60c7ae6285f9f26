"""Activation offloading: the checkpointed block inputs of a training step kept in page-locked host memory instead of on
the device, for long sequences (a Wan clip of 81 frames at 480p is 32,760 tokens: its 40 checkpointed inputs alone
are over 13 GB).

Each block's inputs that carry a gradient (its hidden states; text states, timestep and rotary embeddings shared by
every block stay on the device) are copied out on a stream of their own as soon as the block's forward has them, and
copied back one block ahead of the backward's reverse-order replay, so the copies overlap compute as the block
ring's do. On a CPU the "host copy" is a plain one, which keeps the bookkeeping tested where there is no GPU.

The host buffers are page-locked at their exact size (runtime/host/pinned.py) and reused step after step
(:class:`HostBuffers`). torch's pinned allocator would round each request up to a power of two and keep it cached
after the run: an 81-frame Wan input of 327 MB locks 512 MB, so 40 blocks held 20.5 GB where the host plan counts
13.1 GB, and the process still held them when the run had ended.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .host.pinned import HostMemory

OFFLOAD_MIN_BYTES = 1 << 20  # smaller inputs are not worth a copy each way


class HostBuffers:
    """Host memory for the offloaded inputs, kept for the next step: a request takes the smallest free buffer that
    holds it, else a new one of its exact size, after the free ones (all smaller) are given back, so what is held
    never passes one step's inputs at the largest bucket's size. Reuse needs no wait: every copy into or out of
    them runs on the offload's one stream, in order."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: list[HostMemory] = []

    def take(self, nbytes: int) -> HostMemory:
        fitting = [m for m in self.free if m.nbytes >= nbytes]
        if fitting:
            best = min(fitting, key=lambda m: m.nbytes)
            self.free.remove(best)
            return best
        self.close()  # none holds it: a longer clip's bucket; the smaller ones would only sit beside it
        return HostMemory(nbytes, self.device, fill=lambda _: None)

    def give_back(self, buffers: list[HostMemory]) -> None:
        self.free.extend(buffers)

    def close(self) -> None:
        """Unlock and free the buffers not in use."""
        for m in self.free:
            m.close()
        self.free.clear()


def _view(memory: HostMemory, like: torch.Tensor) -> torch.Tensor:
    return memory.tensor[: like.numel() * like.element_size()].view(like.dtype).view(like.shape)


@dataclass
class _Stashed:
    host: list[torch.Tensor]
    memory: list[HostMemory]
    requires_grad: list[bool]
    copied_out: torch.cuda.Event | None
    back: list[torch.Tensor] | None = None  # on the device again, once fetched
    copied_back: torch.cuda.Event | None = None


class ActivationOffload:
    """The stash of one training step's offloaded block inputs, by key, in forward order."""

    def __init__(self, device: torch.device, min_bytes: int = OFFLOAD_MIN_BYTES) -> None:
        self.device, self.min_bytes = device, min_bytes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stashed: dict[int, _Stashed] = {}
        self.buffers = HostBuffers(device)  # page-locked on a GPU, plain pages elsewhere
        self.next_key = 0
        self.bytes_out = 0  # what this step moved to the host (telemetry, tests)

    def wanted(self, tensor: torch.Tensor) -> bool:
        """Whether a checkpointed input goes to the host: a block's own stream, large enough to be worth it."""
        return tensor.requires_grad and tensor.is_floating_point() \
            and tensor.numel() * tensor.element_size() >= self.min_bytes

    def put(self, tensors: list[torch.Tensor]) -> int:
        """Copy ``tensors`` to the host (asynchronously on a GPU); the key that :meth:`take` gives them back by."""
        cuda = self.stream is not None
        memory = [self.buffers.take(t.numel() * t.element_size()) for t in tensors]
        host = [_view(m, t) for m, t in zip(memory, tensors, strict=True)]
        event = None
        if cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the block's inputs are written
            with torch.cuda.stream(self.stream):
                for h, t in zip(host, tensors, strict=True):
                    h.copy_(t.detach(), non_blocking=True)
            for t in tensors:
                t.record_stream(self.stream)  # the allocator keeps it until the copy has read it
            event = self.stream.record_event()
        else:
            for h, t in zip(host, tensors, strict=True):
                h.copy_(t.detach())
        key, self.next_key = self.next_key, self.next_key + 1
        self.stashed[key] = _Stashed(host, memory, [t.requires_grad for t in tensors], event)
        self.bytes_out += sum(t.numel() * t.element_size() for t in tensors)
        return key

    def take(self, key: int) -> list[torch.Tensor]:
        """The tensors of ``key`` on the device again, ready for the current stream; starts bringing back the ones
        put before them, which the reverse-order backward takes next."""
        entry = self.stashed.pop(key)
        earlier = max((k for k in self.stashed if k < key), default=None)
        self._fetch(entry)
        self.buffers.give_back(entry.memory)  # read back on the offload's stream, before any later copy into them
        if earlier is not None:
            self._fetch(self.stashed[earlier])
        if entry.copied_back is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.copied_back)
        return [t.requires_grad_(g) for t, g in zip(entry.back, entry.requires_grad, strict=True)]

    def _fetch(self, entry: _Stashed) -> None:
        if entry.back is not None:
            return
        if self.stream is None:
            entry.back = [h.clone() for h in entry.host]
            return
        current = torch.cuda.current_stream(self.device)
        entry.back = [torch.empty(h.shape, dtype=h.dtype, device=self.device) for h in entry.host]
        self.stream.wait_stream(current)  # the memory it reuses is free of the work issued before
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(entry.copied_out)
            for b, h in zip(entry.back, entry.host, strict=True):
                b.copy_(h, non_blocking=True)
        entry.copied_back = self.stream.record_event()

    def clear(self) -> None:
        """Forget what a step left (a step that stopped before its backward)."""
        for entry in self.stashed.values():
            self.buffers.give_back(entry.memory)
        self.stashed.clear()
        self.bytes_out = 0

    def close(self) -> None:
        """Give the host buffers back to the system (the end of a run)."""
        if self.stream is not None:
            self.stream.synchronize()  # no copy still reads or writes them
        self.clear()
        self.buffers.close()
