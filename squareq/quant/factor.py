"""GPTQ's factor ``U`` (upper Cholesky factor of ``(H + λI)⁻¹``), computed in place in one ``K × K`` float64 matrix.

With ``J`` the reversal of rows and columns and ``C`` the lower Cholesky factor of ``J (H + λI) J``,
``U = J C⁻¹ J``. Both steps, the Cholesky factorization and the inversion of ``C``, run here block by block in the
matrix itself, with temporaries of a few column blocks: the library routines keep their input beside their output,
and inverting ``H`` and then factorizing the inverse held three ``K × K`` float64 matrices at once (at K = 24,576, a
FLUX.2 single block's output layer, each is 4.8 GB of a compile's VRAM budget). The blocked algorithms are the
textbook right-looking Cholesky and the backward blocked triangular inverse; the arithmetic does not depend on
where the matrix lives or how much memory is free.
"""
from __future__ import annotations

import torch

BLOCK = 1024  # columns per step: large enough for the matrix products to run at speed, small beside K²


class InverseFactor:
    """``U`` handed out a block of rows at a time (``inverse`` holds ``C⁻¹``; its strict upper triangle is 0)."""

    def __init__(self, inverse: torch.Tensor) -> None:
        self.inverse = inverse
        self.k = inverse.shape[0]

    def rows(self, b0: int, b1: int) -> torch.Tensor:
        """``U[b0:b1, :]`` in float32 (zero left of the diagonal): rows ``k - b1 .. k - b0`` of ``C⁻¹`` reversed in
        both directions."""
        return self.inverse[self.k - b1:self.k - b0].flip(0, 1).float()

    def full(self) -> torch.Tensor:
        """All of ``U`` (small matrices and tests)."""
        return self.rows(0, self.k)


def cholesky_inplace_(a: torch.Tensor, block: int = BLOCK) -> bool:
    """Overwrite the symmetric positive definite ``a`` (its lower triangle is read) with its lower Cholesky factor,
    strict upper triangle zeroed. False (``a`` then undefined) when it is not positive definite."""
    n = a.shape[0]
    for j in range(0, n, block):
        e = min(j + block, n)
        d = a[j:e, j:e].tril()
        factor, info = torch.linalg.cholesky_ex(d + d.tril(-1).mT)
        if int(info) != 0 or not bool(torch.isfinite(factor.diagonal()).all()):
            return False
        a[j:e, j:e] = factor
        if e < n:
            panel = torch.linalg.solve_triangular(factor.mT, a[e:, j:e], upper=True, left=False)
            a[e:, j:e] = panel
            for c in range(e, n, block):  # the trailing lower triangle, one column block at a time
                ce = min(c + block, n)
                a[c:, c:ce] -= panel[c - e:] @ panel[c - e:ce - e].mT
        a[j:e, e:] = 0
    return True


def invert_lower_inplace_(low: torch.Tensor, block: int = BLOCK) -> None:
    """Overwrite the lower-triangular ``low`` (strict upper triangle 0) with its inverse, from the last column block
    to the first: ``(L⁻¹)[e:, j:e] = −(L⁻¹)[e:, e:] · L[e:, j:e] · (L[j:e, j:e])⁻¹`` uses the inverse already in
    place below and to the right."""
    n = low.shape[0]
    for j in reversed(range(0, n, block)):
        e = min(j + block, n)
        d = low[j:e, j:e]
        d_inv = torch.linalg.solve_triangular(d, torch.eye(e - j, dtype=d.dtype, device=d.device), upper=False)
        if e < n:
            panel = low[e:, j:e].clone()
            out = torch.empty_like(panel)
            for r in range(e, n, block):  # rows of (L⁻¹)[e:, e:] are zero right of their diagonal
                re_ = min(r + block, n)
                out[r - e:re_ - e] = low[r:re_, e:re_] @ panel[:re_ - e]
            low[e:, j:e] = -(out @ d_inv)
        low[j:e, j:e] = d_inv


def inverse_factor(prepare, damp: float, base: float, retries: int = 4):
    """:class:`InverseFactor` for ``prepare()`` (a fresh float64 ``J H J`` it may overwrite) with ``λ = damp · base``
    on the diagonal, the damping raised tenfold after each failed factorization. Returns ``(factor, relative
    damping used)`` or ``(None, last damping tried)``."""
    rel = damp
    for _ in range(retries):
        a = prepare()
        a.diagonal().add_(rel * base)
        if cholesky_inplace_(a):
            invert_lower_inplace_(a)
            if bool(torch.isfinite(a.diagonal()).all()) and bool((a.diagonal() > 0).all()):
                return InverseFactor(a), rel
        del a
        rel = rel * 10.0 if rel > 0 else 0.01
    return None, rel / 10.0
