"""Triton kernel: packed W4/W6/W8 codes + group scales (+ zero points, + folded 1/s) -> bf16.

It computes exactly what :func:`squareq.quant.dequantize` defines,
``bf16(float32(q - z) * float32(scale) [* inv_smooth])``, so results match the torch reference
bit for bit. Importing this module imports triton; :mod:`.dequant` decides whether to.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import QuantizedWeight


@triton.jit
def _load_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes,
                BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Signed int32 codes for columns [k0, k0 + BLOCK_K) of ``rows``; out-of-row bytes read as 0."""
    base = q_ptr + rows[:, None].to(tl.int64) * q_row_stride
    if BITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        q = tl.load(base + cols[None, :], mask=m, other=0).to(tl.int32)
    elif BITS == 4:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        b = tl.load(base + cols[None, :], mask=m, other=0).to(tl.int32)
        q = tl.reshape(tl.join((b & 0xF) - 8, (b >> 4) - 8), (BLOCK_N, BLOCK_K))
    else:  # 6-bit: 4 codes in 3 bytes, little-endian 24-bit word
        cols = (k0 // 4) * 3 + 3 * tl.arange(0, BLOCK_K // 4)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        p = base + cols[None, :]
        word = (tl.load(p, mask=m, other=0).to(tl.int32)
                | (tl.load(p + 1, mask=m, other=0).to(tl.int32) << 8)
                | (tl.load(p + 2, mask=m, other=0).to(tl.int32) << 16))
        v0 = (word & 0x3F) - 32
        v1 = ((word >> 6) & 0x3F) - 32
        v2 = ((word >> 12) & 0x3F) - 32
        v3 = ((word >> 18) & 0x3F) - 32
        # join stacks on a new last axis, so the outer join must pair (v0, v1) and (v2, v3).
        q = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_N, BLOCK_K))
    return q


@triton.jit
def _bf16_bits_rne(x):
    """Round fp32 to bf16 (nearest, ties to even) and return the bits as int16.

    Done in integer arithmetic because the Triton interpreter truncates in ``.to(tl.bfloat16)``;
    this keeps CPU-interpreted and CUDA results identical to torch's rounding.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, inv_ptr, out_ptr,
                    N, K, row_bytes, n_groups, q_row_stride, s_row_stride, out_row_stride,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k0 = pid_k * BLOCK_K
    q = _load_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes, BITS, BLOCK_N, BLOCK_K)

    # BLOCK_K is a multiple of GROUP, so a tile holds whole groups: view it as [N, groups, GROUP].
    NG: tl.constexpr = BLOCK_K // GROUP
    g = pid_k * NG + tl.arange(0, NG)
    gm = row_mask[:, None] & (g[None, :] < n_groups)
    g_off = rows[:, None].to(tl.int64) * s_row_stride + g[None, :]
    s = tl.load(s_ptr + g_off, mask=gm, other=1.0).to(tl.float32)
    q3 = tl.reshape(q, (BLOCK_N, NG, GROUP))
    if HAS_ZERO:
        z = tl.load(z_ptr + g_off, mask=gm, other=0).to(tl.int32)
        q3 = q3 - z[:, :, None]
    w = tl.reshape(q3.to(tl.float32) * s[:, :, None], (BLOCK_N, BLOCK_K))

    cols = k0 + tl.arange(0, BLOCK_K)
    if HAS_SMOOTH:
        inv = tl.load(inv_ptr + cols, mask=cols < K, other=1.0)
        w = w * inv[None, :]
    out_off = rows[:, None].to(tl.int64) * out_row_stride + cols[None, :]
    tl.store(out_ptr + out_off, _bf16_bits_rne(w), mask=row_mask[:, None] & (cols[None, :] < K))


def default_tile(spec_group: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a layer; BLOCK_K is a multiple of the group size."""
    block_k = max(spec_group, 256 if k >= 256 else 64)
    block_n = max(1, 8192 // block_k)
    return block_n, block_k, 4


def triton_dequantize_into(out: torch.Tensor, qw: QuantizedWeight,
                           tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Launch the dequant kernel writing ``qw``'s effective weight into ``out`` (bf16 [N, K], unit column stride)."""
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    block_n, block_k, warps = tile or default_tile(spec.group_size, k)
    if block_k % spec.group_size:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of group_size={spec.group_size}.")
    qweight = t["qweight"].view(torch.int8) if spec.bits == 8 else t["qweight"]
    scales = t["scales"]
    zeros = t.get("zeros", scales)  # any tensor: the pointer is unused when HAS_ZERO is False
    inv = t.get("inv_smooth", scales)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](
        qweight, scales, zeros, inv, out.view(torch.int16),
        n, k, qweight.shape[1], scales.shape[1], qweight.stride(0), scales.stride(0), out.stride(0),
        BITS=spec.bits, GROUP=spec.group_size, HAS_ZERO="zeros" in t, HAS_SMOOTH="inv_smooth" in t,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
    )
    return out
