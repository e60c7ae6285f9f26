"""Sizes: the budget's parser, a candidate's bytes in its block blob (measured or to come), and the error a budget
or cap raises.

The plan itself (which rung each layer takes within the budget) is compiler/plan.py.
"""
from __future__ import annotations

import math

import torch

from .. import sizes
from ..quant import tensor_layout
from ..slab.manifest import align_up

OBJECTIVES = ("size", "quality")


class BudgetError(ValueError):
    """The thresholds cannot be met within the budget (or the budget cannot be parsed)."""


def parse_size(text: str, flag: str | None = None) -> int:
    """'12GB', '11.5GiB', '800MB', '123456' -> bytes; :class:`BudgetError` (naming ``flag``) when unreadable."""
    try:
        return sizes.parse_size(text, flag)
    except sizes.SizeError as exc:
        raise BudgetError(str(exc)) from None


def layer_candidate_bytes(spec, shape: tuple[int, int]) -> int:
    """Bytes a ``shape`` layer's candidate at ``spec`` adds to its block blob, before it exists: its tensors, and a
    smoothed candidate's float32 inverse scales."""
    return layout_bytes(spec, shape) + align_up(4 * shape[1])


def layout_bytes(spec, shape: tuple[int, int]) -> int:
    """Bytes of a ``shape`` layer's stored tensors at ``spec``, each 256-aligned as in a block blob."""
    return sum(align_up(torch.empty((), dtype=d).element_size() * math.prod(s))
               for d, s in tensor_layout(spec, shape).values())


def block_candidate_bytes(block, specs) -> int:
    """Bytes of one block's candidates at ``specs``: every linear layer at every spec, smoothed candidates' scales
    included."""
    from torch import nn

    return sum(layer_candidate_bytes(spec, tuple(m.weight.shape)) for m in block.modules()
               if isinstance(m, nn.Linear) for spec in specs)


def largest_block_candidates(skeleton, block_paths, specs) -> int:
    """The most bytes one block's candidates at ``specs`` take (:func:`block_candidate_bytes`)."""
    return max((block_candidate_bytes(skeleton.get_submodule(path), specs) for path in block_paths), default=0)


def candidate_bytes(c) -> int:
    """Bytes a candidate adds to its block blob (every stored tensor starts 256-aligned)."""
    return sum(align_up(t.numel() * t.element_size()) for t in c.qweight.tensors.values())


# the manifest's JSON per layer (its spec, measurements and reasons: about 1.5 KB on FLUX.1), with room to spare
MANIFEST_PER_LAYER = 8 << 10


def _stored_bytes(t) -> int:
    """Bytes of a tensor outside the quantized layers as the slab and the runtime hold it (floating ones in bf16)."""
    return t.numel() * (2 if t.is_floating_point() else t.element_size())


def _shape_parts(skeleton, block_paths, specs, scales: bool = False):
    """From ``skeleton``'s shapes alone, per tensor: (the block it belongs to, None for a resident one; its fewest
    bytes; its most bytes; whether it is a linear layer's weight). A layer's weight at its smallest rung among
    ``specs`` (with ``scales``, plus the smoothing scales the search may give it: the most its smallest rung can take)
    and at its largest with smoothing's scales and its manifest entry; any other tensor as stored; each 256-aligned as
    the slab stores it."""
    from torch import nn

    weights = {f"{name}.weight": tuple(m.weight.shape) for path in block_paths
               for name, m in skeleton.get_submodule(path).named_modules(prefix=path) if isinstance(m, nn.Linear)}
    prefixes = [(p + ".", p) for p in block_paths]
    for name, t in skeleton.state_dict().items():
        block = next((path for prefix, path in prefixes if name.startswith(prefix)), None)
        if name in weights:
            at = layer_candidate_bytes if scales else layout_bytes
            yield (block, min(at(spec, weights[name]) for spec in specs),
                   max(layer_candidate_bytes(spec, weights[name]) for spec in specs) + MANIFEST_PER_LAYER, True)
        else:
            stored = align_up(_stored_bytes(t))
            yield block, stored, stored, False


def slab_bounds(skeleton, block_paths, specs) -> tuple[int, int, int, int]:
    """From ``skeleton``'s shapes alone: (the resident tensors, the blocks' other tensors, every layer at its smallest
    rung among ``specs``, every layer at its largest with smoothing's scales and its manifest entry), each 256-aligned
    as the slab stores it (floating tensors in bf16)."""
    resident = fixed = least = most = 0
    for block, fewest, largest, layer in _shape_parts(skeleton, block_paths, specs):
        if layer:
            least, most = least + fewest, most + largest
        elif block is None:
            resident += fewest
        else:
            fixed += fewest
    return resident, fixed, least, most


