"""Bit packing of integer codes along the input (K) dimension.

Codes are signed integers in ``[-2^(b-1), 2^(b-1) - 1]``. On disk:

* ``u4x2``: unsigned nibble ``u = q + 8``; byte ``j`` of a row holds column ``2j`` in its low
  nibble and ``2j + 1`` in its high nibble. Rows are padded to an even K.
* ``u6x4``: unsigned ``u = q + 32``; columns ``4j .. 4j+3`` form the 24-bit little-endian word
  ``u0 | u1 << 6 | u2 << 12 | u3 << 18`` stored in bytes ``3j, 3j+1, 3j+2``. Rows padded to 4.
* ``i8``: the signed code itself, one byte per column (stored as raw bytes).

Padding columns hold the code 0.
"""
from __future__ import annotations

import torch

VALUES_PER_UNIT = {4: 2, 6: 4, 8: 1}
BYTES_PER_UNIT = {4: 1, 6: 3, 8: 1}


def packed_row_bytes(bits: int, k: int) -> int:
    """Bytes one packed row of ``k`` codes occupies."""
    per = VALUES_PER_UNIT[bits]
    return -(-k // per) * BYTES_PER_UNIT[bits]


def _pad_columns(q: torch.Tensor, multiple: int) -> torch.Tensor:
    k = q.shape[-1]
    pad = (-k) % multiple
    if pad:
        q = torch.nn.functional.pad(q, (0, pad), value=0)
    return q


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 2-D int tensor of signed codes ``[N, K]`` into ``uint8 [N, packed_row_bytes]``."""
    if q.dim() != 2:
        raise ValueError(f"pack expects a 2-D code tensor, got shape {tuple(q.shape)}.")
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"codes outside [{lo}, {hi}] cannot be packed as {bits}-bit.")
    q = q.to(torch.int32)
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8).contiguous()
    u = q + (1 << (bits - 1))
    if bits == 4:
        u = _pad_columns(u, 2)
        return (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8).contiguous()
    if bits == 6:
        u = _pad_columns(u, 4)
        word = u[:, 0::4] | (u[:, 1::4] << 6) | (u[:, 2::4] << 12) | (u[:, 3::4] << 18)
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
        return out.reshape(q.shape[0], -1).to(torch.uint8).contiguous()
    raise ValueError(f"no packing for bits={bits}.")


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [N, packed_row_bytes]`` -> signed ``int32 [N, k]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError("unpack expects a 2-D uint8 tensor.")
    if packed.shape[1] != packed_row_bytes(bits, k):
        raise ValueError(
            f"packed rows have {packed.shape[1]} bytes but {bits}-bit K={k} needs {packed_row_bytes(bits, k)}."
        )
    n = packed.shape[0]
    if bits == 8:
        return packed.view(torch.int8).to(torch.int32)[:, :k]
    p = packed.to(torch.int32)
    if bits == 4:
        u = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(n, -1)
    elif bits == 6:
        b = p.reshape(n, -1, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        u = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).reshape(n, -1)
    else:
        raise ValueError(f"no packing for bits={bits}.")
    return u[:, :k] - (1 << (bits - 1))
