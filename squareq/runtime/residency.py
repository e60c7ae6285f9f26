"""Sizing the block ring and choosing resident blocks from measured copy and compute times (``squareq sample``).

A streamed forward hides a block's copy while the K-1 blocks ahead of it compute. Whether that holds depends on
the device, the resolution and the slab, so :class:`StreamTuner` measures one step (compute per block from events
on the compute stream, host-to-device bandwidth from timed copies of the largest blocks) and then

* adds ring slots until the longest copy fits in the compute of the blocks ahead of it (``prefetch="auto"``; an
  integer grows the ring to that many); for a forward-only (sampling) step it instead simulates the step's copies
  and computes in block order for each ring size and takes the smallest within :data:`RING_TOLERANCE` of the
  fastest (:func:`forward_step_seconds`): where every block's copy outlasts its compute, more slots buy nothing,
  while each extra slot costs a block's memory and, with CUDA graphs, a capture of every block in it,
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

from ..devices import allocator_cap
from .block_compile import compile_seconds

log = logging.getLogger("squareq.runtime")

MAX_SLOTS = 8
COPY_SLACK = 0.85  # streamed copies may take this share of a step's compute: the copy stream needs headroom
MAX_POSTPONED_PROBES = 4  # steps that compiled and so were not measured, before one is measured anyway
MIN_MARGIN_BYTES = 3 << 29  # VRAM left free for activations and the allocator beyond what a step used (1.5 GiB)
CAPTURE_MARGIN = 1 << 26  # peak_limit: room for the captures of newly kept blocks and slots (64 MiB)
RING_TOLERANCE = 0.01  # a forward-only ring grows only while the simulated step gets faster than this share


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


def forward_step_seconds(order: list[int], copy_s: dict[int, float], compute_s: dict[int, float],
                         slots: int) -> float:
    """A forward-only step's seconds once steps follow each other: the blocks of ``order`` compute one after
    another; each streamed block (those in ``copy_s``; kept blocks have no copy) is copied in the same order on one
    copy stream into one of ``slots`` slots, a slot being free once the block before in it has computed. The third
    of three steps back to back is measured, so a step's first copies may run during the end of the step before."""
    copy_free = compute_free = start = 0.0
    computed: list[float] = []  # when each streamed visit's compute ended, in copy order
    for _ in range(3):
        start = compute_free
        for b in order:
            ready = compute_free
            if b in copy_s:
                slot_free = computed[-slots] if len(computed) >= slots else 0.0
                copy_free = max(copy_free, slot_free) + copy_s[b]
                ready = max(ready, copy_free)
            compute_free = ready + compute_s.get(b, 0.0)
            if b in copy_s:
                computed.append(compute_free)
    return compute_free - start


