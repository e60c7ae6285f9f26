"""From the plan to the slab: the planner's rungs checked against the slab's exact size, the output correction
fitted to them (compiler/correction.py) and the plan's output error measured, each block's chosen weights and
biases, and the slab written."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..slab import BlockContent, SlabBuilder, SlabError, WriteOptions
from ..slab.atomic import remove_debris, restore_replaced
from ..slab.writer import block_linears
from ..sources import Source
from .budget import BudgetError
from .compile_setup import CompileSetup
from .correction import METRICS as CORRECTION_METRICS
from .correction import Correction, NotFitted, fit_correction, wanted
from .effect import PlanWeights, plan_output_errors
from .manifest_records import CORRECTION_RECORD, layer_annotations, metadata_bytes
from .options import CompileOptions
from .plan import CapFlag, Plan, make_plan
from .previous import Previous
from .progress import CompileProgress
from .state import CompileState

# A manifest's layer record grows with the plan's reasons and history; the budget reserves this much per layer and
# build before the plan is known, and the exact size is checked against the budget before anything is written.
SLACK_PER_LAYER = 512


def check_output(out: Path, overwrite: bool, say=lambda line: print(f"[compile] {line}", file=sys.stderr)) -> None:
    """Refuse a slab path that is taken (without ``overwrite``, --force) before any work, rather than after the
    calibration and measurements; the driver checks again before it writes. A slab that a killed ``--force`` left
    hidden is put back first, and what a killed compile left beside it is removed, refused or not (``say`` says
    so)."""
    restored = restore_replaced(out)
    if restored is not None:
        say(f"put {out} back from {restored.name}: a compile that replaced it was killed before the new slab was in "
            "place")
    for debris in remove_debris(out):
        say(f"removed {debris}, left by a compile that was killed")
    if out.exists() and not overwrite:
        raise SlabError(f"{out} already exists; choose another output path or pass --force.")


def fit_plan(setup: CompileSetup, opts: CompileOptions, state: CompileState, names, layers, fixed, notes,
             measured_rungs, build: int, write_opts: WriteOptions) -> Plan:
    """The planner's rungs within τ_OUT, the budget and the block cap, checked against the slab's exact size."""
    correcting = wanted(opts.output_correction, setup.batch.description, setup.batch.heldout) is None
    meta = lambda plan: metadata_bytes(setup.skeleton, names, layers, plan, measured_rungs, notes,  # noqa: E731
                                       setup.previous, build, setup.residents, write_opts, opts.thresholds,
                                       correcting)
    overhead = meta(Plan({x.name: x.start for x in layers})) + SLACK_PER_LAYER * build * len(layers)
    try:
        flag = CapFlag() if opts.vram_cap is None else CapFlag("--vram-cap", opts.vram_cap, max(opts.ring_slots, 1))
        plan = make_plan(layers, fixed, opts.thresholds.out, opts.budget, overhead, opts.objective, setup.cap, names,
                         flag)
        needed = meta(plan) + sum(fixed.values()) + plan.layer_bytes
        if needed > opts.budget:
            raise BudgetError(f"the plan needs a slab of at least {needed:,} bytes but --budget is {opts.budget:,} "
                              "bytes; raise --budget to at least that.")
    except BudgetError as exc:
        state.mark_refused(str(exc))
        raise BudgetError(f"{exc} Nothing was written; the measurements are kept in {state.folder}, so rerunning "
                          "with another --budget or --thresholds (and the same other options) skips them.") from None
    return plan


def write_slab(source: Source, out: Path, opts: CompileOptions, setup: CompileSetup, plan: Plan, layers, notes,
               measured_rungs, build: int, weights: PlanWeights, correction: Correction | None,
               write_opts: WriteOptions, started: float, progress: CompileProgress):
    """Encode each block's blob from the plan's weights and biases (with the output correction's measurements) and
    assemble the slab (atomically); ``progress`` shows it as a pass over the blocks ("write")."""
    fixes = correction.fixes if correction is not None else {}
    n = len(source.block_paths)
    with SlabBuilder(out, setup.skeleton, write_opts) as slab, progress.blocks(n, "write"):
        for i, path in enumerate(source.block_paths):
            progress.begin(f"block {i + 1}/{n} {path}: writing")
            qws, biases = weights.weights_of(i), weights.biases_of(i)
            metrics, reasons, annotations = layer_annotations(path, layers, plan, notes, setup.previous, build,
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
            progress.done()
        write_opts.calibration.update(compile_seconds=round(time.perf_counter() - started, 3))
        return slab.finish(setup.residents, max_bytes=opts.budget)


def correct_plan(source: Source, opts: CompileOptions, setup: CompileSetup, planned: PlanWeights,
                 progress: CompileProgress):
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
    record = dict(CORRECTION_RECORD, mode=opts.output_correction)
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


def kept_biases(previous: Previous | None, reused: bool, path: str, plan: Plan) -> dict[str, torch.Tensor]:
    """For a rebuild that keeps layers of a previous slab on their rung: the biases that slab stores with the layers
    it corrected (their stored scales were fitted with them)."""
    if previous is None or not reused:
        return {}
    kept = (n for n, r in plan.rungs.items() if n.startswith(path + ".") and previous.rungs.get(n) == r
            and previous.corrected(n))
    return {n: b for n in kept if (b := previous.bias(n, path)) is not None}


def planned_weights(state: CompileState, previous: Previous | None, index: int, path: str, plan: Plan):
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
