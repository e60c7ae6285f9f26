"""Gate: a LoRA trained on the slab learns like one trained on the bf16 source, decided with statistics.

Three runs of ``squareq train`` itself, with the same configuration and seed, so they see the same images,
captions, noise and timesteps in the same order: the bf16 reference (a slab of the source with every layer stored
as bf16, written here block by block and reused while the source is unchanged), the same with every LoRA update
zeroed (``frozen``: the loss the model has without learning), and the slab. The schedule is constant (no
warm-up), so every step of every run has the same learning rate.

* **Power.** Over the second half of the steps, the bf16 run must have learned more than the margin: the one-sided
  t-test of the per-step relative improvement ``(frozen − bf16) / frozen`` against τ_CONV must reject at α. When it
  does not, the gate is INCONCLUSIVE (never PASS): a short run on data it cannot learn shows nothing about the slab.
* **Equivalence.** Per step, the relative difference ``(slab − bf16) / bf16`` of the two losses on the same batch,
  noise and time. Two one-sided paired t-tests (TOST) against ±τ_CONV: PASS when both reject at α, that is when the
  90% confidence interval of the mean difference lies inside (−τ_CONV, τ_CONV); FAIL otherwise. A slab whose loss is
  different in either direction trains a different model, so a lower loss fails as well as a higher one.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import quant
from ..extras import require
from ..models import ADAPTERS
from ..plot import plot_curves, smooth
from ..slab import BlockContent, Slab, SlabBuilder, SlabError, WriteOptions, open_slab
from ..slab.writer import block_linears
from ..sources import Source
from ..sources.encoder_source import EncoderSource
from ..sources.encoders import EncoderError, check_encoder_source
from ..train.config import TrainConfig, load_config
from ..train.loop import train
from ..train.sinks import METRICS_FILE
from .gates import FAIL, INCONCLUSIVE, PASS, GateResult, advance, gate_bar, skipped

NAME = "convergence"


@dataclass(frozen=True)
class ConvergenceSettings:
    """What the two training runs share. ``base`` is an optional trainer TOML (``--train-config``); a setting left
    None comes from it, else from :data:`GATE_DEFAULTS`."""

    steps: int = 40
    tau: float = 0.03
    data: str = ""
    resolution: int | None = None
    max_sequence_length: int | None = None
    lr: float | None = None
    rank: int | None = None
    seed: int = 0
    base: str | None = None
    compute: str = "auto"  # the slab run's base-layer arithmetic; the bf16 references always run in bf16


# Below the base TOML: a short run needs a higher learning rate than a long one for its loss to move.
GATE_DEFAULTS = {"resolution": 512, "max_sequence_length": 512, "lr": 1e-3, "rank": 16}
ALPHA = 0.05  # the tests' significance level


def training_config(s: ConvergenceSettings, slab_path: Path, encoders: EncoderSource | str, out: Path, cache: Path,
                    steps: int):
    """The trainer configuration of one run: flags (non-None settings) > base TOML > gate defaults > trainer's."""
    encoders = EncoderSource.of(encoders)
    trainer_defaults = TrainConfig().to_dict()  # default_factory fields (resolution, ...) included
    base = load_config(s.base) if s.base else None
    values = {k: v for k, v in GATE_DEFAULTS.items() if base is None or getattr(base, k) == trainer_defaults[k]}
    values.update({k: getattr(s, k) for k in GATE_DEFAULTS if getattr(s, k) is not None})
    values.update({"slab": str(slab_path), "data": s.data, "output": str(out), "model": encoders.where,
                   **encoders.file_map,
                   "cache_dir": str(cache), "steps": steps, "seed": s.seed, "schedule": "constant", "warmup": 0,
                   "save_every": 0, "sample_every": 0, "log": "jsonl"})
    # a base config's epochs, resume or VRAM refusal would break the pairing of the two runs: this gate decides them
    return dataclasses.replace(load_config(s.base, values), epochs=None, resume=None, vram_budget=None)


