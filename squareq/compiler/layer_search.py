"""One layer at one rung (a format at one width): search smoothing α and clip ratio, round, and keep only what beats
plain rounding.

Every choice is made on the layer's output error ``‖XWᵀ − XŴᵀ‖² / ‖XWᵀ‖²``, not on weight error. The search
proposes on the calibration (fit) rows: the α and clip ratio whose round-to-nearest result is best there, and
GPTQ-style rounding fitted to their Gram matrix; and the same in the space rotated by a Hadamard transform within each
group (``QuantSpec.rotate``): plain rounding, a clip ratio, and GPTQ. The held-out rows then decide between plain
round-to-nearest (no smoothing, no clipping, no rotation) and every proposal: a transform stays only where it lowers
the error on rows it was not tuned on. On real data this matters: the search tuned on random token ids made a real text
model 35% worse than plain rounding (docs/compiler.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .. import kernels, quant
from ..quant import QuantizedWeight, QuantSpec
from .calibration import LayerStats

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75)
# GPTQ's damping, as a fraction of the mean diagonal of the input second moments. 0.1 rather than the usual 0.01:
# calibration data is a few hundred sentences or a few dozen images, not the data the model will see; on a real
# text model measured on other corpora, 0.1 gave 7-8% less model-output error and cost about 1% on the calibration
# corpus's own held-out rows (docs/compiler.md, "GPTQ damping").
GPTQ_DAMP = 0.1
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
ROUNDINGS = ("gptq", "nearest")


@dataclass
class Candidate:
    """The best quantization of a layer at one rung, with what was measured to choose it."""

    qweight: QuantizedWeight
    alpha: float
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rung(self) -> str:
        """The rung's name (``W4``, ``NF4``, ``bf16``, ...)."""
        return self.qweight.spec.short_label

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes


def weight_metrics(w: torch.Tensor, deq: torch.Tensor) -> dict[str, float]:
    """The stored weight against the original: rel-MSE and SQNR (dB), measured here on the compile device so that
    writing the slab need not read the original weights again."""
    return {"weight_rel_mse": float(quant.rel_mse(w, deq)), "weight_sqnr_db": quant.sqnr_db(w, deq)}


def group_scale_ratio(qw: QuantizedWeight, w: torch.Tensor, smooth: torch.Tensor | None) -> float:
    """max / median of the layer's unclipped group scales (1.0 for bf16).

    Taken before clipping, so it describes the weight (as stored, after smoothing) rather than the
    clip search's choices, and does not move when per-group clipping does.
    """
    if qw.spec.is_passthrough:
        return 1.0
    unclipped = replace(qw.spec, clip_ratio=1.0, smooth=False)
    s = quant.group_scales(w, unclipped, smooth).float().reshape(-1)
    med = float(s.median())
    return float(s.max()) / med if med > 0 else float("inf")


