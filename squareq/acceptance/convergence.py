"""Gate 2: a LoRA trained on the slab learns like one trained on the bf16 source.

Both runs are ``squareq train`` itself, with the same configuration and seed, so they see the same
images, captions, noise and timesteps in the same order; the only difference is the slab. The bf16
reference is a slab of the source with every layer stored as bf16 (written here, block by block, and
reused while the source is unchanged). The reference trains N steps, the quantized slab N + Δ. The gate
passes when

* the quantized run's smoothed loss reaches the reference's final smoothed loss by step N + Δ, and
* at step N the two smoothed losses differ by at most τ_CONV (relative to the reference).

Smoothing is a trailing mean over ``window`` steps, as the trainer's running average. The schedule is
constant (no warm-up), so the first N steps of both runs have the same learning rates.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import quant
from ..compiler.sources import Source
from ..models import ADAPTERS
from ..slab import Slab, SlabError, open_slab
from ..slab.writer import WriteOptions, assemble_slab, block_linears, encode_block
from ..train.config import TrainConfig, load_config
from ..train.encoders import EncoderError, check_encoder_source
from ..train.loop import METRICS_FILE, train
from .gates import FAIL, PASS, GateResult, skipped
from .plot import plot_curves

NAME = "convergence"


@dataclass(frozen=True)
class ConvergenceSettings:
    """What the two training runs share. ``base`` is an optional trainer TOML (``--train-config``); a setting left
    None comes from it, else from :data:`GATE_DEFAULTS`."""

    steps: int = 30
    delta: int = 5
    tau: float = 0.02
    data: str = ""
    resolution: int | None = None
    max_sequence_length: int | None = None
    lr: float | None = None
    rank: int | None = None
    seed: int = 0
    base: str | None = None


# Below the base TOML: a short run needs a higher learning rate than a long one for its loss to move.
GATE_DEFAULTS = {"resolution": 512, "max_sequence_length": 512, "lr": 1e-3, "rank": 16}


def training_config(s: ConvergenceSettings, slab_path: Path, model: str, out: Path, cache: Path, steps: int):
    """The trainer configuration of one run: flags (non-None settings) > base TOML > gate defaults > trainer's."""
    trainer_defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    base = load_config(s.base) if s.base else None
    values = {k: v for k, v in GATE_DEFAULTS.items() if base is None or getattr(base, k) == trainer_defaults[k]}
    values.update({k: getattr(s, k) for k in GATE_DEFAULTS if getattr(s, k) is not None})
    values.update({"slab": str(slab_path), "data": s.data, "output": str(out), "model": model,
                   "cache_dir": str(cache), "steps": steps, "seed": s.seed, "schedule": "constant", "warmup": 0,
                   "save_every": 0, "sample_every": 0, "log": "jsonl"})
    # a base config's epochs, resume or VRAM refusal would break the pairing of the two runs: this gate decides them
    return dataclasses.replace(load_config(s.base, values), epochs=None, resume=None, vram_budget=None)


def cannot_run(source: Source, model: str) -> str | None:
    """Why this gate cannot run for ``source`` (None when it can): the trainer's families and its encoders."""
    adapter = ADAPTERS.get(source.family)
    if adapter is None or adapter.recipe is None:
        return f"squareq train cannot train {source.description} (family {source.family})"
    try:
        check_encoder_source(model, source.family)
    except EncoderError as exc:
        return str(exc)
    return None


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values at each step."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def reference_slab(source: Source, folder: Path, echo) -> Path:
    """The source as a slab with every layer in bf16 (the convergence reference); reused when current."""
    path = folder / "reference-bf16.slab"
    skeleton = source.skeleton()
    fingerprint = source.fingerprint()
    if path.exists():
        try:
            with open_slab(path, verify="off") as old:
                if (old.manifest.calibration or {}).get("source_fingerprint") == fingerprint:
                    return path
        except SlabError:
            pass
    echo(f"writing the bf16 reference slab {path} (block by block from {source.description})")
    with tempfile.TemporaryDirectory(prefix=".reference-blocks-", dir=folder) as work:
        encoded = []
        for i, block_path in enumerate(source.block_paths):
            block = source.load_block(block_path, "cpu", torch.float32)
            weights = {name: quant.quantize(m.weight.detach().float(), quant.QuantSpec(bits=16))
                       for name, m in block_linears(block_path, block)}
            encoded.append(encode_block(i, block_path, block, weights, Path(work) / f"block.{i}.bin"))
        assemble_slab(path, skeleton, encoded, source.resident_state("cpu", torch.float32),
                      WriteOptions(family=source.family, source=source.description, overwrite=True,
                                   calibration={"kind": "bf16-reference", "source_fingerprint": fingerprint}))
    return path


