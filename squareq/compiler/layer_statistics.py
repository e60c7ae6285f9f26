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

The forward pass only *records* each layer's inputs (once per distinct tensor: ``to_q``, ``to_k`` and ``to_v`` read
the same one), on the GPU or, when the compile's VRAM plan says so, in pinned host memory, or when its host plan says
so in a spill file (compiler/spill.py: read back one recording at a time). The statistics are then
built one group of layers at a time, so a block's Gram matrices are never all in memory at once (a FLUX.1 double
block's are 3.3 GB in float64, a FLUX.2 block's 8.4 GB), with the same arithmetic wherever the inputs were kept.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..quant import row_chunks
from ..quant.hadamard import hadamard, rotated_diagonal
from .prefetch import read_ahead

GRAM_COLUMNS = 2048  # columns of a Gram matrix added per product (a K x 2048 float32 temporary)


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
    _hessian: torch.Tensor | None = field(default=None, repr=False)
    _rotated_second: dict = field(default_factory=dict, repr=False)  # rotated_second_moment's, by group size

    @property
    def second_moment(self) -> torch.Tensor:
        """E[x_k²] per input channel."""
        return (self.sq_sum / max(self.count, 1)).float()

    @property
    def judging_rows(self) -> torch.Tensor:
        """The rows a layer's candidates are judged on: the held-out rows (the fit rows when none were held out)."""
        return self.heldout_rows if self.heldout_rows is not None else self.rows

    @property
    def has_hessian(self) -> bool:
        return self.gram is not None or self._hessian is not None

    @property
    def hessian(self) -> torch.Tensor:
        """E[x xᵀ] over the rows that were not held out (zero when every row was held out), float32."""
        if self._hessian is not None:
            return self._hessian
        if self.gram is None:
            raise ValueError("this layer's Gram matrix was not collected (hessian=False).")
        return (self.gram / max(self.gram_count, 1)).float()

    def rotated_second_moment(self, group_size: int) -> torch.Tensor | None:
        """E[(x·H)_k²] per channel of the rotated inputs ``x·H`` (the grouped Hadamard transform of
        squareq/quant/hadamard.py, groups of ``group_size``), float32 on the device of :attr:`absmax` (worked out
        once per group size; every rung of a layer asks): exact from the Gram matrix when it was collected (the
        diagonal of ``H·E[x xᵀ]·H``, from its diagonal blocks), else estimated from the sampled fit rows
        (:attr:`rows`); None when there are neither."""
        if group_size not in self._rotated_second:
            second = None
            if self.has_hessian:
                second = rotated_diagonal(self.hessian, group_size, device=self.absmax.device).float()
            elif self.rows is not None and self.rows.shape[0]:
                second = hadamard(self.rows.float(), group_size).pow(2).mean(dim=0).to(self.absmax.device)
            self._rotated_second[group_size] = second
        return self._rotated_second[group_size]

    def finish(self, pinned_host: bool = False) -> LayerStats:
        """Keep E[x xᵀ] as float32 and drop the float64 Gram matrix: the same values :attr:`hessian` gives, in a
        third of the memory (the division is done in place, as the search no longer needs the sums).
        ``pinned_host``: keep it in pinned host memory (GPTQ copies it to the GPU when it factorizes it, so the
        GPU holds two K x K float64 matrices at most, not those and this one too)."""
        if self.gram is not None:
            mean = self.gram.div_(max(self.gram_count, 1))
            self.gram = None
            if pinned_host and mean.is_cuda:  # a row tile at a time: no float32 copy beside the float64 one
                hessian = torch.empty(mean.shape, dtype=torch.float32, pin_memory=True)
                for r in range(0, mean.shape[0], GRAM_COLUMNS):
                    hessian[r:r + GRAM_COLUMNS].copy_(mean[r:r + GRAM_COLUMNS].float(), non_blocking=True)
                torch.cuda.current_stream(mean.device).synchronize()  # the host copy is read by the CPU next
            else:
                hessian = mean.float()
            self._hessian = hessian
        return self

    def outlier_score(self, smooth: torch.Tensor | None = None) -> float:
        """p99.9 / median of the per-channel absmax (of ``x·diag(1/s)`` when a smoothing ``s`` is
        given): how far the worst input channels stand out."""
        a = self.absmax.float() if smooth is None else self.absmax.float() / smooth.float()
        med = float(a.median())
        return float(torch.quantile(a, 0.999)) / med if med > 0 else float("inf")


