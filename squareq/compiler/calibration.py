"""Per-layer input statistics gathered while calibration batches run through one block.

For every ``nn.Linear`` in the block, on the inputs it actually sees, split into *fit* rows and *held-out* rows:

* from the fit rows: per-input-channel absmax and second moments (for smoothing and activation-weighted clip
  search), optionally the input Gram matrix ``Σ x xᵀ`` (for error-compensating rounding), and a uniform sample of
  rows (``rows``: where the search compares its candidates);
* from the held-out rows only: a uniform sample (``heldout_rows``), on which each layer's transforms are kept or
  rejected against plain rounding and its output error ``‖XWᵀ − XŴᵀ‖² / ‖XWᵀ‖²`` is reported.

Held-out rows are the rows of held-out *samples* (whole images or sentences, ``heldout_samples``) wherever a layer's
input keeps the batch axis first; elsewhere a seeded share of the rows. Padding rows of text (``row_mask``) are
neither. Fitting and judging on the same rows reported errors 13x too small on held-out inputs
(benchmarks/quality.py, medium model), and rows of the same sentence or image resemble each other more than rows
of another: judging on other samples is what tells a transform that fits the calibration data from one that helps.
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
    heldout_rows: torch.Tensor | None = None
    _priority: dict = field(default_factory=dict, repr=False)

    @property
    def second_moment(self) -> torch.Tensor:
        """E[x_k²] per input channel."""
        return (self.sq_sum / max(self.count, 1)).float()

    @property
    def judging_rows(self) -> torch.Tensor:
        """The rows a layer's candidates are judged on: the held-out rows (the fit rows when none were held out)."""
        return self.heldout_rows if self.heldout_rows is not None else self.rows

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

    ``max_rows`` fit rows and ``max_rows`` held-out rows per layer are kept as uniform samples (seeded, so a re-run
    keeps the same rows); ``hessian=True`` also accumulates ``Σ x xᵀ`` over the fit rows. ``samples`` is the batch
    size of the calibration runs and ``heldout_samples`` the indices of its held-out samples; ``row_mask``
    (``[samples, tokens]``) marks real tokens. Inputs without the batch axis first, or calls without held-out
    samples, hold out a seeded share ``holdout`` of their rows instead (each layer at least one);
    ``holdout=0`` keeps no held-out rows at all.
    """

    def __init__(self, prefix: str, block: nn.Module, max_rows: int = 512, hessian: bool = True, seed: int = 0,
                 holdout: float = 0.25, samples: int | None = None, heldout_samples=(),
                 row_mask: torch.Tensor | None = None):
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must lie in [0, 1).")
        self.prefix = prefix
        self.block = block
        self.max_rows = max_rows
        self.hessian = hessian
        self.holdout = holdout
        self.samples = samples
        self.heldout_samples = torch.zeros(samples or 0, dtype=torch.bool)
        self.heldout_samples[list(heldout_samples)] = True
        self.row_mask = None if row_mask is None else row_mask.bool().cpu()
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
            x = args[0].detach()
            held, real = self._split(x)
            x = x.reshape(-1, x.shape[-1])
            if real is not None:
                x, held = x[real.to(x.device)], held[real]
            self._update(name, x, held)

        return hook

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(held-out flag per row, real-token flag per row or None) for an input ``x [..., K]``."""
        rows = x.numel() // x.shape[-1]
        per_sample = self.samples and x.dim() >= 2 and x.shape[0] == self.samples and bool(self.heldout_samples.any())
        if not per_sample:
            held = torch.zeros(rows, dtype=torch.bool)
            if self.holdout > 0:
                held = torch.rand(rows, generator=self.generator) < self.holdout
            return held, None
        held = self.heldout_samples.view(-1, *([1] * (x.dim() - 2))).expand(x.shape[:-1]).reshape(-1)
        mask = self.row_mask
        real = mask.reshape(-1) if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape) \
            else None
        return held, real

    @torch.no_grad()
    def _update(self, name: str, x: torch.Tensor, held: torch.Tensor) -> None:
        xf = x.float()
        st = self.stats.get(name)
        if st is None:
            k = xf.shape[1]
            st = LayerStats(torch.zeros(k, device=x.device), torch.zeros(k, dtype=torch.float64, device=x.device))
            if self.hessian:
                st.gram = torch.zeros(k, k, dtype=torch.float64, device=x.device)
            self.stats[name] = st
        if self.holdout > 0 and st.heldout_rows is None and not held.any() and held.numel() > 1 \
                and not self.heldout_samples.any():
            held = held.clone()
            held[-1] = True  # every layer holds out at least one row
        held = held.to(xf.device)
        fit = xf[~held]
        if fit.shape[0]:
            st.absmax = torch.maximum(st.absmax, fit.abs().amax(dim=0))
            st.sq_sum += fit.double().pow(2).sum(dim=0)
            st.count += fit.shape[0]
        if st.gram is not None:
            st.gram += (fit.T @ fit).double()
            st.gram_count += fit.shape[0]
        self._sample_rows(st, "rows", fit)
        self._sample_rows(st, "heldout_rows", xf[held])

    def _sample_rows(self, st: LayerStats, attr: str, xf: torch.Tensor) -> None:
        # Keeping the rows with the highest random priorities is a uniform sample without replacement.
        if xf.shape[0] == 0:
            return
        prio = torch.rand(xf.shape[0], generator=self.generator).to(xf.device)
        kept = getattr(st, attr)
        rows = xf if kept is None else torch.cat([kept, xf])
        prio = prio if attr not in st._priority else torch.cat([st._priority[attr], prio])
        if rows.shape[0] > self.max_rows:
            keep = torch.topk(prio, self.max_rows).indices.sort().values
            rows, prio = rows[keep], prio[keep]
        setattr(st, attr, rows.clone())
        st._priority[attr] = prio