def least_slab_bytes(skeleton, block_paths, specs) -> tuple[int, int, int]:
    """A lower bound on any slab of ``skeleton``: (the resident tensors, the blocks' other tensors, every layer at its
    smallest rung among ``specs``). The manifest and a smoothed layer's scales only add to it."""
    return slab_bounds(skeleton, block_paths, specs)[:3]


def most_slab_bytes(skeleton, block_paths, specs) -> int:
    """An upper bound on any slab of ``skeleton`` at rungs ``specs``: every layer at its largest rung, and the
    manifest. A ``--budget`` above it is never spent."""
    resident, fixed, _, most = slab_bounds(skeleton, block_paths, specs)
    return resident + fixed + most + (1 << 20)


def least_block_bytes(skeleton, block_paths, specs, scales: bool = False) -> dict[str, int]:
    """Each block's fewest bytes, from ``skeleton``'s shapes alone: its layers at their smallest rung among ``specs``
    and its other tensors as stored (a lower bound on what the plan can make of it). With ``scales``, each layer's
    smallest rung with the smoothing scales the search may add to it: what the block takes at most with every layer
    at its smallest rung, so a block cap of that holds it whatever the search picks (a rung's other transforms,
    clipping and rotation, store no more)."""
    out = dict.fromkeys(block_paths, 0)
    for block, fewest, _, _ in _shape_parts(skeleton, block_paths, specs, scales):
        if block is not None:
            out[block] += fewest
    return out


def largest_least_block(skeleton, block_paths, specs, scales: bool = False) -> tuple[str, int]:
    """The block with the most bytes at the smallest rung (:func:`least_block_bytes`), and those bytes."""
    least = least_block_bytes(skeleton, block_paths, specs, scales)
    path = max(least, key=least.get)
    return path, least[path]


def check_block_cap(cap: int | None, skeleton, block_paths, specs) -> None:
    """Refuse, before anything is measured, a ``--max-block-bytes`` below what a block can take with every layer at
    its smallest rung (smoothing's scales included: which layers the search smooths is known only after calibration,
    and the plan cannot take them off again), so that a cap this lets through is never refused after the search."""
    if cap is None:
        return
    path, need = largest_least_block(skeleton, block_paths, specs, scales=True)
    if need > cap:
        raise BudgetError(f"--max-block-bytes {cap:,} cannot hold block {path}, which can take {need:,} bytes with "
                          "every layer at the smallest rung of --formats and its smoothing scales; raise "
                          f"--max-block-bytes to at least {need:,} ({sizes.format_size_up(need)}), or offer a smaller "
                          "rung in --formats.")


def check_vram_cap(cap: int | None, slots: int, skeleton, block_paths, specs) -> None:
    """Refuse, before anything is measured, a ``--vram-cap`` below the resident tensors and ``slots`` ring slots of
    the largest block with every layer at its smallest rung, smoothing's scales included (:func:`check_block_cap`)."""
    if cap is None:
        return
    prefixes = tuple(p + "." for p in block_paths)  # the resident tensors as the runtime holds them, unaligned
    resident = sum(_stored_bytes(t) for n, t in skeleton.state_dict().items() if not n.startswith(prefixes))
    path, block = largest_least_block(skeleton, block_paths, specs, scales=True)
    slots = max(slots, 1)
    need = resident + slots * block
    if cap < need:
        raise BudgetError(f"--vram-cap {cap:,} cannot hold the resident tensors ({resident:,} bytes) and {slots} ring "
                          f"slots of block {path}, which can take {block:,} bytes with every layer at the smallest "
                          f"rung of --formats and its smoothing scales: {need:,} bytes in all; raise --vram-cap to at "
                          f"least {need:,} ({sizes.format_size_up(need)}), or offer a smaller rung in --formats.")


def check_least_budget(budget: int, skeleton, block_paths, specs) -> None:
    """Refuse, before anything is measured, a ``--budget`` below :func:`least_slab_bytes`."""
    resident, fixed, layers = least_slab_bytes(skeleton, block_paths, specs)
    least = resident + fixed + layers
    if budget < least:
        raise BudgetError(f"--budget {budget:,} bytes is below the smallest slab this model can have, "
                          f"{least:,} bytes ({sizes.format_size_up(least)}): its resident tensors "
                          f"({sizes.format_size(resident)}), its blocks' other tensors ({sizes.format_size(fixed)}) "
                          f"and every layer at its smallest rung ({sizes.format_size(layers)}); raise --budget to "
                          "more than that (the manifest and the measured plan add to it).")

