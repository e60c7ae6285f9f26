"""The ladder of one layer: every rung measured, and the diagnostics each rung shows.

A rung is a registered format at one width (squareq/quant/formats/), named by its short label: ``NF4``, ``W4``,
``W6``, ``FP8``, ``W8`` and ``bf16``, ordered by the bytes they store per weight. ``squareq compile --formats`` picks
the rungs to measure (:data:`DEFAULT_FORMATS` by default); a format added to the registry is a rung without a change
here.

Which rung a layer takes is decided for the whole model at once, by measured effect on the model's output per byte
(compiler/plan.py). The layer's own error (τ_MSE) and the dynamic-range scores (τ_ACT, τ_SCALE) are diagnostics:
shown by ``squareq inspect``, never a reason to move (docs/compiler.md, "What predicts the output error").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..quant import FORMATS, QuantSpec, tensor_layout
from .layer_search import Candidate, search_rungs
from .layer_statistics import LayerStats
from .thresholds import Thresholds

# The int ladder. NF4 and FP8 are offered through --formats: on the real text model of docs/benchmarks.md ("Formats
# on the ladder"), with every rung offered the planner took NF4 for 1 layer of 36 and FP8 for none, and the error per
# byte stayed within 2.6% of this ladder's, for a quarter more compile time.
DEFAULT_FORMATS = ("W4", "W6", "W8", "bf16")
_REFERENCE_SHAPE = (256, 3072)  # for ordering rungs by bytes per weight (scales and zero points included)


def bytes_per_weight(spec: QuantSpec) -> float:
    """What ``spec`` stores per weight, scales and zero points included, on a typical layer's shape."""
    n, k = _REFERENCE_SHAPE
    layout = tensor_layout(spec, _REFERENCE_SHAPE)
    return sum(torch.empty((), dtype=dtype).element_size() * torch.Size(shape).numel()
               for dtype, shape in layout.values()) / (n * k)


def ladder(group_size: int = 64, symmetric: bool = False) -> dict[str, QuantSpec]:
    """Every rung the format registry offers, by name, from the fewest bytes per weight to the most. Formats without
    zero points are symmetric whatever ``symmetric`` says."""
    specs = [QuantSpec(bits=16)]
    for fmt in FORMATS.values():
        for bits in fmt.bits:
            specs.append(QuantSpec(bits=bits, group_size=group_size, symmetric=symmetric or not fmt.zero_points,
                                   format=fmt.name))
    return {s.short_label: s for s in sorted(specs, key=lambda s: (bytes_per_weight(s), s.bits))}


def rung_specs(names, group_size: int = 64) -> list[QuantSpec]:
    """The specs of the rungs ``names`` (``--formats``), from the fewest bytes to the most. Raises ValueError with a
    sentence for an unknown or repeated name."""
    offered = ladder(group_size)
    names = list(names)
    unknown = [n for n in names if n not in offered]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"--formats {','.join(map(str, names)) or '(empty)'}: name each rung once, from "
                         f"{', '.join(offered)}.")
    return [spec for name, spec in offered.items() if name in names]


@dataclass
class LayerDecision:
    """A layer's measured candidates, one per rung, and the one it starts from (``chosen``)."""

    name: str
    chosen: Candidate
    tried: list[Candidate]
    reasons: list[str] = field(default_factory=list)

    def candidate(self, rung: str) -> Candidate | None:
        return next((c for c in self.tried if c.rung == rung), None)


def diagnostics(spec: QuantSpec, m: dict, t: Thresholds) -> list[str]:
    """Each proxy limit a candidate stored as ``spec`` with metrics ``m`` exceeds, as 'W4: group-scale ratio 138.9 >
    τ_SCALE·2^0 30'. The dynamic-range limits double per bit of the code width."""
    if spec.is_passthrough:
        return []
    r, b = spec.short_label, spec.bits
    out = []
    if m["output_rel_mse"] > t.mse:
        out.append(f"{r}: output rel-MSE {m['output_rel_mse']:.4g} > τ_MSE {t.mse:g}")
    if m["act_outlier_score"] > t.range_limit("act", b):
        out.append(f"{r}: activation outlier score {m['act_outlier_score']:.4g} > τ_ACT·2^{b - 4} "
                   f"{t.range_limit('act', b):g}")
    if m["scale_ratio"] > t.range_limit("scale", b):
        out.append(f"{r}: group-scale ratio {m['scale_ratio']:.4g} > τ_SCALE·2^{b - 4} {t.range_limit('scale', b):g}")
    return out


def measure_rungs(name: str, w: torch.Tensor, stats: LayerStats, rungs: list[QuantSpec],
                  rounding: str = "gptq", rotation: bool = True, learned_rounding: bool = True) -> LayerDecision:
    """Search the layer at each of ``rungs`` (compiler/layer_search.py), with its rotated candidates when
    ``rotation`` and learned rounding when ``learned_rounding``; it starts at the rung of fewest bytes."""
    if not rungs:
        raise ValueError(f"layer {name}: no rungs to measure.")
    tried = search_rungs(w, stats, sorted(rungs, key=bytes_per_weight), rounding=rounding, rotate=rotation,
                         refine=learned_rounding)
    return LayerDecision(name, tried[0], tried)
