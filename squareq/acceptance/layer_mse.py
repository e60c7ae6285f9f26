"""Gate 1: every layer's output rel-MSE, re-measured on inputs the compile never saw.

The source model runs block by block (its own forward, full precision, real weights read lazily), and
each quantized layer's input rows are multiplied by both the source weight and the slab's effective
weight (dequantized through the exact reference, smoothing included). The manifest's own metrics are
only shown next to the measurement, never used for the verdict.
"""
from __future__ import annotations

import time

import torch

from ..compiler.sources import Source
from ..slab import Slab
from ..slab.writer import block_linears
from .gates import FAIL, PASS, GateResult

NAME = "layer MSE"
OFFSETS = (0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875)  # where in each grid cell the fresh timesteps may sit


def _fresh_timesteps(n: int, used: list[float]) -> torch.Tensor:
    """``n`` timesteps spread over the schedule, none within 1e-3 of a timestep the compile used."""
    for offset in OFFSETS:
        grid = 0.05 + 0.9 * (torch.arange(n, dtype=torch.float32) + offset) / max(n, 1)
        if all(abs(float(t) - u) > 1e-3 for t in grid for u in used):
            return grid
    return grid


def _fresh_seed(source: Source, samples: int, recorded: dict) -> int:
    """A seed other than the compile's; when the family draws prompts from a pool by seed, the one whose prompts
    overlap the compile's least (none, while the pool has enough)."""
    base = int(recorded.get("seed", 0)) + max(samples, int(recorded.get("samples", 0))) + 101
    used = set(recorded.get("prompts") or [])
    if not used:
        return base
    from ..models.prompts import CALIBRATION_PROMPTS

    pool = len(CALIBRATION_PROMPTS)
    overlap = lambda seed: sum(CALIBRATION_PROMPTS[(seed + i) % pool] in used for i in range(samples))  # noqa: E731
    return min(range(base, base + pool), key=overlap)


def fresh_inputs(source: Source, slab: Slab, samples: int, device):
    """Calibration inputs with another seed, other prompts and other timesteps than the compile recorded."""
    recorded = slab.manifest.calibration or {}
    seed = _fresh_seed(source, samples, recorded)
    batch = source.adapter.calibration_batch(source.skeleton(), samples, seed, source.pipeline, device)
    kwargs, description = dict(batch.kwargs), dict(batch.description)
    if "timestep" in kwargs:
        grid = _fresh_timesteps(kwargs["timestep"].shape[0], [float(t) for t in recorded.get("timesteps") or []])
        kwargs["timestep"] = grid.to(kwargs["timestep"])
        description["timesteps"] = [round(float(t), 4) for t in grid]
    description["seed"] = seed
    shared = sorted(set(description.get("prompts") or []) & set(recorded.get("prompts") or []))
    description["prompts_shared_with_compile"] = len(shared)
    return kwargs, description


class _Measure:
    """Runs each source block for real while accumulating its layers' output errors against the slab."""

    def __init__(self, source: Source, slab: Slab, device) -> None:
        self.source, self.slab, self.device = source, slab, device
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

    def _hook(self, name: str, w: torch.Tensor, w_hat: torch.Tensor):
        def hook(module, args) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            ref = x @ w.t()
            self.err[name] = self.err.get(name, 0.0) + float((ref - x @ w_hat.t()).square().sum())
            self.ref[name] = self.ref.get(name, 0.0) + float(ref.square().sum())
        return hook


@torch.no_grad()
def layer_mse_gate(source: Source, slab: Slab, tau: float, samples: int = 2, device="cpu", worst: int = 5) -> GateResult:
    """PASS when every layer's measured rel-MSE is at most ``tau``; lists the ``worst`` layers either way."""
    started = time.perf_counter()
    kwargs, description = fresh_inputs(source, slab, samples, device)
    measure = _Measure(source, slab, device)
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
