"""FP8 compute for a frozen linear layer: its weight as E4M3 rows with one scale per output channel, the input
quantized per token, and one ``torch._scaled_mm`` between them (fp32 accumulation, bf16 output).

The operands are made by the Triton kernels of :mod:`.triton_fp8` on the Triton backends and by
:mod:`squareq.quant.fp8_rows` (their exact reference) on the torch backend; :func:`.backend.backend_for` picks, as
it does for dequantization. ``torch._scaled_mm`` needs K and N to be multiples of 16 (:func:`fp8_shape_ok`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import quant
from ..quant import QuantizedWeight
from ..quant.fp8_rows import quantize_rows
from .backend import backend_for, prepare_dequantize

FP8 = torch.float8_e4m3fn
MULTIPLE = 16  # torch._scaled_mm's rule for every matrix dimension
# Fast accumulation keeps partial sums in the tensor cores' own precision instead of promoting them to fp32 every few
# products. On the H100 it made torch._scaled_mm 3-13% faster on FLUX shapes with the same output rel-MSE against
# the bf16 path (1.42e-3 either way, K up to 15,360): benchmarks/fp8_linear.py, docs/benchmarks.md "FP8 compute".
FAST_ACCUM = True
# The input gradient's products keep fp32 accumulation until fast accumulation is measured on gradients (issue 41).
FAST_ACCUM_GRAD = False
# Calls with fewer input rows stay bf16: a few rows' quantization error is not averaged over many tokens, and FLUX's
# modulation (one row per sample, from the timestep embedding) scales and shifts every token of its block with it.
# The 12B LoRA gradient cosine against bf16 at 1024² was 0.9945 on the H100, whose small-M calls go to the fused bf16
# kernels (kernels/crossover.py), and 0.9857 on the H200, where they ran in FP8, with the same code and seeds; the
# H200 was not re-measured with this limit. A tiny FLUX at 512² on the CPU (its 16 text tokens fall under the limit
# too): cosine 0.9991 with it, 0.9986 without (docs/benchmarks.md, issue 41). Such calls are bound by reading the
# weight; bf16 moves 2 bytes a weight where E4M3 moves 1: ~3 ms of a 1024² 12B step by arithmetic, not measured.
FP8_MIN_ROWS = 128
# The bias added in torch._scaled_mm's epilogue costs nothing measurable; a separate add after it made FLUX's linears
# 5-50% slower on the H100 (benchmarks/fp8_linear.py times both).
BIAS_IN_EPILOGUE = True


@dataclass
class RowMax:
    """A layer's row maxima of its bf16 weight (fp32 ``[N]``), found on first use and then kept: the weight is frozen,
    so every later conversion to E4M3 reads the codes once."""

    values: torch.Tensor
    ready: bool = False


def fp8_shape_ok(n: int, k: int) -> bool:
    """Whether an ``[n, k]`` weight can run through ``torch._scaled_mm``."""
    return n % MULTIPLE == 0 and k % MULTIPLE == 0


def prepare_weight_fp8(out: torch.Tensor, scales: torch.Tensor, qw: QuantizedWeight, bf16: torch.Tensor | None,
                       row_max: RowMax | None = None) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A zero-argument callable writing ``qw``'s weight as E4M3 rows into ``out`` (float8_e4m3fn ``[N, K]``; for an
    ``int`` layer also a transposed view, strides ``(1, N)``) and their scales into ``scales`` (fp32 ``[N]``),
    returning both. Formats other than ``int`` dequantize into
    ``bf16`` (a ``[N, K]`` scratch view; None for a bf16 layer, read in place) first; ``int`` layers go straight from
    their codes, with the rows' largest magnitudes kept in ``row_max`` (the layer's own; a new one when None)."""
    if backend_for(out.device) == "torch":
        def reference() -> tuple[torch.Tensor, torch.Tensor]:
            codes, s = quantize_rows(quant.dequantize(qw))
            out.copy_(codes)
            scales.copy_(s)
            return out, scales

        return reference
    from .triton_fp8 import prepare_int_fp8, prepare_rows_fp8

    if qw.spec.is_passthrough:
        dequant = None
        launch = prepare_rows_fp8(out, scales, qw.tensors["weight"])
    elif qw.spec.format == "int":
        dequant = None
        launch = prepare_int_fp8(out, scales, qw, row_max or RowMax(torch.empty_like(scales)))
    else:
        dequant = prepare_dequantize(bf16, qw)
        launch = prepare_rows_fp8(out, scales, bf16)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        if dequant is not None:
            dequant()
        launch()
        return out, scales

    return run


def quantize_activations(x: torch.Tensor, col_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of 2-D bf16 ``x`` quantized per row (per token): float8_e4m3fn and fp32 ``[M]``.
    ``col_scales`` (fp32 ``[K]``): quantize ``x·diag(col_scales)`` instead, the product taken in fp32 in the same
    pass."""
    if backend_for(x.device) == "torch":
        return quantize_rows(x if col_scales is None else x.float() * col_scales.float()[None, :])
    from .triton_fp8 import rows_fp8_into

    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    rows_fp8_into(codes, scales, x, None if col_scales is None else col_scales.float().contiguous())
    return codes, scales


def fp8_linear(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` in bf16 from bf16 ``x [..., K]`` and ``weight`` = (E4M3 ``[N, K]``, fp32 scales ``[N]``)."""
    codes, w_scales = weight
    lead = x.shape[:-1]
    xq, x_scales = quantize_activations(x.reshape(-1, x.shape[-1]))
    epilogue = bias.to(torch.bfloat16) if BIAS_IN_EPILOGUE and bias is not None else None
    y = torch._scaled_mm(xq, codes.t(), scale_a=x_scales[:, None], scale_b=w_scales[None, :], bias=epilogue,
                         out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)
    if bias is not None and epilogue is None:
        y.add_(bias)
    return y.view(*lead, codes.shape[0])


def fp8_input_grad(grad: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``grad·W`` in bf16 from bf16 ``grad [..., N]`` and ``weight`` = (E4M3 ``[N, K]``, fp32 scales ``[N]``): the
    input gradient of :func:`fp8_linear` as one ``torch._scaled_mm``. The weight's scales run along the product's
    contracted dimension here, so they cannot scale its output; they are folded into the gradient
    (``grad·diag(s)·W_codes``) in the pass that quantizes it per row (per token), as the forward's input is.
    ``_scaled_mm`` reads its second operand column-major: codes in the transposed layout (strides ``(1, N)``, as
    :func:`prepare_weight_fp8` writes an ``int`` layer's into a transposed view) are read as they are, row-major
    ones are copied transposed (N·K bytes)."""
    codes, w_scales = weight
    n, k = codes.shape
    lead = grad.shape[:-1]
    gq, g_scales = quantize_activations(grad.reshape(-1, n), col_scales=w_scales)
    ones = torch.ones((1, k), dtype=torch.float32, device=codes.device)
    column_major = codes if codes.stride(0) == 1 else codes.t().contiguous().t()
    out = torch._scaled_mm(gq, column_major, scale_a=g_scales[:, None], scale_b=ones,
                           out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM_GRAD)
    return out.view(*lead, k)
