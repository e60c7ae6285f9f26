"""Triton kernels: matmuls that read the packed W4/W6/W8 weight directly, for layers with few rows of input.

* forward: ``y[M, N] = x[M, K] @ W[N, K]ᵀ (+ bias)``
* input gradient: ``dx[M, K] = dy[M, N] @ W[N, K]``

``W`` is what :func:`squareq.quant.dequantize` defines (codes minus zero point, times the group scale, times the
folded 1/s of smoothing, times the Hadamard rotation of a rotated layer), built tile by tile in registers and never
written to memory; products accumulate in fp32 and the output is bf16. At small M (modulation layers run with M =
batch size) a matmul is bound by reading the weight, so reading 4-bit codes instead of a bf16 weight (that
dequantization first wrote) saves most of the traffic; at large M the dequantize-then-vendor-matmul path wins, and
:mod:`.dispatch` picks per layer by M.

Two kernel shapes, both turning codes into floats with one exact subtraction instead of an int-to-float
conversion (see :func:`_centered_codes`):

* GEMV (one row): no tensor cores, plain fp32 FMAs; scales apply once per group, smoothing's 1/s and a rotated
  layer's Hadamard rotation to the input row (forward: ``x·(D·diag(1/s)·H)ᵀ = ((x·H)·diag(1/s))·Dᵀ``, H being
  symmetric) or the result (gradient) instead of every weight, and the weight is never rounded to bf16, so results
  differ from the dequantize path by that rounding and the order of the sums only.
* MMA (more rows): the bf16 weight tile, rounded as the reference rounds it (rotated layers: the butterfly of
  :mod:`squareq.quant.hadamard` on the fp32 tile, launched with floating-point fusion off), feeds ``tl.dot``.

For few rows the reduction axis (K for the forward, N for the input gradient) is split over SPLIT programs, each
writing its fp32 partial sum to its own plane; one small kernel adds the planes in a fixed order (deterministic,
unlike atomics: a redone training step sees the same bits). Unsplit configurations store bf16 directly.
Tile shapes come from short lists of configurations autotuned per (device, shape, format) by Triton, which caches
the winner on disk. Under ``TRITON_INTERPRET=1`` (CI on a CPU) tile products run in fp32, since the interpreter has
no bf16 matmul, and rounding to bf16 is done in integer arithmetic, since it truncates.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from .. import settings
from ..quant import QuantizedWeight
from .triton_dequant import (
    _bf16_bits_rne,
    _biased_codes,
    _hadamard_groups,
    _vec6_ok,
    packed_operands,
    rotation_constants,
)

_INTERPRET = settings.triton_interpret()  # fixed at import, with the autotuning list
# the winning configuration per key also goes to Triton's on-disk cache, so later processes skip the tuning
_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_CACHE.update(warmup=5, rep=20)  # milliseconds per candidate: enough to rank tiles of a few-µs kernel
_KEY = ["M_BUCKET", "N", "K", "BITS", "GROUP", "HAS_ZERO", "HAS_SMOOTH", "ROT_STAGES"]

MAX_SPLIT = 16  # the largest SPLIT of any configuration
SPLIT_MAX_M = 64  # configurations for more rows than this do not split the reduction (enough programs without)


def _configs(tiles, splits, fixed: dict) -> list[triton.Config]:
    """One configuration per (tile, split) of the lists, or ``fixed`` alone when tuning is off. The tuner times a
    kernel alone, so a split configuration's plane sum (one small extra launch) is not in its time."""
    if _INTERPRET or not settings.fused_autotune():  # no tuning (interpreter, tests)
        return [triton.Config(fixed, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, **extra}, num_warps=warps, num_stages=3)
            for bn, bk, warps, extra in tiles for split in splits]


