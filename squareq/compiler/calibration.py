"""Per-layer input statistics gathered while calibration batches run through one block.

For every ``nn.Linear`` in the block, on the inputs it actually sees: per-input-channel absmax and
second moments (for smoothing and activation-weighted clip search), optionally the input Gram
matrix ``Σ x xᵀ`` (for error-compensating rounding), and a uniform sample of input rows (for
measuring output error ``‖XWᵀ − XŴᵀ‖² / ‖XWᵀ‖²``).

The measurement rows are held out: a seeded random share of the rows goes only to the sample, the
rest only to the Gram matrix. Error-compensating rounding fits the Gram matrix, so measuring it on
the same rows reported errors 13x too small on held-out inputs (benchmarks/quality.py, medium model).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LayerStats:
    """Running statistics of one linear layer's inputs (float32/float64 on the collection device)."""

    absmax: torch.Tensor
    sq_sum: torch.Tensor
    count: int = 0
    gram: torch.Tensor | None = None
    gram_count: int = 0
    rows: torch.Tensor | None = None
    _priority: torch.Tensor | None = field(default=None, repr=False)

    @property
    def second_moment(self) -> torch.Tensor:
        """E[x_k²] per input channel."""
        return (self.sq_sum / max(self.count, 1)).float()

    @property
    def hessian(self) -> torch.Tensor:
        """E[x xᵀ] over the rows that were not held out (zero when every row was held out)."""
        if self.gram is None:
            raise ValueError("this layer's Gram matrix was not collected (hessian=False).")
        return (self.gram / max(self.gram_count, 1)).float()

    def outlier_score(self, smooth: torch.Tensor | None = None) -> float:
        """p99.9 / median of the per-channel absmax (of ``x·diag(1/s)`` when a smoothing ``s`` is
        given): how far the worst input channels stand out."""
        a = self.absmax.float() if smooth is None else self.absmax.float() / smooth.float()
        med = float(a.median())
        return float(torch.quantile(a, 0.999)) / med if med > 0 else float("inf")


class StatsCollector:
    """Forward pre-hooks on every linear of a block; use as a context manager around calibration runs.

    ``max_rows`` input rows per layer are kept as a uniform sample (seeded, so a re-run keeps the same
    rows); ``hessian=True`` also accumulates ``Σ x xᵀ``. A share ``holdout`` of the rows feeds only the
    sample and the rest only the Gram matrix (each layer holds out at least one row); ``holdout=0``
    samples from the same rows the Gram matrix sees.
    """

    def __init__(self, prefix: str, block: nn.Module, max_rows: int = 512, hessian: bool = True, seed: int = 0,
                 holdout: float = 0.25):
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must lie in [0, 1).")
        self.prefix = prefix
        self.block = block
        self.max_rows = max_rows
        self.hessian = hessian
        self.holdout = holdout
        self.generator = torch.Generator().manual_seed(seed)
        self.stats: dict[str, LayerStats] = {}
        self._handles: list = []

    def __enter__(self) -> "StatsCollector":
        for rel, mod in self.block.named_modules():
            if isinstance(mod, nn.Linear):
                self._handles.append(mod.register_forward_pre_hook(self._hook(f"{self.prefix}.{rel}")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, args) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            self._update(name, x)

        return hook

    @torch.no_grad()
    def _update(self, name: str, x: torch.Tensor) -> None:
        xf = x.float()
        st = self.stats.get(name)
        if st is None:
            k = xf.shape[1]
            st = LayerStats(torch.zeros(k, device=x.device), torch.zeros(k, dtype=torch.float64, device=x.device))
            if self.hessian:
                st.gram = torch.zeros(k, k, dtype=torch.float64, device=x.device)
            self.stats[name] = st
        st.absmax = torch.maximum(st.absmax, xf.abs().amax(dim=0))
        st.sq_sum += xf.double().pow(2).sum(dim=0)
        st.count += xf.shape[0]
        held = torch.zeros(xf.shape[0], dtype=torch.bool)
        if self.holdout > 0:
            held = torch.rand(xf.shape[0], generator=self.generator) < self.holdout
            if st.rows is None and not held.any():
                held[-1] = True
        held = held.to(xf.device)
        fit = xf[~held] if self.holdout > 0 else xf
        if st.gram is not None:
            st.gram += (fit.T @ fit).double()
            st.gram_count += fit.shape[0]
        self._sample_rows(st, xf[held] if self.holdout > 0 else xf)

    def _sample_rows(self, st: LayerStats, xf: torch.Tensor) -> None:
        # Keeping the rows with the highest random priorities is a uniform sample without replacement.
        if xf.shape[0] == 0:
            return
        prio = torch.rand(xf.shape[0], generator=self.generator).to(xf.device)
        rows = xf if st.rows is None else torch.cat([st.rows, xf])
        prio = prio if st._priority is None else torch.cat([st._priority, prio])
        if rows.shape[0] > self.max_rows:
            keep = torch.topk(prio, self.max_rows).indices.sort().values
            rows, prio = rows[keep], prio[keep]
        st.rows, st._priority = rows.clone(), prio