def cannot_run(source: Source, model: EncoderSource | str) -> str | None:
    """Why this gate cannot run for ``source`` (None when it can): the trainer's families and its encoders."""
    adapter = ADAPTERS.get(source.family)
    if adapter is None or adapter.recipe is None:
        return f"squareq train cannot train {source.description} (family {source.family})"
    try:
        check_encoder_source(model, source.family)
    except EncoderError as exc:
        return str(exc)
    return None


def reference_slab(source: Source, folder: Path, echo, progress: bool | None = False) -> Path:
    """The source as a slab with every layer in bf16 (the convergence reference); reused when current. Its blocks
    are counted on a bar (``progress``) or in lines for ``echo`` (:func:`gate_bar`)."""
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
    options = WriteOptions(family=source.family, source=source.description, overwrite=True,
                           calibration={"kind": "bf16-reference", "source_fingerprint": fingerprint})
    with SlabBuilder(path, skeleton, options) as slab, \
            gate_bar("bf16 reference", len(source.block_paths), "block", progress, echo) as bar:
        for i, block_path in enumerate(source.block_paths):
            block = source.load_block(block_path, "cpu", torch.float32)
            weights = {name: quant.quantize(m.weight.detach().float(), quant.QuantSpec(bits=16))
                       for name, m in block_linears(block_path, block)}
            slab.add_block(BlockContent(i, block_path, block, weights))
            advance(bar)
        slab.finish(source.resident_state("cpu", torch.float32))
    return path


def _run(slab_path: Path, model: EncoderSource | str, out: Path, cache: Path, steps: int, s: ConvergenceSettings, echo,
         frozen: bool = False, compute: str = "bf16", after_step=None):
    if out.exists():
        shutil.rmtree(out)  # this gate's own folder: every run starts from step 0
    cfg = dataclasses.replace(training_config(s, slab_path, model, out, cache, steps), compute=compute)
    # frozen: every LoRA gradient zeroed before AdamW sees it, so B stays 0 and the LoRA adds nothing
    zero = (lambda step, grads: [g.zero_() for g in grads if g is not None]) if frozen else None
    train(cfg, echo=echo, progress=False, on_gradients=zero, after_step=after_step)
    return cfg, [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]


def _stats():
    return require("scipy.stats", "squareq accept's convergence gate")


