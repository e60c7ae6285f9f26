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
    layout = tensor_layout(spec, shape)
    return sum(align_up(torch.empty((), dtype=d).element_size() * math.prod(s)) for d, s in layout.values()) + \
        align_up(4 * shape[1])


def candidate_bytes(c) -> int:
    """Bytes a candidate adds to its block blob (every stored tensor starts 256-aligned)."""
    return sum(align_up(t.numel() * t.element_size()) for t in c.qweight.tensors.values())
