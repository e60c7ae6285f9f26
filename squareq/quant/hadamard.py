"""The grouped, normalized Walsh–Hadamard transform: ``x ↦ x·H_g`` within each group of ``g`` consecutive entries of
the last dimension, where ``H_g`` is the Sylvester Hadamard matrix of order ``g`` (``H_1 = [1]``,
``H_2m = [[H_m, H_m], [H_m, -H_m]]``) divided by ``sqrt(g)``. ``H_g`` is symmetric and orthonormal, so the
transform is its own inverse.

A rotated layer (``QuantSpec.rotate``) stores ``W·H`` and dequantization multiplies by ``H`` again; quantization,
dequantization, the search's statistics and GPTQ's Hessian all go through :func:`hadamard`, and the Triton kernels
repeat its arithmetic bit for bit in float32, so its order of operations is part of the format:

* ``log2(g)`` butterfly stages, each pairing the entries ``2i`` and ``2i + 1`` of a group and writing their sum to
  entry ``i`` and their difference (even minus odd) to entry ``i + g/2`` (the constant-geometry order: every stage
  is the same gather, which a kernel expresses as one split, one join and one transpose of the tile);
* then one multiplication by ``1/sqrt(g)`` rounded to the tensor's dtype. For ``g = 64`` (the default group) it is
  ``1/8``, exact; for odd ``log2(g)`` (8, 32, 128, ...) it is the nearest float32 (or float64) to ``1/sqrt(g)``, so
  ``hadamard(hadamard(x))`` differs from ``x`` by that rounding (about 3e-8 relative in float32) besides the sums'.

Each float32 operation is rounded once (no fused multiply-add: the kernels are launched with fusion off).
"""
from __future__ import annotations

import math

import torch


def check_group(group_size: int) -> int:
    """``log2(group_size)``; raises ValueError unless it is a power of two of at least 2."""
    if not isinstance(group_size, int) or group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"a Hadamard group must be a power of two of at least 2, not {group_size!r}.")
    return group_size.bit_length() - 1


def scale_factor(group_size: int, dtype: torch.dtype = torch.float32) -> float:
    """``1/sqrt(group_size)`` rounded to ``dtype``, as the transform applies it in that dtype (exact for even
    log2)."""
    stages = check_group(group_size)
    factor = 2.0 ** -(stages // 2) * (1 / math.sqrt(2) if stages % 2 else 1.0)
    return float(torch.tensor(factor, dtype=dtype))


def hadamard(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x·H_g`` within each group of ``group_size`` entries of the last dimension (whose length must be a multiple
    of it), in ``x``'s floating dtype, in the fixed order of the module docstring. Returns a new tensor."""
    stages = check_group(group_size)
    if not x.is_floating_point():
        raise ValueError(f"the Hadamard transform works on floating tensors, not {x.dtype}.")
    k = x.shape[-1]
    if k % group_size:
        raise ValueError(f"the last dimension ({k}) is not a whole number of Hadamard groups of {group_size}.")
    lead = x.shape[:-1]
    y = x.reshape(-1, k // group_size, group_size)
    for _ in range(stages):
        pairs = y.reshape(y.shape[0], y.shape[1], group_size // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        y = torch.cat([even + odd, even - odd], dim=-1)
    factor = torch.tensor(scale_factor(group_size, x.dtype), dtype=x.dtype, device=x.device)
    return (y * factor).reshape(*lead, k)


def rotate_both_sides_(m: torch.Tensor, group_size: int, flipped: bool = False, tile: int = 256) -> torch.Tensor:
    """``m ← H·m·H`` in place for a square ``m`` (a Hessian; K a whole number of groups): each row, then each column,
    transformed as :func:`hadamard` transforms a vector, ``tile`` rows or columns at a time (no second ``K × K``
    matrix). ``flipped``: ``m`` is ``J·Σ·J`` (``J`` the reversal, the order GPTQ factorizes in) and becomes
    ``J·(H·Σ·H)·J``: each slice is reversed, transformed and reversed back."""
    def rotate(x: torch.Tensor) -> torch.Tensor:
        return hadamard(x.flip(-1), group_size).flip(-1) if flipped else hadamard(x, group_size)

    k = m.shape[0]
    for r in range(0, k, tile):
        m[r:r + tile] = rotate(m[r:r + tile])
    for c in range(0, k, tile):
        m[:, c:c + tile] = rotate(m[:, c:c + tile].T).T
    return m


def hadamard_both_sides(blocks: torch.Tensor, group_size: int) -> torch.Tensor:
    """``H·B·H`` of square blocks ``[..., g, g]``: the last dimension transformed first, then the one before."""
    return hadamard(hadamard(blocks, group_size).transpose(-1, -2), group_size).transpose(-1, -2)


def diagonal_blocks(m: torch.Tensor, group_size: int, device=None) -> torch.Tensor:
    """The ``[G, g, g]`` blocks on the diagonal of a square ``[G·g, G·g]`` matrix (copied, in float64, to ``device``,
    ``m``'s own when None): one strided view, so a matrix in host memory is read in one copy."""
    groups = m.shape[0] // group_size
    device = m.device if device is None else device
    if not groups:
        return torch.zeros((0, group_size, group_size), dtype=torch.float64, device=device)
    r, c = m.stride()
    blocks = m.as_strided((groups, group_size, group_size), (group_size * (r + c), r, c), m.storage_offset())
    return blocks.to(device=device, dtype=torch.float64)


def rotated_diagonal(m: torch.Tensor, group_size: int, symmetrize: bool = False, device=None) -> torch.Tensor:
    """The diagonal of ``H·M·H`` (float64 ``[K]``, on ``device``, ``m``'s own when None) for a square ``M`` (a
    Hessian), from its diagonal blocks only. ``symmetrize``: of ``(M + Mᵀ)/2`` instead (whose diagonal blocks are
    ``(B + Bᵀ)/2``)."""
    blocks = diagonal_blocks(m, group_size, device)
    if symmetrize:
        blocks = (blocks + blocks.transpose(-1, -2)) * 0.5
    return hadamard_both_sides(blocks, group_size).diagonal(dim1=-2, dim2=-1).reshape(-1)
