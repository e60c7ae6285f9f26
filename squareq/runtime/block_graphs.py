"""CUDA graphs per streamed block (``LoadOptions(cuda_graphs=True)``): a block's forward, and a training step's
recompute + backward of it, are each captured once and replayed from then on, so a step's host time no longer grows
with the kernel launches of its blocks (about 1,400 per FLUX.1 training step at 512², where the GPU sat idle waiting
for Python: docs/benchmarks.md, "LoRA training step").

Why a replay computes what the eager run would: every address a block's kernels touch is fixed for a (block, slot)
pair. The quantized weights and block parameters are views into the slot (the binder caches them per pair), the
dequant scratch is shared and fixed, and the LoRA factors are updated in place by the optimizer. So a graph is kept
per (block, slot, everything else that shapes the kernels: runtime/graph_keys.py) and replayed whenever that block is
in that slot again. Inputs are copied into static buffers before a replay and outputs copied out of static buffers
after it. Those buffers are shared by every graph with the same signature, and every graph's temporaries come from
one memory pool, so memory grows by about one block's working set, not by one per graph.

* A call is captured only after it ran eagerly :data:`WARMUP` times: Triton compiles, each layer's one-time launch
  checks and FP8 compute's row maxima happen then, not during a capture. Those runs are counted per block call, in
  whichever slots they ran (:func:`twin`: the key less its slot), since that one-time work is the block's, not the
  slot's. So a block kept on the device, or a block in a slot the ring just grew, is captured at its first call there,
  with no eager runs, whose temporaries would otherwise be reserved beside the graphs' pool (the sampling steps after
  a plan peaked 0.4 GB above the steady steps: docs/benchmarks.md). Should such a capture fail, every key warms up in
  its own slot from then on (said once).
* A key whose capture fails runs eagerly from then on (said once); after :data:`MAX_FAILURES` failures no block is
  graphed any more.
* Static buffers are capped at :data:`STATIC_BYTES_CAP`: when shapes keep changing (many aspect buckets), the graphs
  used longest ago go, with their buffers, between steps.

Forward hooks on modules inside a block run during the eager runs and the capture only.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .graph_keys import (
    ModuleState,
    NotKeyable,
    argument_values,
    autocast_state,
    sdpa_backends,
    spec_key,
    tensor_signature,
)

log = logging.getLogger("squareq.runtime")

WARMUP = 2  # eager runs of a key before it is captured
MAX_FAILURES = 3  # failed captures after which the runtime stops graphing
STATIC_BYTES_CAP = 1 << 30  # static input/output buffers kept across shapes (FLUX.1 at 1024²: ~0.25 GB per shape)

Run = Callable[[list[torch.Tensor], bool], tuple[list[torch.Tensor | None], Any]]


@contextlib.contextmanager
def uncached_autocast(device_type: str):
    """The current autocast without its cast cache: a cast cached during a capture would live in the graph's pool and
    be handed to later eager code, and one cached before it would be read by every replay (torch requires the cache
    off for captures)."""
    enabled, dtype = autocast_state(device_type)
    with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False):
        yield


def cuda_capture(body: Callable[[], None], pool, stream) -> Callable[[], None]:
    """Capture ``body``'s kernels into a CUDA graph on ``stream`` (``pool`` shared by every capture); returns its
    replay, which launches them on the current stream. Other threads (a disk reader's copies) may keep working.

    Unlike ``torch.cuda.graph`` this empties no cache and, when the body or the capture fails, ends the capture and
    the pool's allocation routing and gives the current stream back, so eager work can go on."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        try:  # capture_begin too: it can fail after it has put the random generator in capture mode
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            body()
        except BaseException:
            with contextlib.suppress(Exception):
                graph.capture_end()
            _clean_up_failed_capture(stream.device, pool)
            raise
        try:
            graph.capture_end()
        except BaseException:
            _clean_up_failed_capture(stream.device, pool)
            raise
    return graph.replay


def _clean_up_failed_capture(device: torch.device, pool) -> None:
    """Undo what a failed capture left behind (call on the capture stream, no longer capturing).

    torch's capture_end raises before its epilogue then: this thread's allocations still go to the graphs' pool,
    and the device's random generator state stays in capture mode, so its next draw outside a graph raises
    ("Offset increment outside graph capture"), and so does the replay of every graph captured earlier, which holds
    the same state. The routing is ended here, and an empty capture runs the generator's prologue and epilogue once
    more, which takes that state out of capture mode (its seed and offset are kept). Should that capture fail too,
    the generator gets a fresh copy of its seed and offset, so eager random draws work; graphs captured before still
    hold the old state then, and their replays may raise (none was seen: the empty capture worked in every GPU run)."""
    with contextlib.suppress(Exception):
        torch._C._cuda_endAllocateToPool(device.index, pool)
    try:
        reset = torch.cuda.CUDAGraph()
        reset.capture_begin(pool=pool, capture_error_mode="thread_local")
        reset.capture_end()
    except Exception:  # noqa: BLE001 - the fallback below
        with contextlib.suppress(Exception):
            generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
            generator.graphsafe_set_state(generator.clone_state())


@dataclass
class _Entry:
    """One key's state: eager runs so far, then its graph and the static buffers it reads and writes."""

    runs: int = 0  # eager runs of this key itself
    failed: bool = False
    replay: Callable[[], None] | None = None
    static_in: list[torch.Tensor] = field(default_factory=list)
    static_out: list[torch.Tensor | None] = field(default_factory=list)
    extra: Any = None  # what the run returned beside its tensors, at capture
    used: int = 0  # the step it last ran in


@dataclass
class _Warmup:
    """A block call's eager runs so far, in any slot (:func:`twin`), and the layouts of its outputs."""

    runs: int = 0
    outputs: list | None = None  # per output: None, or (shape, dtype, strides) of the last eager run's tensor


@dataclass
class GraphStats:
    """Counts since the runtime was loaded (or :meth:`BlockGraphs.reset_stats`)."""

    eager: int = 0  # runs of a graphable key before its capture
    captures: int = 0
    replays: int = 0
    failures: int = 0
    at_once: int = 0  # captures of keys that had not run WARMUP times themselves (their block had, in other slots)
    ungraphed: int = 0  # calls that could not be graphed (dropout, unusual arguments, a failed key)
    evicted: int = 0  # graphs dropped to keep the static buffers under STATIC_BYTES_CAP


class BlockGraphs:
    """The CUDA graphs of one runtime's streamed blocks, their shared static buffers and memory pool.

    ``capture(body, pool, stream) -> replay``: :func:`cuda_capture` on a GPU; tests on a CPU pass one that replays by
    running ``body`` again, which checks the static-buffer plumbing without CUDA."""

    def __init__(self, device: torch.device, capture: Callable = cuda_capture) -> None:
        self.device = device
        self.capture = capture
        self.entries: dict[tuple, _Entry] = {}
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.stats = GraphStats()
        self.enabled = True  # off after MAX_FAILURES failed captures
        self._failures = 0
        self._step = 0
        self._pool = self._stream = None
        self._said: set[str] = set()
        self._settling = False  # this step ran keys eagerly before their capture, or captured
        self.at_once = True  # count warm-up runs per block call across slots (twin), not per key
        self._warmups: dict[tuple, _Warmup] = {}  # per twin (per key once at_once is off)
        self._states: dict[int, ModuleState] = {}  # per block module

    # ------------------------------------------------------------------ keys

    def key(self, phase: str, block: int, slot: int, spec, layout: tuple, values: tuple, extra: tuple,
            tensors: list[torch.Tensor], module: nn.Module) -> tuple | None:
        """The graph key of one call of block ``module`` (number ``block``, in slot ``slot``), or None where it must
        run eagerly (said once per reason). ``spec``, ``layout`` and ``values``: the call's argument structure, where
        its tensors go in it, and its other arguments; ``extra``: whatever else its kernels depend on. The slot is
        the key's third item (:func:`twin`)."""
        if not self.enabled:
            self.stats.ungraphed += 1
            return None
        try:
            if any(t.device != self.device for t in tensors):
                raise NotKeyable("a streamed block got a tensor on another device; that block runs without a graph")
            state = self._states.get(id(module))  # the state holds its module, so the id stays that module's
            if state is None:
                state = self._states[id(module)] = ModuleState(module)
            return (phase, block, slot, spec_key(spec), layout, argument_values(values), extra,
                    tuple(tensor_signature(t) for t in tensors), state(), sdpa_backends())
        except NotKeyable as why:
            self._say(str(why), f"{why}.")
            self.stats.ungraphed += 1
            return None

    # ------------------------------------------------------------------ calls

    def call(self, key: tuple, tensors: list[torch.Tensor], run: Run) -> tuple[list, Any]:
        """``run(tensors, capturing=False)`` eagerly, or its graph replayed on ``tensors``; returns its
        (tensors-or-None, extra). ``key``: from :meth:`key` (never None: such a call runs without this class). ``run``
        must depend on nothing but its tensors and what the key holds."""
        entry = self.entries.setdefault(key, _Entry())
        if entry.failed:
            self.stats.ungraphed += 1
            return run(tensors, False)
        entry.used = self._step
        if entry.replay is None:
            warmup = self._warmups.setdefault(twin(key) if self.at_once else key, _Warmup())
            if warmup.runs < WARMUP:
                return self._eager(entry, warmup, tensors, run)
        self._load_inputs(entry, tensors)
        if entry.replay is None:
            try:
                self._capture(entry, run, warmup.outputs)
            except Exception as exc:  # noqa: BLE001 - any failed capture falls back to eager, said once
                if self.at_once and entry.runs < WARMUP:  # warmed up in other slots: warm it up in its own first
                    self._no_captures_at_once(exc)
                    return self.call(key, tensors, run)
                self._failed(entry, exc)
                return run(tensors, False)
            self.stats.at_once += entry.runs < WARMUP
        entry.replay()
        self.stats.replays += 1
        return [None if s is None else copy_in_layout(s) for s in entry.static_out], entry.extra

    def _eager(self, entry: _Entry, warmup: _Warmup, tensors: list[torch.Tensor], run: Run) -> tuple[list, Any]:
        """One of the eager runs before ``entry``'s capture."""
        outs, extra = run(tensors, False)
        entry.runs += 1
        warmup.runs += 1
        warmup.outputs = _layouts(outs)
        self.stats.eager += 1
        self._settling = True
        return outs, extra

    def _no_captures_at_once(self, exc: Exception) -> None:
        self.at_once = False
        self._say("at once", f"capturing a streamed block in a slot where it had not run eagerly failed "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                             "from now on every block runs eagerly in each slot before its capture there, which "
                             "is correct and costs a few slower steps; their eager runs reserve more memory than a "
                             "--vram-budget plan made before allowed for.")

    def _failed(self, entry: _Entry, exc: Exception) -> None:
        entry.failed, entry.replay = True, None
        self.stats.failures += 1
        self._failures += 1
        self._say("capture", f"capturing a streamed block as a CUDA graph failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); such calls run without graphs "
                             "from now on, which is correct but slower.")
        if self._failures >= MAX_FAILURES:
            self.enabled = False
            self.clear()
            self._say("off", f"{MAX_FAILURES} captures failed; this run goes on without CUDA graphs.")

    def _load_inputs(self, entry: _Entry, tensors: list[torch.Tensor]) -> None:
        if not entry.static_in:
            entry.static_in = [self._buffer("in", i, *tensor_signature(t)) for i, t in enumerate(tensors)]
        with torch.no_grad():
            for static, t in zip(entry.static_in, tensors, strict=True):
                static.copy_(t)

    def _capture(self, entry: _Entry, run: Run, outputs: list) -> None:
        """Capture ``entry``'s graph; ``outputs``: the layouts of its block call's outputs in the eager runs."""
        entry.static_out = [None if o is None else self._buffer("out", i, *o) for i, o in enumerate(outputs)]
        box: dict[str, Any] = {}

        def body() -> None:
            outs, box["extra"] = run(entry.static_in, True)
            if _layouts(outs) != outputs:
                raise RuntimeError("the block's outputs changed shape or dtype between its eager runs and the capture")
            for static, o in zip(entry.static_out, outs):
                if static is not None:
                    static.copy_(o)

        if self.device.type == "cuda":
            if self._pool is None:
                self._pool, self._stream = torch.cuda.graph_pool_handle(), self._warm_stream()
            # What the eager runs cached is not needed by the graph, whose temporaries come from its own pool:
            # given back first, the two are not reserved side by side at the capture steps' peak.
            torch.cuda.empty_cache()
        entry.replay = self.capture(body, self._pool, self._stream)
        entry.extra = box["extra"]
        self.stats.captures += 1
        self._settling = True

    def _warm_stream(self) -> torch.cuda.Stream:
        """The stream every capture runs on, after one small matmul there: cuBLAS sets up its handle and workspace
        for a stream on first use, which a capture should not be the one to do."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                a = torch.ones(16, 16, dtype=dtype, device=self.device)
                torch.mm(a, a)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return stream

    # ------------------------------------------------------------------ buffers

    def _buffer(self, role: str, position: int, shape, dtype, stride, requires_grad: bool = False) -> torch.Tensor:
        """The static buffer for input or output (``role``) ``position`` of graphs whose tensor there has this shape,
        dtype, layout and need of a gradient: shared by every such graph (they run one after another on one stream,
        each fed just before it runs, its outputs copied out just after)."""
        key = (role, position, shape, dtype, stride, requires_grad)
        buffer = self.buffers.get(key)
        if buffer is None:
            buffer = empty_in_layout(shape, dtype, stride, self.device).requires_grad_(requires_grad)
            self.buffers[key] = buffer
        return buffer

    def static_bytes(self) -> int:
        """Bytes held by the static buffers."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    # ------------------------------------------------------------------ upkeep

    @property
    def settling(self) -> bool:
        """Whether the step since the last :meth:`end_step` ran blocks eagerly before their capture, or captured them:
        its timings are not a replaying step's."""
        return self._settling

    def end_step(self) -> None:
        """Between steps (``Runtime.step_stats`` and ``squareq sample`` call it). Over :data:`STATIC_BYTES_CAP`, the
        graphs used longest ago go with the buffers only they used. After a step that ran blocks eagerly or captured
        them, the caching allocator's free memory goes back: the blocks' temporaries now live in the graphs' pool,
        and what the eager runs cached for them would otherwise stay reserved beside it for the rest of the run."""
        self._step += 1
        if self.static_bytes() > STATIC_BYTES_CAP:
            self._evict()
        if self._settling and self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._settling = False

    def _evict(self) -> None:
        """Drop the graphs used longest ago (never the last step's) until the buffers the rest use fit the cap."""
        users: dict[int, int] = {}  # buffer id -> entries using it
        for e in self.entries.values():
            for b in _buffers_of(e):
                users[id(b)] = users.get(id(b), 0) + 1
        held = self.static_bytes()
        for key in sorted(self.entries, key=lambda k: self.entries[k].used):
            entry = self.entries[key]
            if entry.used >= self._step - 1 or held <= STATIC_BYTES_CAP:
                break
            del self.entries[key]
            self._warmups.pop(key, None)  # a key's own warm-up (at_once off): run again when it returns
            self.stats.evicted += 1
            for b in _buffers_of(entry):
                users[id(b)] -= 1
                held -= 0 if users[id(b)] else b.numel() * b.element_size()
        self.buffers = {k: b for k, b in self.buffers.items() if users.get(id(b), 0) > 0}
        self._say("evict", f"the shapes of this run need more than {STATIC_BYTES_CAP / 2**30:g} GiB of CUDA-graph "
                           "buffers, so graphs of shapes not seen lately are dropped and captured again when their "
                           "shape returns; with many aspect buckets, --cuda-graphs may not pay.")

    def forget_slot(self, slot: int) -> None:
        """Slot ``slot``'s buffer is gone: drop its graphs, which read it."""
        for key in [k for k in self.entries if k[2] == slot]:
            del self.entries[key]
            self._warmups.pop(key, None)

    def clear(self) -> None:
        """Drop every graph and static buffer (they are captured again as calls come)."""
        self.entries.clear()
        self.buffers.clear()
        self._warmups.clear()

    def reset_stats(self) -> GraphStats:
        """The counts so far, and start counting again."""
        stats, self.stats = self.stats, GraphStats()
        return stats

    def _say(self, reason: str, message: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            log.warning("CUDA graphs: %s", message)


def twin(key: tuple) -> tuple:
    """``key`` without its slot: the keys of one block's call in every slot."""
    return key[:2] + key[3:]


def _layouts(outs: list[torch.Tensor | None]) -> list:
    """Per output: None, or the (shape, dtype, strides) its static buffer must have."""
    return [None if o is None else (tuple(o.shape), o.dtype, o.stride()) for o in outs]


def _buffers_of(entry: _Entry):
    """The static buffers ``entry`` reads and writes (each once)."""
    return {id(b): b for b in (*entry.static_in, *entry.static_out) if b is not None}.values()


def non_overlapping(shape, stride) -> bool:
    """Whether no two elements of a ``shape`` tensor with ``stride`` share memory (gaps allowed: a slice's layout)."""
    extent = 0  # one past the largest offset reached by the dimensions taken so far
    for size, step in sorted(((n, st) for n, st in zip(shape, stride) if n > 1), key=lambda p: p[1]):
        if step < max(extent, 1):
            return False
        extent = step * (size - 1) + extent + (1 if extent == 0 else 0)
    return True


def empty_in_layout(shape, dtype, stride, device) -> torch.Tensor:
    """An uninitialized tensor with ``stride`` where that layout has no overlaps (a slice of a wider tensor keeps its
    strides, with unused gaps), else contiguous (an expanded tensor: the same values, each stored once). The eager
    block saw the first layout; handing its graph and its successors the same keeps their keys and kernels the same.
    Never an inference tensor, even under ``torch.inference_mode``: static buffers are written again outside it."""
    with torch.inference_mode(False):
        return _empty(shape, dtype, stride, device)


def _empty(shape, dtype, stride, device) -> torch.Tensor:
    if non_overlapping(shape, stride):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def copy_in_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (``clone`` makes a slice's copy contiguous)."""
    return _empty(t.shape, t.dtype, t.stride(), t.device).copy_(t)
