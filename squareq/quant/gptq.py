"""Error-compensating (GPTQ-style) rounding: quantize a weight column by column and push each
column's rounding error onto the columns not yet quantized, weighted by the inverse of the layer's
input second moments, so that the *output* error ``‖x Wᵀ - x Ŵᵀ‖²`` is small rather than each weight's.

The result is stored exactly like :func:`squareq.quant.quantize` (same roles, dtypes, packing and
scale/zero rules), so :func:`squareq.quant.dequantize` and the kernels read it unchanged. Plain
round-to-nearest stays available as :func:`squareq.quant.quantize`.

The algorithm (Frantar et al., "GPTQ", 2022), in outline. With ``H = E[x xᵀ]`` (plus damping) and
``U`` the upper Cholesky factor of ``H⁻¹`` (``H⁻¹ = Uᵀ U``), columns are processed in order; column
``j`` is rounded to its group's grid, its error divided by ``U[j, j]`` is ``e``, and every later
column ``l`` receives ``-e · U[j, l]``. Updates inside a block of columns are applied at once per
column; updates to the columns after the block are applied in one matrix product per block.

Two consequences for callers: (1) the weight itself moves further from ``W`` than round-to-nearest
(it trades weight error for output error), so judge a GPTQ layer by its output error
(:func:`squareq.quant.output_rel_mse`), not by weight SQNR; (2) ``H`` must be estimated from many
more input rows than ``K``, or GPTQ also "compensates" the sampling noise of ``H``: on uncorrelated
inputs at K = 256 the held-out output error was 7% above round-to-nearest with 2048 calibration
rows and 0.5% above with 32768 (tests/quant/test_gptq.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .rtn import (
    QuantizedWeight,
    _apply_smoothing,
    _check_weight,
    assemble,
    group_params,
    num_groups,
    quantize,
    round_to_grid,
)
from .spec import QuantSpec

log = logging.getLogger("squareq.quant")

DAMP_RETRIES = 4  # damping tried: damp, 10·damp, 100·damp, 1000·damp (relative to mean diag(H))


@dataclass(frozen=True)
class GPTQInfo:
    """What :func:`gptq_quantize_with_info` did.

    fell_back_to_rtn: the Cholesky factorization failed at every damping tried, so the result is
        plain round-to-nearest (also logged as a warning on ``squareq.quant``).
    damp: the relative damping that was used (a fraction of the mean live diagonal of H).
    dead_channels: input channels with ``H_kk == 0`` (never seen a non-zero input); their columns
        are rounded to nearest on their group's grid and affect nothing else.
    """

    fell_back_to_rtn: bool
    damp: float
    dead_channels: int


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """``E[x xᵀ]`` over the rows of ``x [..., K]``, as float32 ``[K, K]`` (accumulated in float64)."""
    x = x.detach().double().reshape(-1, x.shape[-1])
    return (x.T @ x / max(x.shape[0], 1)).float()


def _check_hessian(hessian: torch.Tensor, k: int, device: torch.device) -> torch.Tensor:
    if hessian.dim() != 2 or tuple(hessian.shape) != (k, k):
        raise ValueError(f"the Hessian must be [{k}, {k}] for a weight with {k} inputs, got {tuple(hessian.shape)}.")
    h = hessian.detach().to(device=device, dtype=torch.float64)
    if not torch.isfinite(h).all():
        raise ValueError("the Hessian contains NaN or Inf values; check the calibration activations.")
    return (h + h.T) * 0.5


def _inverse_cholesky(h: torch.Tensor, damp: float, base: float):
    """Upper Cholesky factor of ``(H + λI)⁻¹`` in float32, raising the damping on failure.

    Returns ``(U, relative damping used)`` or ``(None, last damping tried)``.
    """
    rel = damp
    for _ in range(DAMP_RETRIES):
        damped = h.clone()
        damped.diagonal().add_(rel * base)
        lower, info = torch.linalg.cholesky_ex(damped)
        del damped
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0 and torch.isfinite(upper).all() and (upper.diagonal() > 0).all():
                return upper.float(), rel
        rel = rel * 10.0 if rel > 0 else 0.01
    return None, rel / 10.0


def gptq_quantize_with_info(
    w: torch.Tensor,
    spec: QuantSpec,
    hessian: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> tuple[QuantizedWeight, GPTQInfo]:
    """:func:`gptq_quantize`, also returning a :class:`GPTQInfo` (fallback flag, damping used)."""
    _check_weight(w)
    k = w.shape[1]
    if not (damp >= 0.0 and damp < float("inf")):
        raise ValueError(f"damp={damp} must be a finite non-negative fraction (0.01 is typical).")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive.")
    if spec.is_passthrough:
        return quantize(w, spec, smooth_scale), GPTQInfo(False, 0.0, 0)
    w = w.detach().float()
    h = _check_hessian(hessian, k, w.device)
    ws, inv = _apply_smoothing(w, spec, smooth_scale)
    if inv is not None:
        # The stored weight W·diag(s) sees inputs x·diag(1/s): H_s = diag(1/s) H diag(1/s).
        inv64 = inv.double()
        h = h * inv64[:, None] * inv64[None, :]

    diag = h.diagonal().clone()
    dead = ~(diag > 0)
    n_dead = int(dead.sum())
    if n_dead:
        # A channel whose input is always zero: decouple it (row and column of H zeroed, H_kk = 1),
        # so its column is rounded to nearest and neither gives nor receives error.
        h[dead, :] = 0
        h[:, dead] = 0
        h[dead, dead] = 1.0
    base = float(diag[~dead].mean()) if n_dead < k else 1.0

    perm = torch.argsort(diag, descending=True, stable=True) if act_order else None
    if perm is not None:
        h = h[perm][:, perm]
    upper, used = _inverse_cholesky(h, damp, base)
    if upper is None:
        log.warning(
            "GPTQ: the Cholesky factorization of the %dx%d Hessian failed even with damping %.3g of its mean "
            "diagonal; this layer falls back to round-to-nearest.", k, k, used,
        )
        return quantize(w, spec, smooth_scale), GPTQInfo(True, used, n_dead)

    codes, scales, zeros = _gptq_codes(ws, upper, spec, perm, block_size)
    return assemble(spec, codes, scales, zeros, inv), GPTQInfo(False, used, n_dead)


def gptq_quantize(
    w: torch.Tensor,
    spec: QuantSpec,
    hessian: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
) -> QuantizedWeight:
    """Quantize ``w [N, K]`` (out, in) under ``spec`` with error-compensating rounding.

    ``hessian`` is ``E[x xᵀ]`` (or ``XᵀX``; the scale does not matter) over the layer's inputs,
    ``[K, K]`` in the original, unsmoothed input space; with ``spec.smooth`` it is mapped into the
    smoothed space internally. ``damp`` adds ``damp · mean(diag H)`` to the diagonal (raised up to
    1000× if the factorization fails, then falling back to round-to-nearest with a logged warning;
    :func:`gptq_quantize_with_info` reports it). ``block_size`` is the column block of the lazy
    updates (rounded to whole groups). ``act_order`` quantizes columns in order of decreasing
    ``H_kk``; group scales and zero points are then fixed up front from the original weight
    ("static groups") so the stored format keeps contiguous K groups and original column order.
    Without it, each group's scale and zero point come from the error-updated weights when the
    group is reached, with the same rules (clip ratio, rounded-up scale, zero point) as
    :func:`squareq.quant.quantize`.
    """
    return gptq_quantize_with_info(w, spec, hessian, smooth_scale, damp, block_size, act_order)[0]


def _gptq_codes(w: torch.Tensor, upper: torch.Tensor, spec: QuantSpec, perm: torch.Tensor | None, block_size: int):
    """Run the column sweep; returns (codes int32 [N, K] in original column order, scales, zeros)."""
    n, k = w.shape
    g = spec.group_size
    n_groups = num_groups(k, g)
    static = perm is not None
    if static:
        wg = torch.nn.functional.pad(w, (0, n_groups * g - k)).reshape(n, n_groups, g)
        scales, zeros = group_params(wg, spec)
        order = perm.tolist()
        w = w[:, perm].contiguous()
    else:
        scales = torch.empty((n, n_groups), dtype=spec.torch_scale_dtype, device=w.device)
        zeros = None if spec.symmetric else torch.empty((n, n_groups), dtype=torch.float32, device=w.device)
        order = range(k)
        w = w.clone()
        # Blocks hold whole groups, so a group's parameters are chosen from fully updated columns.
        block_size = max(g, block_size - block_size % g)
    codes = torch.empty((n, k), dtype=torch.int32, device=w.device)
    scale_f = scales.float() if static else None

    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        blk = w[:, b0:b1]  # a view: updates land in w
        u_blk = upper[b0:b1, b0:b1]
        err = torch.empty((n, b1 - b0), dtype=torch.float32, device=w.device)
        for j in range(b1 - b0):
            col = order[b0 + j]
            gi = col // g
            if not static and col % g == 0:
                s_new, z_new = group_params(blk[:, j : min(j + g, b1 - b0)], spec)
                scales[:, gi] = s_new
                if zeros is not None:
                    zeros[:, gi] = z_new
            s = scale_f[:, gi] if static else scales[:, gi].float()
            z = None if zeros is None else zeros[:, gi]
            x = blk[:, j]
            q = round_to_grid(x, s, z, spec)
            codes[:, col] = q.to(torch.int32)
            deq = (q if z is None else q - z) * s
            e = (x - deq) / u_blk[j, j]
            err[:, j] = e
            if j + 1 < b1 - b0:
                blk[:, j + 1 :] -= e[:, None] * u_blk[j, j + 1 :][None, :]
        if b1 < k:
            w[:, b1:] -= err @ upper[b0:b1, b1:]
    return codes, scales, zeros
