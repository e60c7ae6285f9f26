"""The compile's host memory: ``--host-budget``, the plan that keeps what waits on the host within it, and its refusal.

What the compile's process holds in host memory, as the plan counts it (:class:`HostNeeds`):

* the process itself: the interpreter, torch and the libraries it loaded (:data:`PROCESS_CPU`, :data:`PROCESS_CUDA`);
* the resident tensors the slab writer keeps (float32) and the calibration batch;
* the largest block as read from the source: the pages of the mapped checkpoint and their copy (twice its bytes);
* the largest block's candidates, every rung of every layer until the block is saved, and the previous block's while
  a worker writes them to the state (twice), and on a GPU the pinned float32 Hessian of each width of layer (the
  allocator keeps one of each);
* on a CPU compile, the work a GPU compile keeps on the GPU (compiler/vram.py's estimate);
* what waits, where the VRAM plan put it on the host: the largest block's recorded layer inputs (the *tape*) with its
  outputs parked beside them, and every block's inputs for the effects pass's backward. In pinned memory each copy is
  counted as torch's pinned allocator makes it, rounded up to a power of two. What is spilled costs its reads in
  flight instead: the item being consumed and the next one, read ahead (compiler/prefetch.py).

Not counted: the encoders (they run before the compile, within the same budget on their own:
sources/encoder_placement.py, and are dropped), and the slab writer's and the plan-error pass's buffers (a block at a
time, below the calibration pass's).

The tape and the effect inputs never wait at once (the last block's tape is gone before the effects pass starts), so
each is spilled to a scratch file in the state folder (compiler/spill.py) only when its own pass would pass the
budget; the effect inputs are the larger part and are read once. A spilled tape keeps its first recorded inputs in
memory all the same, as many as the budget has room for beside the spill (:meth:`HostNeeds.room_for_tape`): on the
12B model each byte through the file and back cost more than the block's forward. When even with both spilled the
count passes the budget, the compile is refused before calibration starts, naming the smallest budget that works.
The budget defaults to what the machine has available (docs/compiler.md, "Compiling within a host memory budget").
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..runtime.host.budget import default_host_budget, pinned_bytes
from ..sizes import format_size, format_size_up
from .budget import BudgetError, largest_block_candidates
from .spill import SEGMENT, SpillFile
from .state import spill_path
from .vram import Needs, VramPlan, _nbytes, _tensors

# The process before it holds any tensor of the compile: measured 0.46 GB resident on a CPU with torch 2.13, diffusers
# and transformers imported; 1.19 GB on an H200 with torch 2.11 (CUDA 13) once cuBLAS and a Triton kernel had run,
# before diffusers and transformers were imported. The rest is the allocators' slack.
PROCESS_CPU = 1 << 30
PROCESS_CUDA = 2 << 30
# the parts that wait, by the name of their spill file and manifest keys
TAPE, SAVED = "recorded-inputs", "effect-inputs"


@dataclass(frozen=True)
class HostNeeds:
    """Bytes of each part of the compile's host memory (module docstring)."""

    process: int  # the interpreter, torch and its libraries
    kept: int  # the resident tensors as the writer keeps them and the calibration batch
    block: int  # the largest block as read from the source
    rungs: int  # the largest block's candidates, one copy
    hessian: int  # the pinned Hessians (a GPU compile with GPTQ)
    calibrate: int  # a CPU compile's calibration work beside the tape (0 on a GPU)
    effects: int  # a CPU compile's effects work beside the effect inputs (0 on a GPU)
    tape: int  # the largest block's recorded inputs and parked outputs, where they wait on the host (0: on the GPU)
    saved: int  # every block's inputs for the effects pass's backward, where they wait on the host (0: on the GPU)
    staging: int = 0  # the spill's pinned staging buffer (a GPU compile)
    tape_reads: int = 0  # a spilled tape's reads in flight: the recorded input being consumed and the next one
    saved_reads: int = 0  # spilled effect inputs' reads in flight: the chunk being replayed and the next one

    @property
    def fixed(self) -> int:
        return self.process + self.kept + self.block

    def phases(self, spill_tape: bool, spill_saved: bool, kept: int = 0) -> tuple[int, int]:
        """(the calibration pass's bytes beside :attr:`fixed`, the effects pass's); ``kept``: bytes of a spilled
        tape kept in memory all the same."""
        tape = self.tape_reads + kept if spill_tape else self.tape
        calibrate = self.calibrate + 2 * self.rungs + self.hessian + tape
        effects = self.effects + self.rungs + (self.saved_reads if spill_saved else self.saved)
        return calibrate, effects

    def peak(self, spill_tape: bool, spill_saved: bool, kept: int = 0) -> int:
        spilling = (spill_tape and self.tape) or (spill_saved and self.saved)
        return self.fixed + max(self.phases(spill_tape, spill_saved, kept)) + (self.staging if spilling else 0)

    def room_for_tape(self, budget: int, spill_saved: bool) -> int:
        """Bytes of a spilled tape that can stay in memory within ``budget``: each of them saves a write to the spill
        file and a read back, which on the 12B model cost more than the block's own forward."""
        spare = budget - self.fixed - self.staging - self.phases(True, spill_saved)[0]
        return max(0, min(spare, self.tape))

    def placements(self) -> list[tuple[bool, bool]]:
        """(spill the tape, spill the effect inputs), from the least spilled; a part that does not wait on the host
        is never spilled."""
        return [(t, s) for t, s in ((False, False), (False, True), (True, False), (True, True))
                if (self.tape or not t) and (self.saved or not s)]

    @property
    def least(self) -> int:
        """The smallest budget any placement fits (spilling parts smaller than the staging buffer saves nothing)."""
        return min(self.peak(*p) for p in self.placements())


