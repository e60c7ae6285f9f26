"""The W4 → W6 → W8 → bf16 ladder of one layer: every rung measured, and the diagnostics each rung shows.

Which rung a layer takes is decided for the whole model at once, by measured effect on the model's output
(compiler/plan.py). The layer's own error (τ_MSE) and the dynamic-range scores (τ_ACT, τ_SCALE) are diagnostics:
shown by ``squareq inspect``, never a reason to move (docs/compiler.md, "What predicts the output error").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .calibration import LayerStats
from .layer_search import Candidate, search_layer
from .thresholds import Thresholds

RUNGS = (4, 6, 8, 16)


@dataclass
class LayerDecision:
    """A layer's measured candidates, one per rung, and the one it starts from (``chosen``)."""

    name: str
    chosen: Candidate
    tried: list[Candidate]
    reasons: list[str] = field(default_factory=list)

    def candidate(self, bits: int) -> Candidate | None:
        return next((c for c in self.tried if c.bits == bits), None)


def diagnostics(b: int, m: dict, t: Thresholds) -> list[str]:
    """Each proxy limit a candidate at ``b`` bits with metrics ``m`` exceeds, as 'W4: group-scale ratio 138.9 >
    τ_SCALE·2^0 30'."""
    if b == 16:
        return []
    out = []
    if m["output_rel_mse"] > t.mse:
        out.append(f"W{b}: output rel-MSE {m['output_rel_mse']:.4g} > τ_MSE {t.mse:g}")
    if m["act_outlier_score"] > t.range_limit("act", b):
        out.append(f"W{b}: activation outlier score {m['act_outlier_score']:.4g} > τ_ACT·2^{b - 4} "
                   f"{t.range_limit('act', b):g}")
    if m["scale_ratio"] > t.range_limit("scale", b):
        out.append(f"W{b}: group-scale ratio {m['scale_ratio']:.4g} > τ_SCALE·2^{b - 4} {t.range_limit('scale', b):g}")
    return out


def measure_rungs(name: str, w: torch.Tensor, stats: LayerStats, rungs, rounding: str = "gptq",
                  group_size: int = 64) -> LayerDecision:
    """Search the layer at each of ``rungs`` (compiler/layer_search.py); it starts at the lowest."""
    rungs = sorted(rungs)
    if not rungs or any(b not in RUNGS for b in rungs):
        raise ValueError(f"rungs {rungs} must be taken from {RUNGS}.")
    tried = [search_layer(w, stats, bits, group_size=group_size, rounding=rounding) for bits in rungs]
    return LayerDecision(name, tried[0], tried)
