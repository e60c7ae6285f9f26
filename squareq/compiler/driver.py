"""`squareq compile`: measure every layer at every rung, measure each one's effect on the model's output, plan the
rungs by that effect within τ_OUT and the budget, write the slab.

The model runs its own forward once over the calibration batch, with each streamed block replaced by a stand-in that
loads the real block from the source, records its layers' inputs and searches every rung of every layer
(compiler/calibration_pass.py, compiler/ladder.py), then passes the original block's output on: the measurements
depend on the source, the data and the search options only, never on a plan, so a rebuild with other thresholds or
budget (``--from``, ``--resume``) reuses them. The effects pass (compiler/effect.py) then measures, end to end on the
held-out samples, what each candidate does to the model's output, the planner (compiler/plan.py) spends bytes where
that falls most per byte, and the chosen plan's output error is measured once more, directly
(compiler/slab_output.py). Only one real block is materialized at a time.

The stages, in order: compiler/compile_setup.py (before anything is measured), compiler/measurements.py (measured
or reused), compiler/slab_output.py (planned, corrected and written); compiler/manifest_records.py holds what the
manifest records of them.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..sizes import format_size
from ..slab import WriteOptions
from ..slab.atomic import OutputError, os_error_sentence
from ..sources import Source
from ..sources.local_files import source_identity
from .budget import OBJECTIVES, BudgetError
from .compile_setup import CompileSetup, set_up
from .effect import PlanWeights
from .manifest_records import calibration_record, vram_record
from .measurements import gather_measurements
from .options import CompileOptions
from .progress import CompileProgress, Progress
from .slab_output import check_output, correct_plan, fit_plan, kept_biases, planned_weights, write_slab
from .state import CompileState, state_folder
from .vram import PeakLog, VramPlan, vram_cap


def compile_slab(source: Source, out: str | Path, opts: CompileOptions, progress: Progress = lambda s: None,
                 bar: bool = False):
    """Compile ``source`` into the slab directory ``out`` and return its manifest. ``progress`` gets each message;
    with ``bar`` (stderr is a terminal) each pass over the blocks is a tqdm bar on stderr with an ETA, else a line per
    block (compiler/progress.py). A full disk or an unwritable folder is an :class:`OutputError` sentence; the
    blocks measured so far stay in the state folder."""
    out = Path(out)
    try:
        return _compile(source, out, opts, CompileProgress(progress, bar))
    except OSError as exc:
        then = "rerun with --resume (the blocks measured so far are kept)" if state_folder(out).is_dir() \
            else "run the command again"
        raise OutputError(os_error_sentence(exc, f"compiling {out}", then)) from None


def _compile(source: Source, out: Path, opts: CompileOptions, progress: CompileProgress):
    check_output(out, opts.overwrite, progress)
    if opts.objective not in OBJECTIVES:
        raise BudgetError(f"--objective {opts.objective!r} is not one of {', '.join(OBJECTIVES)}.")
    setup = set_up(source, out, opts, progress)
    with vram_cap(setup.vram):
        try:
            return _build(source, out, opts, progress, setup)
        except torch.OutOfMemoryError:
            raise BudgetError(_out_of_memory(setup.vram, opts, state_folder(out), setup.calibration.peaks)) from None


def _out_of_memory(vram: VramPlan, opts: CompileOptions, state: Path, peaks: PeakLog) -> str:
    peak = peaks.peak_reserved
    flag = f"--vram-budget {format_size(vram.budget)}" if opts.vram_budget else \
        f"the {format_size(vram.budget)} the GPU had free"
    then = "and a larger --vram-budget" if opts.vram_budget else "after freeing GPU memory"
    return (f"the compile ran out of GPU memory within {flag} (it expected to peak at "
            f"{format_size(vram.expected_peak or 0)}, reserved {format_size(peak or 0)}); rerun with --resume {then} "
            f"(the blocks measured so far are kept in {state}).")


def _build(source: Source, out: Path, opts: CompileOptions, progress: CompileProgress, setup: CompileSetup):
    """Measure (or reuse the measurements), plan, measure the plan's error and write the slab."""
    previous, calibration = setup.previous, setup.calibration
    calibration.peaks.lap("setup")  # the encoders' and the plan's probes'
    # a rebuild's state holds only the layers it searched again, so it must never pass for a full compile's
    state = calibration.state = CompileState(state_folder(out),
                                             {"measurement_key": setup.key,
                                              "rebuild_of": str(previous.path) if setup.reused else None},
                                             opts.resume, echo=progress)
    # before the long part: the identity of the files as the compile reads them, not as they are hours later
    named = [source.description, *(opts.encoders or {}).values()]
    identity = {where: found for where in named if (found := source_identity(where)) is not None}
    started = time.perf_counter()
    layers, fixed, notes, measured_rungs, effect_info = gather_measurements(source, opts, progress, setup, state)
    calibrate_s = time.perf_counter() - started
    build = previous.build + 1 if previous is not None else 1
    write_opts = WriteOptions(family=source.family, source=source.description, encoders=opts.encoders,
                              source_identity=identity,
                              overwrite=opts.overwrite, thresholds=opts.thresholds.to_dict(),
                              calibration=calibration_record(setup, opts, build, effect_info))
    names = dict(enumerate(source.block_paths))
    plan = fit_plan(setup, opts, state, names, layers, fixed, notes, measured_rungs, build, write_opts)

    if setup.reused:
        moved = {n: b for n, b in plan.rungs.items() if b != previous.rungs.get(n)}
        if moved:
            progress(f"{len(moved)} layers moved to a rung the previous slab does not hold: searching them")
            calibration.wanted = moved
            calibration.run(setup.shell)
    planned = lambda i: planned_weights(state, previous if setup.reused else None, i, names[i], plan)  # noqa: E731
    # a layer kept from a previous slab that stores it corrected keeps that slab's bias with its stored scales
    kept = lambda i: kept_biases(previous, setup.reused, names[i], plan)  # noqa: E731
    correction, measured, record = correct_plan(source, opts, setup, PlanWeights(planned, kept), progress)
    weights_of = planned if correction is None else lambda i: correction.weights(planned(i))  # noqa: E731
    biases_of = kept if correction is None else lambda i: {**kept(i), **correction.biases(  # noqa: E731
        correction.fixes)}
    calibration.peaks.lap("plan error")
    progress(f"plan: predicted model-output rel-MSE {plan.error:.3g}, measured {measured:.3g} (τ_OUT "
             f"{opts.thresholds.out:g})")
    peak = calibration.peaks.peak_reserved
    if peak is not None:
        progress(f"peak GPU memory reserved: {format_size(peak)} (budget {format_size(setup.vram.budget)}, "
                 f"expected {format_size(setup.vram.expected_peak or 0)}); allocated at most, by phase: "
                 f"{calibration.peaks.describe()}")
    write_opts.calibration.update(budget_bytes=opts.budget, predicted_output_rel_mse=plan.error,
                                  measured_output_rel_mse=measured, calibrate_seconds=round(calibrate_s, 3),
                                  output_correction=record,
                                  vram=vram_record(setup.vram, calibration.peaks, setup.host))
    manifest = write_slab(source, out, opts, setup, plan, layers, notes, measured_rungs, build,
                          PlanWeights(weights_of, biases_of), correction, write_opts, started, progress)
    if previous is not None:
        previous.slab.close()
    state.remove()
    return manifest

