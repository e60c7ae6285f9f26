"""What the slab's manifest records of a compile: its calibration block (the data, the search options, the plan's
predicted and measured error, the VRAM and host plans and peaks, the output correction) and each layer's metrics,
reasons, history and measured rungs; and, from the skeleton alone, how many bytes all of it takes for a plan."""
from __future__ import annotations

from .. import quant
from ..slab import BlockContent, SlabBuilder, WriteOptions
from ..slab.writer import PLACEHOLDER_FLOAT
from .compile_setup import CompileSetup
from .correction import METRICS as CORRECTION_METRICS
from .host_plan import HostPlan
from .ladder import diagnostics
from .options import CompileOptions
from .plan import HYSTERESIS, Plan
from .previous import Previous
from .thresholds import Thresholds
from .vram import PHASES, PeakLog, VramPlan

# The manifest's record of the output correction; the values here are also the widest form the budget plans with.
CORRECTION_RECORD = {"mode": "auto", "fitted": False, "kept": False, "layers": 0, "corrected": 0, "refused": 0,
                     "passes": 0, "fit_samples": 0, "scale_min": None, "scale_max": None, "seconds": None,
                     "output_rel_mse_without": None, "output_rel_mse_with": None}


def calibration_record(setup: CompileSetup, opts: CompileOptions, build: int, effect_info: dict) -> dict:
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
            "vram": vram_record(setup.vram, None, setup.host),
            "output_correction": {k: "auto" if k == "mode" else 10**15 if isinstance(v, int) and not isinstance(v, bool)
                                  else PLACEHOLDER_FLOAT for k, v in CORRECTION_RECORD.items()}}


def vram_record(vram: VramPlan, peaks: PeakLog | None, host: HostPlan) -> dict:
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


def layer_annotations(path: str, layers, plan: Plan, notes, previous: Previous | None, build: int, specs,
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


def metadata_bytes(skeleton, names: dict[int, str], layers, plan: Plan, specs, notes, previous, build,
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
        metrics, reasons, annotations = layer_annotations(path, layers, plan, notes, previous, build, specs, thresholds)
        if correcting:
            for m in metrics.values():
                m.update(dict.fromkeys(CORRECTION_METRICS, PLACEHOLDER_FLOAT))
        blocks.append(BlockContent(i, path, skeleton.get_submodule(path), qws, metrics, reasons, annotations,
                                   measure=False))
    return SlabBuilder.metadata_bytes(skeleton, blocks, residents, write_opts)
