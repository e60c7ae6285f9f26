"""Each layer as the planner sees it (its rungs' bytes and effects on the model's output, where the plan starts it),
each block's fixed bytes, each layer's notes and measured rungs: measured now, by the calibration pass and then the
effects pass (compiler/effect.py), or reused from a previous slab measured alike."""
from __future__ import annotations

from ..runtime.host.budget import empty_host_cache
from ..sources import Source
from .budget import candidate_bytes
from .compile_setup import CompileSetup
from .effect import measure_effects
from .host_plan import SAVED
from .options import CompileOptions
from .plan import LayerOptions
from .previous import Previous
from .progress import CompileProgress
from .state import CompileState


def gather_measurements(source: Source, opts: CompileOptions, progress: CompileProgress, setup: CompileSetup,
                        state: CompileState):
    """Each layer as the planner sees it, fixed bytes, notes, measured rungs and the effects record: measured now
    (the calibration pass, then the effects pass), or reused from the previous slab."""
    if setup.reused:
        progress(f"reusing the measurements of {opts.previous}: same source, calibration data and search options")
        (layers, fixed, notes, measured_rungs), effect_info = _from_previous(setup.previous), setup.previous.effect_info
    else:
        setup.calibration.run(setup.shell)
        found = state.load_effects()
        if found is None:
            quantized = lambda i: state.load_weights(i, lambda n, r: r != "bf16")  # noqa: E731 - bf16's effect is 0
            with setup.host.spilling(SAVED) as spill:
                keep = spill.put if spill is not None else setup.vram.store(setup.vram.host_saved)
                found = measure_effects(source, *setup.held, quantized, opts.device, opts.effect_probes, opts.seed,
                                        progress, axes=setup.axes, batched=setup.batched, keep=keep,
                                        lap=setup.calibration.peaks.lap,
                                        end_pass=spill.reset if spill is not None else None)
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
