"""`squareq compile`: calibrate block by block, climb the ladder per layer, check block drift, solve the
budget, write the slab.

The model runs its own forward once over the calibration batch, with each streamed block replaced
by a stand-in that loads the real block from the source, measures and decides it, and then runs
the *quantized* block, so the next block sees the error the runtime will see. Only one real block
is materialized at a time; everything else of the model is resident.
"""
from __future__ import annotations

import copy
import hashlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import quant
from ..models.calibration import CalibrationSet
from ..slab import SlabError, WriteOptions
from ..slab.manifest import ResidentRecord, align_up, dtype_name, resident_tensor_name
from ..slab.writer import (
    PLACEHOLDER_FLOAT,
    assemble_slab,
    block_linears,
    build_manifest,
    encode_block,
    header_bytes,
    layout_block,
    stored_tensor,
)
from .budget import BlockLayers, BudgetError, candidate_bytes, solve
from .calibration import StatsCollector
from .inputs import calibration_batch
from .ladder import RUNGS, LayerDecision, climb
from .layer_search import Candidate, search_layer, weight_metrics
from .sources import Source
from .state import CompileState
from .thresholds import Thresholds

# The quality objective's upgrades lengthen a layer's manifest record by a reason (~150 bytes) and
# other metric digits; the exact size is checked against the budget before anything is written.
QUALITY_SLACK_PER_LAYER = 256


@dataclass
class CompileOptions:
    """Everything `squareq compile` takes besides the model and the output path."""

    budget: int
    objective: str = "size"
    thresholds: Thresholds = field(default_factory=Thresholds)
    min_bits: int = 4
    rounding: str = "gptq"
    group_size: int = 64
    calib_samples: int | None = None  # None: the measured default for the kind of data (compiler/inputs.py)
    calib_images: CalibrationSet | None = None  # encoded images + captions (squareq.train.calibration)
    calib_cache: str | None = None  # a training cache folder to calibrate on (squareq cache / squareq train)
    calib_text: str | None = None  # a text file, one sample per line (text models)
    calib_tokens: int | None = None  # most tokens per text sample (None: the default)
    calib_synthetic: bool = False  # noise and Gaussian text instead of data: for speed runs only
    max_rows: int = 512
    seed: int = 0
    stream_window: int | None = None
    max_window_bytes: int | None = None
    device: str = "cpu"
    resume: bool = False
    overwrite: bool = False

    def fingerprint(self) -> dict:
        keep = ("objective", "min_bits", "rounding", "group_size", "calib_samples", "calib_tokens", "calib_synthetic",
                "max_rows", "seed")
        return {k: getattr(self, k) for k in keep} | {"thresholds": self.thresholds.compile_dict()}


Progress = Callable[[str], None]


def state_folder(out: Path) -> Path:
    return out.parent / f"{out.name}.state"


