"""Triton kernel for lookup formats (a :class:`squareq.quant.Format` with a ``table``): 4-bit codes packed two to a
byte or 8-bit codes, each replaced by its table value and multiplied by its group's scale (and by 1/s where the
layer is smoothed), rounded once to bf16: ``bf16(float32(table[u]) * float32(scale) [* inv_smooth])``, the
formats' torch reference bit for bit. Importing this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quant import QuantizedWeight
from ..triton_dequant import _bf16_bits_rne
from . import register

BLOCK_N, BLOCK_K, WARPS = 8, 256, 4


@triton.jit
def _lookup_kernel(q_ptr, table_ptr, s_ptr, inv_ptr, out_ptr, N, K, row_bytes, q_row_stride, s_row_stride,
                   out_row_stride, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k0 = tl.program_id(1) * BLOCK_K
    base = q_ptr + rows[:, None].to(tl.int64) * q_row_stride
    if BITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        u = tl.load(base + cols[None, :], mask=row_mask[:, None] & (cols[None, :] < row_bytes), other=0).to(tl.int32)
    else:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(base + cols[None, :], mask=row_mask[:, None] & (cols[None, :] < row_bytes), other=0).to(tl.int32)
        u = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))  # even column in the low nibble
    ks = k0 + tl.arange(0, BLOCK_K)
    inside = row_mask[:, None] & (ks[None, :] < K)
    s = tl.load(s_ptr + rows[:, None].to(tl.int64) * s_row_stride + (ks // GROUP)[None, :], mask=inside,
                other=1.0).to(tl.float32)
    w = tl.load(table_ptr + u) * s
    if HAS_SMOOTH:
        w = w * tl.load(inv_ptr + ks, mask=ks < K, other=1.0)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_row_stride + ks[None, :], _bf16_bits_rne(w), mask=inside)


def _serves(fmt) -> bool:
    return fmt.table is not None and all(bits in (4, 8) for bits in fmt.bits)


_tables: dict[tuple[str, torch.device], torch.Tensor] = {}  # each format's table on each device, copied there once


def _table(name: str, device: torch.device) -> torch.Tensor:
    from ...quant import FORMATS

    if (name, device) not in _tables:
        _tables[(name, device)] = torch.tensor(FORMATS[name].table, dtype=torch.float32, device=device)
    return _tables[(name, device)]


def prepare_lookup_dequantize(out: torch.Tensor, qw: QuantizedWeight):
    """A zero-argument launcher writing ``qw``'s bf16 weight into ``out`` (the table is copied to the device once)."""
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    table = _table(spec.format, out.device)
    scales = t["scales"]
    inv = t.get("inv_smooth", scales)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))

    def launch() -> torch.Tensor:
        _lookup_kernel[grid](t["qweight"], table, scales, inv, out.view(torch.int16), n, k, t["qweight"].shape[1],
                             t["qweight"].stride(0), scales.stride(0), out.stride(0), BITS=spec.bits,
                             GROUP=spec.group_size, HAS_SMOOTH="inv_smooth" in t, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             num_warps=WARPS)
        return out

    return launch


register(_serves, prepare_lookup_dequantize)
