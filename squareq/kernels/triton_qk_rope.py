"""Triton kernel: RMS-normalize each head of a query or key, then rotate it by its token's rotary embedding, in one
pass over the tensor (what :func:`squareq.kernels.qk_rope.qk_norm_rope` defines).

The diffusers FLUX attention processor runs these as a norm kernel and about eight elementwise kernels per tensor,
with float32 temporaries; here each program reads a few rows of ``head_dim`` values once and writes the rotated
bf16 rows straight into their place in the joint (text + image) sequence. The pairs ``(x[2i], x[2i+1])`` rotate
together, so each row is loaded as its even and its odd columns. Rounding to bf16 is the GPU's conversion, and the
integer rounding of :mod:`.triton_fp8` under the interpreter (whose conversion truncates).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fp8 import _bf16_value, _hardware_conversion
from .triton_launch import DirectLaunch


@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, R, H, S, eps,
                         x_stride_b, x_stride_s, out_stride_b, out_stride_s, cs_stride,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_WEIGHT: tl.constexpr, HW: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # over (batch, token, head)
    row_mask = rows < R
    h = rows % H
    s = (rows // H) % S
    b = rows // (H * S)
    even = 2 * tl.arange(0, D // 2)
    m = row_mask[:, None]
    x_row = x_ptr + b.to(tl.int64)[:, None] * x_stride_b + s.to(tl.int64)[:, None] * x_stride_s + h[:, None] * D
    xe = tl.load(x_row + even[None, :], mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_row + even[None, :] + 1, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(xe * xe, axis=1) + tl.sum(xo * xo, axis=1)) / D + eps)
    ye = xe * rstd[:, None]
    yo = xo * rstd[:, None]
    if HAS_WEIGHT:
        ye = ye * tl.load(w_ptr + even).to(tl.float32)[None, :]
        yo = yo * tl.load(w_ptr + even + 1).to(tl.float32)[None, :]
    # the normalized head is a bf16 tensor in the unfused model before it is rotated: round it the same way
    ye = _bf16_value(ye, HW)
    yo = _bf16_value(yo, HW)
    cs = s.to(tl.int64)[:, None] * cs_stride
    ce = tl.load(cos_ptr + cs + even[None, :], mask=m, other=0.0)
    co = tl.load(cos_ptr + cs + even[None, :] + 1, mask=m, other=0.0)
    se = tl.load(sin_ptr + cs + even[None, :], mask=m, other=0.0)
    so = tl.load(sin_ptr + cs + even[None, :] + 1, mask=m, other=0.0)
    out_row = out_ptr + b.to(tl.int64)[:, None] * out_stride_b + s.to(tl.int64)[:, None] * out_stride_s + h[:, None] * D
    # a value already rounded to bf16 converts exactly, also where the interpreter's conversion truncates
    tl.store(out_row + even[None, :], _bf16_value(ye * ce - yo * se, HW).to(tl.bfloat16), mask=m)
    tl.store(out_row + even[None, :] + 1, _bf16_value(yo * co + ye * so, HW).to(tl.bfloat16), mask=m)


ROWS = 16  # heads per program: 16 x 128 values of a FLUX head is 4 KB read per program
_launchers: dict[tuple, DirectLaunch] = {}  # (head_dim, has_weight) -> its launcher


def qk_norm_rope_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Write the normalized, rotated bf16 heads of ``x [B, S, H, D]`` into ``out`` (same shape); ``cos``/``sin``:
    float32 ``[S, D]``. Heads and head_dim must be contiguous in both (checked by the caller)."""
    b, s, h, d = x.shape
    key = (d, weight is not None)
    launch = _launchers.get(key)
    if launch is None:
        constants = dict(D=d, BLOCK_R=ROWS, HAS_WEIGHT=weight is not None, HW=_hardware_conversion(), num_warps=4)
        launch = _launchers[key] = DirectLaunch(_qk_norm_rope_kernel, constants, outputs=(4,))
    rows = b * s * h
    w = weight if weight is not None else cos  # never read without HAS_WEIGHT
    launch((triton.cdiv(rows, ROWS),), (x, w, cos, sin, out, rows, h, s, float(eps), x.stride(0), x.stride(1),
                                      out.stride(0), out.stride(1), cos.stride(0)))
