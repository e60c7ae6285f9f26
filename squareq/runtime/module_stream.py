"""Streaming an in-memory module's blocks for inference: the large text encoders while the cache fills.

FLUX.1's T5-XXL encoder is 9.5 GB in bf16, more than the GPU a SquareQ user trains on may have free.
:func:`stream_module` packs each block's tensors into one page-locked host blob (the layout a slab block
has: tensors at aligned offsets) and runs the blocks through the same ring of device slots, copy stream
and prefetch as a slab, so only ``prefetch`` blocks are on the device at once. The module's other tensors
(embeddings, final norm) move to the device. The result serves forwards without gradients only.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import BlockRunner
from .host.staging import PinnedArena
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


def _layout(block: nn.Module) -> tuple[list[_Entry], int]:
    entries, offset = [], 0
    for owner in block.modules():
        for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
            for attr, t in table.items():
                if t is None:
                    continue
                entries.append(_Entry(owner, attr, is_param, offset, t.dtype, t.shape))
                offset = -(-(offset + entries[-1].nbytes) // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def stream_module(module: nn.Module, device: str | torch.device, blocks: str | None = None,
                  prefetch: int = 2) -> nn.Module:
    """Make ``module`` (on the host) run on ``device`` with its blocks streamed; returns ``module``.

    blocks: the path of the ``nn.ModuleList`` to stream (default: the largest one). Everything outside it
    moves to ``device``. The host copies of the block tensors are replaced by the page-locked blobs, so
    host memory does not double. Forwards must run without gradients.
    """
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
                    table[attr] = nn.Parameter(t.detach().to(device), requires_grad=False) \
                        if isinstance(t, nn.Parameter) else t.to(device)

    layouts = [_layout(b) for b in block_list]

    def fill(index: int, blob: torch.Tensor) -> None:
        for e in layouts[index][0]:
            table = e.owner._parameters if e.is_param else e.owner._buffers
            e.view(blob).copy_(table[e.attr].detach())
            e.set(e.wrap(e.view(blob)))  # the original host tensor is freed now, one block at a time

    sizes = [size for _, size in layouts]
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
