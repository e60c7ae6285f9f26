"""Gate 1: every layer's output rel-MSE, re-measured on inputs the compile never saw.

The source model runs block by block (its own forward, full precision, real weights read lazily), and
each quantized layer's input rows are multiplied by both the source weight and the slab's effective
weight (dequantized through the exact reference, smoothing included). The manifest's own metrics are
only shown next to the measurement, never used for the verdict.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..compiler import CompileOptions
from ..compiler.inputs import calibration_batch
from ..models import BUILTIN_MODELS
from ..progress import Echo, Progress
from ..slab import Slab
from ..slab.writer import block_linears
from ..sources import Source
from .gates import FAIL, PASS, GateResult, advance, gate_bar

NAME = "layer MSE"
OFFSETS = (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875)  # where in each grid cell the fresh timesteps may sit
FRESH_PHASE = 0.25  # the compile stratifies its times at (i + 0.5)/n; fresh ones at (i + 0.25)/n


def _fresh_timesteps(n: int, used: list[float]) -> torch.Tensor:
    """``n`` timesteps spread over the schedule, none within 1e-3 of a timestep the compile used."""
    for offset in OFFSETS:
        grid = 0.05 + 0.9 * (torch.arange(n, dtype=torch.float32) + offset) / max(n, 1)
        if all(abs(float(t) - u) > 1e-3 for t in grid for u in used):
            return grid
    return grid


def _existing(path) -> str | None:
    return str(path) if path and (str(path) in BUILTIN_MODELS or Path(str(path)).exists()) else None


def fresh_inputs(source: Source, slab: Slab, samples: int, device):
    """Inputs of the kind the compile calibrated on (real images, real text; synthetic only for a synthetic
    calibration), with another seed: other noise, other times and, where there are more than the compile used,
    other sentences."""
    recorded = slab.manifest.calibration or {}
    seed = int(recorded.get("seed", 0)) + max(samples, int(recorded.get("samples", 0))) + 101
    kind = recorded.get("kind")
    opts = CompileOptions(budget=0, calib_samples=samples, seed=seed, device=str(device),
                          calib_tokens=recorded.get("max_tokens"), calib_text=_existing(recorded.get("text_file")))
    if kind == "images" and _existing(recorded.get("cache")):
        opts.calib_cache = recorded["cache"]
    elif kind == "images":
        from ..compiler.calibration_images import DEFAULT_MAX_SEQUENCE_LENGTH, DEFAULT_RESOLUTION, calibration_images

        opts.calib_images = calibration_images(
            source, data=_existing(recorded.get("data")), encoders=_existing(recorded.get("encoders")),
            resolution=int(recorded.get("resolution", DEFAULT_RESOLUTION)),
            max_sequence_length=int(recorded.get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)), device=device,
            limit=samples, seed=seed)
    elif kind != "text":
        opts.calib_synthetic = True
    batch = calibration_batch(source, source.skeleton(), opts, phase=FRESH_PHASE)
    kwargs, description = dict(batch.kwargs), dict(batch.description)
    if opts.calib_synthetic and "timestep" in kwargs:
        grid = _fresh_timesteps(kwargs["timestep"].shape[0], [float(t) for t in recorded.get("timesteps") or []])
        kwargs["timestep"] = grid.to(kwargs["timestep"])
        description["timesteps"] = [round(float(t), 4) for t in grid]
    return kwargs, description


class _Measure:
    """Runs each source block for real while accumulating its layers' output errors against the slab."""

    def __init__(self, source: Source, slab: Slab, device, bar: Progress) -> None:
        self.source, self.slab, self.device, self.bar = source, slab, device, bar
        self.layers = {layer.name for layer in slab.manifest.layers}
        self.err: dict[str, float] = {}
        self.ref: dict[str, float] = {}

    def __call__(self, index: int, path: str, args, kwargs):
        block = self.source.load_block(path, self.device, torch.float32)
        hooks = []
        for name, module in block_linears(path, block):
            if name in self.layers:
                w_hat = self.slab.dequantized_weight(name).to(self.device, torch.float32)
                hooks.append(module.register_forward_pre_hook(self._hook(name, module.weight.detach(), w_hat)))
        try:
            return block(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
            advance(self.bar)

    def _hook(self, name: str, w: torch.Tensor, w_hat: torch.Tensor):
        def hook(module, args) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            ref = x @ w.t()
            self.err[name] = self.err.get(name, 0.0) + float((ref - x @ w_hat.t()).square().sum())
            self.ref[name] = self.ref.get(name, 0.0) + float(ref.square().sum())
        return hook


@torch.no_grad()
def layer_mse_gate(source: Source, slab: Slab, tau: float, samples: int = 2, device="cpu",
                   worst: int = 5, progress: bool | None = False, echo: Echo = lambda line: None) -> GateResult:
    """PASS when every layer's measured rel-MSE is at most ``tau``; lists the ``worst`` layers either way. The blocks
    are counted on a bar (``progress``) or in lines for ``echo`` (:func:`gate_bar`)."""
    started = time.perf_counter()
    kwargs, description = fresh_inputs(source, slab, samples, device)
    with gate_bar(NAME, len(source.block_paths), "block", progress, echo) as bar:
        measure = _Measure(source, slab, device, bar)
        source.shell(measure, device)(**kwargs)
    claimed = {layer.name: layer.metrics.get("output_rel_mse") for layer in slab.manifest.layers}
    rel = {n: measure.err[n] / max(measure.ref[n], 1e-30) for n in measure.err}
    unmeasured = sorted(measure.layers - set(rel))
    ranked = sorted(rel.items(), key=lambda kv: -kv[1])
    over = [n for n, v in ranked if v > tau]
    status = FAIL if over else PASS
    top = ranked[0] if ranked else ("-", 0.0)
    note = f"worst {top[0]}"
    if over:
        note = f"{len(over)} of {len(rel)} layers over τ_MSE; worst {top[0]}"
    if unmeasured:  # the model's forward never calls them, so their error cannot reach an output
        note += f"; {len(unmeasured)} layers never run in the forward ({unmeasured[0]}, ...)"
    return GateResult(
        NAME, status, f"max {top[1]:.3g} over {len(rel)} layers", f"τ_MSE {tau:g}", note,
        time.perf_counter() - started,
        {"tau": tau, "layers": len(rel), "over": over, "unmeasured": unmeasured, "inputs": description,
         "worst": [{"layer": n, "rel_mse": v, "manifest_rel_mse": claimed.get(n)} for n, v in ranked[:worst]],
         "rel_mse": rel})
