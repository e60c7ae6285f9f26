"""Each layer's effect on the model's final output, measured end to end on the held-out calibration samples.

Quantizing layer L at rung r changes its weight by ``ΔW = W − Ŵ_r``; to first order the model's output moves by
``J_L ΔW`` (the output's Jacobian with respect to that weight). Its squared size, relative to the output's power,
is the layer's *effect*: what quantizing L alone at r does to what the model returns, in the units of
``squareq accept``'s drift (``‖Δy‖² / ‖y‖²``). With a random Gaussian probe ``v`` over the output,
``E[(vᵀ J_L ΔW)²] = ‖J_L ΔW‖²``, and ``vᵀ J_L ΔW = ⟨∇_W (vᵀ y), ΔW⟩``: one backward pass per probe gives every
layer's weight gradient, and one inner product per layer and rung its sample. The effect is the mean over
``probes`` seeded probes.

The model runs its own forward over the held-out samples (whole images or sentences the search never fitted to),
one block at a time: each block runs without a graph, and is loaded again and re-run during the backward pass
(activation checkpointing), so memory stays near one block plus the blocks' inputs, at any model size.

Effects add up to the plan's output error when the layers' errors are small and independent; the compiler checks
that by measuring the chosen plan's output error directly (:func:`plan_output_error`) and records both.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import quant
from ..quant import QuantizedWeight
from ..slab.writer import block_linears

DEFAULT_PROBES = 16


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


class _StreamedBlock(torch.autograd.Function):
    """A block that keeps no graph: its forward runs without one, its backward loads the block again and replays
    it (reentrant checkpointing that also reaches the block's weight gradients: ``on_backward(block)``)."""

    @staticmethod
    def forward(ctx, runner, anchor, *tensors):
        ctx.runner = runner
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            outs = runner.run(tensors, grad=False)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outs = ctx.runner.run(inputs, grad=True)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.runner.after_backward()
        return (None, None, *[t.grad if t.requires_grad else None for t in inputs])


class _BlockRunner:
    """Loads and runs one block for :class:`_StreamedBlock`, rebuilding its arguments around the tensors."""

    def __init__(self, load: Callable[[bool], nn.Module], leaves, spec, on_backward) -> None:
        self.load, self.leaves, self.spec, self.on_backward = load, leaves, spec, on_backward
        self.block = None
        self.out_spec = self.out_leaves = None

    def run(self, tensors, grad: bool) -> list[torch.Tensor]:
        it = iter(tensors)
        leaves = [next(it) if torch.is_tensor(x) else x for x in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        self.block = self.load(grad)
        out_leaves, self.out_spec = tree_flatten(self.block(*args, **kwargs))
        self.out_leaves = out_leaves
        return [x for x in out_leaves if torch.is_tensor(x)]

    def rebuild(self, outs):
        it = iter(outs)
        return tree_unflatten([next(it) if torch.is_tensor(x) else x for x in self.out_leaves], self.out_spec)

    def after_backward(self) -> None:
        self.on_backward(self.block)
        self.block = None


@torch.no_grad()
def _sample(block: nn.Module, path: str, candidates: Mapping[str, Mapping[int, QuantizedWeight]], sums: dict) -> None:
    for name, mod in block_linears(path, block):
        g = mod.weight.grad
        if g is None or name not in candidates:
            continue
        w = mod.weight.detach()
        for bits, qw in candidates[name].items():
            s = float((g * (w - quant.dequantize(qw.to(w.device)).to(w.dtype))).sum())
            sums.setdefault(name, {}).setdefault(bits, []).append(s)


def measure_effects(source, kwargs: dict, row_mask: torch.Tensor | None,
                    candidates_of: Callable[[int], Mapping[str, Mapping[int, QuantizedWeight]]], device="cpu",
                    probes: int = DEFAULT_PROBES, seed: int = 0,
                    progress: Callable[[str], None] = lambda s: None) -> tuple[dict[str, dict[int, float]], dict]:
    """``{layer: {bits: effect}}`` for every candidate ``candidates_of(block index)`` returns, and a record of the
    measurement (probes, samples' output power, seconds). Effects are relative to the output's power, so they are
    in the units of the model-output rel-MSE."""
    started = time.perf_counter()
    sums: dict[str, dict[int, list[float]]] = {}
    anchor = torch.zeros((), device=device, requires_grad=True)

    def run_block(index: int, path: str, args, kw):
        leaves, spec = tree_flatten((args, kw))
        wanted = None

        def load(grad: bool) -> nn.Module:
            block = source.load_block(path, device, torch.float32)
            block.requires_grad_(False)
            if grad:
                for _, mod in block_linears(path, block):
                    mod.weight.requires_grad_(True)
            return block

        def on_backward(block):
            nonlocal wanted
            wanted = candidates_of(index) if wanted is None else wanted
            _sample(block, path, wanted, sums)

        runner = _BlockRunner(load, leaves, spec, on_backward)
        outs = _StreamedBlock.apply(runner, anchor, *[x for x in leaves if torch.is_tensor(x)])
        return runner.rebuild(outs)

    shell = source.shell(run_block, device)
    power = 0.0
    for k in range(probes):
        progress(f"measuring each layer's effect on the model output: probe {k + 1}/{probes}")
        with torch.enable_grad():
            y = main_output(shell(**kwargs)).float()
            mask = output_mask(y, row_mask)
            if k == 0:
                power = float((y.detach() * mask).square().sum())
            v = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + k)).to(y.device) * mask
            (v * y).sum().backward()
    power = max(power, 1e-30)
    effects = {name: {bits: sum(s * s for s in samples) / len(samples) / power for bits, samples in rungs.items()}
               for name, rungs in sums.items()}
    return effects, {"probes": probes, "output_power": power, "seconds": round(time.perf_counter() - started, 3)}


@torch.no_grad()
def plan_output_error(source, kwargs: dict, row_mask: torch.Tensor | None,
                      weights_of: Callable[[int], Mapping[str, QuantizedWeight]], device="cpu") -> float:
    """The model-output rel-MSE ``‖ŷ − y‖² / ‖y‖²`` on ``kwargs`` with every block's linears at the weights
    ``weights_of(block index)`` gives (the plan), against the source model: measured, not predicted."""
    plan = False

    def run_block(index: int, path: str, args, kw):
        block = source.load_block(path, device, torch.float32)
        if plan:
            weights = weights_of(index)
            for name, mod in block_linears(path, block):
                if name in weights:
                    mod.weight.copy_(quant.dequantize(weights[name].to(device)).to(mod.weight.dtype))
        return block(*args, **kw)

    shell = source.shell(run_block, device)
    y = main_output(shell(**kwargs)).float()
    plan = True
    got = main_output(shell(**kwargs)).float()
    mask = output_mask(y, row_mask)
    return float(((got - y) * mask).square().sum()) / max(float((y * mask).square().sum()), 1e-30)
