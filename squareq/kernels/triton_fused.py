"""Triton kernels: matmuls that read the packed W4/W6/W8 weight directly, for layers with few rows of input.

* forward: ``y[M, N] = x[M, K] @ W[N, K]ᵀ (+ bias)``
* input gradient: ``dx[M, K] = dy[M, N] @ W[N, K]``

``W`` is what :func:`squareq.quant.dequantize` defines (codes minus zero point, times the group scale, times the
folded 1/s of smoothing, rounded to bf16), built tile by tile in registers and never written to memory. Products
accumulate in fp32; the output is bf16. At small M (modulation layers run with M = batch size) a matmul is bound by
reading the weight, so reading 4-bit codes instead of a bf16 weight (that dequantization first wrote) saves most of
the traffic; at large M the dequantize-then-vendor-matmul path wins, and :mod:`.dispatch` picks per layer by M.

Tile shapes come from a short list of configurations autotuned per (device, shape, format) by Triton, which caches
the winner per key for the process. Under ``TRITON_INTERPRET=1`` (CI on a CPU) the tile products run in fp32, since
the interpreter has no bf16 matmul; bf16 operands are exact in fp32, so only the summation order differs.
"""
from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl

from ..quant import QuantizedWeight
from .triton_dequant import _bf16_bits_rne, _load_codes, _vec6_ok, packed_operands

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the winning configuration per key also goes to Triton's on-disk cache, so later processes skip the tuning
_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_CACHE.update(warmup=5, rep=20)  # milliseconds per candidate: enough to rank tiles of a few-µs kernel


@triton.jit
def _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, rows, row_mask, k0, K, row_bytes, n_groups, q_row_stride,
                 s_row_stride, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 HAS_SMOOTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr):
    """The bf16 weight tile W[rows, k0:k0 + BLOCK_K] (zeros outside the matrix), as the reference rounds it."""
    q = _load_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes, BITS, BLOCK_N, BLOCK_K, VEC6)
    NG: tl.constexpr = BLOCK_K // GROUP
    g = k0 // GROUP + tl.arange(0, NG)
    gm = row_mask[:, None] & (g[None, :] < n_groups)
    g_off = rows[:, None].to(tl.int64) * s_row_stride + g[None, :]
    s = tl.load(s_ptr + g_off, mask=gm, other=0.0).to(tl.float32)  # 0 outside: padded rows/columns weigh nothing
    q3 = tl.reshape(q, (BLOCK_N, NG, GROUP))
    if HAS_ZERO:
        z = tl.load(z_ptr + g_off, mask=gm, other=0).to(tl.int32)
        q3 = q3 - z[:, :, None]
    w = tl.reshape(q3.to(tl.float32) * s[:, :, None], (BLOCK_N, BLOCK_K))
    if HAS_SMOOTH:
        cols = k0 + tl.arange(0, BLOCK_K)
        w = w * tl.load(inv_ptr + cols, mask=cols < K, other=0.0)[None, :]
    return _bf16_bits_rne(w).to(tl.bfloat16, bitcast=True)


def _configs(kind: str) -> list[triton.Config]:
    """Autotuning candidates. The fused path serves few rows, so M tiles are narrow and the reduction axis (K for
    the forward, N for the input gradient) is split over SPLIT programs, each writing its fp32 partial sum to its
    own plane that the wrapper adds up in a fixed order (deterministic, unlike atomics): without the split a
    3072-wide layer gives an H100's 132 SMs a few dozen programs."""
    if _INTERPRET or os.environ.get("SQUAREQ_FUSED_AUTOTUNE") == "0":  # one configuration, no tuning (tests)
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT": 2}, num_warps=4)]
    out = []
    for bm in (16, 64):
        for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (32, 256, 4), (64, 256, 8)):
            for split in (1, 4, 8):
                out.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split},
                                         num_warps=warps, num_stages=3))
    return out


@triton.autotune(configs=_configs("forward"), key=["M_BUCKET", "N", "K", "BITS", "GROUP", "HAS_ZERO", "HAS_SMOOTH"],
                 prune_configs_by={"early_config_prune": lambda configs, named, **kw: _prune(configs, {**named, **kw})},
                 **_CACHE)
