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


@dataclass(frozen=True)
class GroupClipResult:
    clip: torch.Tensor  # [N, G] the chosen ratio of every group
    error: float  # weighted squared error with those ratios
    error_unclipped: float  # the same with no clipping


def search_group_clip(
    w: torch.Tensor,
    spec: QuantSpec,
    act_second_moment: torch.Tensor | None = None,
    smooth_scale: torch.Tensor | None = None,
    ratios: tuple[float, ...] = DEFAULT_CLIP_RATIOS,
) -> GroupClipResult:
    """Choose each group's clip ratio separately.

    Every (row, group) has its own scale, and the (activation-weighted) squared error is a sum over
    those groups, so the best ratio per group minimises the layer's error exactly and never does worse
    than any single ratio for the whole layer. Ties keep the larger ratio.
    """
    n, k = w.shape
    g = spec.group_size
    groups = -(-k // g)
    ref = w.detach().float()
    h = torch.ones(k, device=ref.device) if act_second_moment is None else act_second_moment.to(ref.device).float()
    best_err = best_clip = None
    unclipped = None
    for r in sorted(set(ratios) | {1.0}, reverse=True):
        approx = fake_quantize(ref, spec.with_clip(r), smooth_scale)
        per = ((approx - ref).double().pow(2) * h.double()[None, :])
        per = torch.nn.functional.pad(per, (0, groups * g - k)).reshape(n, groups, g).sum(-1)
        if unclipped is None:
            unclipped, best_err = per, per.clone()
            best_clip = torch.full((n, groups), r, dtype=torch.float32, device=ref.device)
            continue
        better = per < best_err
        best_err = torch.where(better, per, best_err)
        best_clip = torch.where(better, torch.full_like(best_clip, r), best_clip)
    return GroupClipResult(best_clip, float(best_err.sum()), float(unclipped.sum()))
