"""Streaming an in-memory module's blocks for inference: the large text encoders while the cache fills.

FLUX.1's T5-XXL encoder is 9.5 GB in bf16, more than the GPU a SquareQ user trains on may have free.
:func:`stream_module` runs the blocks through the same ring of device slots, copy stream and prefetch as a slab,
so only ``prefetch`` blocks are on the device at once; each block travels as one blob (the layout a slab block has:
tensors at aligned offsets). Where the blobs wait on the host is ``host``:

* ``"pinned"``: every block packed once into one page-locked buffer (the module's own host tensors freed as they
  move in): the fastest, and the whole encoder in host memory;
* ``"ring"``: the module keeps its host tensors (memory-mapped from the weights file when the library loaded them
  that way, so they cost page cache, not the process's own memory) and a reader thread packs each block on demand
  into a ring of ``stages`` page-locked buffers (runtime/host/staging.py's ``StagingRing``), casting as it copies.

The module's other tensors (embeddings, final norm) move to the device. The result serves forwards without
gradients only.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import BlockRunner
from .host.staging import STAGES, PinnedArena, StagingRing
from .streamer import Streamer
from .telemetry import Telemetry

ALIGN = 256  # bytes; every tensor in a blob starts at a multiple, so typed views of a slot are aligned


@dataclass
class _Entry:
    owner: nn.Module
    attr: str
    is_param: bool
    offset: int
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, blob: torch.Tensor) -> torch.Tensor:
        return blob[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)

    def wrap(self, value: torch.Tensor) -> torch.Tensor:
        return nn.Parameter(value, requires_grad=False) if self.is_param else value

    def set(self, value: torch.Tensor) -> None:
        """Put ``value`` (from :meth:`wrap`) in the owner's parameter or buffer table."""
        (self.owner._parameters if self.is_param else self.owner._buffers)[self.attr] = value


@dataclass
class _InferenceOnly:
    """What a :class:`BlockRunner` asks of its runtime; these blocks never train, so never checkpoint."""

    class_name: str
    checkpointing: bool = False
    resident_blocks: tuple = ()  # nothing is kept on the device and nothing is timed (runtime/residency.py)
    block_timer: None = None
    graphs: None = None  # no CUDA graphs (runtime/block_graphs.py): these run once per caption batch


def largest_block_list(module: nn.Module) -> str:
    """The path of the ``nn.ModuleList`` holding the most parameter bytes (``encoder.block`` for T5)."""
    best, best_bytes = None, 0
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name:
            size = sum(p.numel() * p.element_size() for p in child.parameters())
            if size > best_bytes:
                best, best_bytes = name, size
    if best is None:
        raise ValueError(f"{type(module).__name__} has no nn.ModuleList of blocks to stream; pass blocks= explicitly.")
    return best


def run_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` runs in: ``dtype`` for floating tensors (None: their own), integers unchanged."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _layout(block: nn.Module, dtype: torch.dtype | None) -> tuple[list[_Entry], int]:
    entries, offset = [], 0
    for owner in block.modules():
        for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
            for attr, t in table.items():
                if t is None:
                    continue
                entries.append(_Entry(owner, attr, is_param, offset, run_dtype(t, dtype), t.shape))
                offset = -(-(offset + entries[-1].nbytes) // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def blob_bytes(block: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of ``block``'s blob on the host and in a device slot: its tensors in ``dtype``, each at an aligned
    offset."""
    return _layout(block, dtype)[1]


HOSTS = ("pinned", "ring")
RING_STAGES = STAGES  # page-locked staging buffers of host="ring"


def stream_module(module: nn.Module, device: str | torch.device, blocks: str | None = None,
                  prefetch: int = 2, host: str = "pinned", dtype: torch.dtype | None = None,
                  stages: int = RING_STAGES) -> nn.Module:
    """Make ``module`` (on the host) run on ``device`` with its blocks streamed; returns ``module``.

    blocks: the path of the ``nn.ModuleList`` to stream (default: the largest one). Everything outside it
    moves to ``device``. ``host="pinned"``: the host copies of the block tensors are replaced by the page-locked
    blobs, so host memory does not double; ``host="ring"``: they stay where they are and ``stages`` page-locked
    buffers carry the blocks (see the module docstring). ``dtype``: what floating tensors run in (None: their
    own), cast block by block as they are packed, never the whole module at once. Forwards must run without
    gradients.
    """
    if host not in HOSTS:
        raise ValueError(f"host={host!r}: choose one of {', '.join(HOSTS)}.")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = blocks or largest_block_list(module)
    block_list = list(module.get_submodule(path))
    inside = {id(m) for b in block_list for m in b.modules()}
    for owner in module.modules():
        if id(owner) in inside:
            continue
        for table in (owner._parameters, owner._buffers):
            for attr, t in table.items():
                if t is not None:
                    moved = t.detach().to(device, run_dtype(t, dtype))
                    table[attr] = nn.Parameter(moved, requires_grad=False) if isinstance(t, nn.Parameter) else moved

    layouts = [_layout(b, dtype) for b in block_list]
    sizes = [size for _, size in layouts]
    if host == "ring":
        # the module's own host tensors stay: each block is packed from them whenever it is needed
        originals = [[(e, (e.owner._parameters if e.is_param else e.owner._buffers)[e.attr]) for e in entries]
                     for entries, _ in layouts]

        def pack(index: int, stage: torch.Tensor) -> None:
            for e, t in originals[index]:
                e.view(stage).copy_(t.detach())

        arena = StagingRing(sizes, pack, device, stages, name="squareq-encoder-reader")
        host_views = originals
    else:
        def fill(index: int, blob: torch.Tensor) -> None:
            for e in layouts[index][0]:
                table = e.owner._parameters if e.is_param else e.owner._buffers
                e.view(blob).copy_(table[e.attr].detach())
                e.set(e.wrap(e.view(blob)))  # the original host tensor is freed now, one block at a time

        arena = PinnedArena(sizes, fill, device)
        host_views = [[(e, e.wrap(e.view(arena.blob(i)))) for e in entries] for i, (entries, _) in enumerate(layouts)]
    slot_views: dict[tuple[int, int], list] = {}

    def bind(block: int, key: int, buffer: torch.Tensor) -> None:
        views = slot_views.get((block, key))
        if views is None:
            views = slot_views[(block, key)] = [(e, e.wrap(e.view(buffer))) for e in layouts[block][0]]
        for e, v in views:
            e.set(v)

    def unbind(block: int) -> None:
        for e, v in host_views[block]:
            e.set(v)

    streamer = Streamer(arena, device, prefetch, max(sizes), sizes, bind, unbind, Telemetry(device, None))
    runtime = _InferenceOnly(type(module).__name__)
    for i, block in enumerate(block_list):
        block.forward = BlockRunner(block, i, streamer, runtime)
    module.requires_grad_(False)
    module.eval()
    weakref.finalize(module, streamer.close)
    object.__setattr__(module, _HANDLE, (streamer, block_list))
    return module


_HANDLE = "_squareq_module_stream"


def release_module(module: nn.Module) -> None:
    """Undo :func:`stream_module` now: unlock and drop its host blobs and device slots (the blocks' tensors go with
    them, so the module cannot run again). Without it they go when the module is garbage-collected."""
    handle = module.__dict__.pop(_HANDLE, None)
    if handle is None:
        return
    streamer, block_list = handle
    streamer.close()
    for block in block_list:
        block.__dict__.pop("forward", None)  # the runner refers back to its block: break the cycle
        for owner in block.modules():
            for table in (owner._parameters, owner._buffers):
                for attr in table:
                    table[attr] = None
    streamer.slots.clear()
