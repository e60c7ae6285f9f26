"""The quantized layer's frozen base product as a ``torch.library`` custom operator, so that ``torch.compile`` traces
a whole streamed block in one graph (issue 41): the norms, modulation, attention's elementwise work, the LoRA
products and their adds around the base products are then all inductor's to fuse.

* ``squareq::streamed_linear(x, handle, out_features)``: ``x Wᵀ + b`` from the block the layer is bound to now;
* ``squareq::streamed_linear_input_grad(grad, handle, in_features)``: ``grad · W``, its backward.

What the operators take is a *handle*, a one-element CPU tensor naming the layer, not the layer's stored tensors.
Their bodies call the layer's own eager code (``QuantLinear.base_product`` / ``base_input_grad``), so they keep
everything the layer has: its slot views and the dequantizers prepared for them, the fused small-M kernels, FP8
compute with its scratch and kept row maxima. And the graph stays one per block class: a tensor argument is guarded on
its shape and dtype only, so blocks whose layers differ in format (W4 and W6 pack their rows differently) or sit in
other slots share their graphs; the handles' values differ from block to block but are read only when the operator
runs. ``out_features`` and ``in_features`` are the graph's constants, the same for a layer position in every block.

The autograd formula returns the input gradient only, as the eager layer's ``torch.autograd.Function`` does: the base
weight and bias are frozen. Saved for the backward is the handle alone; the layer's block is in a slot again when its
backward runs (the checkpointed recompute brought it back, runtime/blocks.py).
"""
from __future__ import annotations

import itertools
import weakref

import torch

_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)


def register(layer) -> torch.Tensor:
    """A new handle naming ``layer`` (anything with ``base_product`` and ``base_input_grad``) for the operators."""
    key = next(_NEXT)
    _LAYERS[key] = layer
    return torch.tensor(key, dtype=torch.int64)


def _layer(handle: torch.Tensor):
    layer = _LAYERS.get(int(handle))
    if layer is None:
        raise RuntimeError(f"squareq::streamed_linear: no layer is registered under handle {int(handle)}; a "
                           "compiled block must run in the process whose runtime.load built it.")
    return layer


@torch.library.custom_op("squareq::streamed_linear", mutates_args=())
def streamed_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x Wᵀ + b`` in ``x``'s dtype (the run's: bf16, or fp16), from the block the layer named by ``handle`` is bound
    to now."""
    return _layer(handle).base_product(x).to(x.dtype)


@streamed_linear.register_fake
def _(x, handle, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("squareq::streamed_linear_input_grad", mutates_args=())
def streamed_linear_input_grad(grad: torch.Tensor, handle: torch.Tensor, in_features: int) -> torch.Tensor:
    """``grad · W`` in ``grad``'s dtype: the input gradient of :func:`streamed_linear`."""
    return _layer(handle).base_input_grad(grad).to(grad.dtype)


@streamed_linear_input_grad.register_fake
def _(grad, handle, in_features):
    return grad.new_empty((*grad.shape[:-1], in_features))


def _setup_context(ctx, inputs, output) -> None:
    x, handle, _ = inputs
    ctx.save_for_backward(handle)
    ctx.in_features = x.shape[-1]


def _backward(ctx, grad):
    if not ctx.needs_input_grad[0]:
        return None, None, None
    (handle,) = ctx.saved_tensors
    return streamed_linear_input_grad(grad, handle, ctx.in_features), None, None


streamed_linear.register_autograd(_backward, setup_context=_setup_context)