def _prune(configs, named):
    """Keep configurations whose K tile holds whole groups (and 64-code chunks for vectorized W6), whose M tile is
    not far wider than the rows there are, and that split only for few rows."""
    group, m = named["GROUP"], named["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] % group == 0 and c.kwargs["BLOCK_K"] % 64 == 0
            and c.kwargs.get("BLOCK_M", 16) <= max(16, m) and (m <= SPLIT_MAX_M or c.kwargs["SPLIT"] == 1)]
    return kept or [triton.Config({**configs[0].kwargs, "BLOCK_K": max(group, 64), "SPLIT": 1,
                                   **({"BLOCK_M": 16} if "BLOCK_M" in configs[0].kwargs else {})},
                                  num_warps=configs[0].num_warps)]


def _tuned(configs):
    return triton.autotune(configs=configs, key=_KEY, **_CACHE, prune_configs_by={
        "early_config_prune": lambda configs, named, **kw: _prune(configs, {**named, **kw})})


@triton.jit
def _centered_codes(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, row_bytes, n_groups, q_row_stride, s_row_stride,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, VEC6: tl.constexpr):
    """(code − zero point as fp32 [rows, groups, GROUP], fp32 scales [rows, groups]) of columns [k0, k0 + BLOCK_K);
    scales are 0 outside the matrix, so padded rows and columns weigh nothing.

    The codes become floats without an int-to-float conversion (a quarter-rate instruction that bounded these
    kernels): a biased code u < 2^23 OR-ed into the exponent of 2^23 reads as the float 2^23 + u, and one
    subtraction of 2^23 + bias + zero point, exact in fp32, leaves q − z.
    """
    u = _biased_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes, BITS, BLOCK_N, BLOCK_K, VEC6)
    NG: tl.constexpr = BLOCK_K // GROUP
    g = k0 // GROUP + tl.arange(0, NG)
    gm = row_mask[:, None] & (g[None, :] < n_groups)
    g_off = rows[:, None].to(tl.int64) * s_row_stride + g[None, :]
    s = tl.load(s_ptr + g_off, mask=gm, other=0.0).to(tl.float32)
    c = tl.full((BLOCK_N, NG), 8388608.0 + (1 << (BITS - 1)), tl.float32)
    if HAS_ZERO:
        c += tl.load(z_ptr + g_off, mask=gm, other=0).to(tl.float32)
    f = (tl.reshape(u, (BLOCK_N, NG, GROUP)) | 0x4B000000).to(tl.float32, bitcast=True)
    return f - c[:, :, None], s


@triton.jit
def _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, rows, row_mask, k0, K, row_bytes, n_groups, q_row_stride,
                 s_row_stride, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 HAS_SMOOTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr,
                 INTERPRETED: tl.constexpr, ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    """The bf16 weight tile W[rows, k0:k0 + BLOCK_K] (zeros outside the matrix), as the reference rounds it."""
    qz, s = _centered_codes(q_ptr, s_ptr, z_ptr, rows, row_mask, k0, row_bytes, n_groups, q_row_stride,
                            s_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K, VEC6)
    w = tl.reshape(qz * s[:, :, None], (BLOCK_N, BLOCK_K))
    if HAS_SMOOTH:
        cols = k0 + tl.arange(0, BLOCK_K)
        w = w * tl.load(inv_ptr + cols, mask=cols < K, other=0.0)[None, :]
    if ROT_STAGES > 0:
        w = _hadamard_groups(w, BLOCK_N, BLOCK_K, GROUP, ROT_STAGES, ROT_SCALE)
    return _to_bf16(w, INTERPRETED)


@triton.jit
def _store_result(acc, out_ptr, plane_ptr, m, cols, mask, row_stride, plane_stride, pid_s, SPLIT: tl.constexpr):
    """An fp32 result tile [m, cols]: bf16 into the output (an int16 view) when the reduction is not split, else
    split ``pid_s``'s fp32 partial sums into its plane."""
    off = m[:, None].to(tl.int64) * row_stride + cols[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + off, _bf16_bits_rne(acc), mask=mask)
    else:
        tl.store(plane_ptr + pid_s.to(tl.int64) * plane_stride + off, acc, mask=mask)


