"""Each layer's effect on the model's final output, measured end to end on the held-out calibration samples.

Quantizing layer L at rung r changes its weight by ``ΔW = W − Ŵ_r``; to first order the model's output moves by
``J_L ΔW`` (the output's Jacobian with respect to that weight). Its squared size, relative to the output's power,
is the layer's *effect*: what quantizing L alone at r does to what the model returns, in the units of
``squareq accept``'s drift (``‖Δy‖² / ‖y‖²``). Samples do not interact, so the effect is a sum over held-out samples
``s`` of ``‖J_{L,s} ΔW‖²``, and with a random Gaussian probe ``v_s`` over sample s's output,
``E[(v_sᵀ J_{L,s} ΔW)²] = ‖J_{L,s} ΔW‖²``. The inner product is ``Σ_rows δY ⊙ (X ΔWᵀ)`` over the sample's rows,
where ``X`` is the layer's input and ``δY`` the probe's gradient at the layer's output: one backward pass gives
every layer's and every rung's term for every sample. The effect is the mean over ``probes`` seeded probes of the
sum over samples; the probes run together, as ``probes`` copies of the held-out batch with a probe each.

A per-sample term has no cross terms between samples, so 4 probes on 8 held-out samples (32 terms) estimate an
effect with a relative spread of about 25%, where a sum over samples per probe needed 16 backward passes for 35%
(docs/compiler.md, "Measured effect on the output").

The model runs its own forward over those copies one block at a time: each block runs without a graph, on a few
samples at a time (compiler/chunks.py), and is loaded again and re-run during the backward pass (activation
checkpointing), so memory stays near one block with its quantized candidates, one chunk's activations and the
blocks' inputs (kept in pinned host memory when the VRAM plan says so, or in a spill file when the host plan does),
at any model size. On a GPU its matrix products run in TF32: the effect is an estimate, and TF32's 1e-3 relative
error is far below its sampling spread.

Effects add up to the plan's output error when the layers' errors are small and independent; the compiler checks
that by measuring the chosen plan's output error directly (:func:`plan_output_error`) and records both.
"""
from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import kernels, quant
from ..kernels.lean_attention import LeanAttentionMode
from ..quant import QuantizedWeight
from ..slab.writer import block_linears
from .chunks import (
    BatchAxes,
    CallAxes,
    call_batch,
    map_batched,
    run_chunked,
    split_leaves,
)
from .prefetch import read_ahead
from .progress import CompileProgress
from .spill import Spilled

DEFAULT_PROBES = 4

Keep = Callable[[torch.Tensor], torch.Tensor]


def main_output(out) -> torch.Tensor:
    """The main tensor of a model's output: a tensor, or the first field of a tuple or ``ModelOutput``; a list of
    per-sample tensors (Z-Image) is stacked, or concatenated flat when their shapes differ."""
    while not isinstance(out, torch.Tensor):
        if isinstance(out, list) and out and all(isinstance(t, torch.Tensor) for t in out):
            if len({tuple(t.shape) for t in out}) == 1:
                return torch.stack(out)
            return torch.cat([t.reshape(-1) for t in out])
        out = out[0]
    return out


