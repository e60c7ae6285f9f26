"""The W4 → W6 → W8 → bf16 ladder for one layer: climb while any threshold trips, and say why."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .calibration import LayerStats
from .layer_search import Candidate, search_layer
from .thresholds import Thresholds

RUNGS = (4, 6, 8, 16)


@dataclass
class LayerDecision:
    """Where a layer ended, every rung measured on the way, and the reasons it left each lower rung."""

    name: str
    chosen: Candidate
    tried: list[Candidate]
    reasons: list[str] = field(default_factory=list)

    def candidate(self, bits: int) -> Candidate | None:
        return next((c for c in self.tried if c.bits == bits), None)


def trips(c: Candidate, t: Thresholds) -> list[str]:
    """Each threshold the candidate exceeds, as 'W4: output rel-MSE 0.031 > τ_MSE 0.01'."""
    if c.bits == 16:
        return []
    m, b, out = c.metrics, c.bits, []
    if m["output_rel_mse"] > t.mse:
        out.append(f"W{b}: output rel-MSE {m['output_rel_mse']:.4g} > τ_MSE {t.mse:g}")
    if m["act_outlier_score"] > t.range_limit("act", b):
        out.append(f"W{b}: activation outlier score {m['act_outlier_score']:.4g} > τ_ACT·2^{b - 4} "
                   f"{t.range_limit('act', b):g}")
    if m["scale_ratio"] > t.range_limit("scale", b):
        out.append(f"W{b}: group-scale ratio {m['scale_ratio']:.4g} > τ_SCALE·2^{b - 4} {t.range_limit('scale', b):g}")
    return out


def climb(name: str, w: torch.Tensor, stats: LayerStats, thresholds: Thresholds, min_bits: int = 4,
          rounding: str = "gptq", group_size: int = 64, measure_all: bool = False) -> LayerDecision:
    """Start at ``min_bits`` and move up while a threshold trips; bf16 always passes.

    ``measure_all`` also measures the rungs above the chosen one (the quality objective needs their
    error and size to spend a remaining budget).
    """
    if min_bits not in RUNGS:
        raise ValueError(f"min_bits={min_bits} must be one of {RUNGS}.")
    tried, reasons, chosen = [], [], None
    for bits in (b for b in RUNGS if b >= min_bits):
        c = search_layer(w, stats, bits, group_size=group_size, rounding=rounding)
        tried.append(c)
        if chosen is None:
            failed = trips(c, thresholds)
            if not failed:
                chosen = c
                if not measure_all:
                    break
            reasons += failed
    return LayerDecision(name, chosen, tried, reasons)
