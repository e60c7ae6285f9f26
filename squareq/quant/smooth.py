"""SmoothQuant-style per-input-channel scales that move outliers from activations into weights."""
from __future__ import annotations

import torch

from .rtn import row_chunks


def smoothing_scale(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float, eps: float = 1e-5) -> torch.Tensor:
    """``s_k = a_k^α / w_k^(1-α)`` where ``a_k`` is the activation absmax of input channel ``k`` and
    ``w_k`` the weight's absmax over that column. Channels where either is zero keep ``s = 1``.

    The layer then stores ``Q(W·diag(s))`` with ``1/s`` folded back in at dequantization.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must lie in [0, 1].")
    a = act_absmax.detach().float().reshape(-1)
    wmax = torch.stack([weight[rows].detach().float().abs().amax(dim=0) for rows in row_chunks(*weight.shape)]).amax(0)
    if a.numel() != wmax.numel():
        raise ValueError(f"activation stats cover {a.numel()} channels but the weight has {wmax.numel()} inputs.")
    live = (a > eps) & (wmax > eps)
    s = a.clamp(min=eps).pow(alpha) / wmax.clamp(min=eps).pow(1.0 - alpha)
    return torch.where(live, s, torch.ones_like(s))