@triton.jit
def _to_bf16(x, INTERPRETED: tl.constexpr):
    """fp32 -> bf16, nearest even (the interpreter's own cast truncates)."""
    if INTERPRETED:
        return _bf16_bits_rne(x).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _sum_planes(plane_ptr, out_ptr, numel, plane_stride, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out (int16 view of bf16) = the planes' sum, added in plane order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(plane_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        total += tl.load(plane_ptr + s * plane_stride + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _bf16_bits_rne(total), mask=mask)


# ---- GEMV: one row, plain FMAs -------------------------------------------------------------------------------

@_tuned(_configs(((8, 256, 2, {}), (16, 256, 4, {}), (32, 256, 4, {}), (32, 256, 8, {}), (64, 256, 8, {}),
                  (16, 512, 4, {}), (32, 512, 8, {})),
                 (1, 2, 4, 8), {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT": 1}))
@triton.jit
def _gemv_forward(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, b_ptr, out_ptr, plane_ptr, M, N, K, M_BUCKET, row_bytes,
                  n_groups, x_row_stride, q_row_stride, s_row_stride, out_row_stride, plane_stride,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                  HAS_BIAS: tl.constexpr, VEC6: tl.constexpr, INTERPRETED: tl.constexpr,
                  ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    # each step sums its groups, then scales the group sums (one multiply per group, not per weight; measured
    # faster on an H100 than accumulating every product in its own lane, on every FLUX shape and format)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    NG: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros((BLOCK_N, NG), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    for k0 in range(pid_s * per_split, tl.minimum(K, (pid_s + 1) * per_split), BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        if ROT_STAGES > 0:
            x = tl.reshape(_hadamard_groups(tl.reshape(x, (1, BLOCK_K)), 1, BLOCK_K, GROUP, ROT_STAGES, ROT_SCALE),
                           (BLOCK_K,))
        if HAS_SMOOTH:
            x = x * tl.load(inv_ptr + kk, mask=kk < K, other=0.0)
        qz, s = _centered_codes(q_ptr, s_ptr, z_ptr, n, n_mask, k0, row_bytes, n_groups, q_row_stride,
                                s_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K, VEC6)
        acc += tl.sum(qz * tl.reshape(x, (NG, GROUP))[None, :, :], axis=2) * s
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        if pid_s == 0:
            y += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    _store_result(y[None, :], out_ptr, plane_ptr, tl.arange(0, 1), n, n_mask[None, :], out_row_stride,
                  plane_stride, pid_s, SPLIT)


@_tuned(_configs(((32, 64, 4, {}), (64, 64, 4, {}), (64, 64, 8, {}), (128, 64, 8, {}), (32, 128, 4, {}),
                  (32, 128, 8, {}), (16, 256, 4, {})),
                 (4, 8, 16), {"BLOCK_N": 16, "BLOCK_K": 128, "SPLIT": 4}))
@triton.jit
def _gemv_input_grad(dy_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, out_ptr, plane_ptr, M, N, K, M_BUCKET, row_bytes,
                     n_groups, dy_row_stride, q_row_stride, s_row_stride, out_row_stride, plane_stride,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                     VEC6: tl.constexpr, INTERPRETED: tl.constexpr, ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    # dx[k] = inv[k] · Σ_n dy[n] · s[n, g(k)] · (q[n, k] − z[n, g(k)]): the products accumulate in their own lanes
    # over the split, the sum over n happens once at the end
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    k0 = pid_k * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    NG: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros((BLOCK_N, NG, GROUP), dtype=tl.float32)
    per_split = tl.cdiv(tl.cdiv(N, BLOCK_N), SPLIT) * BLOCK_N
    for n0 in range(pid_s * per_split, tl.minimum(N, (pid_s + 1) * per_split), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < N
        dy = tl.load(dy_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
        qz, s = _centered_codes(q_ptr, s_ptr, z_ptr, n, n_mask, k0, row_bytes, n_groups, q_row_stride,
                                s_row_stride, BITS, GROUP, HAS_ZERO, BLOCK_N, BLOCK_K, VEC6)
        acc += (dy[:, None] * s)[:, :, None] * qz
    dx = tl.reshape(tl.sum(acc, axis=0), (BLOCK_K,))
    if HAS_SMOOTH:
        dx = dx * tl.load(inv_ptr + kk, mask=kk < K, other=0.0)
    if ROT_STAGES > 0:  # each split's partial sum is rotated: the rotation is linear, the planes add up the same
        dx = tl.reshape(_hadamard_groups(tl.reshape(dx, (1, BLOCK_K)), 1, BLOCK_K, GROUP, ROT_STAGES, ROT_SCALE),
                        (BLOCK_K,))
    _store_result(dx[None, :], out_ptr, plane_ptr, tl.arange(0, 1), kk, (kk < K)[None, :], out_row_stride,
                  plane_stride, pid_s, SPLIT)


# ---- MMA: more rows, tensor cores ----------------------------------------------------------------------------

def _mma_configs(fixed_split: int):
    tiles = [(bn, bk, warps, {"BLOCK_M": bm}) for bm in (16, 64)
             for bn, bk, warps in ((64, 128, 4), (128, 128, 4), (32, 256, 4), (64, 256, 8))]
    return _configs(tiles, (1, 4, 8), {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "SPLIT": fixed_split})


# the untuned configurations (tests) store both ways: directly for the GEMV forward and the MMA input gradient,
# through split planes for the other two
@_tuned(_mma_configs(2))
@triton.jit
def _mma_forward(x_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, b_ptr, out_ptr, plane_ptr, M, N, K, M_BUCKET, row_bytes,
                 n_groups, x_row_stride, q_row_stride, s_row_stride, out_row_stride, plane_stride,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                 HAS_BIAS: tl.constexpr, VEC6: tl.constexpr, INTERPRETED: tl.constexpr,
                 ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr,
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
                         s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, INTERPRETED,
                         ROT_STAGES, ROT_SCALE)
        if INTERPRETED:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        if pid_s == 0:
            acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_result(acc, out_ptr, plane_ptr, m, n, m_mask[:, None] & n_mask[None, :], out_row_stride, plane_stride,
                  pid_s, SPLIT)


@_tuned(_mma_configs(1))
@triton.jit
def _mma_input_grad(dy_ptr, q_ptr, s_ptr, z_ptr, inv_ptr, out_ptr, plane_ptr, M, N, K, M_BUCKET, row_bytes,
                    n_groups, dy_row_stride, q_row_stride, s_row_stride, out_row_stride, plane_stride,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    VEC6: tl.constexpr, INTERPRETED: tl.constexpr, ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr,
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
                         s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, INTERPRETED,
                         ROT_STAGES, ROT_SCALE)
        if INTERPRETED:
            acc += tl.dot(dy.to(tl.float32), w.to(tl.float32))
        else:
            acc += tl.dot(dy, w)
    _store_result(acc, out_ptr, plane_ptr, m, kk, m_mask[:, None] & (kk[None, :] < K), out_row_stride, plane_stride,
                  pid_s, SPLIT)


# ---- launching ------------------------------------------------------------------------------------------------

def _m_bucket(m: int) -> int:
    """Autotune once per power of two of M, not per M."""
    return 1 << max(0, (m - 1).bit_length())


def _rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [..., width] as a 2-D [rows, width] view with unit column stride."""
    t2 = t.reshape(-1, width)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


VARIANT_ENV = settings.FUSED_VARIANT
_KERNELS = {("gemv", "forward"): _gemv_forward, ("gemv", "input grad"): _gemv_input_grad,
            ("mma", "forward"): _mma_forward, ("mma", "input grad"): _mma_input_grad}


def _variant(m: int, bits: int, direction: str) -> str:
    """The kernel shape for ``m`` rows: GEMV for one row, MMA otherwise (``SQUAREQ_FUSED_VARIANT=mma`` for one
    row too). The W6 input gradient stays on MMA: its GEMV ran at a third of bf16 speed on an H100 (the 48-byte
    chunks of W6 rows fit the narrow K tiles this kernel needs badly), where MMA reached two thirds."""
    wanted = settings.fused_variant() or ("mma" if bits == 6 and direction == "input grad" else "gemv")
    if wanted not in ("gemv", "mma"):
        raise ValueError(f"{VARIANT_ENV}={wanted!r}: use gemv or mma (or leave it unset).")
    return wanted if m == 1 else "mma"


def _run(direction: str, qw: QuantizedWeight, rows: torch.Tensor, *args, **flags) -> torch.Tensor:
    """Launch the chosen kernel of ``direction`` on ``rows`` with ``qw``'s packed operands; returns the bf16 result
    [rows, N or K], adding the split planes in order when the chosen configuration split the reduction.
    ``args`` / ``flags`` are the kernel's own (bias, HAS_BIAS)."""
    spec, m = qw.spec, rows.shape[0]
    n, k = qw.shape
    variant = _variant(m, spec.bits, direction)
    kernel = _KERNELS[(variant, direction)]
    width = n if direction == "forward" else k

    def grid(meta):
        tile = meta["BLOCK_N"] if direction == "forward" else meta["BLOCK_K"]
        if variant == "gemv":
            return triton.cdiv(width, tile), meta["SPLIT"]
        return triton.cdiv(width, tile), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT"]

    out = torch.empty(m, width, dtype=torch.bfloat16, device=rows.device)
    # planes for every split the launch may use: pruning keeps more rows than SPLIT_MAX_M unsplit, but the
    # autotuner skips pruning when it has one configuration (tuning off), so that one's split counts then
    splits = kernel.configs[0].kwargs["SPLIT"] if len(kernel.configs) == 1 else MAX_SPLIT if m <= SPLIT_MAX_M else 1
    planes = torch.empty(splits, m, width, dtype=torch.float32, device=rows.device) if splits > 1 else out
    vec6 = spec.bits == 6 and _vec6_ok(qw.tensors["qweight"])  # whole 48-byte chunks per row, 16-byte aligned
    qweight, scales, zeros, inv = packed_operands(qw, vec6)
    row_bytes = qw.tensors["qweight"].shape[1]
    rotation = rotation_constants(spec)
    if variant == "gemv":  # its sums are not the reference's anyway; fused multiply-adds keep it fast
        rotation.pop("enable_fp_fusion", None)
    kernel[grid](rows, qweight, scales, zeros, inv, *args, out.view(torch.int16), planes, m, n, k, _m_bucket(m),
                 row_bytes, scales.shape[1], rows.stride(0), qweight.stride(0), scales.stride(0), out.stride(0),
                 m * width, BITS=spec.bits, GROUP=spec.group_size, HAS_ZERO="zeros" in qw.tensors,
                 HAS_SMOOTH="inv_smooth" in qw.tensors, VEC6=vec6, INTERPRETED=_INTERPRET or rows.device.type != "cuda",
                 **rotation, **flags)
    split = kernel.best_config.kwargs["SPLIT"]
    if split > 1:
        block = 1024
        _sum_planes[(triton.cdiv(m * width, block),)](planes, out.view(torch.int16), m * width, m * width,
                                                      SPLIT=split, BLOCK=block)
    return out


def fused_linear(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ Wᵀ (+ bias)`` in bf16 for bf16 ``x`` [..., K], reading ``qw``'s packed codes directly."""
    n, k = qw.shape
    x2 = _rows(x, k)
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    y = _run("forward", qw, x2, bias if bias is not None else qw.tensors["scales"], HAS_BIAS=bias is not None)
    return y.view(*x.shape[:-1], n)


def fused_input_grad(dy: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """``dy @ W`` in bf16 for bf16 ``dy`` [..., N]: the input gradient of :func:`fused_linear`."""
    n, k = qw.shape
    dy2 = _rows(dy, n)
    if dy2.shape[0] == 0:
        return dy.new_empty(*dy.shape[:-1], k, dtype=torch.bfloat16)
    dx = _run("input grad", qw, dy2)
    return dx.view(*dy.shape[:-1], k)
