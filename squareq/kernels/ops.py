"""SquareQ's quantized linear as ``torch.library`` custom operators, so ``torch.compile`` can trace a whole block
through it (issue 41): the layer's stored tensors are the operator's inputs (the block slot's views, rebound each
time the runtime brings a block in), its spec and shape plain arguments, and a fake implementation gives the output's
shape without running anything.

* ``squareq::quant_linear(x, tensors, spec, shape, bias)``: ``y = x·Wᵀ + b``, ``W`` dequantized to bf16;
* ``squareq::quant_linear_input_grad(grad, tensors, spec, shape)``: ``grad·W``, its backward.

The autograd formula returns the input gradient only, as the eager layer's ``torch.autograd.Function`` does
(runtime/qlinear.py): the base weight is frozen and so is its bias. Saved for the backward are the stored tensors
themselves, views into a slot: in a training step the block's backward runs after its checkpointed recompute has
brought the block into a slot again, so they hold the same bytes then (runtime/streamer.py).

``spec`` is :meth:`QuantSpec.to_dict` as JSON (an operator takes strings, not objects); the tensors come in the order
of :func:`squareq.quant.tensor_layout`.
"""
from __future__ import annotations

import functools
import json

import torch
import torch.nn.functional as F

from ..quant import QuantizedWeight, QuantSpec, tensor_layout
from .backend import dequantize


@functools.lru_cache(maxsize=256)
def _spec(spec: str) -> QuantSpec:
    return QuantSpec.from_dict(json.loads(spec))


def spec_argument(spec: QuantSpec) -> str:
    """``spec`` as the operators take it."""
    return json.dumps(spec.to_dict(), sort_keys=True)


def operands(qw: QuantizedWeight) -> tuple[list[torch.Tensor], str, list[int]]:
    """``(tensors, spec, shape)``: ``qw`` as the operators take it."""
    roles = tensor_layout(qw.spec, qw.shape)
    return [qw.tensors[role] for role in roles], spec_argument(qw.spec), list(qw.shape)


def _weight(tensors: list[torch.Tensor], spec: str, shape: list[int], device) -> torch.Tensor:
    s, (n, k) = _spec(spec), shape
    qw = QuantizedWeight(s, (n, k), dict(zip(tensor_layout(s, (n, k)), tensors, strict=True)))
    return dequantize(qw, device)


@torch.library.custom_op("squareq::quant_linear", mutates_args=())
def quant_linear(x: torch.Tensor, tensors: list[torch.Tensor], spec: str, shape: list[int],
                 bias: torch.Tensor | None) -> torch.Tensor:
    """``x·Wᵀ + b`` in bf16, ``W`` the stored weight dequantized."""
    return F.linear(x.to(torch.bfloat16), _weight(tensors, spec, shape, x.device), bias)


@quant_linear.register_fake
def _(x, tensors, spec, shape, bias):
    return x.new_empty((*x.shape[:-1], shape[0]), dtype=torch.bfloat16)


@torch.library.custom_op("squareq::quant_linear_input_grad", mutates_args=())
def quant_linear_input_grad(grad: torch.Tensor, tensors: list[torch.Tensor], spec: str,
                            shape: list[int]) -> torch.Tensor:
    """``grad·W`` in bf16: the input gradient of :func:`quant_linear`."""
    return grad.to(torch.bfloat16).matmul(_weight(tensors, spec, shape, grad.device))


@quant_linear_input_grad.register_fake
def _(grad, tensors, spec, shape):
    return grad.new_empty((*grad.shape[:-1], shape[1]), dtype=torch.bfloat16)


def _setup_context(ctx, inputs, output) -> None:
    x, tensors, spec, shape, _ = inputs
    ctx.save_for_backward(*tensors)
    ctx.spec, ctx.shape, ctx.x_dtype = spec, shape, x.dtype


def _backward(ctx, grad):
    tensors = list(ctx.saved_tensors)
    grad_x = quant_linear_input_grad(grad, tensors, ctx.spec, ctx.shape).to(ctx.x_dtype)
    return grad_x, [None] * len(tensors), None, None, None


quant_linear.register_autograd(_backward, setup_context=_setup_context)
