"""Sizing the block ring and choosing resident blocks from measured copy and compute times (``squareq sample``).

A streamed forward hides a block's copy while the K-1 blocks ahead of it compute. Whether that holds depends on
the device, the resolution and the slab, so :class:`StreamTuner` measures one step (compute per block from events
on the compute stream, host-to-device bandwidth from timed copies of the largest blocks) and then

* adds ring slots until the longest copy fits in the compute of the blocks ahead of it (``prefetch="auto"``; an
  integer grows the ring to that many),
* keeps blocks on the GPU, those whose copy most exceeds their own compute first, while the copies of the blocks
  still streamed take more than :data:`COPY_SLACK` of a whole step's block compute and free VRAM allows
  (``resident="auto"``; an integer keeps that many). At least one block keeps streaming.

:func:`plan_stream` is the pure decision, :class:`StreamTuner` the measuring and applying around it.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .block_compile import compile_seconds

log = logging.getLogger("squareq.runtime")

MAX_SLOTS = 8
COPY_SLACK = 0.85  # streamed copies may take this share of a step's compute: the copy stream needs headroom
MAX_POSTPONED_PROBES = 4  # steps that compiled and so were not measured, before one is measured anyway
MIN_MARGIN_BYTES = 3 << 29  # VRAM left free for activations and the allocator beyond what a step used (1.5 GiB)


@dataclass(frozen=True)
class BlockTimes:
    """Per streamed block (by slab block index): its bytes, copy seconds and compute seconds in one step."""

    nbytes: dict[int, int]
    copy_s: dict[int, float]
    compute_s: dict[int, float]


@dataclass(frozen=True)
class StreamPlan:
    """What :func:`plan_stream` decided: ring slots, blocks kept on the device, and the step's copy and compute
    seconds it expects."""

    slots: int
    resident: tuple[int, ...]
    copy_s: float  # copies per step of the blocks still streamed
    compute_s: float  # compute per step of every block

    def describe(self) -> str:
        """One line for a log."""
        state = "hidden" if self.copy_s <= self.compute_s else "not hidden (copy-bound)"
        return (f"{self.slots} slots, {len(self.resident)} blocks kept on the GPU; per step the streamed copies take "
                f"{self.copy_s * 1e3:.0f} ms against {self.compute_s * 1e3:.0f} ms of block compute: {state}")


def plan_stream(times: BlockTimes, slots: int, slot_bytes: int, budget_bytes: int, resident: int | str = 0,
                prefetch: int | str = "auto") -> StreamPlan:
    """The ring size and resident blocks for ``times`` within ``budget_bytes`` of free device memory.

    resident: "auto" (as many as help, see the module docstring), a count (the blocks whose copy most exceeds
    their compute first, as the budget allows) or 0. prefetch: "auto" (enough slots that the longest streamed copy
    fits in the compute of the slots ahead of it, as the budget allows, at most :data:`MAX_SLOTS`) or a K to grow
    the ring to. The ring never shrinks.
    """
    total_compute = sum(times.compute_s.values())
    streamed = dict(times.copy_s)
    chosen: list[int] = []
    if resident:
        # the blocks whose copy is least covered by their own compute first; ties: the larger first
        order = sorted(streamed, key=lambda b: (times.copy_s[b] - times.compute_s.get(b, 0.0), times.nbytes[b]),
                       reverse=True)
        for b in order:
            if resident == "auto" and sum(streamed.values()) <= COPY_SLACK * total_compute:
                break
            if resident != "auto" and len(chosen) >= int(resident):
                break
            if len(streamed) <= 1 or times.nbytes[b] > budget_bytes:
                continue
            budget_bytes -= times.nbytes[b]
            chosen.append(b)
            del streamed[b]
    want = slots if prefetch == "auto" else max(slots, int(prefetch))
    if prefetch == "auto" and streamed:
        per_block = total_compute / max(1, len(times.compute_s))
        want = 1 + math.ceil(max(streamed.values()) / per_block) if per_block > 0 else MAX_SLOTS
        want = max(slots, min(MAX_SLOTS, want, slots + budget_bytes // max(1, slot_bytes)))
    return StreamPlan(int(want), tuple(sorted(chosen)), sum(streamed.values()), total_compute)


class BlockTimer:
    """Compute time per block over one step, from marks on the runtime's clock (telemetry's: CUDA events on the
    compute stream, the host clock on a CPU) around each streamed block's forward."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.marks: list[tuple[int, object, object]] = []
        self._open: dict[int, object] = {}

    def start(self, block: int) -> None:
        """``block``'s forward begins (in stream order)."""
        self._open[block] = self.clock.mark()

    def stop(self, block: int) -> None:
        """``block``'s forward has been enqueued to its end."""
        start = self._open.pop(block, None)
        if start is not None:
            self.marks.append((block, start, self.clock.mark()))

    def seconds(self) -> dict[int, float]:
        """Compute seconds per block over the marks so far (waits for the last one)."""
        if self.marks:
            self.clock.settle(self.marks[-1][2])
        out: dict[int, float] = {}
        for block, a, b in self.marks:
            out[block] = out.get(block, 0.0) + self.clock.seconds(a, b)
        return out


