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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .factor import InverseFactor, inverse_factor
from .hadamard import rotate_both_sides_, rotated_diagonal
from .registry import FORMATS
from .rtn import (
    QuantizedWeight,
    _apply_smoothing,
    _check_weight,
    all_finite,
    assemble,
    check_rotation,
    group_params,
    grouped,
    num_groups,
    quantize,
    rotated,
    round_to_grid,
    row_chunks,
)
from .spec import QuantSpec, SpecError

log = logging.getLogger("squareq.quant")

ROTATE_TILE = 256  # rows (then columns) of the Hessian rotated at once: five such float64 tiles at most
DAMP_RETRIES = 4
# (block of W [N, B], its part of U [B, B], spec) -> (codes, scales, zeros, err): one block of the column sweep
# damping tried: damp, 10·damp, 100·damp, 1000·damp (relative to mean diag(H))
BlockSweep = Callable[[torch.Tensor, torch.Tensor, QuantSpec], tuple]


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


def _check_hessian(hessian: torch.Tensor, k: int) -> None:
    if hessian.dim() != 2 or tuple(hessian.shape) != (k, k):
        raise ValueError(f"the Hessian must be [{k}, {k}] for a weight with {k} inputs, got {tuple(hessian.shape)}.")


def _check_finite(h: torch.Tensor) -> torch.Tensor:
    # on the compute device: a Hessian kept in host memory would be scanned by the CPU at every call
    if not all_finite(h):
        raise ValueError("the Hessian contains NaN or Inf values; check the calibration activations.")
    return h


def symmetrize_(h: torch.Tensor, tile: int = 2048) -> torch.Tensor:
    """``h ← (h + hᵀ) / 2`` in place, tile by tile: the same value in every element as the one-line formula, without
    two more ``K × K`` float64 temporaries (at K = 15,360 each is 1.9 GB of a compile's VRAM budget)."""
    k = h.shape[0]
    for i0 in range(0, k, tile):
        for j0 in range(i0, k, tile):
            mean = (h[i0:i0 + tile, j0:j0 + tile] + h[j0:j0 + tile, i0:i0 + tile].T) * 0.5
            h[i0:i0 + tile, j0:j0 + tile] = mean
            h[j0:j0 + tile, i0:i0 + tile] = mean.T
    return h


@dataclass(frozen=True)
class GPTQFactor:
    """GPTQ's inverse factor of one layer's damped Hessian in the space a spec stores its weight in (rotated within
    its Hadamard groups or not, smoothed by one scale or not): every GPTQ run in that space shares it, whatever its
    width or clip ratio. The compiler's search factors once per space and layer instead of once per candidate
    (compiler/layer_search.py)."""

    factor: InverseFactor | None  # None: the factorization failed at every damping tried
    damp: float  # the relative damping used (the last one tried when it failed)
    dead_channels: int
    perm: torch.Tensor | None  # act_order's column order
    rotate_group: int  # the Hadamard group the Hessian was rotated with, 0 when not rotated
    smooth_scale: torch.Tensor | None  # the smoothing scale it was mapped with (compared by identity)
    k: int  # the layer's inputs
    damp_asked: float  # the damping it was asked for

    def fits(self, spec: QuantSpec, smooth_scale: torch.Tensor | None, act_order: bool) -> bool:
        """Whether a run under ``spec`` with ``smooth_scale`` and ``act_order`` may use this factor."""
        smooth = smooth_scale if spec.smooth else None
        return ((spec.group_size if spec.rotate else 0) == self.rotate_group and smooth is self.smooth_scale
                and act_order == (self.perm is not None))