def estimate_host(needs: Needs, vram: VramPlan, skeleton: nn.Module, block_paths, batch, axes, specs,
                  probes: int, gptq: bool) -> HostNeeds:
    """The parts of the compile's host memory for this model, batch, chunking and VRAM plan (module docstring)."""
    cuda = torch.device(vram.device).type == "cuda"
    prefixes = tuple(p + "." for p in block_paths)
    resident = sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for n, t in _tensors(skeleton)
                   if not n.startswith(prefixes))
    batch_bytes = _nbytes(batch.kwargs) + _nbytes(batch.heldout_kwargs)
    rungs = largest_block_candidates(skeleton, block_paths, specs)
    widths = {m.weight.shape[1] for path in block_paths for m in skeleton.get_submodule(path).modules()
              if isinstance(m, nn.Linear)}
    samples = int(batch.description.get("samples") or 1)
    copies = axes.probes_per_pass(len(batch.heldout) or samples, probes) * (len(batch.heldout) or samples)
    reads = _reads_in_flight(axes, samples, copies)
    if not cuda:  # the GPU's work is the host's: what the VRAM estimate counts, with the tape and effect inputs apart
        (calibrate, effects), (with_tape, _) = needs.phases(True, True), needs.phases(False, True)
        return HostNeeds(PROCESS_CPU, resident, 2 * needs.block, rungs, 0, calibrate, effects, with_tape - calibrate,
                         _saved(axes, copies, needs, pinned=False), 0, *reads)
    tape = _pinned_tape(axes, samples, needs) if vram.host_tape else 0
    saved = _saved(axes, copies, needs, pinned=True) if vram.host_saved else 0
    hessian = sum(pinned_bytes(4 * k * k) for k in widths) if gptq else 0
    return HostNeeds(PROCESS_CUDA, resident + batch_bytes, 2 * needs.block, rungs, hessian, 0, 0, tape, saved,
                     SEGMENT, *reads)


def _pinned_tape(axes, samples: int, needs: Needs) -> int:
    """The largest block's recorded inputs in pinned memory, one copy per chunk and distinct input, and its outputs
    parked beside them (a pinned copy per chunk, and the joined outputs)."""
    if not axes.calls:
        return 2 * (needs.tape + needs.hidden)  # no per-tensor sizes: a power of two at most doubles each
    sizes = [b - a for a, b in axes.ranges(samples)]
    worst = 0
    for _, c in axes.calls:
        entries = sum(pinned_bytes(r * d) for r in sizes for d in c.tape_inputs)
        parked = sum(pinned_bytes(r * o if b else o) for r in sizes for o, b in zip(c.output_bytes, c.outputs))
        joined = samples * sum(o for o, b in zip(c.output_bytes, c.outputs) if b) if len(sizes) > 1 else 0
        worst = max(worst, entries + parked + joined)
    return worst


