"""`squareq compile`: measure every layer at every rung, measure each one's effect on the model's output, plan the
rungs by that effect within τ_OUT and the budget, write the slab.

The model runs its own forward once over the calibration batch, with each streamed block replaced by a stand-in that
loads the real block from the source, records its layers' inputs and searches every rung of every layer
(compiler/ladder.py), then passes the original block's output on: the measurements depend on the source, the data and
the search options only, never on a plan, so a rebuild with other thresholds or budget (``--from``, ``--resume``)
reuses them. The effects pass (compiler/effect.py) then measures, end to end on the held-out samples, what each
candidate does to the model's output, the planner (compiler/plan.py) spends bytes where that falls most per byte,
and the chosen plan's output error is measured once more, directly. Only one real block is materialized at a time.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import quant
from ..models.calibration import CalibrationSet
from ..models.local_files import source_identity
from ..sizes import format_size
from ..slab import BlockContent, SlabBuilder, SlabError, WriteOptions
from ..slab.atomic import OutputError, os_error_sentence, remove_debris
from ..slab.manifest import align_up
from ..slab.writer import PLACEHOLDER_FLOAT, block_linears, stored_tensor
from .budget import OBJECTIVES, BudgetError, candidate_bytes, check_least_budget
from .calibration import StatsCollector
from .chunks import BatchAxes, batched_kwargs, call_batch, probe_batch_axes, run_chunked
from .correction import METRICS as CORRECTION_METRICS
from .correction import MODES as CORRECTION_MODES
from .correction import Correction, NotFitted, fit_correction, wanted
from .disk import check_disk, estimate_disk
from .effect import DEFAULT_PROBES, PlanWeights, measure_effects, plan_output_errors
from .host_budget import SAVED, TAPE, HostPlan, empty_host_cache, estimate_host, plan_host
from .inputs import calibration_batch
from .ladder import DEFAULT_FORMATS, LayerDecision, diagnostics, ladder, measure_rungs, rung_specs
from .layer_search import Candidate, weight_metrics
from .plan import HYSTERESIS, LayerOptions, Plan, make_plan
from .previous import Previous, read_previous
from .sources import Source
from .spill import fetch
from .state import CompileState
from .thresholds import Thresholds
from .vram import PHASES, PeakLog, VramPlan, estimate_needs, plan_vram, vram_cap

# A manifest's layer record grows with the plan's reasons and history; the budget reserves this much per layer and
# build before the plan is known, and the exact size is checked against the budget before anything is written.
SLACK_PER_LAYER = 512


@dataclass
class CompileOptions:
    """Everything `squareq compile` takes besides the model and the output path."""

    budget: int
    objective: str = "size"
    thresholds: Thresholds = field(default_factory=Thresholds)
    formats: tuple[str, ...] = DEFAULT_FORMATS  # the rungs measured, by name (compiler/ladder.py)
    rounding: str = "gptq"
    rotation: bool = True  # the search also tries each layer Hadamard-rotated (compiler/layer_search.py)
    learned_rounding: bool = True  # and refines its winner's codes on the calibration rows (quant/refine.py)
    output_correction: str = "auto"  # refit each layer's scale and bias after the plan (compiler/correction.py)
    group_size: int = 64
    calib_samples: int | None = None  # None: the measured default for the kind of data (compiler/inputs.py)
    calib_images: CalibrationSet | None = None  # encoded images + captions (squareq.train.calibration)
    encoders: dict[str, str] | None = None  # recorded: the encoders calib_images came from, when not the source's
    calib_cache: str | None = None  # a training cache folder to calibrate on (squareq cache / squareq train)
    calib_text: str | None = None  # a text file, one sample per line (text models)
    calib_tokens: int | None = None  # most tokens per text sample (None: the default)
    calib_synthetic: bool = False  # noise and Gaussian text instead of data: for speed runs only
    max_rows: int = 512
    seed: int = 0
    effect_probes: int = DEFAULT_PROBES
    max_block_bytes: int | None = None  # the runtime's ring holds K slots of the largest block (docs/compiler.md)
    vram_cap: int | None = None  # or: GPU memory for the streamed weights, shared by ring_slots slots
    ring_slots: int = 2
    vram_budget: int | None = None  # the compile's own GPU memory (None: what the device has free)
    host_budget: int | None = None  # the compile's host memory (None: what the machine has available, less a margin)
    previous: str | None = None  # --from: a slab built before, whose rungs each layer starts at
    device: str = "cpu"  # where it runs (the CLI resolves --device auto: compiler/device_choice.py)
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        # checked when the options are made, before calibration data is encoded or any state folder is written: the
        # search builds its first spec only once the state exists, and that state would then refuse the fixed rerun
        try:
            quant.QuantSpec(group_size=self.group_size)
        except quant.SpecError as exc:
            raise quant.SpecError(f"--group-size {self.group_size}: {exc}") from None
        if isinstance(self.formats, str):
            self.formats = tuple(f.strip() for f in self.formats.split(",") if f.strip())
        try:
            self.formats = tuple(s.short_label for s in rung_specs(self.formats, self.group_size))
        except ValueError as exc:
            raise BudgetError(str(exc)) from None
        if self.output_correction not in CORRECTION_MODES:
            raise BudgetError(f"--output-correction {self.output_correction!r} must be one of "
                              f"{', '.join(CORRECTION_MODES)}.")
        for flag, value, least in (("--calib-samples", self.calib_samples, 2), ("--calib-tokens", self.calib_tokens, 2),
                                   ("--effect-probes", self.effect_probes, 1), ("--ring-slots", self.ring_slots, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise BudgetError(f"{flag} {value} must be a whole number of at least {least}.")

    def fingerprint(self) -> dict:
        """What the measurements depend on (the plan's thresholds, budget and objective are not among them)."""
        keep = ("formats", "rounding", "rotation", "learned_rounding", "group_size", "calib_samples", "calib_tokens",
                "calib_synthetic",
                "max_rows", "seed", "effect_probes")
        return {k: getattr(self, k) for k in keep}


Progress = Callable[[str], None]


def state_folder(out: Path) -> Path:
    return out.parent / f"{out.name}.state"


def _on_host(decision: LayerDecision) -> LayerDecision:
    """The decision with its candidates' tensors in host memory (a FLUX.1 double block's four rungs are 1.5 GB)."""
    tried = [Candidate(c.qweight.to("cpu"), c.alpha, c.metrics) for c in decision.tried]
    return LayerDecision(decision.name, tried[decision.tried.index(decision.chosen)], tried, decision.reasons)


def _unmeasured(name: str, w: torch.Tensor) -> LayerDecision:
    """A linear the calibration never called (a branch the inputs did not take): kept at bf16."""
    qw = quant.quantize(w.detach().float(), quant.QuantSpec(bits=16))
    c = Candidate(qw, 0.0, {**weight_metrics(w.detach().float(), quant.dequantize(qw)), "output_rel_mse": 0.0,
                            "heldout_rel_mse": 0.0, "heldout_rtn_rel_mse": 0.0, "calib_rel_mse": 0.0,
                            "act_outlier_score": 0.0, "scale_ratio": 1.0, "alpha": 0.0, "clip_ratio": 1.0, "gptq": 0.0})
    return LayerDecision(name, c, [c], ["not called during calibration, so it has no measurements: kept at bf16"])


class _Run:
    """The calibration pass's block stand-in: measures blocks the state does not hold yet (``wanted``: only these
    layers at these rungs, for a rebuild) and passes the original block's output on. Every block runs chunk by
    chunk (``axes``), measured or not, so a resumed compile passes on the same outputs."""

    def __init__(self, source: Source, opts: CompileOptions, progress: Progress, batch, axes: BatchAxes,
                 vram: VramPlan, host: HostPlan) -> None:
        self.source, self.opts, self.progress = source, opts, progress
        self.batch, self.axes, self.vram, self.host = batch, axes, vram, host
        self.last_call = None
        self.state: CompileState | None = None
        self.wanted: dict[str, str] | None = None
        self.started = time.perf_counter()
        self.done_blocks = 0
        self.forward_s = self.search_s = 0.0
        self.cursor = axes.cursor()
        self.peaks = PeakLog(opts.device)
        self.block_peaks = PeakLog(opts.device)
        self.offered = ladder(opts.group_size)  # every rung by name, worked out once for the whole compile
        self.rungs = [self.offered[r] for r in opts.formats]

    def run(self, shell) -> None:
        """One calibration pass of the model's own forward over the batch (on the device for this pass only)."""
        self.cursor = self.axes.cursor()
        kwargs = _moved(self.batch.kwargs, self.opts.device)
        try:
            with torch.no_grad():
                shell(**kwargs)
        except BaseException:
            self.state.wait(quiet=True)  # an interrupted pass keeps the block written meanwhile, for --resume
            raise
        else:
            self.state.wait()  # the last block's files, written while the pass went on
        finally:
            self.host.close(TAPE)  # the pass's spill file, and the pinned copies it kept for reuse
            empty_host_cache()

    def _eta(self, index: int, n: int) -> str:
        if self.done_blocks == 0:
            return "ETA --"
        per = (time.perf_counter() - self.started) / self.done_blocks
        return f"ETA {per * (n - index):.0f}s"

    def rungs_for(self, name: str) -> list[quant.QuantSpec] | None:
        """The specs to measure the layer at: every --formats rung, or for a rebuild only the rung it moved to."""
        if self.wanted is None:
            return self.rungs
        return [self.offered[self.wanted[name]]] if name in self.wanted else None

    def block(self, index: int, path: str, args, kwargs):
        n = len(self.source.block_paths)
        call = self.cursor.next(index)
        leaves, _ = tree_flatten((args, kwargs))
        ranges = self.axes.ranges(call_batch(leaves, call) or 1)
        real = self.source.load_block(path, self.opts.device, torch.float32, upcast_linears=True)
        todo = [name for name, _ in block_linears(path, real) if self.rungs_for(name)]
        if self.state.has_block(index) or (self.wanted is not None and not todo):
            return run_chunked(real, args, kwargs, call, ranges)
        self.progress(f"block {index + 1}/{n} {path}: calibrating and searching ({self._eta(index, n)})")
        if self.vram.host_tape and call != self.last_call:
            # the pinned allocator keeps freed copies for reuse by copies of the same size: a block of another kind
            # would add its own beside them (the host plan counts one kind's)
            empty_host_cache()
        self.last_call = call
        started = time.perf_counter()
        out = self._measure(index, path, real, set(todo), args, kwargs, call, ranges)
        self.done_blocks += 1
        self.progress(f"block {index + 1}/{n} {path}: done in {time.perf_counter() - started:.1f} s (forward "
                      f"{self.forward_s:.1f} s, search {self.search_s:.1f} s)"
                      f"{_peak_note(self.peaks, self.block_peaks)}")
        return out

    @torch.no_grad()
    def _measure(self, index: int, path: str, real: nn.Module, todo: set[str], args, kwargs, call, ranges):
        """Measure the block's layers at their rungs, save them, and return the original block's output."""
        o, b = self.opts, self.batch
        spill = self.host.spill_file(TAPE) if self.host.spill_tape else None
        store = spill.put if spill is not None else self.vram.store(self.vram.host_tape)
        # off the GPU (or out of host memory) the block's outputs wait with the recorded inputs while the layers are
        # searched
        parked = (lambda *a, **kw: tree_map(lambda t: store(t) if torch.is_tensor(t) else t, real(*a, **kw))) \
            if self.vram.host_tape or spill is not None else real
        with StatsCollector(path, real, max_rows=o.max_rows, hessian=o.rounding == "gptq", seed=o.seed + index,
                            samples=b.description.get("samples"), heldout_samples=b.heldout,
                            row_mask=b.row_mask, store=store) as col:
            started = time.perf_counter()
            ref = run_chunked(parked, args, kwargs, call, ranges, each=col.window)
            self.forward_s = time.perf_counter() - started
        block_peaks = self.block_peaks = PeakLog(o.device)  # this block's own, beside the compile's
        measured: dict[str, LayerDecision] = {}
        block_peaks.charge("calibration forward", self.peaks.lap("calibration forward"))
        self.search_s = 0.0
        for names in col.groups():
            mine = [x for x in names if x in todo]
            if mine:
                stats = col.group_stats(names, o.device).finish(pinned_host=True)
                col.release(names)  # the search reads the statistics only
                block_peaks.charge("statistics", self.peaks.lap("statistics"))
                for name in mine:
                    self.progress(f"block {index + 1}/{len(self.source.block_paths)} {path}: {name}")
                    weight = real.get_submodule(name[len(path) + 1:]).weight.float()
                    started = time.perf_counter()
                    decision = measure_rungs(name, weight, stats, self.rungs_for(name), o.rounding, o.rotation,
                                             o.learned_rounding)
                    self.search_s += time.perf_counter() - started
                    measured[name] = _on_host(decision)  # every rung of every layer until the block is saved
                    del weight, decision
                    block_peaks.charge("search", self.peaks.lap("search"))
                del stats
            col.release(names)
        decisions = {name: measured.get(name) or _unmeasured(name, mod.weight)
                     for name, mod in block_linears(path, real) if name in todo}
        ref = tree_map(lambda t: fetch(t, o.device), ref)
        if spill is not None:
            spill.reset()  # the block's tape is consumed: its disk space back before the next block's
        # Bytes of the block's other tensors in its blob, as the writer stores them (floating ones as bf16).
        weights = {f"{x[len(path) + 1:]}.weight" for x, _ in block_linears(path, real)}
        kept = (stored_tensor(t) for n, t in real.state_dict().items() if n not in weights)
        fixed = sum(align_up(t.numel() * t.element_size()) for t in kept)
        self.state.save_block(index, list(decisions.values()), {"fixed_bytes": fixed})
        return ref


# Bumped when the measurements' arithmetic changes, so that no rebuild reuses measurements made the old way (2: chunked
# calibration forward, per-sample effect probes; 3: the effects pass's own attention and products a slice of rows at a
# time; 4: the search's Hadamard-rotated candidates; 5: learned rounding).
MEASUREMENT_VERSION = 5


def measurement_key(source: Source, batch, opts: CompileOptions, chunk_samples: int | None = None) -> str:
    """Changes when anything the measurements depend on does: the source's weights (files, sizes, times), the
    calibration data, how many samples a block sees at once and the search options."""
    parts = {"source": source.fingerprint(), "calibration": batch.description, "chunk_samples": chunk_samples,
             "version": MEASUREMENT_VERSION, **opts.fingerprint()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compile_slab(source: Source, out: str | Path, opts: CompileOptions, progress: Progress = lambda s: None):
    """Compile ``source`` into the slab directory ``out`` and return its manifest. A full disk or an unwritable
    folder is an :class:`OutputError` sentence; the blocks measured so far stay in the state folder."""
    out = Path(out)
    try:
        return _compile(source, out, opts, progress)
    except OSError as exc:
        then = "rerun with --resume (the blocks measured so far are kept)" if state_folder(out).is_dir() \
            else "run the command again"
        raise OutputError(os_error_sentence(exc, f"compiling {out}", then)) from None


@dataclass
class _Setup:
    """What the compile works out before it measures anything (and before any state is written)."""

    skeleton: nn.Module
    previous: Previous | None
    batch: object
    batched: set
    axes: BatchAxes
    vram: VramPlan
    host: HostPlan
    key: str
    run: _Run
    shell: nn.Module
    residents: dict
    cap: int | None

    @property
    def reused(self) -> bool:
        return self.previous is not None and self.previous.key == self.key

    @property
    def held(self) -> tuple[dict, torch.Tensor | None]:
        """The held-out samples' forward arguments and row mask (all samples when none are held out), on the
        device."""
        b = self.batch
        if b.heldout_kwargs is not None:
            return b.heldout_kwargs, b.heldout_row_mask
        return _moved(b.kwargs, self.vram.device), b.row_mask


def _moved(tree, device):
    """``tree`` with its tensors on ``device``."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, tree)


def _compile(source: Source, out: Path, opts: CompileOptions, progress: Progress):
    if out.exists() and not opts.overwrite:
        raise SlabError(f"{out} already exists; choose another output path or pass --force.")
    if opts.objective not in OBJECTIVES:
        raise BudgetError(f"--objective {opts.objective!r} is not one of {', '.join(OBJECTIVES)}.")
    for debris in remove_debris(out):
        progress(f"removed {debris}, left by a compile that was killed")
    setup = _setup(source, out, opts, progress)
    with vram_cap(setup.vram):
        try:
            return _build(source, out, opts, progress, setup)
        except torch.OutOfMemoryError:
            raise BudgetError(_out_of_memory(setup.vram, opts, state_folder(out), setup.run.peaks)) from None


def check_budget(source: Source, opts: CompileOptions) -> None:
    """Refuse, from the shapes alone, a ``--budget`` no slab of ``source`` fits: before any encoder or calibration
    runs (a rebuild is not checked: it may keep rungs its ``--formats`` no longer offers)."""
    if opts.previous is None:
        check_least_budget(opts.budget, source.skeleton(), source.block_paths,
                           rung_specs(opts.formats, opts.group_size))


def _setup(source: Source, out: Path, opts: CompileOptions, progress: Progress) -> _Setup:
    skeleton = source.skeleton()
    previous = read_previous(opts.previous, source, skeleton) if opts.previous else None
    check_budget(source, opts)
    specs = rung_specs(opts.formats, opts.group_size)
    batch = calibration_batch(source, skeleton, opts)
    progress(_calibration_line(batch.description))
    samples = int(batch.description.get("samples") or 1)
    batched = batched_kwargs(batch.kwargs, batch.heldout_kwargs, samples)
    axes = probe_batch_axes(source, batch.kwargs, batched, samples)
    needs = estimate_needs(source, skeleton, batch, axes, gptq=opts.rounding == "gptq", max_rows=opts.max_rows,
                           probes=opts.effect_probes, specs=specs)
    # between the passes that read it, the calibration batch waits in host memory (FLUX.2's text states are 1 GB)
    batch.kwargs = _moved(batch.kwargs, "cpu")
    vram = plan_vram(needs, opts.vram_budget, opts.device)
    host_needs = estimate_host(needs, vram, skeleton, source.block_paths, batch, axes, specs, opts.effect_probes,
                               opts.rounding == "gptq")
    host = plan_host(host_needs, opts.host_budget, vram, state_folder(out))
    progress(vram.describe(axes.chunk_samples, axes.why))
    progress(host.describe())
    key = measurement_key(source, batch, opts, axes.chunk_samples)
    spilled = max(needs.tape if host.spill_tape else 0, needs.saved if host.spill_saved else 0)
    disk = estimate_disk(skeleton, source.block_paths, specs, spilled, opts.budget, state_folder(out),
                         rebuild=previous is not None and previous.key == key)
    progress(check_disk(disk, state_folder(out), out))
    run = _Run(source, opts, progress, batch, axes, vram, host)
    shell = source.shell(run.block, opts.device, upcast_linears=True)  # checks the checkpoint
    residents = source.resident_state("cpu", torch.float32)
    return _Setup(skeleton, previous, batch, batched, axes, vram, host, key, run, shell, residents,
                  _block_cap(opts, residents))


def _peak_note(peaks: PeakLog, block: PeakLog) -> str:
    if peaks.peak_reserved is None:
        return ""
    return (f"; GPU memory allocated at most: {block.describe()}; reserved so far "
            f"{format_size(peaks.peak_reserved)}")


def _out_of_memory(vram: VramPlan, opts: CompileOptions, state: Path, peaks: PeakLog) -> str:
    peak = peaks.peak_reserved
    flag = f"--vram-budget {format_size(vram.budget)}" if opts.vram_budget else \
        f"the {format_size(vram.budget)} the GPU had free"
    then = "and a larger --vram-budget" if opts.vram_budget else "after freeing GPU memory"
    return (f"the compile ran out of GPU memory within {flag} (it expected to peak at "
            f"{format_size(vram.expected_peak or 0)}, reserved {format_size(peak or 0)}); rerun with --resume {then} "
            f"(the blocks measured so far are kept in {state}).")


def _build(source: Source, out: Path, opts: CompileOptions, progress: Progress, setup: _Setup):
    """Measure (or reuse the measurements), plan, measure the plan's error and write the slab."""
    previous, run = setup.previous, setup.run
    run.peaks.lap("setup")  # the encoders' and the plan's probes'
    # a rebuild's state holds only the layers it searched again, so it must never pass for a full compile's
    state = run.state = CompileState(state_folder(out), {"measurement_key": setup.key,
                                                         "rebuild_of": str(previous.path) if setup.reused else None},
                                     opts.resume, echo=progress)
    # before the long part: the identity of the files as the compile reads them, not as they are hours later
    named = [source.description, *(opts.encoders or {}).values()]
    identity = {where: found for where in named if (found := source_identity(where)) is not None}
    started = time.perf_counter()
    layers, fixed, notes, measured_rungs, effect_info = _measurements(source, opts, progress, setup, state)
    calibrate_s = time.perf_counter() - started
    build = previous.build + 1 if previous is not None else 1
    write_opts = WriteOptions(family=source.family, source=source.description, encoders=opts.encoders,
                              source_identity=identity,
                              overwrite=opts.overwrite, thresholds=opts.thresholds.to_dict(),
                              calibration=_calibration_record(setup, opts, build, effect_info))
    names = dict(enumerate(source.block_paths))
    plan = _plan(setup, opts, state, names, layers, fixed, notes, measured_rungs, build, write_opts)

    if setup.reused:
        moved = {n: b for n, b in plan.rungs.items() if b != previous.rungs.get(n)}
        if moved:
            progress(f"{len(moved)} layers moved to a rung the previous slab does not hold: searching them")
            run.wanted = moved
            run.run(setup.shell)
    planned = lambda i: _weights(state, previous if setup.reused else None, i, names[i], plan)  # noqa: E731
    # a layer kept from a previous slab that stores it corrected keeps that slab's bias with its stored scales
    kept_biases = lambda i: _kept_biases(previous, setup.reused, names[i], plan)  # noqa: E731
    correction, measured, record = _correct(source, opts, setup, PlanWeights(planned, kept_biases), progress)
    weights_of = planned if correction is None else lambda i: correction.weights(planned(i))  # noqa: E731
    biases_of = kept_biases if correction is None else lambda i: {**kept_biases(i), **correction.biases(  # noqa: E731
        correction.fixes)}
    run.peaks.lap("plan error")
    progress(f"plan: predicted model-output rel-MSE {plan.error:.3g}, measured {measured:.3g} (τ_OUT "
             f"{opts.thresholds.out:g})")
    peak = run.peaks.peak_reserved
    if peak is not None:
        progress(f"peak GPU memory reserved: {format_size(peak)} (budget {format_size(setup.vram.budget)}, "
                 f"expected {format_size(setup.vram.expected_peak or 0)}); allocated at most, by phase: "
                 f"{run.peaks.describe()}")
    write_opts.calibration.update(budget_bytes=opts.budget, predicted_output_rel_mse=plan.error,
                                  measured_output_rel_mse=measured, calibrate_seconds=round(calibrate_s, 3),
                                  output_correction=record,
                                  vram=_vram_record(setup.vram, run.peaks, setup.host))
    manifest = _write(source, out, opts, setup, plan, layers, notes, measured_rungs, build,
                      PlanWeights(weights_of, biases_of), correction, write_opts, started)
    if previous is not None:
        previous.slab.close()
    state.remove()
    return manifest


def _correct(source: Source, opts: CompileOptions, setup: _Setup, planned: PlanWeights, progress: Progress):
    """The output correction (compiler/correction.py) when fitted and kept, the slab's measured output error on the
    held-out samples, and the manifest's record of both. Kept only if it lowers that error."""
    batch = setup.batch
    why = wanted(opts.output_correction, batch.description, batch.heldout)
    fitted = None
    if why is None:
        progress("output correction: refitting each layer's scale and bias on the quantized model's own inputs")
        try:
            fitted = fit_correction(source, batch.kwargs, batch.row_mask, batch.heldout, planned.weights_of,
                                    setup.batched, setup.axes, opts.device, progress, planned.biases_of)
        except NotFitted as exc:
            why = str(exc)
        except torch.OutOfMemoryError:
            why = "its pass ran out of memory (it holds two copies of the calibration batch)"
    progress("measuring the plan's model-output error on the held-out samples")
    record = dict(_CORRECTION_RECORD, mode=opts.output_correction)
    if fitted is None:
        progress(f"output correction: not fitted ({why})")
        return None, plan_output_errors(source, *setup.held, [planned], opts.device, setup.axes)[0], record
    fixed = fitted.biases(fitted.fixes)
    corrected = PlanWeights(lambda i: fitted.weights(planned.weights_of(i)),
                            lambda i: {**planned.biases_of(i), **fixed})
    without, corrected = plan_output_errors(source, *setup.held, [planned, corrected], opts.device, setup.axes)
    kept = corrected < without
    record.update(fitted.record, fitted=True, kept=kept, output_rel_mse_without=without, output_rel_mse_with=corrected)
    progress(f"output correction: {fitted.record['corrected']} of {fitted.record['layers']} layers corrected "
             f"({fitted.record['refused']} would have erred more than plain rounding on the held-out samples); "
             f"model-output rel-MSE {corrected:.4g} against {without:.4g} without: "
             + ("kept" if kept else "not kept, since it does not lower it"))
    return (fitted if kept else None), min(corrected, without), record


def _kept_biases(previous: Previous | None, reused: bool, path: str, plan: Plan) -> dict[str, torch.Tensor]:
    """For a rebuild that keeps layers of a previous slab on their rung: the biases that slab stores with the layers
    it corrected (their stored scales were fitted with them)."""
    if previous is None or not reused:
        return {}
    kept = (n for n, r in plan.rungs.items() if n.startswith(path + ".") and previous.rungs.get(n) == r
            and previous.corrected(n))
    return {n: b for n in kept if (b := previous.bias(n, path)) is not None}


# The manifest's record of the output correction; the values here are also the widest form the budget plans with.
_CORRECTION_RECORD = {"mode": "auto", "fitted": False, "kept": False, "layers": 0, "corrected": 0, "refused": 0,
                      "passes": 0, "fit_samples": 0, "scale_min": None, "scale_max": None, "seconds": None,
                      "output_rel_mse_without": None, "output_rel_mse_with": None}


def _measurements(source: Source, opts: CompileOptions, progress: Progress, setup: _Setup, state: CompileState):
    """Each layer as the planner sees it, fixed bytes, notes, measured rungs and the effects record: measured now
    (the calibration pass, then the effects pass), or reused from the previous slab."""
    if setup.reused:
        progress(f"reusing the measurements of {opts.previous}: same source, calibration data and search options")
        (layers, fixed, notes, measured_rungs), effect_info = _from_previous(setup.previous), setup.previous.effect_info
    else:
        setup.run.run(setup.shell)
        found = state.load_effects()
        if found is None:
            quantized = lambda i: state.load_weights(i, lambda n, r: r != "bf16")  # noqa: E731 - bf16's effect is 0
            with setup.host.spilling(SAVED) as spill:
                keep = spill.put if spill is not None else setup.vram.store(setup.vram.host_saved)
                found = measure_effects(source, *setup.held, quantized, opts.device, opts.effect_probes, opts.seed,
                                        progress, axes=setup.axes, batched=setup.batched, keep=keep,
                                        lap=setup.run.peaks.lap, end_pass=spill.reset if spill is not None else None)
            empty_host_cache()  # the pass's pinned copies, kept for reuse by the allocator
            state.save_effects(*found)
        effects, effect_info = found
        layers, fixed, notes, measured_rungs = _from_state(source, state, effects)
    for layer in layers:
        layer.start = _start(layer, setup.previous)
    return layers, fixed, notes, measured_rungs, effect_info


def _start(layer: LayerOptions, previous: Previous | None) -> str:
    """Where the plan starts the layer: its cheapest rung, or for a rebuild its rung in the previous slab (when that
    is no longer measured, the cheapest rung that stores at least as many bytes)."""
    if previous is None or layer.name not in previous.records:
        return layer.rungs[0]
    rung = previous.rungs[layer.name]
    if rung in layer.bytes:
        return rung
    had = previous.layer_bytes(layer.name)
    return next((r for r in layer.rungs if layer.bytes[r] >= had), layer.rungs[-1])


def _calibration_record(setup: _Setup, opts: CompileOptions, build: int, effect_info: dict) -> dict:
    """The manifest's calibration block, with placeholders of the widest form for numbers known only at the end."""
    return {**setup.batch.description, "objective": opts.objective, "budget_bytes": 10**15,
            "rounding": opts.rounding, "rotation": opts.rotation, "learned_rounding": opts.learned_rounding,
            "formats": list(opts.formats),
            "group_size": opts.group_size,
            "build": build, "from": str(opts.previous) if opts.previous else None, "measurement_key": setup.key,
            "measurements": f"reused from {opts.previous}" if setup.reused else "measured",
            "effect": effect_info, "tau_out": opts.thresholds.out, "hysteresis": HYSTERESIS,
            "chunk_samples": setup.axes.chunk_samples,
            "predicted_output_rel_mse": PLACEHOLDER_FLOAT, "measured_output_rel_mse": PLACEHOLDER_FLOAT,
            "calibrate_seconds": PLACEHOLDER_FLOAT, "compile_seconds": PLACEHOLDER_FLOAT,
            "vram": _vram_record(setup.vram, None, setup.host),
            "output_correction": {k: "auto" if k == "mode" else 10**15 if isinstance(v, int) and not isinstance(v, bool)
                                  else PLACEHOLDER_FLOAT for k, v in _CORRECTION_RECORD.items()}}


def _vram_record(vram: VramPlan, peaks: PeakLog | None, host: HostPlan) -> dict:
    """The VRAM and host plans and the measured peaks, for the manifest (integers; the widest form while planning,
    when ``peaks`` is None)."""
    wide = 10**15
    phases = dict.fromkeys(PHASES, wide) if peaks is None else \
        {p: b if peaks.cuda else None for p, b in peaks.record().items()}
    return {"budget_bytes": wide if peaks is None else vram.budget,
            "expected_peak_bytes": wide if peaks is None else vram.expected_peak,
            "peak_reserved_bytes": wide if peaks is None else peaks.peak_reserved,
            "peak_allocated_bytes": wide if peaks is None else peaks.peak_allocated,
            "phase_peak_allocated_bytes": phases,
            "recorded_inputs_on_host": vram.host_tape, "effect_inputs_on_host": vram.host_saved,
            **host.record(final=peaks is not None)}


def _plan(setup: _Setup, opts: CompileOptions, state: CompileState, names, layers, fixed, notes, measured_rungs,
          build: int, write_opts: WriteOptions) -> Plan:
    """The planner's rungs within τ_OUT, the budget and the block cap, checked against the slab's exact size."""
    correcting = wanted(opts.output_correction, setup.batch.description, setup.batch.heldout) is None
    meta = lambda plan: _metadata_bytes(setup.skeleton, names, layers, fixed, plan, measured_rungs, notes,  # noqa: E731
                                        setup.previous, build, setup.residents, write_opts, opts.thresholds,
                                        correcting)
    overhead = meta(Plan({x.name: x.start for x in layers})) + SLACK_PER_LAYER * build * len(layers)
    try:
        plan = make_plan(layers, fixed, opts.thresholds.out, opts.budget, overhead, opts.objective, setup.cap, names)
        needed = meta(plan) + sum(fixed.values()) + plan.layer_bytes
        if needed > opts.budget:
            raise BudgetError(f"the plan needs a slab of at least {needed:,} bytes but --budget is {opts.budget:,} "
                              "bytes; raise --budget to at least that.")
    except BudgetError as exc:
        raise BudgetError(f"{exc} Nothing was written; the measurements are kept in {state.folder}, so rerunning "
                          "with --resume and another --budget or --thresholds skips them.") from None
    return plan


def _write(source: Source, out: Path, opts: CompileOptions, setup: _Setup, plan: Plan, layers, notes, measured_rungs,
           build: int, weights: PlanWeights, correction: Correction | None, write_opts: WriteOptions, started: float):
    """Encode each block's blob from the plan's weights and biases (with the output correction's measurements) and
    assemble the slab (atomically)."""
    fixes = correction.fixes if correction is not None else {}
    with SlabBuilder(out, setup.skeleton, write_opts) as slab:
        for i, path in enumerate(source.block_paths):
            qws, biases = weights.weights_of(i), weights.biases_of(i)
            metrics, reasons, annotations = _annotations(path, layers, plan, notes, setup.previous, build,
                                                         measured_rungs, opts.thresholds)
            for name in qws:
                if name in fixes:
                    metrics[name].update(fixes[name].metrics)
                elif name in biases:  # a previous slab's corrected layer, kept as it was: so are its measurements
                    was = setup.previous.records[name].metrics
                    metrics[name].update({k: was[k] for k in CORRECTION_METRICS if k in was})
            measured_here = all("weight_rel_mse" in metrics[n] for n in qws)
            real = source.load_block(path, "cpu", torch.float32, linear_weights=not measured_here)
            for name, mod in block_linears(path, real):
                if name in biases:
                    mod.bias.data.copy_(biases[name])
            slab.add_block(BlockContent(i, path, real, qws, metrics, reasons, annotations, measure=not measured_here))
        write_opts.calibration.update(compile_seconds=round(time.perf_counter() - started, 3))
        return slab.finish(setup.residents, max_bytes=opts.budget)


def _block_cap(opts: CompileOptions, residents: dict) -> int | None:
    """The largest block the plan may make: --max-block-bytes, or (--vram-cap − the resident tensors as stored) /
    --ring-slots, since the runtime's ring holds that many slots of the largest block."""
    if opts.vram_cap is None:
        return opts.max_block_bytes
    resident = sum(t.numel() * t.element_size() for t in map(stored_tensor, residents.values()))
    cap = (opts.vram_cap - resident) // max(opts.ring_slots, 1)
    if cap <= 0:
        raise BudgetError(f"--vram-cap {opts.vram_cap:,} bytes does not even hold the resident tensors ({resident:,} "
                          "bytes); raise it.")
    return cap


def _from_state(source: Source, state: CompileState, effects):
    """From the finished blocks' records, in one pass: each layer as the planner sees it, each block's fixed bytes,
    each layer's notes that are not moves (e.g. 'not called during calibration') and its measured rungs as
    ``{rung: (spec, metrics)}``."""
    layers, fixed, notes, measured = [], {}, {}, {}
    for i, _ in enumerate(source.block_paths):
        decisions, info = state.load_block(i, tensors=False)
        fixed[i] = info["fixed_bytes"]
        for d in decisions:
            rungs = {c.rung: candidate_bytes(c) for c in d.tried}
            effect = {r: (0.0 if r == "bf16" else effects.get(d.name, {}).get(r, 0.0)) for r in rungs}
            layers.append(LayerOptions(d.name, i, rungs, effect, min(rungs, key=rungs.get)))
            notes[d.name] = list(d.reasons)
            measured[d.name] = {c.rung: (c.qweight.spec.to_dict(), c.metrics) for c in d.tried}
    return layers, fixed, notes, measured


def _from_previous(previous: Previous):
    """The same four as :func:`_from_state`, from the records of a previous slab measured alike."""
    notes = {n: list(rec.history[0].get("notes", [])) if rec.history else [] for n, rec in previous.records.items()}
    measured = {n: {rung: (r["spec"], r["metrics"]) for rung, r in rec.rungs.items()}
                for n, rec in previous.records.items()}
    return previous.layer_options(), previous.fixed_bytes(), notes, measured


def _weights(state: CompileState, previous: Previous | None, index: int, path: str, plan: Plan):
    """The plan's quantized weights of one block: from the state's candidates (only the chosen rungs are read), or
    the previous slab's own tensors where a rebuild kept a layer on its rung."""
    chosen = {n: b for n, b in plan.rungs.items() if n.startswith(path + ".")}
    found = state.load_weights(index, lambda n, r: chosen.get(n) == r) if state.has_block(index) else {}
    out = {}
    for name, rung in chosen.items():
        if rung in found.get(name, {}):
            out[name] = found[name][rung]
        elif previous is not None and previous.rungs.get(name) == rung:
            out[name] = previous.quantized_weight(name)
        else:
            raise RuntimeError(f"layer {name} has no candidate at {rung}; this is a bug in squareq's compiler.")
    return out


def _annotations(path: str, layers, plan: Plan, notes, previous: Previous | None, build: int, specs,
                 thresholds: Thresholds):
    """(metrics, reasons, {history, rungs}) by layer name for one block under ``plan``."""
    metrics, reasons, annotations = {}, {}, {}
    for x in (x for x in layers if x.name.startswith(path + ".")):
        rung = plan.rungs[x.name]
        measured = specs[x.name]
        metrics[x.name] = {**measured[rung][1], "effect": x.effect[rung]}
        moves = plan.moves.get(x.name, [])
        reasons[x.name] = list(notes.get(x.name, [])) + moves
        before = list(previous.records[x.name].history) if previous is not None and x.name in previous.records else []
        entry = {"build": build, "rung": rung, "moves": moves}
        if notes.get(x.name):
            entry["notes"] = notes[x.name]
        flagged = diagnostics(quant.QuantSpec.from_dict(measured[rung][0]), measured[rung][1], thresholds)
        if flagged:
            entry["diagnostics"] = flagged
        rungs = {r: {"spec": measured[r][0], "bytes": x.bytes[r], "metrics": {**measured[r][1], "effect": x.effect[r]}}
                 for r in x.rungs}
        annotations[x.name] = {"history": before + [entry], "rungs": rungs}
    return metrics, reasons, annotations


def _metadata_bytes(skeleton, names: dict[int, str], layers, fixed, plan: Plan, specs, notes, previous, build,
                    residents: dict, write_opts: WriteOptions, thresholds: Thresholds, correcting: bool = False) -> int:
    """Bytes of everything but the blobs (header, resident tensors, manifest) for ``plan``, planned from the
    skeleton: an upper bound, since unknown numbers are given their longest JSON form (with ``correcting``, those
    the output correction writes into every layer's metrics too)."""
    blocks = []
    for i, path in names.items():
        qws = {}
        for x in (x for x in layers if x.name.startswith(path + ".")):
            spec = quant.QuantSpec.from_dict(specs[x.name][plan.rungs[x.name]][0])
            qws[x.name] = quant.QuantizedWeight.placeholder(spec, tuple(skeleton.get_submodule(x.name).weight.shape))
        metrics, reasons, annotations = _annotations(path, layers, plan, notes, previous, build, specs, thresholds)
        if correcting:
            for m in metrics.values():
                m.update(dict.fromkeys(CORRECTION_METRICS, PLACEHOLDER_FLOAT))
        blocks.append(BlockContent(i, path, skeleton.get_submodule(path), qws, metrics, reasons, annotations,
                                   measure=False))
    return SlabBuilder.metadata_bytes(skeleton, blocks, residents, write_opts)


def _calibration_line(d: dict) -> str:
    what = d.get("source") or d.get("why") or d.get("kind")
    held = f", {d['heldout_samples']} held out to judge the transforms" if d.get("heldout_samples") else ""
    return f"calibrating on {d.get('samples')} samples of {what}{held}"