def gptq_factor(hessian: torch.Tensor, spec: QuantSpec, smooth_scale: torch.Tensor | None = None,
                damp: float = 0.01, act_order: bool = False, device=None) -> GPTQFactor:
    """The :class:`GPTQFactor` of ``hessian [K, K]`` for weights stored under ``spec`` (its rotation and smoothing;
    its width and clip do not matter), on ``device`` (the Hessian's when None)."""
    k = hessian.shape[0]
    _check_hessian(hessian, k)
    if not (damp >= 0.0 and damp < float("inf")):
        raise ValueError(f"damp={damp} must be a finite non-negative fraction (0.01 is typical).")
    if spec.rotate and act_order:
        raise ValueError("GPTQ's act_order is not offered for a rotated spec; quantize it in column order.")
    check_rotation(spec, k)
    device = hessian.device if device is None else torch.device(device)
    inv64 = None
    if spec.smooth:
        ones = torch.ones((1, k), dtype=torch.float32, device=device)
        inv64 = _apply_smoothing(ones, spec, smooth_scale)[1].double()

    def prepare() -> torch.Tensor:
        # J H J (the order the factor needs; act_order's permutation folded in), copied in row tiles so that only
        # the float64 matrix is whole on the compute device
        order = (perm if perm is not None else torch.arange(k, device=device)).flip(0)
        h = torch.empty((k, k), dtype=torch.float64, device=device)
        for rows in row_chunks(k, k):
            if perm is None:
                part = hessian[k - rows.stop:k - rows.start].to(device).flip(0, 1)
            else:
                part = hessian[order[rows].to(hessian.device)].to(device)[:, order]
            h[rows] = part
        _check_finite(h)
        symmetrize_(h)
        if spec.rotate:
            # the stored weight W·H sees inputs x·H: H_r = H·Σ·H (the transform's few temporaries of ROTATE_TILE
            # rows stay within the factorization's own three K × 1024 panels, which compiler/vram.py budgets)
            rotate_both_sides_(h, spec.group_size, flipped=True, tile=ROTATE_TILE)
        if inv64 is not None:
            # The stored weight W·diag(s) sees inputs x·diag(1/s): H_s = diag(1/s) H diag(1/s).
            scale = inv64[order]
            h.mul_(scale[:, None]).mul_(scale[None, :])
        if n_dead:
            # A channel whose input is always zero: decouple it (row and column of H zeroed, H_kk = 1),
            # so its column is rounded to nearest and neither gives nor receives error.
            gone = dead[order]
            h[gone, :] = 0
            h[:, gone] = 0
            h[gone, gone] = 1.0
        return h

    diag = _prepared_diagonal(hessian, spec, inv64, device)
    dead = ~(diag > 0)
    n_dead = int(dead.sum())
    base = float(diag[~dead].mean()) if n_dead < k else 1.0
    perm = torch.argsort(diag, descending=True, stable=True) if act_order else None
    factor, used = inverse_factor(prepare, damp, base, DAMP_RETRIES)
    return GPTQFactor(factor, used, n_dead, perm, spec.group_size if spec.rotate else 0,
                      smooth_scale if spec.smooth else None, k, damp)