def output_mask(y: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
    """1 where an output element counts (real tokens of text; everything for images), broadcastable to ``y``."""
    if row_mask is not None and y.dim() >= 2 and tuple(y.shape[:2]) == tuple(row_mask.shape):
        return row_mask.to(y.device, y.dtype).reshape(*row_mask.shape, *([1] * (y.dim() - 2)))
    return torch.ones((), device=y.device, dtype=y.dtype)


def repeat_batch(kwargs: Mapping, batched: set[str], times: int) -> dict:
    """``kwargs`` with every batched argument repeated ``times`` along the batch axis (copy k is samples
    ``[k·B, (k+1)·B)``)."""
    return map_batched(kwargs, batched, lambda v: v.repeat(times, *([1] * (v.dim() - 1))), lambda vs: vs * times)


@contextlib.contextmanager
def estimate_kernels(device):
    """Attention by :func:`~squareq.kernels.lean_attention.lean_attention` (the same gradients on every run, and no
    attention matrix kept for the backward pass: PyTorch's memory-efficient kernel adds its gradients with atomics,
    so two runs would differ in the last bits and could tip a layer between rungs, and the math kernel keeps 0.9 GB
    of probabilities per FLUX.1 sample); on a CUDA device also TF32 matrix products. Restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with LeanAttentionMode():
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


class _Products:
    """While a block is replayed for the backward pass: every linear's input, and once its output's gradient arrives,
    each rung's per-sample term ``Σ_rows δY ⊙ (X ΔW_rᵀ)`` added to
    ``sums[name][rung][offset + start:offset + stop]``."""

    def __init__(self, path: str, block: nn.Module, candidates: Mapping[str, Mapping[int, QuantizedWeight]],
                 sums: dict, offset: int = 0) -> None:
        self.candidates, self.sums, self.offset = candidates, sums, offset
        self.window = (0, 0)
        self.handles = [mod.register_forward_hook(self._hook(name, mod)) for name, mod in block_linears(path, block)
                        if name in candidates]

    def _hook(self, name: str, mod: nn.Linear):
        def hook(module, args, out):
            x, window = args[0].detach(), self.window
            if not out.requires_grad:  # a layer fed only by inputs without a gradient (adaLN on temb): start one here
                out = out.detach().requires_grad_(True)
            out.register_hook(lambda g: self._add(name, mod, x, g, window))
            return out

        return hook

    @torch.no_grad()
    def _add(self, name: str, mod: nn.Linear, x: torch.Tensor, g: torch.Tensor, window) -> None:
        start, stop = window
        weight = mod.weight.detach()
        xf, gf = x.float(), g.float()
        per_sample = x.shape[0] == stop - start
        for rung, qw in self.candidates[name].items():
            deq = kernels.dequantize(qw)
            per = None
            # a slice of output rows at a time: ΔW and the products are float32 temporaries of the slice's size
            for rows in quant.row_chunks(*weight.shape):
                terms = gf[..., rows] * torch.nn.functional.linear(xf, weight[rows].float() - deq[rows].float())
                part = terms.reshape(terms.shape[0], -1).sum(dim=1) if per_sample else terms.sum()[None]
                per = part if per is None else per + part
            row = self.sums[name][rung]
            at = self.offset + start
            row[at:at + per.shape[0]] += per.to(row.device, row.dtype)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _StreamedBlock(torch.autograd.Function):
    """A block that keeps no graph: its forward runs without one, chunk by chunk; its backward loads the block again
    and replays each chunk with a graph, from the saved inputs (reentrant checkpointing)."""

    @staticmethod
    def forward(ctx, runner, anchor, *tensors):
        ctx.runner = runner
        with torch.no_grad():
            outs = runner.forward(tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        runner, ctx.runner = ctx.runner, None  # no cycle through the graph keeps the block's tensors alive
        return (None, None, *runner.backward(grads))


class _BlockRunner:
    """Loads, runs and replays one block call for :class:`_StreamedBlock`."""

    def __init__(self, load: Callable[[], nn.Module], leaves, spec, axes: CallAxes | None, ranges, keep: Keep,
                 on_replay: Callable[[nn.Module], _Products], device,
                 step: Callable[[str], contextlib.AbstractContextManager]) -> None:
        # the call's structure only: a runner waits for its backward pass through the whole forward, and tensors it
        # kept would hold every block's hidden states on the device at once (its inputs wait in ``saved``)
        self.leaves, self.spec = _shape_only(leaves), spec
        self.load, self.axes, self.ranges = load, axes, ranges
        self.keep, self.on_replay, self.device = keep, on_replay, device
        self.step = step  # step("forward"): the progress of this block's forward (its backward, "backward")
        self.saved: list = []
        self.out_leaves = self.out_spec = None

    def _tensors(self, leaves) -> list:
        return [x for x in leaves if torch.is_tensor(x)]

    def forward(self, tensors) -> list[torch.Tensor]:
        self.saved = [self.keep(t.detach()) for t in tensors]
        args, kwargs = self._args(list(tensors))
        with self.step("forward"):
            out = run_chunked(self.load(), args, kwargs, self.axes, self.ranges)
        leaves, self.out_spec = tree_flatten(out)
        self.out_leaves = _shape_only(leaves)
        return self._tensors(leaves)

    def _args(self, tensors):
        return _fill(self.leaves, self.spec, tensors)

    def rebuild(self, outs):
        return _fill(self.out_leaves, self.out_spec, outs)

    def backward(self, grads) -> list:
        chunked = self.axes is not None and len(self.ranges) > 1
        in_flags = self.axes.inputs if chunked else (False,) * len(self.saved)
        out_flags = self.axes.outputs if chunked else (False,) * len(grads)
        saved = self.saved

        def rows(window):  # only this chunk's inputs (from the GPU, pinned host memory or the spill file)
            return _saved_rows(saved, in_flags, *window) if chunked else [_whole(x) for x in saved]

        # spilled rows are read a chunk ahead, the first while the block loads
        with self.step("backward"), read_ahead(rows, self.ranges if chunked else [self.ranges[0]],
                                               ahead=any(isinstance(x, Spilled) for x in saved)) as chunks:
            block = self.load()
            products = self.on_replay(block)
            got = _Gradients(saved, in_flags, self.device)
            try:
                for (start, stop), inputs in chunks:
                    part = [x.to(self.device, non_blocking=True).detach().requires_grad_(x.is_floating_point())
                            for x in inputs]
                    g_part = split_leaves(list(grads), out_flags, start, stop) if chunked else list(grads)
                    products.window = (start, stop)
                    with torch.enable_grad(), estimate_kernels(self.device):
                        args, kwargs = self._args(part)
                        outs = self._tensors(tree_flatten(block(*args, **kwargs))[0])
                        pairs = [(o, g) for o, g in zip(outs, g_part) if g is not None and o.requires_grad]
                        if pairs:
                            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                    got.add(part, start, stop)
            finally:
                products.remove()
        self.saved = []
        return got.result



def _saved_rows(saved: list, batched: tuple[bool, ...], start: int, stop: int) -> list:
    """A chunk's part of a block call's saved inputs: the batched ones cut to samples ``[start, stop)``, only those
    rows read back where they were spilled."""
    if not any(isinstance(x, Spilled) for x in saved):
        return split_leaves(saved, batched, start, stop)
    return [(x.load(start, stop) if isinstance(x, Spilled) else x[start:stop]) if b else _whole(x)
            for x, b in zip(saved, batched)]


def _whole(x):
    return x.load() if isinstance(x, Spilled) else x


class _Tensor:
    """Where a tensor was in a call's leaves (:class:`_BlockRunner` keeps the structure, not the tensor)."""


def _shape_only(leaves: list) -> list:
    return [_Tensor if torch.is_tensor(x) else x for x in leaves]


def _fill(leaves: list, spec, tensors):
    it = iter(tensors)
    return tree_unflatten([next(it) if x is _Tensor else x for x in leaves], spec)


class _Gradients:
    """The gradients of a block call's inputs, filled chunk by chunk: a batched input's in one tensor of its full
    size (no list of chunks joined at the end, which held two copies at once), a shared input's summed."""

    def __init__(self, inputs: list, batched: tuple[bool, ...], device) -> None:
        self.inputs, self.batched, self.device = inputs, batched, device
        self.result: list = [None] * len(inputs)

    def add(self, part: list, start: int, stop: int) -> None:
        for i, x in enumerate(part):
            g = x.grad if x.requires_grad else None
            if g is None:
                continue
            if not self.batched[i]:
                self.result[i] = g if self.result[i] is None else self.result[i] + g
                continue
            if self.result[i] is None:
                self.result[i] = torch.zeros(self.inputs[i].shape, dtype=g.dtype, device=self.device)
            self.result[i][start:stop] = g


def measure_effects(source, kwargs: dict, row_mask: torch.Tensor | None,
                    candidates_of: Callable[[int], Mapping[str, Mapping[int, QuantizedWeight]]], device="cpu",
                    probes: int = DEFAULT_PROBES, seed: int = 0,
                    progress: CompileProgress | None = None, axes: BatchAxes | None = None,
                    batched: set[str] | None = None, keep: Keep | None = None,
                    lap: Callable[[str], object] = lambda phase: None,
                    end_pass: Callable[[], object] | None = None) -> tuple[dict[str, dict[int, float]], dict]:
    """``{layer: {rung: effect}}`` for every candidate ``candidates_of(block index)`` returns, and a record of the
    measurement (probes, samples' output power, seconds). Effects are relative to the output's power, so they are
    in the units of the model-output rel-MSE. ``batched`` names the batched keyword arguments, ``axes`` the blocks'
    batched tensors and chunk size, ``keep`` where the blocks' inputs wait for the backward pass (``end_pass()`` is
    called once a pass's backward has consumed them: a spill file's space back); ``lap(phase)`` is called at the
    end of each forward and backward pass (the compile's memory log). The probes run a few at a time
    (:meth:`BatchAxes.probes_per_pass`: a number that depends on the model only, so every budget computes the same).
    ``progress`` shows the passes as one bar, "effects", a unit per block forward and per block backward."""
    started = time.perf_counter()
    axes = axes or BatchAxes()
    batched = batched if batched is not None else {k for k, v in kwargs.items() if torch.is_tensor(v) and v.dim()}
    held = batch_size(kwargs, batched)
    per_pass = axes.probes_per_pass(held, probes)
    progress = CompileProgress() if progress is None else progress
    passes = _ProbePasses(source, kwargs, row_mask, candidates_of, device, axes, batched, keep or (lambda t: t),
                          probes * held, torch.Generator().manual_seed(seed), progress, lap,
                          end_pass or (lambda: None))
    progress(f"measuring each layer's effect on the model output: {probes} probes on {held} held-out samples"
             + (f", {per_pass} probes per pass" if per_pass < probes else ""))
    firsts = range(0, probes, per_pass)
    with progress.blocks(2 * len(source.block_paths) * len(firsts), "effects"):
        powers = [passes.run(first * held, min(per_pass, probes - first), k, len(firsts))
                  for k, first in enumerate(firsts, 1)]
    power = max(powers[0], 1e-30)  # every copy of the held-out batch has the same output
    effects = {name: {rung: float(t.square().sum()) / probes / power for rung, t in rungs.items()}
               for name, rungs in passes.sums.items()}
    return effects, {"probes": probes, "output_power": power, "estimator": "per-sample",
                     "probes_per_pass": per_pass, "seconds": round(time.perf_counter() - started, 3)}


class _ProbePasses:
    """The forward and backward passes of :func:`measure_effects`, each over a few probe copies of the held-out
    batch; every sample's terms go to its row of ``sums`` (``total`` rows: probes x held-out samples)."""

    def __init__(self, source, kwargs, row_mask, candidates_of, device, axes: BatchAxes, batched, keep: Keep,
                 total: int, generator: torch.Generator, progress, lap, end_pass) -> None:
        self.source, self.kwargs, self.row_mask, self.candidates_of = source, kwargs, row_mask, candidates_of
        self.device, self.axes, self.batched, self.keep, self.total = device, axes, batched, keep, total
        self.generator, self.progress, self.lap, self.end_pass = generator, progress, lap, end_pass
        self.sums: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def _step(self, index: int, path: str, phase: str, number: int, passes: int):
        """A block's forward or backward, one unit of the progress: begun (off a terminal, a line with its ETA)."""
        of = f" (probe pass {number}/{passes})" if passes > 1 else ""
        self.progress.begin(f"block {index + 1}/{len(self.source.block_paths)} {path}: effects {phase}{of}")
        yield
        self.progress.done()

    def _on_replay(self, index: int, path: str, offset: int):
        def on_replay(block):
            # on the device once per block: moved in each chunk's products, FLUX.1's were 0.9 TB of copies a compile
            wanted = {name: {rung: qw.to(self.device) for rung, qw in rungs.items()}
                      for name, rungs in self.candidates_of(index).items()}
            for name, rungs in wanted.items():
                for rung in rungs:
                    self.sums.setdefault(name, {}).setdefault(
                        rung, torch.zeros(self.total, dtype=torch.float64, device=self.device))
            return _Products(path, block, wanted, self.sums, offset)

        return on_replay

    def run(self, offset: int, count: int, number: int = 1, passes: int = 1) -> float:
        """One pass (``number`` of ``passes``) over ``count`` copies whose samples are rows ``offset..`` of the sums;
        returns one copy's output power."""
        copies = repeat_batch(self.kwargs, self.batched, count)
        samples = batch_size(copies, self.batched)
        anchor = torch.zeros((), device=self.device, requires_grad=True)
        cursor, device, axes = self.axes.cursor(), self.device, self.axes

        def run_block(index: int, path: str, args, kw):
            leaves, spec = tree_flatten((args, kw))
            call = cursor.next(index)
            b = call_batch(leaves, call) or samples
            runner = _BlockRunner(lambda: self.source.load_block(path, device, torch.float32, upcast_linears=True),
                                  leaves, spec, call, axes.ranges(b, axes.replay_samples), self.keep,
                                  self._on_replay(index, path, offset), device,
                                  lambda phase: self._step(index, path, phase, number, passes))
            outs = _StreamedBlock.apply(runner, anchor, *[x for x in leaves if torch.is_tensor(x)])
            return runner.rebuild(outs)

        shell = self.source.shell(run_block, device, upcast_linears=True)
        mask_rows = self.row_mask.repeat(count, 1) if self.row_mask is not None else None
        with estimate_kernels(device), torch.enable_grad():
            y = main_output(shell(**copies)).float()
            mask = output_mask(y, mask_rows)
            power = float((y.detach() * mask).square().sum()) / count
            v = torch.randn(y.shape, generator=self.generator).to(y.device) * mask
            self.lap("effects forward")
            self.progress("measuring each layer's effect on the model output: the backward pass")
            (v * y).sum().backward()
            self.lap("effects backward")
        del y, v, mask, shell, copies
        gc.collect()  # the graph's last references, before the next pass needs the memory
        self.end_pass()
        return power


def batch_size(kwargs: Mapping, batched: set[str]) -> int:
    sizes = []
    map_batched(kwargs, batched, lambda v: sizes.append(v.shape[0]), lambda vs: sizes.append(len(vs)))
    return max(sizes) if sizes else 1


class PlanWeights(NamedTuple):
    """A plan's quantized weights by block index, and any biases it replaces (compiler/correction.py)."""

    weights_of: Callable[[int], Mapping[str, QuantizedWeight]]
    biases_of: Callable[[int], Mapping[str, torch.Tensor]] | None = None


def plan_output_error(source, kwargs: dict, row_mask: torch.Tensor | None,
                      weights_of: Callable[[int], Mapping[str, QuantizedWeight]], device="cpu",
                      axes: BatchAxes | None = None) -> float:
    """The model-output rel-MSE ``‖ŷ − y‖² / ‖y‖²`` on ``kwargs`` with every block's linears at the weights
    ``weights_of(block index)`` gives (the plan), against the source model: measured, not predicted."""
    return plan_output_errors(source, kwargs, row_mask, [PlanWeights(weights_of)], device, axes)[0]


@torch.no_grad()
def plan_output_errors(source, kwargs: dict, row_mask: torch.Tensor | None, plans: Sequence[PlanWeights],
                       device="cpu", axes: BatchAxes | None = None) -> list[float]:
    """:func:`plan_output_error` of each of ``plans``, against one run of the source model."""
    plan: PlanWeights | None = None
    axes = axes or BatchAxes()

    def run_block(index: int, path: str, args, kw):
        block = source.load_block(path, device, torch.float32, upcast_linears=True)
        if plan is not None:
            weights = plan.weights_of(index)
            biases = plan.biases_of(index) if plan.biases_of is not None else {}
            for name, mod in block_linears(path, block):
                if name in weights:
                    mod.weight.copy_(quant.dequantize(weights[name].to(device)).to(mod.weight.dtype))
                if name in biases:
                    mod.bias.copy_(biases[name].to(device, mod.bias.dtype))
        leaves, _ = tree_flatten((args, kw))
        call = cursor.next(index)
        return run_chunked(block, args, kw, call, axes.ranges(call_batch(leaves, call) or 1))

    shell = source.shell(run_block, device, upcast_linears=True)
    cursor = axes.cursor()
    y = main_output(shell(**kwargs)).float()
    mask = output_mask(y, row_mask)
    power = max(float((y * mask).square().sum()), 1e-30)
    errors = []
    for each in plans:
        plan, cursor = each, axes.cursor()
        got = main_output(shell(**kwargs)).float()
        errors.append(float(((got - y) * mask).square().sum()) / power)
    return errors