def _floats(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _floats(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _floats(o)]
    return [t for o in getattr(out, "__dict__", {}).values() for t in _floats(o)]


def outputs_rel_mse(ref, got) -> float:
    """Σ‖got − ref‖² / Σ‖ref‖² over every floating tensor a block returns."""
    err = power = 0.0
    for r, g in zip(_floats(ref), _floats(got)):
        err += float((g.double() - r.double()).pow(2).sum())
        power += float(r.double().pow(2).sum())
    return err / power if power > 0 else (0.0 if err == 0 else float("inf"))


def _unmeasured(name: str, w: torch.Tensor) -> LayerDecision:
    """A linear the calibration never called (a branch the inputs did not take): kept at bf16."""
    qw = quant.quantize(w.detach().float(), quant.QuantSpec(bits=16))
    c = Candidate(qw, 0.0, {**weight_metrics(w.detach().float(), quant.dequantize(qw)), "output_rel_mse": 0.0,
                            "heldout_rel_mse": 0.0, "heldout_rtn_rel_mse": 0.0, "calib_rel_mse": 0.0,
                            "act_outlier_score": 0.0, "scale_ratio": 1.0, "alpha": 0.0, "clip_ratio": 1.0, "gptq": 0.0})
    return LayerDecision(name, c, [c], ["not called during calibration, so it has no measurements: kept at bf16"])


def _quantized_copy(block: nn.Module, prefix: str, chosen: dict[str, quant.QuantizedWeight], dtype) -> nn.Module:
    q = copy.deepcopy(block)
    for name, mod in block_linears(prefix, q):
        qw = chosen[name]
        on_device = quant.QuantizedWeight(qw.spec, qw.shape, {k: v.to(mod.weight.device) for k, v in qw.tensors.items()})
        with torch.no_grad():
            mod.weight.copy_(quant.dequantize(on_device).to(dtype))
    return q


class _Run:
    def __init__(self, source: Source, opts: CompileOptions, state: CompileState | None, progress: Progress,
                 batch) -> None:
        self.source, self.opts, self.state, self.progress = source, opts, state, progress
        self.batch = batch
        self.started = time.perf_counter()
        self.done_blocks = 0

    def _eta(self, index: int, n: int) -> str:
        if self.done_blocks == 0:
            return "ETA --"
        per = (time.perf_counter() - self.started) / self.done_blocks
        return f"ETA {per * (n - index):.0f}s"

    def block(self, index: int, path: str, args, kwargs):
        n = len(self.source.block_paths)
        real = self.source.load_block(path, self.opts.device, torch.float32)
        if not self.state.has_block(index):
            self.progress(f"block {index + 1}/{n} {path}: calibrating and searching ({self._eta(index, n)})")
            out = self._decide(index, path, real, args, kwargs)
            self.done_blocks += 1
            return out  # the decided quantized block's output: what a resumed run recomputes from the state
        self.progress(f"block {index + 1}/{n} {path}: finished earlier, reusing it")
        decisions, _ = self.state.load_block(index)
        chosen = {d.name: d.chosen.qweight for d in decisions}
        with torch.no_grad():
            return _quantized_copy(real, path, chosen, torch.float32)(*args, **kwargs)

    @torch.no_grad()
    def _decide(self, index: int, path: str, real: nn.Module, args, kwargs):
        """Measure and decide every layer of the block, save them, and return the quantized block's output."""
        o, b = self.opts, self.batch
        with StatsCollector(path, real, max_rows=o.max_rows, hessian=o.rounding == "gptq", seed=o.seed + index,
                            samples=b.description.get("samples"), heldout_samples=b.heldout,
                            row_mask=b.row_mask) as col:
            ref = real(*args, **kwargs)
        decisions: dict[str, LayerDecision] = {}
        for name, mod in block_linears(path, real):
            self.progress(f"block {index + 1}/{len(self.source.block_paths)} {path}: {name}")
            if name not in col.stats:
                decisions[name] = _unmeasured(name, mod.weight)
                continue
            decisions[name] = climb(name, mod.weight, col.stats[name], o.thresholds, o.min_bits, o.rounding,
                                    o.group_size, measure_all=o.objective == "quality")
        drift, out = self._block_drift(path, real, args, kwargs, ref, decisions, col.stats)
        # Bytes of the block's other tensors in its blob, as the writer stores them (floating ones as bf16).
        weights = {f"{x[len(path) + 1:]}.weight" for x in decisions}
        kept = (stored_tensor(t) for n, t in real.state_dict().items() if n not in weights)
        fixed = sum(align_up(t.numel() * t.element_size()) for t in kept)
        self.state.save_block(index, list(decisions.values()), {"block_rel_mse": drift, "fixed_bytes": fixed})
        return out

    def _block_drift(self, path, real, args, kwargs, ref, decisions, stats):
        """Check the block's output against τ_BLOCK; move up the layer whose restoration helps most.

        Returns the final block rel-MSE and the quantized block's output."""
        o = self.opts
        while True:
            chosen = {n: d.chosen.qweight for n, d in decisions.items()}
            out = _quantized_copy(real, path, chosen, torch.float32)(*args, **kwargs)
            err = outputs_rel_mse(ref, out)
            movable = [n for n, d in decisions.items() if d.chosen.bits < 16]
            if err <= o.thresholds.block or not movable:
                return err, out
            restored = {}
            for n in movable:
                trial = dict(chosen)
                trial[n] = quant.quantize(real.get_submodule(n[len(path) + 1:]).weight.detach().float(),
                                          quant.QuantSpec(bits=16))
                restored[n] = outputs_rel_mse(ref, _quantized_copy(real, path, trial, torch.float32)(*args, **kwargs))
            worst = min(restored, key=restored.get)
            d = decisions[worst]
            up = RUNGS[RUNGS.index(d.chosen.bits) + 1]
            cand = d.candidate(up)
            if cand is None:
                cand = search_layer(real.get_submodule(worst[len(path) + 1:]).weight, stats[worst], up,
                                    group_size=o.group_size, rounding=o.rounding)
                d.tried.append(cand)
            d.reasons.append(f"W{d.chosen.bits}: block {path} output rel-MSE {err:.4g} > τ_BLOCK "
                             f"{o.thresholds.block:g}; restoring this layer helped most")
            d.chosen = cand


def compile_slab(source: Source, out: str | Path, opts: CompileOptions, progress: Progress = lambda s: None):
    """Compile ``source`` into the slab directory ``out`` and return its manifest."""
    out = Path(out)
    if out.exists() and not opts.overwrite:
        raise SlabError(f"{out} already exists; choose another output path or pass --force.")
    skeleton = source.skeleton()
    batch = calibration_batch(source, skeleton, opts)
    progress(_calibration_line(batch.description))
    inputs_hash = hashlib.sha256(json.dumps(batch.description, sort_keys=True).encode()).hexdigest()[:16]
    fingerprint = {"source": source.description, "blocks": source.block_paths, "calibration": inputs_hash,
                   **opts.fingerprint()}
    run = _Run(source, opts, None, progress, batch)
    shell = source.shell(run.block, opts.device)  # checks the checkpoint before any state is written
    state = run.state = CompileState(state_folder(out), fingerprint, opts.resume)
    started = time.perf_counter()
    with torch.no_grad():
        shell(**batch.kwargs)
    calibrate_s = time.perf_counter() - started

    blocks, records = [], []
    for i, path in enumerate(source.block_paths):
        decisions, info = state.load_block(i, tensors=False)  # sizes and metrics only: one block's data at a time
        blocks.append(BlockLayers(path, decisions, info["fixed_bytes"]))
        records.append(info)
    residents = source.resident_state("cpu", torch.float32)
    # Planned with placeholders as long as any real value, so a stated minimum holds for every budget.
    calibration = {**batch.description, "objective": opts.objective, "budget_bytes": 10**15,
                   "rounding": opts.rounding, "min_bits": opts.min_bits, "group_size": opts.group_size,
                   "calibrate_seconds": PLACEHOLDER_FLOAT, "compile_seconds": PLACEHOLDER_FLOAT}
    write_opts = WriteOptions(family=source.family, source=source.description, overwrite=opts.overwrite,
                              thresholds=opts.thresholds.to_dict(), calibration=calibration)
    ladder_choice = {d.name: d.tried.index(d.chosen) for b in blocks for d in b.decisions}
    overhead = _metadata_bytes(skeleton, blocks, records, ladder_choice, residents, write_opts)
    if opts.objective == "quality":  # upgraded layers carry a longer reason and other metric digits
        overhead += QUALITY_SLACK_PER_LAYER * len(ladder_choice)
    window = (opts.stream_window, opts.max_window_bytes) if opts.stream_window and opts.max_window_bytes else None
    try:
        choice = solve(blocks, opts.thresholds, opts.budget, opts.objective, overhead, window)
    except BudgetError as exc:
        raise BudgetError(f"{exc} Nothing was written; the measurements are kept in {state.folder}, so rerunning "
                          "with --resume and a larger --budget skips the calibration (changed thresholds need a "
                          "fresh compile).") from None

    with tempfile.TemporaryDirectory(prefix=f".{out.name}.blobs-", dir=out.parent) as work:
        encoded = []
        for i, (b, info) in enumerate(zip(blocks, records)):
            loaded, _ = state.load_block(i)
            qws, metrics, reasons = _annotations(BlockLayers(b.name, loaded, b.fixed_bytes), info, choice)
            # the search measured each candidate's weight error, so the original weights need not be read again
            # (at 12B, reading and measuring them took most of this pass); a state folder without those metrics
            # (an older compile's) is measured here
            measured = all("weight_rel_mse" in m for m in metrics.values())
            real = source.load_block(b.name, "cpu", torch.float32, linear_weights=not measured)
            encoded.append(encode_block(i, b.name, real, qws, Path(work) / f"block.{i}.bin", metrics=metrics,
                                        reasons=reasons, measure=not measured))
        write_opts.calibration["budget_bytes"] = opts.budget
        write_opts.calibration["calibrate_seconds"] = round(calibrate_s, 3)
        write_opts.calibration["compile_seconds"] = round(time.perf_counter() - started, 3)
        manifest = assemble_slab(out, skeleton, encoded, residents, write_opts, max_bytes=opts.budget)
    state.remove()
    return manifest


def _calibration_line(d: dict) -> str:
    what = d.get("source") or d.get("why") or d.get("kind")
    held = f", {d['heldout_samples']} held out to judge the transforms" if d.get("heldout_samples") else ""
    return f"calibrating on {d.get('samples')} samples of {what}{held}"


def _annotations(b: BlockLayers, info: dict, choice: dict[str, int]):
    """(quantized weights, metrics, reasons) by layer name for one block under ``choice``."""
    chosen = {d.name: d.tried[choice[d.name]] for d in b.decisions}
    metrics = {n: {**c.metrics, "block_rel_mse": info["block_rel_mse"]} for n, c in chosen.items()}
    reasons = {d.name: list(d.reasons) + _objective_note(d, choice[d.name]) for d in b.decisions}
    return {n: c.qweight for n, c in chosen.items()}, metrics, reasons


def _metadata_bytes(skeleton, blocks: list[BlockLayers], records: list[dict], choice: dict[str, int],
                    residents: dict, write_opts: WriteOptions) -> int:
    """Bytes of everything but the blobs (header, resident tensors, manifest) for ``choice``, planned from
    the skeleton: an upper bound, since unknown numbers are given their longest JSON form."""
    block_records, layer_records = [], []
    for i, (b, info) in enumerate(zip(blocks, records)):
        qws, metrics, reasons = _annotations(b, info, choice)
        rec, layers, _ = layout_block(i, b.name, skeleton.get_submodule(b.name), qws, metrics=metrics,
                                      reasons=reasons, measure=False)
        block_records.append(rec)
        layer_records += layers
    stored = {n: stored_tensor(t, write_opts.param_dtype) for n, t in residents.items()}
    resident = [ResidentRecord(n, resident_tensor_name(n), dtype_name(t.dtype), list(t.shape), "0" * 64)
                for n, t in stored.items()]
    manifest = build_manifest(skeleton, block_records, layer_records, resident, write_opts)
    return (header_bytes(block_records, residents, write_opts.param_dtype) + len(manifest.to_json().encode())
            + sum(t.numel() * t.element_size() for t in stored.values()))


def _objective_note(d: LayerDecision, index: int) -> list[str]:
    c = d.tried[index]
    if c is d.chosen:
        return []
    return [f"W{d.chosen.bits}→W{c.bits}: --objective quality spent budget here (output rel-MSE "
            f"{d.chosen.metrics['output_rel_mse']:.4g} → {c.metrics['output_rel_mse']:.4g}, "
            f"+{candidate_bytes(c) - candidate_bytes(d.chosen):,} bytes)"]