def _reads_in_flight(axes, samples: int, copies: int) -> tuple[int, int]:
    """What reading spilled tensors back holds at once (compiler/prefetch.py: the item being consumed and the next):
    twice the largest recorded input of a calibration chunk, and twice the largest replay chunk of a block call's
    saved inputs."""
    chunks = [b - a for a, b in axes.ranges(samples)]
    replay = max((b - a for a, b in axes.ranges(copies, axes.replay_samples)), default=0)
    tape = max((r * d for _, c in axes.calls for d in c.tape_inputs for r in chunks), default=0)
    saved = max((sum(replay * n if b else n for n, b in zip(c.input_bytes, c.inputs)) for _, c in axes.calls),
                default=0)
    return 2 * tape, 2 * saved


def _saved(axes, copies: int, needs: Needs, pinned: bool) -> int:
    """Every block call's inputs for ``copies`` samples, the batched and the shared ones, each a copy (``pinned``:
    as the pinned allocator rounds it)."""
    if not axes.calls:  # no per-tensor sizes: a power of two at most doubles each
        return 2 * needs.saved if pinned else needs.saved
    size = pinned_bytes if pinned else int
    return sum(size(copies * n if b else n) for _, c in axes.calls for n, b in zip(c.input_bytes, c.inputs))


@dataclass
class HostPlan:
    """Where what waits goes (``gpu``, ``pinned``, ``host`` or ``spilled``), within ``budget`` (None: no limit)."""

    budget: int | None
    needs: HostNeeds | None = None
    tape_where: str = "gpu"
    saved_where: str = "gpu"
    folder: Path | None = None  # the state folder, where spill files go
    default: str = ""  # how the default budget was found ('': given by --host-budget)
    tape_kept: int = 0  # a spilled tape's bytes kept in memory all the same (the budget's room beside the spill)
    kept_where: str = "pinned"  # where those are kept: ``pinned`` (counted as the pinned allocator rounds) or ``host``
    files: dict[str, SpillFile] = field(default_factory=dict)
    spilled: dict[str, int] = field(default_factory=dict)  # bytes written to each part's spill file

    @property
    def spill_tape(self) -> bool:
        return self.tape_where == "spilled"

    @property
    def spill_saved(self) -> bool:
        return self.saved_where == "spilled"

    @property
    def expected_peak(self) -> int | None:
        return self.needs.peak(self.spill_tape, self.spill_saved, self.tape_kept) if self.needs else None

    def path(self, part: str) -> Path:
        return spill_path(self.folder, part)

    def spill_file(self, part: str) -> SpillFile:
        """The part's spill file (one per pass; :meth:`close` deletes it and counts what went through it)."""
        if part not in self.files:
            self.files[part] = SpillFile(self.path(part))
        return self.files[part]

    def close(self, part: str) -> None:
        f = self.files.pop(part, None)
        if f is not None:
            self.spilled[part] = self.spilled.get(part, 0) + f.bytes_written
            f.remove()

    @contextlib.contextmanager
    def spilling(self, part: str):
        """Inside: the part's spill file when the plan spills it, else None; deleted after."""
        if (part == TAPE and not self.spill_tape) or (part == SAVED and not self.spill_saved):
            yield None
            return
        try:
            yield self.spill_file(part)
        finally:
            self.close(part)

    def describe(self) -> str:
        """The plan in one paragraph, for the compile's log before it starts."""
        n = self.needs
        if self.budget is None or n is None:
            return f"Host plan: no budget ({self.default or 'none given'}); nothing is spilled."
        how = f" ({self.default})" if self.default else " (--host-budget)"
        parts = [self._where("recorded inputs", n.tape, self.tape_where, TAPE),
                 self._where("effect inputs", n.saved, self.saved_where, SAVED)]
        work = f", the compile's own work on the CPU {format_size(max(n.calibrate, n.effects))}" \
            if n.calibrate or n.effects else ""
        return (f"Host plan: budget {format_size(self.budget)}{how}; expected peak {format_size(self.expected_peak)}: "
                f"the process {format_size(n.process)}, resident tensors and calibration batch {format_size(n.kept)}, "
                f"the largest block as read {format_size(n.block)}, its candidates {format_size(2 * n.rungs)}"
                f"{work}; {'; '.join(parts)}.")

    def _where(self, what: str, size: int, where: str, part: str) -> str:
        if where == "gpu":
            return f"{what} on the GPU"
        if where == "spilled" and part == TAPE and self.tape_kept:
            memory = "pinned host memory" if self.kept_where == "pinned" else "host memory"
            return (f"{what} ({format_size(size)}) spilled to {self.path(part)} beyond the first "
                    f"{format_size(self.tape_kept)} of each block, kept in {memory} (the budget's room)")
        if where == "spilled":
            return f"{what} ({format_size(size)}) spilled to {self.path(part)}"
        return f"{what} ({format_size(size)}) in {'pinned ' if where == 'pinned' else ''}host memory"

    def keep_cost(self, t: torch.Tensor) -> int:
        """What keeping ``t`` takes, as :attr:`tape_kept` counts it."""
        n = t.numel() * t.element_size()
        return pinned_bytes(n) if self.kept_where == "pinned" else n

    def record(self, final: bool) -> dict:
        """The plan for the manifest's calibration.vram (integers at their widest while planning, ``final`` False)."""
        wide = 10**15
        return {"recorded_inputs": self.tape_where, "effect_inputs": self.saved_where,
                "host_budget_bytes": self.budget if final else wide,
                "host_expected_peak_bytes": self.expected_peak if final else wide,
                "recorded_inputs_spilled_bytes": self.spilled.get(TAPE, 0) if final else wide,
                "recorded_inputs_kept_bytes": self.tape_kept if final else wide,
                "effect_inputs_spilled_bytes": self.spilled.get(SAVED, 0) if final else wide}


