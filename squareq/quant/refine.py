"""Learned rounding: a quantized layer's codes moved one grid step at a time, each move chosen to lower the layer's
output error on the calibration inputs, ``tr(E·Σ·Eᵀ)`` with ``E`` the stored weight's error and ``Σ = E[x xᵀ]``.

GPTQ rounds the columns in one pass, each once, compensating later columns for earlier errors; it never returns to a
column. Here every row of the weight is revisited as a whole: in each round, each row takes the single ``±1`` code
step (within the code range, scales and zero points unchanged) that lowers its error the most, and rows with no such
step stop. The error of row ``n`` is ``e_n·Σ·e_nᵀ``; with ``g_n = e_n·Σ`` kept up to date, a step of ``δ = ±1`` at
column ``k`` of scale ``s`` changes it by ``s²·Σ_kk − 2·δ·s·g_nk``, and updates ``g_n`` by one row of ``Σ``. It is
learned rounding in AdaRound's sense (Nagel et al. 2020: each weight's rounding fitted to the layer's output on
calibration data), solved by greedy coordinate descent on the exact quadratic instead of a relaxed one, and started
from the search's best candidate instead of nearest rounding. The error is measured where the codes live: for a
rotated layer (``QuantSpec.rotate``) on ``W·H`` against ``H·Σ·H``, for a smoothed one on ``W·diag(s)`` against
``diag(1/s)·Σ·diag(1/s)``. Bytes and format do not change: the kernels read the moved codes as any others.

Fitted to the calibration rows, it can fit their noise; the compiler keeps the result only where it lowers the error
on held-out rows (compiler/layer_search.py).
"""
from __future__ import annotations

import torch

from .gptq import symmetrize_
from .hadamard import rotate_both_sides_
from .packing import unpack
from .registry import FORMATS
from .rtn import QuantizedWeight, assemble, per_column, rotated, row_chunks

# rounds of one step per row: on all-MiniLM-L6-v2's layers most stopped by themselves within 30; the one that ran on
# (to 483) had 89% of its held-out gain by round 32
MAX_ROUNDS = 32


def refine_rounding(qw: QuantizedWeight, w: torch.Tensor, hessian: torch.Tensor, damp: float = 0.0,
                    max_rounds: int = MAX_ROUNDS, sigma: torch.Tensor | None = None) -> tuple[QuantizedWeight, int]:
    """``qw`` (an ``int`` quantization of ``w [N, K]``) with its codes moved to lower ``tr(E·Σ·Eᵀ)`` for ``Σ =
    hessian [K, K]`` (module docstring) plus ``damp`` times its mean diagonal on the diagonal, and the rounds it took.
    ``sigma``: that matrix as :func:`stored_hessian` gives it for ``qw``'s space (its rotation and smoothing), made
    once for several refinements in the same space; ``hessian`` and ``damp`` are then not read.
    Works on ``qw``'s device; ``qw`` is not changed."""
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    if spec.is_passthrough or not FORMATS[spec.format].gptq:
        raise ValueError(f"learned rounding moves integer codes; {spec.label()} has none to move.")
    given = hessian if sigma is None else sigma
    if tuple(w.shape) != (n, k) or tuple(given.shape) != (k, k):
        raise ValueError(f"learned rounding needs a [{n}, {k}] weight and a [{k}, {k}] Hessian, not "
                         f"{list(w.shape)} and {list(given.shape)}.")
    device = t["qweight"].device
    inv = t.get("inv_smooth")
    if sigma is None:
        sigma = stored_hessian(hessian, spec, inv, device, damp)
    q = unpack(t["qweight"], spec.bits, k)
    rounds = 0
    for rows in row_chunks(n, k):  # rows are independent: a slice at a time bounds the N x K temporaries
        target = rotated(w[rows].detach().to(device).float(), spec)
        if inv is not None:
            target = target / inv.float()[None, :]
        scale = per_column(t["scales"][rows].float(), spec.group_size, k)
        zero = per_column(t["zeros"][rows].to(torch.int32), spec.group_size, k) if "zeros" in t else None
        rounds = max(rounds, _descend(q[rows], target, scale, zero, sigma, spec, max_rounds))
    return assemble(spec, q, t["scales"], t.get("zeros"), inv), rounds


def _descend(q: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
             sigma: torch.Tensor, spec, max_rounds: int) -> int:
    """Move the codes ``q`` (a view, changed in place) of some rows by greedy coordinate descent; the rounds taken."""
    lo, hi = (-spec.qmax if spec.symmetric else spec.qmin), spec.qmax
    err = target - (q if zero is None else q - zero).float() * scale
    grad = err @ sigma
    curvature = scale * scale * sigma.diagonal()[None, :]
    level = (err * grad).sum(dim=1)  # each row's error, kept up to date by the gains taken
    rows = torch.arange(q.shape[0], device=q.device)
    for done in range(max_rounds):
        # of a weight's two steps the better is toward s·g's sign (the other adds curvature + 2|s·g| >= 0): one gain
        # per weight, infinite where that step would leave the code range
        pull = scale * grad
        gain = torch.sub(curvature, pull.abs(), alpha=2)
        gain.masked_fill_(torch.where(pull > 0, q >= hi, q <= lo), torch.inf)
        change, col = gain.min(dim=1)
        # a step must lower the row's error by more than float32's noise on it, or the descent could cycle
        moving = change < -1e-6 * level.abs()
        if not moving.any():
            return done
        r, c = rows[moving], col[moving]
        step = torch.where(pull[r, c] > 0, 1, -1)
        q[r, c] += step.to(q.dtype)
        moved = step.float() * scale[r, c]
        err[r, c] -= moved
        grad[r] -= moved[:, None] * sigma[c]
        level[r] += change[moving]
    return max_rounds


def stored_hessian(hessian: torch.Tensor, spec, inv: torch.Tensor | None, device, damp: float = 0.0) -> torch.Tensor:
    """``Σ`` as the stored codes see it (float32 on ``device``, symmetrized): ``H·Σ·H`` for a rotated spec, and
    ``diag(1/s)·Σ·diag(1/s)`` (``inv = 1/s``) for a smoothed one, with ``damp`` times its mean diagonal added to the
    diagonal (GPTQ's damping, a pull toward the plain weight error). One ``K × K`` float32 matrix, half of GPTQ's
    float64 one, which is freed by then (compiler/vram.py's search budget holds both)."""
    sigma = symmetrize_(hessian.detach().to(device=device, dtype=torch.float32, copy=True))
    if spec.rotate:
        rotate_both_sides_(sigma, spec.group_size)
    if inv is not None:
        sigma.mul_(inv.float()[:, None]).mul_(inv.float()[None, :])
    if damp:
        sigma.diagonal().add_(damp * float(sigma.diagonal().mean()))
    return sigma
