"""The compile's own GPU memory: ``--vram-budget``, the plan that fits the work into it, and the cap that holds it.

What a compile keeps on the GPU, and what the plan may move to pinned host memory instead:

* always on the GPU: the model's resident tensors and the calibration batch with the hidden states between blocks
  (``base``), one block's weights (its linear weights in the checkpoint's dtype, cast to float32 one layer at a
  time), one chunk's activations (compiler/chunks.py), and the largest layer's search: its weight copies and, for
  GPTQ, its Hessian with two float64 matrices of the factorization; in the effects pass, the replayed block's
  quantized candidates (moved once per block, not once per replayed chunk: FLUX.1's copies were 0.9 TB a compile);
* movable: the calibration pass's recorded layer inputs (the *tape*: the inputs of a FLUX.1 double block's layers
  are 4-5 GB for 32 samples) and the effects pass's block inputs, waiting for the backward pass (8.6 GB for FLUX.1).

Where a tensor waits never changes a number the compile computes, so a tight budget builds the same slab. The
budget defaults to the memory the device has free. A budget below what the work needs with everything movable on
the host is refused before anything starts, naming the smallest budget that works; otherwise the plan is stated
(expected peak, what goes to the host) and the CUDA caching allocator is capped at the budget, so reserved memory
cannot pass it: a wrong estimate is an out-of-memory sentence, never a silent overrun. The estimate's activation
factors were measured on FLUX.1 blocks (docs/compiler.md, "Compiling within a VRAM budget").
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..sizes import format_size, format_size_up
from .budget import BudgetError, largest_block_candidates

# Measured on an H100 (docs/benchmarks.md, "Compiling within a VRAM budget"): bytes of activations per byte of block
# input in a chunk's calibration forward, and in the effects pass's replay with its backward and per-layer products.
ACT_FORWARD = 20  # FLUX.1 double / single block 9 / 14, FLUX.2 11.3 / 20
# The effects pass's replay with its backward, per byte of a chunk's block input, with the pass's own attention
# (kernels/lean_attention.py: no attention matrix kept) and the stored weights saved instead of float32 copies.
ACT_BACKWARD = 40
# float32 copies of a layer's weight alive at once during its search beside GPTQ's factor (the weight, GPTQ's
# working copy and its int8 codes, the candidates; the metrics and quantizers work a slice of rows at a time):
# measured 4.4 on FLUX.2's 6144 x 24576 layer (H100)
SEARCH_WEIGHT_COPIES = 4.5
# the allocator's own slack between what is allocated and what it reserves, with expandable segments (measured 1.05
# on FLUX.1 and FLUX.2 blocks), and what any CUDA program reserves (cuBLAS workspaces, 2 MB rounding)
SLACK = 1.06
FIXED = 256 << 20
FACTOR_BLOCK = 1024  # quant/factor.py's column block: its temporaries are a few K x 1024 float64 panels


@dataclass(frozen=True)
class Needs:
    """Bytes of each part of the compile's GPU memory (module docstring)."""

    base: int  # resident tensors and the calibration batch
    hidden: int  # the hidden states of the whole batch between two blocks
    held_base: int  # the effects pass's copies of the held-out batch, hidden states and gradients included (the
    # calibration batch waits in host memory meanwhile)
    block: int  # the largest block's weights as the compile keeps them
    chunk: int  # one chunk's activations in the calibration forward
    tape: int  # the largest block's recorded layer inputs
    search: int  # the largest layer's search
    effects: int  # one chunk's replay, backward and products in the effects pass
    saved: int  # every block's inputs for the effects pass's backward
    candidates: int = 0  # the largest block's quantized candidates, on the GPU while its replays measure them
    block_search: int = 0  # the most one block's weights and its largest layer's search need together
    block_name: str = ""
    layer_name: str = ""
    layer_shape: tuple[int, int] = (0, 0)

    def peak(self, host_tape: bool, host_saved: bool) -> int:
        return int(SLACK * max(self.phases(host_tape, host_saved))) + FIXED

    def phases(self, host_tape: bool, host_saved: bool) -> tuple[int, int]:
        """(the calibration pass's bytes, the effects pass's), before the allocator's slack."""
        # the block's inputs and outputs and a glue copy; with the recorded inputs on the host, the outputs wait there
        # too, and the search sees the inputs and a part of the next call's arguments (measured 1.3x on FLUX.2)
        tape, forward, search = (0, 2 * self.hidden, 3 * self.hidden // 2) if host_tape else \
            (self.tape, 3 * self.hidden, 3 * self.hidden)
        searching = self.block_search or self.block + self.search
        calibrate = self.base + max(forward + self.block + self.chunk + tape, search + tape + searching)
        # the replayed block and the one whose outputs' gradients are being consumed
        effects = self.held_base + 2 * self.block + self.effects + self.candidates + (0 if host_saved else self.saved)
        return calibrate, effects


@dataclass(frozen=True)
class VramPlan:
    """Where the compile keeps what it may move, and the cap it runs under (``budget`` None: no cap)."""

    budget: int | None
    needs: Needs | None = None
    host_tape: bool = False
    host_saved: bool = False
    device: str = "cpu"
    free: int | None = None

    @property
    def expected_peak(self) -> int | None:
        return self.needs.peak(self.host_tape, self.host_saved) if self.needs else None

    def store(self, host: bool):
        """Where a recorded tensor goes: a copy in pinned host memory, or a copy where it is."""
        if not host or torch.device(self.device).type != "cuda":
            return lambda t: t.clone()
        return _to_pinned

    def describe(self, chunk_samples: int | None, why_whole: str = "") -> str:
        """The plan in one paragraph, for the compile's log before it starts."""
        n = self.needs
        if n is None or torch.device(self.device).type != "cuda":
            where = f"compiling on {self.device}: no GPU memory to plan"
            return where + (f"; blocks run {chunk_samples} samples at a time" if chunk_samples else "") + "."
        chunks = f"blocks run {chunk_samples} samples at a time" if chunk_samples else \
            f"blocks run the whole batch at once ({why_whole})" if why_whole else "blocks run the whole batch at once"
        moved = [what for what, host in (("the layers' recorded inputs (" + format_size(n.tape) + " for the largest "
                                          "block)", self.host_tape),
                                         ("the effects pass's block inputs (" + format_size(n.saved) + ")",
                                          self.host_saved)) if host]
        free = f" of {format_size(self.free)} free" if self.free else ""
        return (f"VRAM plan: budget {format_size(self.budget)}{free}; {chunks}; expected peak "
                f"{format_size(self.expected_peak)}: resident tensors and calibration batch {format_size(n.base)}, "
                f"hidden states {format_size(n.hidden)} each, the largest block {format_size(n.block)} "
                f"({n.block_name}), the largest layer's "
                f"search {format_size(n.search)} ({n.layer_name} {n.layer_shape[0]}x{n.layer_shape[1]}); "
                + (f"moved off the GPU (the host plan says where they wait): {' and '.join(moved)}." if moved
                   else "everything stays on the GPU."))


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def estimate_needs(source, skeleton: nn.Module, batch, axes, *, gptq: bool, max_rows: int, probes: int,
                   specs) -> Needs:
    """The parts of the compile's GPU memory for this model, calibration batch, chunking and rungs ``specs``
    (module docstring)."""
    samples = int(batch.description.get("samples") or 1)
    held = len(batch.heldout) or samples
    calls = [c for _, c in axes.calls]
    per_sample = max((c.sample_bytes for c in calls), default=0)
    chunk = min(axes.chunk_samples or samples, samples)
    per_pass = axes.probes_per_pass(held, probes)
    held_chunk = min(axes.replay_samples or per_pass * held, per_pass * held)
    prefixes = tuple(p + "." for p in source.block_paths)
    linear_size = _linear_element_size(source, skeleton)
    linears = {f"{n}.weight" for n, m in skeleton.named_modules() if isinstance(m, nn.Linear)}
    resident = sum((linear_size if n in linears else 4) * t.numel() for n, t in _tensors(skeleton)
                   if not n.startswith(prefixes))
    held_kwargs = _nbytes(batch.heldout_kwargs) if batch.heldout_kwargs is not None else _nbytes(batch.kwargs)
    batch_bytes = _nbytes(batch.kwargs) + _nbytes(batch.heldout_kwargs)
    (block_name, block), block_search, name, (n, k), search = _searches(source, skeleton, gptq, linear_size,
                                                                         max_rows)
    upcast = 4 * n * k
    return Needs(
        base=resident + batch_bytes,
        hidden=samples * per_sample,
        # the pass's copies of the held-out batch, and its hidden states: the last block's outputs the graph keeps,
        # the gradients coming in and going out, the autograd engine's buffers (measured 4.7x on FLUX.2)
        held_base=resident + (1 + per_pass) * held_kwargs + 5 * per_pass * held * per_sample,
        block=block,
        chunk=ACT_FORWARD * chunk * per_sample + upcast,
        tape=samples * max((c.tape_bytes for c in calls), default=0),
        search=search,
        effects=ACT_BACKWARD * held_chunk * per_sample + 3 * upcast,
        saved=per_pass * held * sum(c.sample_bytes for c in calls),
        candidates=largest_block_candidates(skeleton, source.block_paths, [s for s in specs if not s.is_passthrough]),
        block_search=block_search, block_name=block_name, layer_name=name, layer_shape=(n, k))


def _nbytes(tree) -> int:
    return sum(v.numel() * v.element_size() for v in tree_flatten(tree or {})[0] if torch.is_tensor(v))


def search_bytes(n: int, k: int, gptq: bool, max_rows: int) -> int:
    """GPU memory of one layer's search: ``SEARCH_WEIGHT_COPIES`` float32 copies of the weight, the sampled rows,
    and for GPTQ one K x K float64 matrix (the Gram matrix's sums while the statistics are built, then the factor,
    in place: quant/factor.py) with three K x 1024 float64 panels of temporaries (the float32 mean waits in pinned
    host memory). Learned rounding runs after GPTQ, in less: one K x K float32 matrix and a few float32 copies of a
    slice of rows (quant/refine.py)."""
    factor = 8 * k * k + 3 * 8 * k * FACTOR_BLOCK if gptq else 0
    return int(factor + SEARCH_WEIGHT_COPIES * 4 * n * k + 2 * 4 * max_rows * k)


def _searches(source, skeleton, gptq: bool, linear_size: int, max_rows: int):
    """((the largest block, its bytes as the compile keeps it: linear weights at ``linear_size``, the rest float32),
    the most any block's weights and its largest layer's search need together, the largest search's layer, its
    shape, its bytes)."""
    worst, largest, biggest = 0, ("", (0, 0), -1), ("", 0)
    for path in source.block_paths:
        block = skeleton.get_submodule(path)
        linear = {f"{rel}.weight" for rel, m in block.named_modules() if isinstance(m, nn.Linear)}
        weights = sum(t.numel() * (linear_size if n in linear else 4) for n, t in _tensors(block))
        biggest = max(biggest, (path, weights), key=lambda b: b[1])
        for rel, mod in block.named_modules():
            if isinstance(mod, nn.Linear):
                n, k = mod.weight.shape
                need = search_bytes(n, k, gptq, max_rows)
                worst = max(worst, weights + need)
                if need > largest[2]:
                    largest = (f"{path}.{rel}", (n, k), need)
    return biggest, worst, *largest


def _tensors(model: nn.Module):
    yield from model.named_parameters()
    yield from model.named_buffers()


def _linear_element_size(source, skeleton) -> int:
    """Bytes per linear weight as the checkpoint stores them, read from its smallest block."""
    path = min(source.block_paths, key=lambda p: sum(t.numel() for _, t in _tensors(skeleton.get_submodule(p))))
    block = source.load_block(path, "cpu", None)
    return max((m.weight.element_size() for m in block.modules() if isinstance(m, nn.Linear)), default=4)


def plan_vram(needs: Needs | None, budget: int | None, device, flag: str = "--vram-budget") -> VramPlan:
    """The cheapest placement that fits ``budget`` (None: what the device has free), or a :class:`BudgetError` that
    names the smallest budget that works."""
    device = str(device)
    if torch.device(device).type != "cuda":
        if budget is not None and needs is not None and budget < needs.peak(True, True):
            raise BudgetError(_too_small(needs, budget, flag))
        return VramPlan(budget, needs, device=device)
    free = torch.cuda.mem_get_info(_index(device))[0]
    budget = budget if budget is not None else free
    if needs is None:
        return VramPlan(budget, None, device=device, free=free)
    host_tape, host_saved = choose_placement(needs, budget, flag)
    return VramPlan(budget, needs, host_tape, host_saved, device, free)


def choose_placement(needs: Needs, budget: int, flag: str = "--vram-budget") -> tuple[bool, bool]:
    """(recorded inputs on the host, effect inputs on the host): everything on the GPU when it fits, else the effect
    inputs (the larger part, read once) first, then the recorded inputs too."""
    for host_tape, host_saved in ((False, False), (False, True), (True, True)):
        if needs.peak(host_tape, host_saved) <= budget:
            return host_tape, host_saved
    raise BudgetError(_too_small(needs, budget, flag))


def _too_small(needs: Needs, budget: int, flag: str) -> str:
    least = needs.peak(True, True)
    return (f"{flag} {format_size(budget)} cannot hold the compile's smallest working set, even with the recorded "
            f"inputs in host memory: the largest layer's search ({needs.layer_name}, {needs.layer_shape[0]}x"
            f"{needs.layer_shape[1]}) needs {format_size(needs.search)} beside "
            f"{format_size(needs.base + 3 * needs.hidden // 2 + needs.block)} "
            "of resident tensors, calibration batch, hidden states and block weights; give it at least "
            f"{format_size_up(least)}.")


@contextlib.contextmanager
def memory_cap(budget: int | None, device):
    """Inside: the CUDA caching allocator may reserve at most ``budget`` bytes on ``device``, with expandable
    segments (less fragmentation between differently sized blocks); both restored after. Nothing off CUDA."""
    if torch.device(device).type != "cuda" or budget is None:
        yield
        return
    device = _index(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    own = settings is not None and "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if own:
        settings("expandable_segments:True")
    try:
        yield
    finally:
        if own:
            settings("expandable_segments:False")
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def vram_cap(plan: VramPlan):
    """:func:`memory_cap` at the plan's budget."""
    return memory_cap(plan.budget, plan.device)


# the phases the compile reports its GPU memory peaks by (in the log and the manifest's calibration.vram)
PHASES = ("setup", "calibration forward", "statistics", "search", "effects forward", "effects backward",
          "plan error")


class PeakLog:
    """The most GPU memory allocated and reserved in each phase of a compile (:data:`PHASES`): the estimate's parts
    are checked against these, so a wrong constant shows where it is wrong. Nothing off CUDA."""

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.index = _index(device) if self.cuda else None
        self.allocated: dict[str, int] = {}
        self.reserved = 0

    def lap(self, phase: str) -> int | None:
        """Charge the peak since the last lap to ``phase`` and start the next lap; returns that peak (allocated)."""
        if not self.cuda:
            return None
        peak = torch.cuda.max_memory_allocated(self.index)
        self.charge(phase, peak)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.index))
        torch.cuda.reset_peak_memory_stats(self.index)
        return peak

    def charge(self, phase: str, peak: int | None) -> None:
        """Count ``peak`` (allocated bytes; None: nothing measured) toward ``phase``'s most."""
        if peak is not None:
            self.allocated[phase] = max(self.allocated.get(phase, 0), peak)

    @property
    def peak_reserved(self) -> int | None:
        """The most reserved since the compile started, laps included (None off CUDA)."""
        return max(self.reserved, torch.cuda.max_memory_reserved(self.index)) if self.cuda else None

    @property
    def peak_allocated(self) -> int | None:
        if not self.cuda:
            return None
        return max([torch.cuda.max_memory_allocated(self.index), *self.allocated.values()])

    def describe(self, phases=PHASES) -> str:
        """``forward 1.20 GB, statistics 2.31 GB`` for the phases measured so far among ``phases``."""
        return ", ".join(f"{p} {format_size(self.allocated[p])}" for p in phases if p in self.allocated)

    def record(self) -> dict[str, int]:
        """Each phase's allocated peak in bytes, every phase of :data:`PHASES` present (0: not run)."""
        return {p: self.allocated.get(p, 0) for p in PHASES}


def _index(device) -> int:
    """A CUDA device's index ('cuda' is the current device)."""
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index
