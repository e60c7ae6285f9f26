"""Rows to FP8 E4M3 with one fp32 scale per row: the operand layout of FP8 compute (``torch._scaled_mm``).

A row's scale is its largest magnitude / 448; each value is ``x * (448 / amax)`` rounded to the nearest E4M3
value (ties to even), so ``codes * scale`` gives the row back. A row of zeros gets scale 0 and zero codes. The
same definition serves weights (rows = output channels; the compute path first dequantizes them to bf16) and
activations (rows = tokens). The Triton kernels in :mod:`squareq.kernels.triton_fp8` reproduce it bit for bit.
"""
from __future__ import annotations

import torch

from .formats.fp8 import E4M3_MAX


def row_scales(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inverse)``, fp32 ``[rows]``: ``amax / 448`` and ``448 / amax`` (0 for a row of zeros)."""
    amax = x.float().abs().amax(dim=-1)
    nonzero = amax > 0
    # tensor over tensor: torch evaluates a number over a tensor (and, on CUDA, a tensor over a number) through a
    # reciprocal, which rounds differently from the kernels' IEEE division
    limit = torch.full_like(amax, E4M3_MAX)
    inverse = torch.where(nonzero, limit / torch.where(nonzero, amax, 1.0), 0.0)
    return amax / limit, inverse


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of a 2-D ``x``: float8_e4m3fn ``[R, K]`` and fp32 ``[R]``."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes a 2-D tensor; got shape {tuple(x.shape)}.")
    scale, inverse = row_scales(x)
    y = (x.float() * inverse[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn), scale


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 rows ``codes * scales`` stand for."""
    return codes.float() * scales.float()[:, None]