def search_layer(w: torch.Tensor, stats: LayerStats, spec: QuantSpec, rounding: str = "gptq",
                 alphas=DEFAULT_ALPHAS, rotate: bool = True, refine: bool = True) -> Candidate:
    """The quantization of ``w [N, K]`` in the format of ``spec`` (its width, group size and symmetry) with the
    lowest output rel-MSE on the held-out rows, among plain round-to-nearest and the transforms the search proposes
    on the calibration rows (module docstring).

    α = 0 means no smoothing. One clip ratio per layer, by activation-weighted error (per-group ratios minimise that
    proxy exactly but raised the medium model's held-out output error from 4.8e-3 to 8.5e-3, through its few-row
    adaLN layers: docs/compiler.md). α and clip are proposed with round-to-nearest; GPTQ then runs once, at the
    proposed α and clip (a quarter of the GPTQ runs of trying it at every α, which dominates compile time at 12B), and
    only for formats GPTQ can round onto (``int``). With ``rotate``, where the format can rotate and K is whole groups,
    the rotated options (:func:`rotated_options`) are judged with them. With ``refine``, the winner's codes are then
    moved by learned rounding (squareq/quant/refine.py, fitted to the calibration rows' Gram matrix), and the result
    is kept only if its held-out error is lower still (``int`` formats, GPTQ rounding).
    A tie keeps the simpler candidate. The metrics record the held-out error of the result (``output_rel_mse`` =
    ``heldout_rel_mse``), that of plain rounding (``heldout_rtn_rel_mse``), and the result's error on the calibration
    rows (``calib_rel_mse``).
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} must be one of {ROUNDINGS}.")
    w = w.detach().float()
    fit, held = stats.rows, stats.judging_rows
    if spec.is_passthrough:
        qw = quant.quantize(w, QuantSpec(bits=16))
        return Candidate(qw, 0.0, _measure(w, qw, fit, held, stats, 0.0, 0.0, False))
    base = replace(spec, clip_ratio=1.0, smooth=False, rotate=False)
    options = [(quant.quantize(w, base), 0.0, None, False), *_proposals(w, stats, base, rounding, alphas)]
    if rotate and can_rotate(base, w.shape[1]):
        options += rotated_options(w, stats, base, rounding)
    judged = [quant.output_rel_mse(w, quant.dequantize(o[0]), held) for o in options]
    pick = min(range(len(options)), key=lambda i: (judged[i], i))
    qw, alpha, smooth, used_gptq = options[pick]
    best, refined = judged[pick], False
    if refine and _uses_gptq(qw.spec, stats, rounding):
        # GPTQ's damping: undamped, the descent fitted the calibration text closer and did worse on other text
        # (docs/compiler.md, "Learned rounding")
        moved, _ = quant.refine_rounding(qw, w, stats.hessian, damp=GPTQ_DAMP)
        error = quant.output_rel_mse(w, quant.dequantize(moved), held)
        if error < best:
            qw, best, refined = moved, error, True
    return Candidate(qw, alpha, _measure(w, qw, fit, held, stats, alpha, judged[0], used_gptq, smooth, best,
                                         refined))


def _gptq(w: torch.Tensor, spec: QuantSpec, stats: LayerStats, smooth: torch.Tensor | None) -> QuantizedWeight:
    return quant.gptq_quantize(w, spec, stats.hessian, smooth, damp=GPTQ_DAMP, sweep=kernels.gptq_sweep(w.device))


def _uses_gptq(spec: QuantSpec, stats: LayerStats, rounding: str) -> bool:
    return rounding == "gptq" and stats.has_hessian and quant.FORMATS[spec.format].gptq


def _proposals(w: torch.Tensor, stats: LayerStats, base: QuantSpec, rounding: str, alphas) -> list[tuple]:
    """The search's proposal (the α and clip whose rounding is best on the fit rows) and its GPTQ result, as
    ``(qweight, alpha, smoothing scale, gptq)`` options."""
    proposal = None
    for alpha in alphas:
        smooth = quant.smoothing_scale(stats.absmax, w, alpha) if alpha > 0 else None
        tried = replace(base, smooth=alpha > 0)
        clip = quant.search_clip_ratio(w, tried, stats.second_moment, smooth, ratios=CLIP_RATIOS).clip_ratio
        qw = quant.quantize(w, tried.with_clip(clip), smooth)
        err = quant.output_rel_mse(w, quant.dequantize(qw), stats.rows)
        if proposal is None or err < proposal[0]:
            proposal = (err, qw, alpha, smooth)
    _, searched, alpha, smooth = proposal
    options = [(searched, alpha, smooth, False)]
    if _uses_gptq(base, stats, rounding):
        options.append((_gptq(w, searched.spec, stats, smooth), alpha, smooth, True))
    return options


def can_rotate(spec: QuantSpec, k: int) -> bool:
    """Whether the search tries the rotated options for a layer of ``k`` inputs under ``spec``'s format."""
    return not spec.is_passthrough and quant.FORMATS[spec.format].rotate and k % spec.group_size == 0


def rotated_options(w: torch.Tensor, stats: LayerStats, base: QuantSpec, rounding: str) -> list[tuple]:
    """The options of the rotated space (the weight stored as ``W·H``, squareq/quant/hadamard.py): plain rounding,
    rounding at the clip ratio the activation-weighted search picks there (weighted by the rotated inputs' second
    moments, ``diag(H·Σ·H)``), and GPTQ fitted to the rotated Gram matrix ``H·Σ·H`` at clip 1 and at that clip.

    Without smoothing: in the rotated space of all-MiniLM-L6-v2's 36 layers at W4, the smoothing search proposed
    α > 0 for 12, and its result erred more on the held-out rows than the search without smoothing for 11 of them;
    on the 12th, rotated GPTQ at clip 1 erred less than either (docs/compiler.md, "Hadamard rotation")."""
    rot = replace(base, rotate=True)
    second = stats.rotated_second_moment(base.group_size)
    clip = quant.search_clip_ratio(quant.rtn.rotated(w, rot), base, None if second is None else second.to(w.device),
                                   ratios=CLIP_RATIOS).clip_ratio
    specs = [rot] + ([rot.with_clip(clip)] if clip < 1.0 else [])
    options = [(quant.quantize(w, s), 0.0, None, False) for s in specs]
    if _uses_gptq(base, stats, rounding):
        options += [(_gptq(w, s, stats, None), 0.0, None, True) for s in specs]
    return options


def _measure(w, qw, fit, held, stats: LayerStats, alpha: float, rtn_heldout: float, gptq: bool,
             smooth: torch.Tensor | None = None, heldout: float | None = None,
             refined: bool = False) -> dict[str, float]:
    deq = quant.dequantize(qw)
    heldout = quant.output_rel_mse(w, deq, held) if heldout is None else heldout
    return {
        **weight_metrics(w, deq),
        "output_rel_mse": heldout,
        "heldout_rel_mse": heldout,
        "heldout_rtn_rel_mse": heldout if qw.spec.is_passthrough else rtn_heldout,
        "calib_rel_mse": quant.output_rel_mse(w, deq, fit),
        "act_outlier_score": stats.outlier_score(smooth),
        "scale_ratio": group_scale_ratio(qw, w, smooth),
        "alpha": alpha,
        "clip_ratio": qw.spec.clip_ratio,
        "gptq": float(gptq),
        "rotate": float(qw.spec.rotate),
        "refined": float(refined),
    }