@triton.jit
def _fused_forward(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, b_ptr, y_ptr, M, N, K, M_BUCKET, row_bytes, n_groups,
                   x_row_stride, q_row_stride, s_row_stride, y_row_stride, y_plane_stride,
                   BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                   HAS_BIAS: tl.constexpr, VEC6: tl.constexpr, FP32_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    for k0 in range(pid_s * per_split, tl.minimum(K, (pid_s + 1) * per_split), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None].to(tl.int64) * x_row_stride + kk[None, :],
                    mask=m_mask[:, None] & (kk[None, :] < K), other=0.0)
        w = _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, n, n_mask, k0, K, row_bytes, n_groups, q_row_stride,
                         s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        if pid_s == 0:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    plane = y_ptr + pid_s.to(tl.int64) * y_plane_stride
    tl.store(plane + m[:, None].to(tl.int64) * y_row_stride + n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.autotune(configs=_configs("grad"), key=["M_BUCKET", "N", "K", "BITS", "GROUP", "HAS_ZERO", "HAS_SMOOTH"],
                 prune_configs_by={"early_config_prune": lambda configs, named, **kw: _prune(configs, {**named, **kw})},
                 **_CACHE)
@triton.jit
def _fused_input_grad(dy_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, dx_ptr, M, N, K, M_BUCKET, row_bytes, n_groups,
                      dy_row_stride, q_row_stride, s_row_stride, dx_row_stride, dx_plane_stride,
                      BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                      VEC6: tl.constexpr, FP32_DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = pid_k * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    m_mask = m < M
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT) * BLOCK_N
    for n0 in range(pid_s * per_split, tl.minimum(N, (pid_s + 1) * per_split), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < N
        dy = tl.load(dy_ptr + m[:, None].to(tl.int64) * dy_row_stride + n[None, :],
                     mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        w = _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, n, n_mask, k0, K, row_bytes, n_groups, q_row_stride,
                         s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6)
        if FP32_DOT:
            acc += tl.dot(dy.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(dy, w)
    plane = dx_ptr + pid_s.to(tl.int64) * dx_plane_stride
    tl.store(plane + m[:, None].to(tl.int64) * dx_row_stride + kk[None, :], acc, mask=m_mask[:, None] & (kk[None, :] < K))


def _prune(configs, named):
    """Keep configurations whose K tile holds whole groups (and 64-code chunks for vectorized W6) and whose M tile
    is not far wider than the rows there are."""
    group, m = named["GROUP"], named["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] % group == 0 and c.kwargs["BLOCK_K"] % 64 == 0
            and c.kwargs["BLOCK_M"] <= max(16, m)]
    return kept or [triton.Config({**configs[0].kwargs, "BLOCK_K": max(group, 64), "BLOCK_M": 16},
                                  num_warps=configs[0].num_warps)]


MAX_SPLIT = 8  # the largest SPLIT of any configuration


def _sum_planes(planes: torch.Tensor, kernel) -> torch.Tensor:
    """The bf16 sum of the partial-sum planes the last launch of ``kernel`` wrote (its chosen configuration's
    SPLIT), added in plane order so that a result does not depend on which program finished first."""
    split = kernel.best_config.kwargs["SPLIT"]
    total = planes[0] if split == 1 else planes[:split].sum(0)
    return total.to(torch.bfloat16)


def _m_bucket(m: int) -> int:
    """Autotune once per power of two of M, not per M."""
    return 1 << max(0, (m - 1).bit_length())


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [..., width] as a 2-D [rows, width] view with unit column stride."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(kernel, grid, qw: QuantizedWeight, rows: torch.Tensor, planes: torch.Tensor, *args, **flags) -> None:
    """Launch a fused kernel on ``rows`` into ``planes`` (one fp32 plane per split) with ``qw``'s packed operands and
    format flags; ``args`` / ``flags`` are the kernel's own (bias, its HAS_BIAS)."""
    spec, m = qw.spec, rows.shape[0]
    vec6 = spec.bits == 6 and _vec6_ok(qw.tensors["qweight"])  # whole 48-byte chunks per row, 16-byte aligned
    qweight, scales, zeros, inv = packed_operands(qw, vec6)
    n, k = qw.shape
    row_bytes = qw.tensors["qweight"].shape[1]
    kernel[grid](rows, qweight, scales, zeros, inv, *args, planes, m, n, k, _m_bucket(m), row_bytes, scales.shape[1],
                 rows.stride(0), qweight.stride(0), scales.stride(0), planes.stride(1),
                 planes.stride(0), BITS=spec.bits, GROUP=spec.group_size, HAS_ZERO="zeros" in qw.tensors,
                 HAS_SMOOTH="inv_smooth" in qw.tensors, VEC6=vec6, FP32_DOT=_INTERPRET or rows.device.type != "cuda",
                 **flags)


def fused_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ Wᵀ (+ bias)`` in bf16 for bf16 ``x`` [..., K], reading ``qw``'s packed codes directly."""
    n, k = qw.shape
    x2 = _rows(x, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    y = torch.empty(MAX_SPLIT, m, n, dtype=torch.float32, device=x.device)  # one fp32 plane per split

    def grid(meta):
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT"]

    _launch(_fused_forward, grid, qw, x2, y, bias if bias is not None else qw.tensors["scales"],
            HAS_BIAS=bias is not None)
    return _sum_planes(y, _fused_forward).view(*x.shape[:-1], n)


def fused_input_grad(dy: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``dy @ W`` in bf16 for bf16 ``dy`` [..., N]: the input gradient of :func:`fused_linear`."""
    n, k = qw.shape
    dy2 = _rows(dy, n)
    m = dy2.shape[0]
    if m == 0:
        return dy.new_empty(*dy.shape[:-1], k, dtype=torch.bfloat16)
    dx = torch.empty(MAX_SPLIT, m, k, dtype=torch.float32, device=dy.device)

    def grid(meta):
        return triton.cdiv(k, meta["BLOCK_K"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT"]

    _launch(_fused_input_grad, grid, qw, dy2, dx)
    return _sum_planes(dx, _fused_input_grad).view(*dy.shape[:-1], k)
