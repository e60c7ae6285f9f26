"""Data-parallel training across processes (``torchrun --nproc-per-node N -m squareq train ...``).

Every rank streams its own copy of the blocks and holds the same LoRA. A step's global batch (batch size ×
ranks, one bucket) is drawn identically on every rank, noise and timesteps included, and each rank takes its
contiguous share; after the backward the LoRA gradients are averaged with one all-reduce. So N ranks with
batch b take the same steps as one process with batch N·b (tested with gloo on a CPU). The ranks of one host
map one shared host copy of the slab's blobs (``host="shared"``) instead of pinning a copy each. Only rank 0 fills the
cache, writes checkpoints, samples, metrics and the LoRA file; the others wait at a barrier.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1  # ranks on this host

    @classmethod
    def from_env(cls, backend: str) -> Ranks:
        """The process group torchrun describes in the environment (or a single process without one)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            # rank 0 alone fills the cache and draws samples while the others wait in a collective: give it time
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(hours=2))
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, size: int) -> slice:
        """This rank's contiguous part of a global batch of ``size`` items (sizes are multiples of ``world``)."""
        per = size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def average_grads(self, params: list[torch.Tensor]) -> None:
        """Replace every gradient by its mean over the ranks (one all-reduce of a flat buffer)."""
        if self.world == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def gather(self, values: list[float], device) -> list[list[float]]:
        """Each of ``values`` from every rank: one list per value, in rank order (every rank must call it)."""
        if self.world == 1:
            return [[v] for v in values]
        mine = torch.tensor(values, dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        return [[float(t[i]) for t in every] for i in range(len(values))]

    def mean(self, value: float, device) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t) / self.world

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()
