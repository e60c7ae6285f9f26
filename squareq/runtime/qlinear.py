"""QuantLinear: a frozen linear layer whose weight lives, quantized, in a block slot of the runtime.

Its autograd Function dequantizes the weight into a shared bf16 scratch buffer and calls the vendor
matmul, in the forward and again in the backward. For few rows of input (modulation layers run with M = batch size)
it calls a fused kernel that reads the packed codes directly instead (kernels/crossover.py). Under FP8 compute
(``LoadOptions(compute="fp8")``) the forward, and so the checkpointed recompute, dequantizes into a shared E4M3
scratch with one scale per output channel and runs ``torch._scaled_mm`` on the input quantized per token
(kernels/fp8.py), for calls of at least ``FP8_MIN_ROWS`` rows (fewer, as the modulation's, stay bf16); the input
gradient stays in bf16 unless ``compute.FP8_BACKWARD`` (then it is an FP8 product too).

It returns only the input gradient: the base weight is frozen, so no weight gradient is ever computed or stored, and
nothing of the weight is saved for the backward (the backward dequantizes again from the slot, which then holds the
same bytes).

Optional LoRA factors (``lora_A``, ``lora_B``) sit on the layer itself, so their state-dict names are the
ones diffusers/PEFT LoRA files use (``<layer>.lora_A.weight``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import fp8 as fp8_kernels
from ..kernels import prepare_dequantize
from ..kernels.crossover import fused_limit
from ..kernels.fp8 import FP8, RowMax, fp8_input_grad, fp8_linear, fp8_shape_ok, prepare_weight_fp8
from ..quant import QuantizedWeight
from . import compute, linear_op


class DequantScratch:
    """One reusable bf16 buffer per device, large enough for the biggest layer that dequantizes into it, and with
    (after :meth:`add_fp8`) an E4M3 buffer and a row-scale buffer for FP8 compute, or (``dtype`` fp16, for GPUs
    without bf16) an fp16 buffer the bf16 weight is converted into for the matmul.

    Every QuantLinear of a model shares it. Uses are ordered on one compute stream (dequantize, then the
    matmul that reads it, then the next layer's dequantize), so sharing is safe and memory stays flat.
    """

    def __init__(self, numel: int, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                 converted_numel: int = 0) -> None:
        self.buffer = torch.empty(max(numel, 1), dtype=torch.bfloat16, device=device)
        self.dtype = dtype  # what the matmuls read and return: the run's activation dtype
        # The slab's weights are bf16 values and the kernels write bf16; an fp16 run converts each (exactly, in the
        # range weights have) into this buffer, sized for the largest layer, stored bf16 ones included.
        self.converted = None if dtype == torch.bfloat16 else \
            torch.empty(max(numel, converted_numel, 1), dtype=dtype, device=device)
        self.fp8 = False

    def add_fp8(self, numel: int, rows: int) -> None:
        """Room for FP8 compute: ``numel`` E4M3 weights and ``rows`` row scales (the largest layer's)."""
        self.fp8 = True
        self.fp8_buffer = torch.empty(max(numel, 1), dtype=FP8, device=self.buffer.device)
        self.row_scales = torch.empty(max(rows, 1), dtype=torch.float32, device=self.buffer.device)

    def view(self, shape: tuple[int, int]) -> torch.Tensor:
        n, k = shape
        return self.buffer[: n * k].view(n, k)

    def prepare(self, qw: QuantizedWeight):
        """A zero-argument callable returning ``qw``'s weight in :attr:`dtype` (dequantized into the scratch), prepared
        once so that the thousands of calls a training step makes cost little host time."""
        if qw.spec.is_passthrough:  # used in place; a slab of bf16 layers only has a one-element scratch
            weight = qw.tensors["weight"]
            to_bf16 = lambda: weight  # noqa: E731
        else:
            to_bf16 = prepare_dequantize(self.view(qw.shape), qw)
        if self.converted is None:
            return to_bf16
        n, k = qw.shape
        out = self.converted[: n * k].view(n, k)
        return lambda: out.copy_(to_bf16())

    def prepare_fp8(self, qw: QuantizedWeight, row_max: RowMax | None = None, transposed: bool = False):
        """A zero-argument callable returning ``qw``'s weight as (E4M3 rows, fp32 row scales) in the scratch, or
        None where the forward stays in bf16: bf16 compute, or a shape ``torch._scaled_mm`` does not take.
        ``row_max``: the layer's kept row maxima (kernels/fp8.py). ``transposed``: the rows written in the
        transposed layout the FP8 input gradient reads (``int`` layers only; None for the others, whose gradient
        copies the row-major codes)."""
        n, k = qw.shape
        if not self.fp8 or not fp8_shape_ok(n, k) or (transposed and (qw.spec.is_passthrough
                                                                      or qw.spec.format != "int")):
            return None
        codes = self.fp8_buffer[: n * k].view(k, n).t() if transposed else self.fp8_buffer[: n * k].view(n, k)
        bf16 = None if qw.spec.is_passthrough else self.view(qw.shape)
        return prepare_weight_fp8(codes, self.row_scales[:n], qw, bf16, row_max)


class _DequantLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantized on the fly; backward returns dL/dx only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
        ctx.layer = layer
        return layer.base_product(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None
        return ctx.layer.base_input_grad(grad_out), None


class QuantLinear(nn.Module):
    """A frozen linear layer computed from a quantized weight held in a runtime block slot.

    ``quantized`` and ``bias`` are views into the slot that holds this layer's block; the runtime rebinds
    them each time it brings the block into a slot. ``scratch`` is the model's shared dequant buffer.
    """

    def __init__(self, in_features: int, out_features: int, scratch: DequantScratch) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scratch = scratch
        self.quantized: QuantizedWeight | None = None
        self.dequant = self._unbound  # the runtime binds a prepared dequantizer with each qweight
        self.dequant_fp8 = None  # and, under FP8 compute, one into the E4M3 scratch
        self.dequant_fp8_grad = None  # and with compute.FP8_BACKWARD, one in the input gradient's layout
        self.row_max: RowMax | None = None  # FP8 compute: the weight's row maxima, found once
        self.register_parameter("bias", None)  # bound to a slot view when the layer has a bias
        self.lora_A: nn.Linear | None = None
        self.lora_B: nn.Linear | None = None
        self.lora_scale = 0.0
        self.fused_limit: int | None = None  # most input rows that go to the fused kernel; decided on first use
        # PEFT's DoRA reads ``weight`` for its values: set for the layers it wraps (runtime/peft_lora.py)
        self.exact_weight = False
        # names the layer to the custom operator a compiled block calls (runtime/linear_op.py); given by
        # runtime/block_compile.py to the layers of the blocks it compiles
        self.handle: torch.Tensor | None = None

    def __getstate__(self):
        # a copy (deepcopy, pickle) gets no handle: the handle names this layer, and would have a copy's compiled
        # graph run this layer's weights; runtime/block_compile.py gives a copy its own when it compiles
        state = dict(super().__getstate__())
        state["handle"] = None
        return state

    @staticmethod
    def _unbound() -> torch.Tensor:
        raise RuntimeError("this QuantLinear has no weight bound; its block must be brought in by the SquareQ "
                           "runtime (use squareq.runtime.load) before it runs.")

    def bind(self, quantized: QuantizedWeight, dequant=None, dequant_fp8=None, dequant_fp8_grad=None) -> None:
        """Point the layer at stored tensors (views into a slot) and the callables that dequantize them (to bf16,
        to E4M3 rows under FP8 compute, and to the transposed E4M3 rows of the FP8 input gradient; prepared here
        when ``dequant`` is not given: the runtime prepares them once per block and slot)."""
        self.quantized = quantized
        if dequant is None:
            dequant, dequant_fp8, dequant_fp8_grad = self.prepared(quantized)
        self.dequant, self.dequant_fp8, self.dequant_fp8_grad = dequant, dequant_fp8, dequant_fp8_grad

    def prepared(self, quantized: QuantizedWeight) -> tuple:
        """The callables :meth:`bind` takes for ``quantized``: bf16, E4M3 rows (None under bf16 compute), and the
        input gradient's transposed E4M3 rows (None unless ``compute.FP8_BACKWARD``)."""
        fp8 = self.prepare_fp8(quantized)
        grad = self.prepare_fp8(quantized, transposed=True) if compute.FP8_BACKWARD and fp8 is not None else None
        return self.scratch.prepare(quantized), fp8, grad

    def prepare_fp8(self, quantized: QuantizedWeight, transposed: bool = False):
        """The scratch's E4M3 converter for ``quantized`` (see :meth:`DequantScratch.prepare_fp8`), sharing this
        layer's row maxima between the slots its block visits."""
        if self.row_max is None and self.scratch.fp8:
            device = self.scratch.buffer.device
            self.row_max = RowMax(torch.empty(self.out_features, dtype=torch.float32, device=device))
        return self.scratch.prepare_fp8(quantized, self.row_max, transposed)

    def unbind(self) -> None:
        self.quantized = None
        self.dequant = self._unbound
        self.dequant_fp8 = self.dequant_fp8_grad = None

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in with the effective weight's shape, dtype (bf16) and device, for model code that inspects
        ``layer.weight.dtype`` (transformers' T5 does). Its values are not the weight: that is dequantized on use;
        :meth:`dequantized_weight` returns it. With ``exact_weight`` set and a block bound, it is the weight itself
        (a fresh copy, which autograd may keep: the shared scratch is overwritten by the next layer)."""
        if self.exact_weight and self.quantized is not None:
            return self.dequantized_weight()
        buffer = self.scratch.buffer if self.scratch.converted is None else self.scratch.converted
        return buffer[:1].view(()).expand(self.out_features, self.in_features)

    def dequantized_weight(self) -> torch.Tensor:
        """A fresh copy of the effective bf16 weight of the block now bound."""
        return self.dequant().clone()

    def extra_repr(self) -> str:
        spec = self.quantized.spec.label() if self.quantized is not None else "unbound"
        lora = f", lora_rank={self.lora_A.out_features}" if self.lora_A is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {spec}{lora}"

    def add_lora(self, rank: int, alpha: float, generator: torch.Generator | None = None,
                 device: torch.device | str | None = None) -> None:
        """Attach fp32 LoRA factors: A kaiming-uniform, B zero (so the layer's output is unchanged at first)."""
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.lora_A.weight.copy_(lora_a_init(rank, self.in_features, generator))
            self.lora_B.weight.zero_()
        self.lora_scale = alpha / rank

    def base_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` of the frozen base, from the block now bound (no autograd: :class:`_DequantLinear` and the
        custom operator of runtime/linear_op.py give it its input gradient)."""
        qw = self.quantized
        if self.uses_fused(x):
            from ..kernels.triton_fused import fused_linear

            return fused_linear(x.to(torch.bfloat16), qw, self.bias)
        if self.uses_fp8(x):
            return fp8_linear(x.to(torch.bfloat16), self.dequant_fp8(), self.bias)
        w, bias = self.dequant(), self.bias
        if not torch.is_autocast_enabled(x.device.type):
            # without autocast the layer computes in its weight's dtype, as nn.Linear would; the stored bias is bf16
            x = x.to(w.dtype)
            bias = None if bias is None else bias.to(w.dtype)
        return F.linear(x, w, bias)

    def base_input_grad(self, grad_out: torch.Tensor) -> torch.Tensor:
        """``grad_out · W``: the base product's input gradient, from the block now bound (the same block again in a
        training step: its backward runs after its recompute brought it back into a slot)."""
        if self.uses_fused(grad_out):
            from ..kernels.triton_fused import fused_input_grad

            return fused_input_grad(grad_out.to(torch.bfloat16), self.quantized)
        if self.uses_fp8(grad_out) and compute.FP8_BACKWARD:
            weight = (self.dequant_fp8_grad or self.dequant_fp8)()
            return fp8_input_grad(grad_out.to(torch.bfloat16), weight)
        w = self.dequant()
        return grad_out.to(w.dtype).matmul(w)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self.handle is not None and torch.compiler.is_compiling():
            # traced into the block's graph as one opaque operator; it runs the eager code below it
            return linear_op.streamed_linear(x.to(self.scratch.dtype), self.handle, self.out_features)
        return _DequantLinear.apply(x, self)

    def uses_fused(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s rows are few enough for the fused kernel (kernels/crossover.py; the limit is settled on
        the layer's first call). A product and its input gradient have the same rows, so they agree."""
        qw = self.quantized
        if qw is None:
            return False
        if self.fused_limit is None:  # the fused kernels compute and return bf16: never in an fp16 run
            self.fused_limit = fused_limit(qw, x.device) if self.scratch.dtype == torch.bfloat16 else 0
        return x.numel() // max(1, x.shape[-1]) <= self.fused_limit

    def uses_fp8(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` runs in FP8: under FP8 compute, for a weight ``torch._scaled_mm`` takes, with at
        least ``FP8_MIN_ROWS`` rows (kernels/fp8.py says why)."""
        return self.dequant_fp8 is not None and x.numel() // max(1, x.shape[-1]) >= fp8_kernels.FP8_MIN_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_A is None:
            return self._base(x)
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # one cast of the input serves the base matmul and the LoRA path (autocast would cast it twice)
            x = x.to(torch.get_autocast_dtype(device_type))
        y = self._base(x)
        return torch.add(y, lora_delta(x, self.lora_A.weight, self.lora_B.weight).to(y.dtype), alpha=self.lora_scale)


def lora_a_init(rank: int, in_features: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A new LoRA ``A [rank, in]`` in fp32: kaiming_uniform(a=sqrt(5)), as nn.Linear and PEFT initialise it."""
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty((rank, in_features), dtype=torch.float32).uniform_(-bound, bound, generator=generator)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x Aᵀ Bᵀ in the activation dtype from fp32 master factors (autocast casts them, once per region)."""
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(F.linear(x, a), b)
    return F.linear(F.linear(x, a.to(x.dtype)), b.to(x.dtype))