@dataclass
class _Entry:
    """One recorded input: its real rows ``x [rows, K]`` (float32; a tensor, or a spill file's handle to one, which
    has ``to`` and ``device`` too) and which of them are held out (on the host)."""

    x: torch.Tensor
    held: torch.Tensor


class StatsCollector:
    """Forward pre-hooks on every linear of a block; use as a context manager around calibration runs.

    ``max_rows`` fit rows and ``max_rows`` held-out rows per layer are kept as uniform samples (seeded, so a re-run
    keeps the same rows); ``hessian=True`` also accumulates ``Σ x xᵀ`` over the fit rows. ``samples`` is the batch
    size of the calibration runs and ``heldout_samples`` the indices of its held-out samples; ``row_mask``
    (``[samples, tokens]``) marks real tokens. A run on samples ``[start, stop)`` of the batch only goes inside
    ``with collector.window(start, stop)``. Inputs without the batch axis first, or calls without held-out samples,
    hold out a seeded share ``holdout`` of their rows instead (each layer at least one); ``holdout=0`` keeps no
    held-out rows at all. ``store`` decides where a recorded input is kept (default: where it is).
    """

    def __init__(self, prefix: str, block: nn.Module, max_rows: int = 512, hessian: bool = True, seed: int = 0,
                 holdout: float = 0.25, samples: int | None = None, heldout_samples=(),
                 row_mask: torch.Tensor | None = None, store: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must lie in [0, 1).")
        self.prefix = prefix
        self.block = block
        self.max_rows = max_rows
        self.hessian = hessian
        self.holdout = holdout
        self.samples = samples
        self.seed = seed
        self.heldout_samples = torch.zeros(samples or 0, dtype=torch.bool)
        self.heldout_samples[list(heldout_samples)] = True
        self.row_mask = None if row_mask is None else row_mask.bool().cpu()
        self.store = store or (lambda t: t)
        self.generator = torch.Generator().manual_seed(seed)
        self._window = (0, samples or 0)
        self._entries: list[_Entry] = []
        self._layers: dict[str, list[int]] = {}  # layer name -> its entries, in call order
        self._seen: dict[int, tuple[torch.Tensor, int]] = {}  # id(input) -> (input, entry) within one window
        self._handles: list = []
        self._stats: dict[str, LayerStats] | None = None

    def __enter__(self) -> StatsCollector:
        for rel, mod in self.block.named_modules():
            if isinstance(mod, nn.Linear):
                self._handles.append(mod.register_forward_pre_hook(self._hook(f"{self.prefix}.{rel}")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()

    @contextlib.contextmanager
    def window(self, start: int, stop: int):
        """The calls inside run on samples ``[start, stop)`` of the batch."""
        self._window, self._seen = (start, stop), {}
        try:
            yield self
        finally:
            self._window, self._seen = (0, self.samples or 0), {}

    def _hook(self, name: str):
        def hook(module: nn.Module, args) -> None:
            x = args[0]
            found = self._seen.get(id(x))
            if found is None or found[0] is not x:
                found = (x, self._record(x.detach()))
                self._seen[id(x)] = found
            self._layers.setdefault(name, []).append(found[1])
            self._stats = None

        return hook

    def _record(self, x: torch.Tensor) -> int:
        held, real = self._split(x)
        x = x.reshape(-1, x.shape[-1]).float()
        if real is not None:
            x, held = x[real.to(x.device)], held[real]
        self._entries.append(_Entry(self.store(x), held))  # the flags stay on the host: the statistics move them
        return len(self._entries) - 1

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(held-out flag per row, real-token flag per row or None) for an input ``x [..., K]``."""
        rows = x.numel() // x.shape[-1]
        start, stop = self._window
        per_sample = (self.samples and x.dim() >= 2 and x.shape[0] == stop - start
                      and bool(self.heldout_samples.any()))
        if not per_sample:
            held = torch.zeros(rows, dtype=torch.bool)
            if self.holdout > 0:
                held = torch.rand(rows, generator=self.generator) < self.holdout
            return held, None
        flags = self.heldout_samples[start:stop]
        held = flags.view(-1, *([1] * (x.dim() - 2))).expand(x.shape[:-1]).reshape(-1)
        mask = None if self.row_mask is None else self.row_mask[start:stop]
        real = mask.reshape(-1) if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape) \
            else None
        return held, real

    def groups(self) -> list[list[str]]:
        """The layers in groups that read the same inputs (their statistics are the same), in first-call order."""
        by_entries: dict[tuple[int, ...], list[str]] = {}
        for name, entries in self._layers.items():
            by_entries.setdefault(tuple(entries), []).append(name)
        return list(by_entries.values())

    def group_stats(self, names: list[str], device=None) -> LayerStats:
        """The statistics of a group of layers (from :meth:`groups`), built on ``device`` (default: where the
        inputs were recorded) from the recorded inputs in call order."""
        entries = [self._entries[i] for i in self._layers[names[0]]]
        position = list(self._layers).index(names[0])
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + position)
        st = None
        force_held = self.holdout > 0 and not self.heldout_samples.any()
        spilled = not all(torch.is_tensor(e.x) for e in entries)  # a spill file's handles: read back, one ahead
        with read_ahead(lambda e: e.x if torch.is_tensor(e.x) else e.x.to("cpu"), entries, ahead=spilled) as reads:
            for e, x in reads:
                dev = device if device is not None else e.x.device
                x, held = x.to(dev, non_blocking=True), e.held.to(dev, non_blocking=True)
                if st is None:
                    k = x.shape[1]
                    st = LayerStats(torch.zeros(k, device=dev), torch.zeros(k, dtype=torch.float64, device=dev))
                    if self.hessian:
                        st.gram = torch.zeros(k, k, dtype=torch.float64, device=dev)
                if force_held and st.heldout_rows is None and not held.any() and held.numel() > 1:
                    held = held.clone()
                    held[-1] = True  # every layer holds out at least one row
                _update(st, x, held, self.max_rows, gen)
        return st

    def release(self, names: list[str]) -> None:
        """Forget the recorded inputs of a group whose statistics are built (their memory is freed)."""
        for i in self._layers[names[0]]:
            self._entries[i] = None
        self._stats = None

    @property
    def stats(self) -> dict[str, LayerStats]:
        """Every layer's statistics (built once, where the inputs were recorded)."""
        if self._stats is None:
            self._stats = {}
            for names in self.groups():
                st = self.group_stats(names)
                self._stats.update(dict.fromkeys(names, st))
        return self._stats


@torch.no_grad()
def _update(st: LayerStats, x: torch.Tensor, held: torch.Tensor, max_rows: int, gen: torch.Generator) -> None:
    fit = x[~held]
    if fit.shape[0]:
        st.absmax = torch.maximum(st.absmax, fit.abs().amax(dim=0))
        for rows in row_chunks(*fit.shape):  # float64 squares a slice of rows at a time (1.1 GB at once at K=15,360)
            st.sq_sum += fit[rows].double().pow(2).sum(dim=0)
        st.count += fit.shape[0]
    if st.gram is not None:
        # the float32 product added in float64, a block of columns at a time: no K x K temporary beside the sums
        for c in range(0, fit.shape[1], GRAM_COLUMNS):
            st.gram[:, c:c + GRAM_COLUMNS].add_(fit.T @ fit[:, c:c + GRAM_COLUMNS])
        st.gram_count += fit.shape[0]
    _sample_rows(st, "rows", fit, max_rows, gen)
    _sample_rows(st, "heldout_rows", x[held], max_rows, gen)


def _sample_rows(st: LayerStats, attr: str, xf: torch.Tensor, max_rows: int, gen: torch.Generator) -> None:
    # Keeping the rows with the highest random priorities is a uniform sample without replacement.
    if xf.shape[0] == 0:
        return
    prio = torch.rand(xf.shape[0], generator=gen).to(xf.device)
    kept = getattr(st, attr)
    rows = xf if kept is None else torch.cat([kept, xf])
    prio = prio if attr not in st._priority else torch.cat([st._priority[attr], prio])
    if rows.shape[0] > max_rows:
        keep = torch.topk(prio, max_rows).indices.sort().values
        rows, prio = rows[keep], prio[keep]
    setattr(st, attr, rows.clone())
    st._priority[attr] = prio