def _run(slab_path: Path, model: str, out: Path, cache: Path, steps: int, s: ConvergenceSettings, echo):
    if out.exists():
        shutil.rmtree(out)  # this gate's own folder: every run starts from step 0
    cfg = training_config(s, slab_path, model, out, cache, steps)
    train(cfg, echo=echo, progress=False)
    return cfg, [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def convergence_gate(source: Source, slab: Slab, model: str, workdir: Path, settings: ConvergenceSettings,
                     echo=print) -> tuple[GateResult, list[dict]]:
    """Train the reference and the slab; returns the gate result and the quantized run's metric records."""
    started = time.perf_counter()
    why_not = cannot_run(source, model)
    if why_not:
        return skipped(NAME, why_not), []
    workdir.mkdir(parents=True, exist_ok=True)
    s = settings
    ref_path = reference_slab(source, workdir, echo)
    runs, config = {}, None
    for label, path, steps in (("bf16", ref_path, s.steps), ("quantized", slab.path, s.steps + s.delta)):
        echo(f"convergence: training the {label} {'reference' if label == 'bf16' else 'slab'} for {steps} steps")
        config, runs[label] = _run(Path(path), model, workdir / f"{label}-run", workdir / "cache", steps, s,
                                   lambda line, label=label: echo(f"  [{label}] {line}"))
    ref = [r["loss"] for r in runs["bf16"]]
    got = [r["loss"] for r in runs["quantized"]]
    window = max(1, min(10, s.steps // 3))
    ref_s, got_s = smooth(ref, window), smooth(got, window)
    target = ref_s[s.steps - 1]
    # from the first full window on: a mean of fewer steps is too noisy to count as having reached anything
    reached = next((i + 1 for i, v in enumerate(got_s) if i + 1 >= window and v <= target), None)
    gap = abs(got_s[s.steps - 1] - target) / max(abs(target), 1e-12)
    on_time = reached is not None and reached <= s.steps + s.delta
    status = PASS if on_time and gap <= s.tau else FAIL
    plot = plot_curves(workdir / "convergence.png", f"LoRA loss, bf16 source vs slab (trailing mean of {window})", {
        "bf16 loss": (ref, (150, 180, 230), 1), "slab loss": (got, (240, 180, 140), 1),
        "bf16 smoothed": (ref_s, (30, 80, 200), 3), "slab smoothed": (got_s, (220, 90, 20), 3)},
        marks={f"N={s.steps}": s.steps})
    reach_text = f"reached at step {reached}" if on_time else f"not reached by step {s.steps + s.delta}"
    note = (f"the slab's smoothed loss reached the bf16 run's final {target:.4g} at step {reached}" if on_time else
            f"the slab's smoothed loss never reached the bf16 run's final {target:.4g} by step {s.steps + s.delta}")
    result = GateResult(
        NAME, status, f"final gap {100 * gap:.2f}%, {reach_text}",
        f"τ_CONV {100 * s.tau:g}%, by step N+Δ = {s.steps}+{s.delta}", note, time.perf_counter() - started,
        {"steps": s.steps, "delta": s.delta, "tau": s.tau, "window": window, "target": target,
         "final_smoothed": {"bf16": target, "quantized": got_s[s.steps - 1]}, "relative_gap": gap,
         "reached_step": reached, "plot": str(plot), "reference_slab": str(ref_path),
         "training": {k: getattr(config, k) for k in ("resolution", "max_sequence_length", "lr", "rank", "batch_size",
                                                       "targets", "seed", "data")},
         "losses": {"bf16": ref, "quantized": got}, "smoothed": {"bf16": ref_s, "quantized": got_s}})
    return result, runs["quantized"]