def gptq_quantize_with_info(
    w: torch.Tensor,
    spec: QuantSpec,
    hessian: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    sweep: BlockSweep | None = None,
    factor: GPTQFactor | None = None,
) -> tuple[QuantizedWeight, GPTQInfo]:
    """:func:`gptq_quantize`, also returning a :class:`GPTQInfo` (fallback flag, damping used). ``factor``: one
    :func:`gptq_factor` made for this Hessian, space and damping (it must :meth:`~GPTQFactor.fits`), instead of
    factoring again."""
    _check_weight(w)
    k = w.shape[1]
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be positive.")
    if spec.is_passthrough:
        return quantize(w, spec, smooth_scale), GPTQInfo(False, 0.0, 0)
    if not FORMATS[spec.format].gptq:
        raise SpecError(f"GPTQ rounds onto the int format's grid; a {spec.format} layer is quantized by rounding "
                        "(squareq.quant.quantize).")
    w = w.detach().float()
    _check_hessian(hessian, k)
    if factor is None:
        factor = gptq_factor(hessian, spec, smooth_scale, damp, act_order, w.device)
    elif not factor.fits(spec, smooth_scale, act_order):
        raise ValueError(f"this GPTQ factor was made for another space than {spec.label()} (rotation, smoothing "
                         "scale or act_order differ); make one with gptq_factor for it.")
    elif factor.k != k:
        raise ValueError(f"this GPTQ factor is for another layer: K={factor.k} there, K={k} here.")
    elif factor.damp_asked != damp:
        raise ValueError(f"this GPTQ factor was made with damping {factor.damp_asked:g}, not {damp:g}; make one with "
                         "gptq_factor at this damping.")
    if factor.factor is None:
        log.warning(
            "GPTQ: the Cholesky factorization of the %dx%d Hessian failed even with damping %.3g of its mean "
            "diagonal; this layer falls back to round-to-nearest.", k, k, factor.damp,
        )
        return quantize(w, spec, smooth_scale), GPTQInfo(True, factor.damp, factor.dead_channels)
    ws, inv = _apply_smoothing(rotated(w, spec), spec, smooth_scale)
    codes, scales, zeros = _gptq_codes(ws, factor.factor, spec, factor.perm, block_size, sweep or sweep_block,
                                       owned=inv is not None or spec.rotate)
    return assemble(spec, codes, scales, zeros, inv), GPTQInfo(False, factor.damp, factor.dead_channels)


def _prepared_diagonal(hessian: torch.Tensor, spec: QuantSpec, inv64: torch.Tensor | None, device) -> torch.Tensor:
    """H's diagonal as ``prepare()`` leaves it before the dead channels are decoupled (float64, on ``device``):
    symmetrizing keeps a diagonal as it is (a rotated one is computed from the symmetrized diagonal blocks with
    prepare's arithmetic), and smoothing scales it by the same two products."""
    if spec.rotate:
        diag = rotated_diagonal(hessian.detach(), spec.group_size, symmetrize=True, device=device)
    else:
        diag = hessian.detach().diagonal().to(device=device, dtype=torch.float64, copy=True)
    return diag * inv64 * inv64 if inv64 is not None else diag


