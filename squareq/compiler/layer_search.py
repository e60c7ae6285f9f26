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
from .layer_statistics import LayerStats

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
    the rotated options (:func:`rotated_specs`) are judged with them. With ``refine``, the winner's codes are then
    moved by learned rounding (squareq/quant/refine.py, fitted to the calibration rows' Gram matrix), and the result
    is kept only if its held-out error is lower still (``int`` formats, GPTQ rounding).
    A tie keeps the simpler candidate. The metrics record the held-out error of the result (``output_rel_mse`` =
    ``heldout_rel_mse``), that of plain rounding (``heldout_rtn_rel_mse``), and the result's error on the calibration
    rows (``calib_rel_mse``).
    """
    return search_rungs(w, stats, [spec], rounding, alphas, rotate, refine)[0]


def search_rungs(w: torch.Tensor, stats: LayerStats, specs: list[QuantSpec], rounding: str = "gptq",
                 alphas=DEFAULT_ALPHAS, rotate: bool = True, refine: bool = True) -> list[Candidate]:
    """:func:`search_layer` at each of ``specs``, with the same results, in less time: the work that does not depend
    on the rung is done once per layer. GPTQ's factor depends only on the space the weight is stored in (rotated or
    not, smoothed by which α), so the GPTQ runs of every rung go in order of space and each space is factored once
    (one factor on the GPU at a time, as compiler/vram.py's search budget counts); learned rounding's matrix likewise.
    Each candidate is judged on the held-out rows when it is made, and only each rung's best is kept."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} must be one of {ROUNDINGS}.")
    w = w.detach().float()
    smooths = _Smoothings(w, stats)
    rungs = [_Rung(w, stats, spec, rounding, alphas, rotate, smooths) for spec in specs]
    factors = _Shared(lambda key, spec, smooth: quant.gptq_factor(stats.hessian, spec, smooth, GPTQ_DAMP,
                                                                  device=w.device))
    for key, rung, index, spec, smooth in sorted(((job[0], i, *job[1:]) for i, r in enumerate(rungs)
                                                  for job in r.gptq_jobs), key=lambda j: j[:3]):
        qw = _gptq(w, spec, stats, smooth, factors.get(key, spec, smooth))
        rungs[rung].offer(index, (qw, key[1], smooth, True))
    factors.drop()
    sigmas = _Shared(lambda key, spec, inv: quant.stored_hessian(stats.hessian, spec, inv, w.device, GPTQ_DAMP))
    results: list[Candidate | None] = [None] * len(rungs)
    for i in sorted(range(len(rungs)), key=lambda i: (rungs[i].space(), i)):  # one learned-rounding Σ per space
        results[i] = rungs[i].result(refine, sigmas)
    return results


class _Shared:
    """One layer's shared matrix (a GPTQ factor, learned rounding's ``Σ``) for one space at a time: asked for
    another space, it frees the one it holds before making the next."""

    def __init__(self, make) -> None:
        self.make, self.key, self.value = make, None, None

    def get(self, key, *args):
        if key != self.key:
            self.drop()
            self.value, self.key = self.make(key, *args), key
        return self.value

    def drop(self) -> None:
        self.key = self.value = None


class _Smoothings:
    """A layer's smoothing scale for each α, made once for all its rungs (the scale depends on α, not on the rung;
    GPTQ's shared factor is keyed by the scale itself)."""

    def __init__(self, w: torch.Tensor, stats: LayerStats) -> None:
        self.w, self.stats, self.scales = w, stats, {}

    def __call__(self, alpha: float) -> torch.Tensor | None:
        if alpha <= 0:
            return None
        if alpha not in self.scales:
            self.scales[alpha] = quant.smoothing_scale(self.stats.absmax, self.w, alpha)
        return self.scales[alpha]


class _Rung:
    """One rung's search: its round-to-nearest options judged when it is made, its GPTQ runs listed for
    :func:`search_rungs` to run in order of space (``(key, index, spec, smoothing)``, the key ``(rotation group,
    α)``), and the best so far. Options keep the order of the one list the search once judged (``index``), so a tie
    still goes to the simpler candidate."""

    def __init__(self, w, stats: LayerStats, spec: QuantSpec, rounding: str, alphas, rotate: bool, smooths) -> None:
        self.w, self.stats, self.spec, self.rounding = w, stats, spec, rounding
        self.best, self.gptq_jobs = None, []
        if spec.is_passthrough:
            self.offer(0, (quant.quantize(w, QuantSpec(bits=16)), 0.0, None, False))
            return
        base = replace(spec, clip_ratio=1.0, smooth=False, rotate=False)
        uses_gptq = _uses_gptq(base, stats, rounding)
        self.offer(0, (quant.quantize(w, base), 0.0, None, False))
        searched, alpha = _proposal(w, stats, base, alphas, smooths)
        self.offer(1, (searched, alpha, smooths(alpha), False))
        index = 2
        if uses_gptq:
            self.gptq_jobs.append(((0, alpha), index, searched.spec, smooths(alpha)))
            index += 1
        if rotate and can_rotate(base, w.shape[1]):
            specs = rotated_specs(w, stats, base)
            for s in specs:
                self.offer(index, (quant.quantize(w, s), 0.0, None, False))
                index += 1
            if uses_gptq:
                self.gptq_jobs += [((base.group_size, 0.0), index + i, s, None) for i, s in enumerate(specs)]

    def offer(self, index: int, option: tuple) -> None:
        """Judge ``option`` (``(qweight, α, smoothing scale, gptq)``) on the held-out rows and keep it if best."""
        error = quant.output_rel_mse(self.w, quant.dequantize(option[0]), self.stats.judging_rows)
        if index == 0:
            self.rtn_heldout = error
        if self.best is None or (error, index) < self.best[:2]:
            self.best = (error, index, option)

    def space(self) -> tuple[int, float]:
        """The best option's stored space, as the shared matrices are keyed: (rotation group or 0, α)."""
        qw, alpha = self.best[2][0], self.best[2][1]
        return (qw.spec.group_size if qw.spec.rotate else 0, alpha)

    def result(self, refine: bool, sigmas: _Shared) -> Candidate:
        w, stats = self.w, self.stats
        best, _, (qw, alpha, smooth, used_gptq) = self.best
        if self.spec.is_passthrough:
            return Candidate(qw, 0.0, _measure(w, qw, stats.rows, stats.judging_rows, stats, 0.0, 0.0, False))
        refined = False
        if refine and _uses_gptq(qw.spec, stats, self.rounding):
            # GPTQ's damping: undamped, the descent fitted the calibration text closer and did worse on other text
            # (docs/compiler.md, "Learned rounding")
            sigma = sigmas.get(self.space(), qw.spec, qw.tensors.get("inv_smooth"))
            moved, _ = quant.refine_rounding(qw, w, stats.hessian, sigma=sigma)
            error = quant.output_rel_mse(w, quant.dequantize(moved), stats.judging_rows)
            if error < best:
                qw, best, refined = moved, error, True
        return Candidate(qw, alpha, _measure(w, qw, stats.rows, stats.judging_rows, stats, alpha, self.rtn_heldout,
                                             used_gptq, smooth, best, refined))


def _gptq(w: torch.Tensor, spec: QuantSpec, stats: LayerStats, smooth: torch.Tensor | None,
          factor: quant.GPTQFactor | None = None) -> QuantizedWeight:
    return quant.gptq_quantize(w, spec, stats.hessian, smooth, damp=GPTQ_DAMP, sweep=kernels.gptq_sweep(w.device),
                               factor=factor)


def _uses_gptq(spec: QuantSpec, stats: LayerStats, rounding: str) -> bool:
    return rounding == "gptq" and stats.has_hessian and quant.FORMATS[spec.format].gptq


def _proposal(w: torch.Tensor, stats: LayerStats, base: QuantSpec, alphas, smooths) -> tuple[QuantizedWeight, float]:
    """The search's proposal: the rounding at the α and clip whose round-to-nearest result is best on the fit rows,
    and that α."""
    proposal = None
    for alpha in alphas:
        smooth = smooths(alpha)
        tried = replace(base, smooth=alpha > 0)
        clip = quant.search_clip_ratio(w, tried, stats.second_moment, smooth, ratios=CLIP_RATIOS).clip_ratio
        qw = quant.quantize(w, tried.with_clip(clip), smooth)
        err = quant.output_rel_mse(w, quant.dequantize(qw), stats.rows)
        if proposal is None or err < proposal[0]:
            proposal = (err, qw, alpha)
    return proposal[1], proposal[2]


def can_rotate(spec: QuantSpec, k: int) -> bool:
    """Whether the search tries the rotated options for a layer of ``k`` inputs under ``spec``'s format."""
    return not spec.is_passthrough and quant.FORMATS[spec.format].rotate and k % spec.group_size == 0


def rotated_specs(w: torch.Tensor, stats: LayerStats, base: QuantSpec) -> list[QuantSpec]:
    """The specs of the rotated space's options (the weight stored as ``W·H``, squareq/quant/hadamard.py): clip 1,
    and the clip ratio the activation-weighted search picks there (weighted by the rotated inputs' second moments,
    ``diag(H·Σ·H)``) when below 1. The search tries plain rounding at each, and GPTQ fitted to the rotated Gram matrix
    ``H·Σ·H`` at each.

    Without smoothing: in the rotated space of all-MiniLM-L6-v2's 36 layers at W4, the smoothing search proposed
    α > 0 for 12, and its result erred more on the held-out rows than the search without smoothing for 11 of them;
    on the 12th, rotated GPTQ at clip 1 erred less than either (docs/compiler.md, "Hadamard rotation")."""
    rot = replace(base, rotate=True)
    second = stats.rotated_second_moment(base.group_size)
    clip = quant.search_clip_ratio(quant.rtn.rotated(w, rot), base, None if second is None else second.to(w.device),
                                   ratios=CLIP_RATIOS).clip_ratio
    return [rot] + ([rot.with_clip(clip)] if clip < 1.0 else [])


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