def plan_host(needs: HostNeeds | None, budget: int | None, vram: VramPlan, folder: Path,
              flag: str = "--host-budget") -> HostPlan:
    """Spill what waits on the host, effect inputs and recorded inputs each only when its pass would pass ``budget``
    (None: what the machine has available), or a :class:`BudgetError` naming the smallest budget that works."""
    default = ""
    if budget is None:
        budget, default = default_host_budget()
    cpu = torch.device(vram.device).type == "cpu"
    tape = "host" if cpu else "pinned" if vram.host_tape else "gpu"
    saved = "host" if cpu else "pinned" if vram.host_saved else "gpu"
    plan = HostPlan(budget, needs, tape, saved, Path(folder), default)
    if needs is None or budget is None:
        return plan
    for spill_tape, spill_saved in needs.placements():
        if needs.peak(spill_tape, spill_saved) <= budget:
            plan.tape_where = "spilled" if spill_tape else tape
            plan.saved_where = "spilled" if spill_saved else saved
            plan.tape_kept = needs.room_for_tape(budget, spill_saved) if spill_tape else 0
            plan.kept_where = tape
            return plan
    raise BudgetError(_too_small(needs, budget, flag, default))


def check_least_host(budget: int | None, device, flag: str = "--host-budget") -> None:
    """Refuse, before any encoder runs, a host budget below what the process itself takes (:data:`PROCESS_CPU`,
    :data:`PROCESS_CUDA`): no plan fits it, and the exact least is only known once calibration has its batch."""
    process = PROCESS_CPU if torch.device(device).type == "cpu" else PROCESS_CUDA
    if budget is not None and budget < process:
        raise BudgetError(f"{flag} {format_size(budget)} cannot hold the compile's host memory: the process itself "
                          f"takes about {format_size(process)} before any tensor of the compile; give it more than "
                          "that (the plan, once calibration has its batch, names the least that works).")


def _too_small(needs: HostNeeds, budget: int, flag: str, default: str) -> str:
    least = needs.least
    given = f"{flag} {format_size(budget)}" if not default else \
        f"the {format_size(budget)} of host memory this machine can give ({default})"
    parts = [f"the process itself ({format_size(needs.process)})",
             f"the resident tensors and calibration batch ({format_size(needs.kept)})",
             f"the largest block as read ({format_size(needs.block)})",
             f"its candidates ({format_size(2 * needs.rungs + needs.hessian)})"]
    if needs.calibrate or needs.effects:
        parts.append(f"the compile's own work on the CPU ({format_size(max(needs.calibrate, needs.effects))})")
    then = f"give it at least {format_size_up(least)}" if not default else \
        f"free memory, or pass {flag} of at least {format_size_up(least)} (more than is free: the system may swap)"
    return (f"{given} cannot hold the compile's host memory even with the recorded inputs and the effect inputs "
            f"spilled to disk: {', '.join(parts[:-1])} and {parts[-1]} need {format_size(least)}; {then}.")
