"""Triton kernel: one block of GPTQ's column sweep in a single launch.

The torch reference (:func:`squareq.quant.gptq.sweep_block`) walks a block's 128 columns one at a time, about a dozen
small kernel launches per column: a 12B FLUX compile spent most of its search in those launches (0.8 s per W4 rung
of a 3072-input layer on an H100, of which the GPU was busy for a tenth). Rows of the weight are independent in the
sweep, so here each program holds a tile of rows × the whole block in registers and walks the columns itself.

It computes what the reference computes, in the same float32 operations and order: group scale and zero point from
the updated columns at each group's first column (stored scale rounded up in its dtype, an all-zero group gets 1),
codes rounded half to even and clamped, the column's error divided by ``U[j, j]``, and the rank-one update of the
block's later columns. Division is IEEE (``div_rn``), multiply-then-subtract is never fused into an FMA
(``enable_fp_fusion=False``), so results match the reference bit for bit (tests/kernels/test_gptq_sweep.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantSpec
from ..quant.spec import SpecError

BLOCK_R = 16
_SCALE_KINDS = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@triton.jit
def _round_half_even(v):
    # Adding and removing 1.5·2^23 rounds half to even for |v| < 2^22; larger values are clamped to the code range
    # afterwards whatever their rounding, so they pass through.
    r = (v + 12582912.0) - 12582912.0
    return tl.where(tl.abs(v) < 4194304.0, r, v)


@triton.jit
def _stored_scale(raw, SCALE_KIND: tl.constexpr):
    """``raw`` in the scale's storage dtype, rounded up (never down) and 1 where it is 0."""
    if SCALE_KIND == 2:
        stored = raw
    else:
        dtype = tl.float16 if SCALE_KIND == 0 else tl.bfloat16
        stored = raw.to(dtype)
        up = (stored.to(tl.int16, bitcast=True) + 1).to(dtype, bitcast=True)
        stored = tl.where(stored.to(tl.float32) < raw, up, stored)
    return tl.where(stored == 0, 1.0, stored.to(tl.float32)).to(stored.dtype)


@triton.jit
def _sweep_kernel(w_ptr, w_stride, u_ptr, u_stride, codes_ptr, codes_stride, scales_ptr, scales_stride,
                  zeros_ptr, zeros_stride, err_ptr, err_stride, n_rows, width, clip, qmin, qmax, levels,
                  G: tl.constexpr, BW: tl.constexpr, BLOCK_R: tl.constexpr, SYMMETRIC: tl.constexpr,
                  SCALE_KIND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BW)
    rmask = rows < n_rows
    cmask = cols < width
    tile = rmask[:, None] & cmask[None, :]
    blk = tl.load(w_ptr + rows[:, None].to(tl.int64) * w_stride + cols[None, :], mask=tile, other=0.0)
    codes = tl.zeros([BLOCK_R, BW], dtype=tl.int32)
    err = tl.zeros([BLOCK_R, BW], dtype=tl.float32)
    s = tl.zeros([BLOCK_R], dtype=tl.float32)
    z = tl.zeros([BLOCK_R], dtype=tl.float32)
    for j in range(0, width):
        if j % G == 0:
            group = ((cols >= j) & (cols < j + G) & cmask)[None, :]
            if SYMMETRIC:
                amax = tl.max(tl.where(group, tl.abs(blk), 0.0), axis=1) * clip
                stored = _stored_scale(tl.div_rn(amax, qmax), SCALE_KIND)
                s = stored.to(tl.float32)
            else:
                lo = tl.minimum(tl.min(tl.where(group, blk, float("inf")), axis=1), 0.0) * clip
                hi = tl.maximum(tl.max(tl.where(group, blk, float("-inf")), axis=1), 0.0) * clip
                stored = _stored_scale(tl.div_rn(hi - lo, levels), SCALE_KIND)
                s = stored.to(tl.float32)
                z = tl.minimum(tl.maximum(_round_half_even(qmin - tl.div_rn(lo, s)), qmin), qmax)
                tl.store(zeros_ptr + rows.to(tl.int64) * zeros_stride + j // G, z, mask=rmask)
            tl.store(scales_ptr + rows.to(tl.int64) * scales_stride + j // G, stored, mask=rmask)
        here = (cols == j)[None, :]
        x = tl.sum(tl.where(here, blk, 0.0), axis=1)
        if SYMMETRIC:
            q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x, s)), -qmax), qmax)
            deq = q * s
        else:
            q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x, s) + z), qmin), qmax)
            deq = (q - z) * s
        e = tl.div_rn(x - deq, tl.load(u_ptr + j * u_stride + j))
        codes = tl.where(here, q.to(tl.int32)[:, None], codes)
        err = tl.where(here, e[:, None], err)
        later = cmask & (cols > j)
        u_row = tl.load(u_ptr + j * u_stride + cols, mask=later, other=0.0)
        blk = tl.where(later[None, :], blk - e[:, None] * u_row[None, :], blk)
    out = rows[:, None].to(tl.int64)
    tl.store(codes_ptr + out * codes_stride + cols[None, :], codes, mask=tile)
    tl.store(err_ptr + out * err_stride + cols[None, :], err, mask=tile)


def triton_sweep_block(blk: torch.Tensor, u_blk: torch.Tensor, spec: QuantSpec):
    """:func:`squareq.quant.gptq.sweep_block` in one launch (same arguments and results; ``blk`` is not changed)."""
    n, width = blk.shape
    if blk.dtype != torch.float32 or u_blk.dtype != torch.float32:
        raise ValueError("the GPTQ sweep kernel takes float32 blocks.")
    blk = blk if blk.stride(1) == 1 else blk.contiguous()
    u_blk = u_blk.contiguous()  # a Cholesky factor may come column-major; the block of it is small
    g = spec.group_size
    groups = -(-width // g)
    dev = blk.device
    codes = torch.empty((n, width), dtype=torch.int32, device=dev)
    err = torch.empty((n, width), dtype=torch.float32, device=dev)
    scales = torch.empty((n, groups), dtype=spec.torch_scale_dtype, device=dev)
    zeros = None if spec.symmetric else torch.empty((n, groups), dtype=torch.float32, device=dev)
    z_arg = zeros if zeros is not None else err  # never written when symmetric
    _sweep_kernel[(triton.cdiv(n, BLOCK_R),)](
        blk, blk.stride(0), u_blk, u_blk.stride(0), codes, codes.stride(0), scales, scales.stride(0),
        z_arg, z_arg.stride(0), err, err.stride(0), n, width, float(spec.clip_ratio), float(spec.qmin),
        float(spec.qmax), float(2**spec.bits - 1), G=g, BW=max(16, triton.next_power_of_2(width)), BLOCK_R=BLOCK_R,
        SYMMETRIC=spec.symmetric, SCALE_KIND=_SCALE_KINDS[spec.torch_scale_dtype], enable_fp_fusion=False)
    if not torch.isfinite(scales).all():
        raise SpecError(f"weight magnitudes overflow scale_dtype={spec.scale_dtype}; use scale_dtype='bfloat16' or "
                        "'float32'.")
    return codes, scales, zeros, err