def plan_stream(times: BlockTimes, slots: int, slot_bytes: int, budget_bytes: int, resident: int | str = 0,
                prefetch: int | str = "auto", order: list[int] | None = None,
                whole_turns: bool = False) -> StreamPlan:
    """The ring size and resident blocks for ``times`` within ``budget_bytes`` of free device memory.

    resident: "auto" (as many as help, see the module docstring), a count (the blocks whose copy most exceeds
    their compute first, as the budget allows) or 0. prefetch: "auto" (enough slots that the longest streamed copy
    fits in the compute of the slots ahead of it, as the budget allows, at most :data:`MAX_SLOTS`) or a K to grow
    the ring to. ``order``: the blocks in the order a forward-only step runs them; given, "auto" takes the smallest
    ring whose simulated step (:func:`forward_step_seconds`) is within :data:`RING_TOLERANCE` of the fastest the
    budget allows. ``whole_turns`` (CUDA graphs): every streamed block comes back to the same slot each step, so a
    grown ring must divide the streamed blocks, and with ``resident="auto"`` the blocks kept last are streamed again
    until the ring does (the streamer fills its slots in turn across steps, and a block in another slot is another
    capture); a count of blocks to keep is kept as asked.
    The ring never shrinks.
    """
    total_compute = sum(times.compute_s.values())
    streamed = dict(times.copy_s)
    chosen: list[int] = []
    if resident:
        # the blocks whose copy is least covered by their own compute first; ties: the larger first
        by_need = sorted(streamed, key=lambda b: (times.copy_s[b] - times.compute_s.get(b, 0.0), times.nbytes[b]),
                         reverse=True)
        for b in by_need:
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
    if prefetch == "auto" and streamed and order:
        most = max(slots, min(MAX_SLOTS, slots + budget_bytes // max(1, slot_bytes)))
        sizes = [k for k in range(slots, most + 1) if k == slots or not whole_turns or len(streamed) % k == 0]
        seconds = {k: forward_step_seconds(order, streamed, times.compute_s, k) for k in sizes}
        fastest = min(seconds.values())
        want = min(k for k, t in seconds.items() if t <= fastest * (1 + RING_TOLERANCE))
    elif prefetch == "auto" and streamed:
        per_block = total_compute / max(1, len(times.compute_s))
        want = 1 + math.ceil(max(streamed.values()) / per_block) if per_block > 0 else MAX_SLOTS
        want = max(slots, min(MAX_SLOTS, want, slots + budget_bytes // max(1, slot_bytes)))
    while whole_turns and resident == "auto" and chosen and len(streamed) % want:
        b = chosen.pop()  # the least helpful kept block streams again
        streamed[b] = times.copy_s[b]
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

    def order(self) -> list[int]:
        """The blocks timed, in the order they ran (each once)."""
        return list(dict.fromkeys(block for block, _, _ in self.marks))

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
    after the probe step, less a margin for activations). ``forward_only`` (sampling): probe the first step
    that replays every block's CUDA graph, not one that ran blocks eagerly before their capture, and size the ring
    by simulating the step (:func:`plan_stream`'s ``order``). ``peak_limit`` (CUDA; ``squareq sample
    --vram-budget``): the peak reserved memory of the steps after the plan stays within it. With CUDA graphs the
    blocks the plan keeps and those in its new slots are captured at their first call, without eager runs (the
    same block calls ran eagerly in their first slots: runtime/block_graphs.py), so the plan gets the limit less
    what the probe step left reserved, less :data:`CAPTURE_MARGIN`. Without graphs (or once such a capture failed)
    blocks run eagerly, so it gets the limit less the peak since the first step the tuner saw (whose start empties
    the allocator's cache and resets the device's peak statistics: the encoders before it are not the denoiser's).
    The plan applied is :attr:`plan`.
    """

    def __init__(self, model: nn.Module, prefetch: int | str = "auto", resident: int | str = 0,
                 probe_step: int = 1, budget_bytes: int | Callable[[], int] | None = None,
                 forward_only: bool = False, peak_limit: int | None = None) -> None:
        from .loader import runtime_of

        self.rt = runtime_of(model)
        if not self.rt.streamed:
            raise ValueError("StreamTuner sizes a streamed model's ring; this model was loaded with stream=False.")
        self.prefetch, self.resident = prefetch, resident
        self.probe_step, self.budget_bytes = probe_step, budget_bytes
        self.forward_only, self.peak_limit = forward_only, peak_limit
        self._peak_reset = False  # peak_limit: the peak statistics were reset at the first step seen
        self.plan: StreamPlan | None = None
        self._compiled_before = 0.0
        self._postponed = 0

    def before_step(self, step: int) -> None:
        """Step ``step`` is about to run: start timing its blocks if it is the probe step."""
        if self.peak_limit is not None and not self._peak_reset and self.rt.device.type == "cuda":
            torch.cuda.empty_cache()  # what the steps before cached is not what a step holds
            torch.cuda.reset_peak_memory_stats(self.rt.device)  # what ran before the denoiser (its encoders) is not its
            self._peak_reset = True
        if step == self.probe_step and self.plan is None:
            self.rt.block_timer = BlockTimer(self.rt.telemetry.clock)
            self._compiled_before = compile_seconds()

    def after_step(self, step: int) -> None:
        """Step ``step`` has been enqueued: after the probe step, measure the copies, plan, and apply the plan."""
        if self.rt.block_timer is not None and step != self.probe_step:
            # armed for a step that never came (a postponed probe past the end of an image: the next image counts
            # its steps from 0 again, so its timer would add up several steps); time the next step instead
            self.rt.block_timer = None
            self.probe_step = step + 1
            return
        if step != self.probe_step or self.rt.block_timer is None:
            return
        # torch.compile compiled in this step (runtime/block_compile.py), or (forward_only) blocks ran eagerly
        # before their CUDA-graph capture: the GPU waited on the host, and the blocks would look slower than they
        # are, hiding copies that are not hidden. Probe the next step. Training does not wait for the graphs: there a
        # settled probe grew a ring that cost more memory than it saved time (issue 41, docs/benchmarks.md).
        graphs = self.rt.graphs
        settling = self.forward_only and graphs is not None and graphs.settling
        if (settling or compile_seconds() > self._compiled_before) and self._postponed < MAX_POSTPONED_PROBES:
            self.rt.block_timer = None
            self.probe_step += 1
            self._postponed += 1
            return
        compute = self.rt.block_timer.seconds()
        order = self.rt.block_timer.order() if self.forward_only else None
        self.rt.block_timer = None
        streamer = self.rt.streamer
        nbytes = {b: streamer.block_sizes[b] for b in compute}
        bandwidth = self.rt.measure_copy_bandwidth()
        times = BlockTimes(nbytes, {b: n / bandwidth for b, n in nbytes.items()}, compute)
        whole_turns = self.forward_only and graphs is not None and graphs.enabled
        self.plan = plan_stream(times, len(streamer.slots), max(streamer.block_sizes), self._budget(),
                                self.resident, self.prefetch, order, whole_turns)
        self.rt.apply_stream_plan(self.plan)
        log.info("streaming tuned after step %d: %s (host-to-device copies at %.1f GB/s).", step,
                 self.plan.describe(), bandwidth / 1e9)

    def _budget(self) -> int:
        free = self._free_budget()
        if self.peak_limit is None or self.rt.device.type != "cuda":
            return free
        device, graphs = self.rt.device, self.rt.graphs
        if graphs is not None and graphs.enabled and graphs.at_once:
            # what the plan adds is captured at once: the steps after it hold what the probe step left reserved (the
            # graphs' pool, the cached temporaries of the unblocked parts) plus the plan's blocks and slots
            held = torch.cuda.memory_reserved(device) + CAPTURE_MARGIN
        else:  # blocks run eagerly before (or without) their capture: the peak so far comes back
            held = torch.cuda.max_memory_reserved(device)
        if held >= self.peak_limit:
            log.warning("the denoising steps already reserve %.2f GB (with room for captures), at or over the VRAM "
                        "budget of %.2f GB: no slots or blocks are added.", held / 1e9, self.peak_limit / 1e9)
        return min(free, max(0, self.peak_limit - held))

    def _free_budget(self) -> int:
        if callable(self.budget_bytes):
            return self.budget_bytes()
        if self.budget_bytes is not None:
            return self.budget_bytes
        if self.rt.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.rt.device)
            index = self.rt.device.index if self.rt.device.index is not None else torch.cuda.current_device()
            cap = allocator_cap(index, total)
            if cap is not None:  # a capped allocator fails at its cap, with the device's memory still free
                free, total = min(free, cap - torch.cuda.memory_reserved(self.rt.device)), cap
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
