"""The calibration pass: the model's own forward over the calibration batch, each streamed block standing in for
itself, loaded from the source, its layers' inputs recorded and every rung of every layer searched
(compiler/ladder.py), its output passed on. The measurements are saved block by block in the state folder."""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .. import quant
from ..runtime.host.budget import empty_host_cache
from ..sizes import format_size
from ..slab.manifest import align_up
from ..slab.writer import block_linears, stored_tensor
from ..sources import Source
from .chunks import BatchAxes, call_batch, run_chunked
from .host_plan import TAPE, HostPlan
from .ladder import LayerDecision, ladder, measure_rungs
from .layer_search import Candidate, weight_metrics
from .layer_statistics import StatsCollector
from .options import CompileOptions
from .progress import CompileProgress
from .spill import KeepThenSpill, fetch
from .state import CompileState
from .vram import PeakLog, VramPlan


class CalibrationPass:
    """The calibration pass (``run``) and its block stand-in (``block``): measures blocks the state does not hold yet
    (``wanted``: only these layers at these rungs, for a rebuild) and passes the original block's output on. Every
    block runs chunk by chunk (``axes``), measured or not, so a resumed compile passes on the same outputs."""

    def __init__(self, source: Source, opts: CompileOptions, progress: CompileProgress, batch, axes: BatchAxes,
                 vram: VramPlan, host: HostPlan) -> None:
        self.source, self.opts, self.progress = source, opts, progress
        self.batch, self.axes, self.vram, self.host = batch, axes, vram, host
        self.last_call = None
        self.state: CompileState | None = None
        self.wanted: dict[str, str] | None = None
        self.forward_s = self.search_s = 0.0
        self.cursor = axes.cursor()
        self.peaks = PeakLog(opts.device)
        self.block_peaks = PeakLog(opts.device)
        self.offered = ladder(opts.group_size)  # every rung by name, worked out once for the whole compile
        self.rungs = [self.offered[r] for r in opts.formats]

    def run(self, shell) -> None:
        """One calibration pass of the model's own forward over the batch (on the device for this pass only)."""
        self.cursor = self.axes.cursor()
        kwargs = on_device(self.batch.kwargs, self.opts.device)
        try:
            with torch.no_grad(), self.progress.blocks(self._to_measure(), "compile"):
                shell(**kwargs)
        except BaseException:
            self.state.wait(quiet=True)  # an interrupted pass keeps the block written meanwhile, for --resume
            raise
        else:
            self.state.wait()  # the last block's files, written while the pass went on
        finally:
            self.host.close(TAPE)  # the pass's spill file, and the pinned copies it kept for reuse
            empty_host_cache()

    def _to_measure(self) -> int:
        """How many blocks this pass measures: those the state does not hold, and for a rebuild only those that hold
        a layer it searches again."""
        wanted = self.wanted
        return sum(1 for i, path in enumerate(self.source.block_paths) if not self.state.has_block(i)
                   and (wanted is None or any(name.startswith(path + ".") for name in wanted)))

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
        self.progress.begin(f"block {index + 1}/{n} {path}: calibrating and searching")
        if self.vram.host_tape and call != self.last_call:
            # the pinned allocator keeps freed copies for reuse by copies of the same size: a block of another kind
            # would add its own beside them (the host plan counts one kind's)
            empty_host_cache()
        self.last_call = call
        started = time.perf_counter()
        out = self._measure(index, path, real, set(todo), args, kwargs, call, ranges)
        self.progress.done(f"block {index + 1}/{n} {path}: done in {time.perf_counter() - started:.1f} s (forward "
                           f"{self.forward_s:.1f} s, search {self.search_s:.1f} s)"
                           f"{_peak_note(self.peaks, self.block_peaks)}")
        return out

    @torch.no_grad()
    def _measure(self, index: int, path: str, real: nn.Module, todo: set[str], args, kwargs, call, ranges):
        """Measure the block's layers at their rungs, save them, and return the original block's output."""
        o, b = self.opts, self.batch
        spill = self.host.spill_file(TAPE) if self.host.spill_tape else None
        park = store = spill.put if spill is not None else self.vram.store(self.vram.host_tape)
        if spill is not None and self.host.tape_kept:
            # the first recorded inputs stay in memory, as many as the budget has room for; the block's outputs are
            # spilled all the same (kept whole, joining their chunks would copy them)
            store = KeepThenSpill(spill, self.vram.store(self.vram.host_tape), self.host.tape_kept,
                                  self.host.keep_cost)
        # off the GPU (or out of host memory) the block's outputs wait with the recorded inputs while the layers are
        # searched
        parked = (lambda *a, **kw: tree_map(lambda t: park(t) if torch.is_tensor(t) else t, real(*a, **kw))) \
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
                    self.progress.now(f"block {index + 1}/{len(self.source.block_paths)} {path}: {name}")
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


def on_device(tree, device):
    """``tree`` with its tensors on ``device``."""
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, tree)


def _peak_note(peaks: PeakLog, block: PeakLog) -> str:
    if peaks.peak_reserved is None:
        return ""
    return (f"; GPU memory allocated at most: {block.describe()}; reserved so far "
            f"{format_size(peaks.peak_reserved)}")
