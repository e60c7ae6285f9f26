"""Error metrics between a reference tensor and its approximation."""
from __future__ import annotations

import math

import torch

from .rtn import row_chunks


def _err_and_ref(ref: torch.Tensor, approx: torch.Tensor, dim):
    ref = ref.detach().double()
    err = (approx.detach().double() - ref).pow(2)
    if dim is None:
        return err.sum(), ref.pow(2).sum()
    return err.sum(dim=dim), ref.pow(2).sum(dim=dim)


def _chunked_err_and_ref(ref: torch.Tensor, approx: torch.Tensor):
    """Squared error and power summed over all elements in float64, a slice of rows at a time (a 2-D weight's
    float64 copies would be 4x its float32 size)."""
    if ref.dim() != 2:
        return _err_and_ref(ref, approx, None)
    err = power = torch.zeros((), dtype=torch.float64, device=ref.device)
    for rows in row_chunks(*ref.shape):
        e, p = _err_and_ref(ref[rows], approx[rows], None)
        err, power = err + e, power + p
    return err, power


def rel_mse(ref: torch.Tensor, approx: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``||approx - ref||² / ||ref||²`` (over all elements, or along ``dim``); 0 when both are zero."""
    err, power = _err_and_ref(ref, approx, dim) if dim is not None else _chunked_err_and_ref(ref, approx)
    safe = torch.where(power > 0, power, torch.ones_like(power))
    return torch.where(power > 0, err / safe, torch.where(err > 0, torch.full_like(err, math.inf), err))


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (``inf`` for an exact approximation)."""
    err, power = _chunked_err_and_ref(ref, approx)
    if err == 0:
        return math.inf
    if power == 0:
        return -math.inf
    return float(10.0 * torch.log10(power / err))


def weighted_sq_error(ref: torch.Tensor, approx: torch.Tensor, channel_weight: torch.Tensor | None = None) -> float:
    """Σ_k h_k Σ_n (approx - ref)²_nk: the expected output error E‖x(W-Ŵ)ᵀ‖² for inputs with
    uncorrelated channels of second moment ``h`` (plain squared error when ``h`` is None)."""
    d = sum((approx[rows].detach().double() - ref[rows].detach().double()).pow(2).sum(dim=0)
            for rows in row_chunks(*ref.shape))
    if channel_weight is not None:
        d = d * channel_weight.detach().double().reshape(-1)
    return float(d.sum())


def output_rel_mse(w_ref: torch.Tensor, w_approx: torch.Tensor, x: torch.Tensor) -> float:
    """Relative output error of a linear layer, ``‖x W_refᵀ - x W_approxᵀ‖² / ‖x W_refᵀ‖²``, for
    inputs ``x [..., K]`` and weights ``[N, K]`` (computed in float64)."""
    x = x.detach().double().reshape(-1, x.shape[-1])
    err = power = 0.0
    for rows in row_chunks(*w_ref.shape):  # output channels a slice at a time: no float64 copy of the whole weight
        ref = w_ref[rows].detach().double()
        err = err + (x @ (w_approx[rows].detach().double() - ref).T).pow(2).sum()
        power = power + (x @ ref.T).pow(2).sum()
    if power == 0:
        return 0.0 if err == 0 else math.inf
    return float(err / power)