class StreamTuner:
    """Measures step ``probe_step`` of a streamed model and applies :func:`plan_stream` after it.

    Call :meth:`before_step` / :meth:`after_step` around each step (a diffusers pipeline: pass
    :meth:`pipeline_callback` as ``callback_on_step_end``). ``budget_bytes``: free device memory to plan with, or a
    function that says it after the probe step (default: what the device, or for a CPU model the host, reports free
    after the probe step, less a margin for activations). ``peak_limit``: the memory reserved after the probe step plus
    what the plan adds stays within it (CUDA; ``squareq sample --vram-budget``). ``wait_for_graphs``: probe the
    first step that replays every block's CUDA graph (sampling), not one that ran blocks eagerly before their
    capture. The plan applied is :attr:`plan`.
    """

    def __init__(self, model: nn.Module, prefetch: int | str = "auto", resident: int | str = 0,
                 probe_step: int = 1, budget_bytes: int | Callable[[], int] | None = None,
                 wait_for_graphs: bool = False, peak_limit: int | None = None) -> None:
        from .loader import runtime_of

        self.rt = runtime_of(model)
        if not self.rt.streamed:
            raise ValueError("StreamTuner sizes a streamed model's ring; this model was loaded with stream=False.")
        self.prefetch, self.resident = prefetch, resident
        self.probe_step, self.budget_bytes = probe_step, budget_bytes
        self.wait_for_graphs, self.peak_limit = wait_for_graphs, peak_limit
        self.plan: StreamPlan | None = None
        self._compiled_before = 0.0
        self._postponed = 0

    def before_step(self, step: int) -> None:
        """Step ``step`` is about to run: start timing its blocks if it is the probe step."""
        if step == self.probe_step and self.plan is None:
            self.rt.block_timer = BlockTimer(self.rt.telemetry.clock)
            self._compiled_before = compile_seconds()

    def after_step(self, step: int) -> None:
        """Step ``step`` has been enqueued: after the probe step, measure the copies, plan, and apply the plan."""
        if step != self.probe_step or self.rt.block_timer is None:
            return
        # torch.compile compiled in this step (runtime/block_compile.py), or (wait_for_graphs) blocks ran eagerly
        # before their CUDA-graph capture: the GPU waited on the host, and the blocks would look slower than they
        # are, hiding copies that are not hidden. Probe the next step. Training does not wait for the graphs: there a
        # settled probe grew a ring that cost more memory than it saved time (issue 41, docs/benchmarks.md).
        graphs = self.rt.graphs
        settling = self.wait_for_graphs and graphs is not None and graphs.settling
        if (settling or compile_seconds() > self._compiled_before) and self._postponed < MAX_POSTPONED_PROBES:
            self.rt.block_timer = None
            self.probe_step += 1
            self._postponed += 1
            return
        compute = self.rt.block_timer.seconds()
        self.rt.block_timer = None
        streamer = self.rt.streamer
        nbytes = {b: streamer.block_sizes[b] for b in compute}
        bandwidth = self.rt.measure_copy_bandwidth()
        times = BlockTimes(nbytes, {b: n / bandwidth for b, n in nbytes.items()}, compute)
        self.plan = plan_stream(times, len(streamer.slots), max(streamer.block_sizes), self._budget(),
                                self.resident, self.prefetch)
        self.rt.apply_stream_plan(self.plan)
        log.info("streaming tuned after step %d: %s (host-to-device copies at %.1f GB/s).", step,
                 self.plan.describe(), bandwidth / 1e9)

    def _budget(self) -> int:
        free = self._free_budget()
        if self.peak_limit is not None and self.rt.device.type == "cuda":
            # what the caching allocator holds after the probe step is that step's need (its graphs' pool, its cached
            # temporaries); the peak since the start would count the text encoders that ran before the denoiser
            return min(free, max(0, self.peak_limit - torch.cuda.memory_reserved(self.rt.device)))
        return free

    def _free_budget(self) -> int:
        if callable(self.budget_bytes):
            return self.budget_bytes()
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self.rt.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.rt.device)
        else:  # the "device" is host memory
            try:
                page = os.sysconf("SC_PAGE_SIZE")
                free, total = os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
            except (AttributeError, ValueError, OSError):
                return 0
        return max(0, free - max(MIN_MARGIN_BYTES, total // 20))

    def pipeline_callback(self, pipe, step: int, timestep, callback_kwargs: dict) -> dict:
        """diffusers' ``callback_on_step_end``: ``step`` has just finished."""
        self.after_step(step)
        self.before_step(step + 1)
        return {}