def mean_interval(values: list[float], confidence: float) -> tuple[float, float, float]:
    """Mean of ``values`` and its two-sided ``confidence`` interval (Student's t)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("-inf"), float("inf")
    stats = _stats()
    se = float(stats.sem(values))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    return mean, mean - half, mean + half


def decide(frozen: list[float], ref: list[float], got: list[float], tau: float, alpha: float = ALPHA) -> dict:
    """The gate's statistics from the three runs' per-step losses (see the module docstring)."""
    stats = _stats()
    late = len(ref) // 2
    learned = [(f - r) / f for f, r in zip(frozen[late:], ref[late:], strict=True)]
    p_learned = float(stats.ttest_1samp(learned, tau, alternative="greater").pvalue) if len(learned) > 1 else 1.0
    diff = [(g - r) / r for g, r in zip(got, ref, strict=True)]
    mean, low, high = mean_interval(diff, 1 - 2 * alpha)
    if len(diff) > 1 and float(stats.tstd(diff)) > 0:
        p_equiv = max(float(stats.ttest_1samp(diff, -tau, alternative="greater").pvalue),
                      float(stats.ttest_1samp(diff, tau, alternative="less").pvalue))
    else:  # identical runs (a bf16 slab): no spread, the difference is exactly the mean
        p_equiv = 0.0 if abs(mean) < tau else 1.0
    learned_mean = sum(learned) / max(len(learned), 1)
    status = INCONCLUSIVE if not p_learned < alpha else PASS if p_equiv < alpha else FAIL
    return {"status": status, "alpha": alpha, "learned_mean": learned_mean, "p_learned": p_learned,
            "relative_difference": diff, "mean_difference": mean, "interval": [low, high], "p_equivalence": p_equiv}


def convergence_gate(source: Source, slab: Slab, model: EncoderSource | str, workdir: Path,
                     settings: ConvergenceSettings, echo=print,
                     progress: bool | None = False) -> tuple[GateResult, list[dict]]:
    """Train the frozen and bf16 references and the slab; returns the gate result and the slab run's metric records.
    The three runs' steps are one bar (``progress``; the runs' own lines print above it) or lines for ``echo``
    (:func:`gate_bar`)."""
    started = time.perf_counter()
    why_not = cannot_run(source, model)
    if why_not:
        return skipped(NAME, why_not), []
    workdir.mkdir(parents=True, exist_ok=True)
    s = settings
    ref_path = reference_slab(source, workdir, echo, progress)
    runs, config = {}, None
    with gate_bar(NAME, 3 * s.steps, "step", progress, echo) as bar:
        said = bar.above(echo)
        for label, path, what in (("frozen", ref_path, "bf16 reference with its LoRA held at zero"),
                                  ("bf16", ref_path, "bf16 reference"), ("quantized", slab.path, "slab")):
            said(f"convergence: training the {what} for {s.steps} steps")
            bar.status(label)
            config, runs[label] = _run(Path(path), model, workdir / f"{label}-run", workdir / "cache", s.steps, s,
                                       lambda line, label=label: said(f"  [{label}] {line}"), frozen=label == "frozen",
                                       compute=s.compute if label == "quantized" else "bf16",
                                       after_step=lambda step: advance(bar))
    frozen, ref, got = ([r["loss"] for r in runs[k]] for k in ("frozen", "bf16", "quantized"))
    verdict = decide(frozen, ref, got, s.tau)
    window = max(1, min(10, s.steps // 3))
    plot = plot_curves(workdir / "convergence.png", "LoRA loss: frozen, bf16 source and slab (trailing mean of "
                                                    f"{window})",
                       {"bf16 loss": (ref, (150, 180, 230), 1), "slab loss": (got, (240, 180, 140), 1),
                        "frozen (no LoRA) smoothed": (smooth(frozen, window), (120, 120, 120), 2),
                        "bf16 smoothed": (smooth(ref, window), (30, 80, 200), 3),
                        "slab smoothed": (smooth(got, window), (220, 90, 20), 3)},
                       marks={"second half": s.steps // 2 + 1})
    low, high = verdict["interval"]
    status = verdict["status"]
    if status == INCONCLUSIVE:
        note = (f"the bf16 run did not learn more than {100 * s.tau:g}% over its frozen copy "
                f"(learned {100 * verdict['learned_mean']:.2f}%, p = {verdict['p_learned']:.2g}): the gate cannot tell "
                "a good slab from a bad one here; raise --steps or --lr, or give --data that a LoRA can learn")
    else:
        note = (f"90% interval of the mean difference [{100 * low:+.2f}%, {100 * high:+.2f}%] "
                f"{'inside' if status == PASS else 'not inside'} ±{100 * s.tau:g}%; the bf16 run learned "
                f"{100 * verdict['learned_mean']:.1f}% (p = {verdict['p_learned']:.2g})")
    result = GateResult(
        NAME, status, f"mean loss difference {100 * verdict['mean_difference']:+.2f}% "
        f"(p = {verdict['p_equivalence']:.2g})", f"±{100 * s.tau:g}% at α = {ALPHA:g}; bf16 must learn > "
        f"{100 * s.tau:g}%", note, time.perf_counter() - started,
        {**verdict, "steps": s.steps, "tau": s.tau, "plot": str(plot), "reference_slab": str(ref_path),
         "training": {k: getattr(config, k) for k in ("resolution", "max_sequence_length", "lr", "rank", "batch_size",
                                                       "targets", "seed", "data")},
         "losses": {"frozen": frozen, "bf16": ref, "quantized": got}})
    return result, runs["quantized"]
