"""Clip-ratio search: pick the clip ratio that minimises (activation-weighted) weight error."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .metrics import weighted_sq_error
from .rtn import fake_quantize
from .spec import QuantSpec

DEFAULT_CLIP_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.00, 0.95, ..., 0.50


@dataclass(frozen=True)
class ClipSearchResult:
    clip_ratio: float
    error: float  # weighted squared error at the chosen ratio
    error_unclipped: float  # the same at clip_ratio = 1.0


def search_clip_ratio(
    w: torch.Tensor,
    spec: QuantSpec,
    act_second_moment: torch.Tensor | None = None,
    smooth_scale: torch.Tensor | None = None,
    ratios: tuple[float, ...] = DEFAULT_CLIP_RATIOS,
) -> ClipSearchResult:
    """Try each clip ratio and keep the one with the least error.

    With ``act_second_moment`` (E[x_k²] per input channel) the error is weighted by it, which
    approximates the layer's output error rather than its weight error. Ties keep the larger ratio.
    """
    if spec.is_passthrough:
        return ClipSearchResult(1.0, 0.0, 0.0)
    ref = w.detach().float()
    errors = {}
    for r in sorted(set(ratios) | {1.0}, reverse=True):
        approx = fake_quantize(ref, spec.with_clip(r), smooth_scale)
        errors[r] = weighted_sq_error(ref, approx, act_second_moment)
    best = min(errors, key=lambda r: (errors[r], -r))
    return ClipSearchResult(best, errors[best], errors[1.0])
