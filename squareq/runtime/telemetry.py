"""Per-step streaming telemetry and the optional Chrome trace (``SQUAREQ_TRACE=path``).

On a GPU every measurement is a pair of CUDA events on the stream it concerns, so the numbers are GPU
time, not host time: *copy wait* is the time the compute stream sat waiting for a slot's copy. Events
are resolved (one synchronize) when :meth:`Telemetry.step` is called, once per training step.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..slab.atomic import atomic_write_bytes

PENDING_LIMIT = 4096  # event pairs kept before resolving, for a caller that never calls step()


@dataclass
class StepStats:
    """What the streamer did since the previous call to :meth:`Telemetry.step`."""

    bytes_copied: int
    copies: int
    demand_loads: int  # acquisitions that found their block neither resident nor prefetched
    copy_wait_s: float  # time the compute stream waited for copies
    read_wait_s: float  # host="disk": time the training thread waited for the reader thread to stage a block
    peak_allocated: int  # bytes; 0 on CPU
    peak_reserved: int
    reserved: int

    def to_dict(self) -> dict:
        return asdict(self)


class _Clock:
    """Timestamps on a stream: CUDA timing events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.origin = self.mark()

    def mark(self, stream=None):
        """A timestamp on ``stream`` (default: the device's current stream)."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def settle(self, mark) -> None:
        """Wait until ``mark`` has happened on the GPU (nothing to wait for on a CPU)."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def since_origin(self, a) -> float:
        return self.seconds(self.origin, a)


class Telemetry:
    """Counters and event pairs collected by the streamer."""

    def __init__(self, device: torch.device, trace_path: str | os.PathLike | None = None) -> None:
        self.device = device
        self.clock = _Clock(device)
        self.trace_path = Path(trace_path) if trace_path else None
        self._trace: list[dict] = []
        self._spans: list[tuple[str, str, int, object, object]] = []
        self._waits: list[tuple[object, object]] = []
        self._resolved_wait = 0.0
        self.bytes_copied = self.copies = self.demand_loads = 0
        self.read_wait_s = 0.0

    @property
    def tracing(self) -> bool:
        return self.trace_path is not None

    def copy(self, nbytes: int, demand: bool) -> None:
        self.bytes_copied += nbytes
        self.copies += 1
        self.demand_loads += int(demand)

    def wait(self, start, end) -> None:
        self._waits.append((start, end))
        if len(self._waits) > PENDING_LIMIT:  # nobody calls step(): fold the older half into a running sum
            half = PENDING_LIMIT // 2
            self.clock.settle(self._waits[half - 1][1])
            self._resolved_wait += sum(self.clock.seconds(a, b) for a, b in self._waits[:half])
            del self._waits[:half]

    def span(self, name: str, category: str, lane: int, start, end) -> None:
        if self.tracing:
            self._spans.append((name, category, lane, start, end))
            if len(self._spans) > PENDING_LIMIT:
                self.clock.settle(end)
                self._resolve_spans()

    def _resolve_spans(self) -> None:
        for name, cat, lane, a, b in self._spans:
            self._trace.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": lane,
                                "ts": round(self.clock.since_origin(a) * 1e6, 3),
                                "dur": round(self.clock.seconds(a, b) * 1e6, 3)})
        self._spans.clear()

    def step(self) -> StepStats:
        """Resolve this step's events, return its figures and start counting the next step."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        wait = self._resolved_wait + sum(self.clock.seconds(a, b) for a, b in self._waits)
        self._resolved_wait = 0.0
        self._resolve_spans()
        if self.clock.cuda:
            peak_alloc = torch.cuda.max_memory_allocated(self.device)
            peak_res = torch.cuda.max_memory_reserved(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            peak_alloc = peak_res = reserved = 0
        stats = StepStats(self.bytes_copied, self.copies, self.demand_loads, float(wait), self.read_wait_s,
                          peak_alloc, peak_res, reserved)
        self._waits.clear()
        self.bytes_copied = self.copies = self.demand_loads = 0
        self.read_wait_s = 0.0
        if self.tracing:
            self.write_trace()
        return stats

    def write_trace(self) -> None:
        """Write every span so far as a Chrome trace (chrome://tracing, Perfetto), atomically."""
        if self.clock.cuda:
            torch.cuda.synchronize(self.device)
        self._resolve_spans()
        lanes = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": t, "args": {"name": n}}
                 for t, n in ((0, "compute stream: blocks"), (1, "copy stream: slot copies"), (2, "compute stream: "
                                                                                                  "copy waits"))]
        text = json.dumps({"traceEvents": lanes + self._trace, "displayTimeUnit": "ms"})
        atomic_write_bytes(self.trace_path, text.encode())