def gptq_quantize(
    w: torch.Tensor,
    spec: QuantSpec,
    hessian: torch.Tensor,
    smooth_scale: torch.Tensor | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    sweep: BlockSweep | None = None,
    factor: GPTQFactor | None = None,
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
    :func:`squareq.quant.quantize`. With ``spec.rotate`` the weight is rotated first and ``hessian`` with it
    (``H·hessian·H``, inside the factorization's own matrix), as the stored weight ``W·H`` sees the inputs ``x·H``;
    ``act_order`` is then refused. ``sweep`` runs one block of columns (:func:`sweep_block`, the torch reference,
    when None; the compiler passes the Triton kernel's on a GPU, which gives the same bits). ``factor``: the
    :func:`gptq_factor` of ``hessian`` in this spec's space, shared by several runs (it gives the same bits as
    factoring here).
    """
    return gptq_quantize_with_info(w, spec, hessian, smooth_scale, damp, block_size, act_order, sweep, factor)[0]


def _gptq_codes(w: torch.Tensor, factor: InverseFactor, spec: QuantSpec, perm: torch.Tensor | None,
                block_size: int, sweep: BlockSweep, owned: bool = False):
    """Run the column sweep; returns (codes int8 [N, K] in original column order, scales, zeros). ``owned``: ``w``
    is the caller's scratch copy (the smoothed weight) and may be overwritten."""
    if perm is not None:
        return _static_codes(w, factor, spec, perm, block_size)
    n, k = w.shape
    g = spec.group_size
    codes = torch.empty((n, k), dtype=torch.int8, device=w.device)  # codes of up to 8 bits; a quarter of int32's
    scales = torch.empty((n, num_groups(k, g)), dtype=spec.torch_scale_dtype, device=w.device)
    zeros = None if spec.symmetric else torch.empty((n, num_groups(k, g)), dtype=torch.float32, device=w.device)
    w = w if owned else w.clone()
    # Blocks hold whole groups, so a group's parameters are chosen from fully updated columns.
    block_size = max(g, block_size - block_size % g)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        g0, g1 = b0 // g, num_groups(b1, g)
        u_rows = factor.rows(b0, b1)
        codes[:, b0:b1], scales[:, g0:g1], z, err = sweep(w[:, b0:b1], u_rows[:, b0:b1], spec)
        if zeros is not None:
            zeros[:, g0:g1] = z
        if b1 < k:
            w[:, b1:] -= err @ u_rows[:, b1:]
    return codes, scales, zeros


def sweep_block(blk: torch.Tensor, u_blk: torch.Tensor, spec: QuantSpec):
    """One block of GPTQ's column sweep, the torch reference: ``blk [N, B]`` (whole groups from the block's first
    column; overwritten), ``u_blk [B, B]`` the block's part of ``U``. Returns ``(codes int32 [N, B], scales [N, G_B]
    in the stored dtype, zeros float32 [N, G_B] or None, err float32 [N, B])``, where ``err`` is each column's
    rounding error divided by ``U[j, j]``, which the caller pushes onto the columns after the block.
    :mod:`squareq.kernels.triton_gptq` computes the same, bit for bit, in one kernel launch."""
    n, width = blk.shape
    g = spec.group_size
    groups = num_groups(width, g)
    codes = torch.empty((n, width), dtype=torch.int32, device=blk.device)
    scales = torch.empty((n, groups), dtype=spec.torch_scale_dtype, device=blk.device)
    zeros = None if spec.symmetric else torch.empty((n, groups), dtype=torch.float32, device=blk.device)
    err = torch.empty((n, width), dtype=torch.float32, device=blk.device)
    for j in range(width):
        gi = j // g
        if j % g == 0:
            s_new, z_new = group_params(blk[:, j: min(j + g, width)], spec)
            scales[:, gi] = s_new
            if zeros is not None:
                zeros[:, gi] = z_new
        z = None if zeros is None else zeros[:, gi]
        codes[:, j], err[:, j] = _column(blk, u_blk, j, scales[:, gi].float(), z, spec)
    return codes, scales, zeros, err


def _column(blk: torch.Tensor, u_blk: torch.Tensor, j: int, s: torch.Tensor, z: torch.Tensor | None,
            spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Round column ``j`` of ``blk`` on its group's grid and push its error onto the block's later columns; returns
    (its codes, int32; its error divided by ``U[j, j]``)."""
    x = blk[:, j]
    q = round_to_grid(x, s, z, spec)
    deq = (q if z is None else q - z) * s
    e = (x - deq) / u_blk[j, j]
    if j + 1 < blk.shape[1]:
        blk[:, j + 1:] -= e[:, None] * u_blk[j, j + 1:][None, :]
    return q.to(torch.int32), e


def _static_codes(w: torch.Tensor, factor: InverseFactor, spec: QuantSpec, perm: torch.Tensor, block_size: int):
    """The sweep in ``act_order`` (``perm``) with group parameters fixed up front from the original weight."""
    n, k = w.shape
    g = spec.group_size
    scales, zeros = group_params(grouped(w, g), spec)
    order = perm.tolist()
    w = w[:, perm].contiguous()
    codes = torch.empty((n, k), dtype=torch.int32, device=w.device)
    scale_f = scales.float()
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        blk = w[:, b0:b1]  # a view: updates land in w
        u_rows = factor.rows(b0, b1)
        u_blk = u_rows[:, b0:b1]
        err = torch.empty((n, b1 - b0), dtype=torch.float32, device=w.device)
        for j in range(b1 - b0):
            gi = order[b0 + j] // g
            z = None if zeros is None else zeros[:, gi]
            codes[:, order[b0 + j]], err[:, j] = _column(blk, u_blk, j, scale_f[:, gi], z, spec)
        if b1 < k:
            w[:, b1:] -= err @ u_rows[:, b1:]
    return codes, scales, zeros
