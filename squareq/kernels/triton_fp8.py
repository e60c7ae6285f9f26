"""Triton kernels that make FP8 compute operands: rows to E4M3 codes with one fp32 scale per row.

* :func:`prepare_rows_fp8`: bf16 rows (activations per token, or a weight already in bf16) to codes + scales.
* :func:`prepare_int_fp8`: packed int codes + group scales straight to E4M3 rows, one byte written per weight
  (the bf16 weight of :mod:`.triton_dequant` is formed in registers and never stored).

Both compute exactly what :func:`squareq.quant.fp8_rows.quantize_rows` defines (for weights: of the bf16 weight
:func:`squareq.quant.dequantize` gives), bit for bit. On a GPU the rounding to E4M3 and to bf16 is the hardware's
conversion. Under the Triton interpreter, whose float8 conversion rounds wrongly, the same rounding is done in
integer arithmetic (it was the GPU path too until the profile of a FLUX step showed the weight kernel at a quarter
of the memory bandwidth); CPU-interpreted and CUDA results are the same bits.
The row kernel's programs each take one whole row: a pass over K finds its largest magnitude, a second writes the
codes. The int weight kernel works in the dequant kernel's tiles, with the row maxima found once per layer (see
:func:`prepare_int_fp8`).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import settings
from ..quant import QuantizedWeight
from .triton_dequant import _bf16_bits_rne, _vec6_ok, _weight_tile, default_tile, packed_operands, rotation_constants
from .triton_launch import DirectLaunch


@triton.jit
def _e4m3_bits(y):
    """E4M3 ("fn") bits, as uint8, of fp32 ``y`` with |y| ≤ 448, rounded to nearest, ties to even."""
    b = y.to(tl.uint32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)  # round the 23-bit mantissa to 3 bits; a carry moves into the exponent
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)  # rebias the exponent from 127 to 7
    # below 2^-6 E4M3 is subnormal: steps of 2^-9, i.e. round(|y| * 512), here by the 2^23 magic number
    f = a.to(tl.float32, bitcast=True) * 512.0
    sub = ((f + 8388608.0) - 8388608.0).to(tl.uint32)
    return (tl.where(a >= 0x3C800000, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _row_inverse(amax):
    """(scale, inverse) of rows with largest magnitude ``amax``, as quant.fp8_rows.row_scales computes them."""
    nonzero = amax > 0
    inverse = tl.where(nonzero, tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), tl.where(nonzero, amax, 1.0)),
                       0.0)
    return tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), inverse


@triton.jit
def _codes(x, inverse, HW: tl.constexpr):
    y = tl.minimum(tl.maximum(x * inverse[:, None], -448.0), 448.0)
    if HW:  # the GPU's own conversion: the same rounding, a fraction of the integer work
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return _e4m3_bits(y)


@triton.jit
def _bf16_value(w, HW: tl.constexpr):
    """fp32 ``w`` rounded to its bf16 value, kept in fp32."""
    if HW:
        return w.to(tl.bfloat16).to(tl.float32)
    return (_bf16_bits_rne(w).to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _rows_kernel(x_ptr, out_ptr, scale_ptr, col_ptr, R, K, x_stride, out_stride,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, HW: tl.constexpr,
                 HAS_COL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    x_base = x_ptr + rows[:, None].to(tl.int64) * x_stride
    out_base = out_ptr + rows[:, None].to(tl.int64) * out_stride
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row fits one tile: read it once
        m = row_mask[:, None] & (cols[None, :] < K)
        x = tl.load(x_base + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_COL:  # each column scaled first, in fp32 (the input gradient's folded weight scales)
            x = x * tl.load(col_ptr + cols, mask=cols < K, other=0.0)[None, :]
        scale, inverse = _row_inverse(tl.max(tl.abs(x), axis=1))
        tl.store(out_base + cols[None, :], _codes(x, inverse, HW), mask=m)
    else:
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            m = row_mask[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_base + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_COL:
                x = x * tl.load(col_ptr + k0 + cols, mask=k0 + cols < K, other=0.0)[None, :]
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale, inverse = _row_inverse(amax)
        for k0 in range(0, K, BLOCK_K):
            m = row_mask[:, None] & (k0 + cols[None, :] < K)
            x = tl.load(x_base + k0 + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if HAS_COL:
                x = x * tl.load(col_ptr + k0 + cols, mask=k0 + cols < K, other=0.0)[None, :]
            tl.store(out_base + k0 + cols[None, :], _codes(x, inverse, HW), mask=m)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


@triton.jit
def _int_tile(q_ptr, s_ptr, z_ptr, inv_ptr, N, K, row_bytes, n_groups, q_row_stride, s_row_stride,
              BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr, HW: tl.constexpr,
              ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    """This program's tile of the bf16 weight (as fp32 values; 0 outside the matrix), its rows and columns."""
    pid_k = tl.program_id(0)  # consecutive programs walk along K within one row block, as the dequant kernel's
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k0 = pid_k * BLOCK_K
    w = _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, rows, row_mask, k0, K, row_bytes, n_groups, q_row_stride,
                     s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, ROT_STAGES, ROT_SCALE)
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.where(row_mask[:, None] & (cols[None, :] < K), _bf16_value(w, HW), 0.0), rows, row_mask, cols


@triton.jit
def _int_amax_kernel(q_ptr, s_ptr, z_ptr, inv_ptr, amax_ptr,
                     N, K, row_bytes, n_groups, q_row_stride, s_row_stride,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr, HW: tl.constexpr,
                     ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    """Each row's largest magnitude, gathered over the K tiles with an atomic max (``amax`` starts at 0)."""
    w, rows, row_mask, cols = _int_tile(q_ptr, s_ptr, z_ptr, inv_ptr, N, K, row_bytes, n_groups, q_row_stride,
                                        s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, HW,
                                        ROT_STAGES, ROT_SCALE)
    tl.atomic_max(amax_ptr + rows, tl.max(tl.abs(w), axis=1), mask=row_mask)


@triton.jit
def _int_fp8_kernel(q_ptr, s_ptr, z_ptr, inv_ptr, amax_ptr, out_ptr, scale_ptr,
                    N, K, row_bytes, n_groups, q_row_stride, s_row_stride, out_row_stride, out_col_stride,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr, HW: tl.constexpr,
                    ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    w, rows, row_mask, cols = _int_tile(q_ptr, s_ptr, z_ptr, inv_ptr, N, K, row_bytes, n_groups, q_row_stride,
                                        s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, HW,
                                        ROT_STAGES, ROT_SCALE)
    scale, inverse = _row_inverse(tl.load(amax_ptr + rows, mask=row_mask, other=0.0))
    out_off = rows[:, None].to(tl.int64) * out_row_stride + cols[None, :].to(tl.int64) * out_col_stride
    tl.store(out_ptr + out_off, _codes(w, inverse, HW), mask=row_mask[:, None] & (cols[None, :] < K),
             cache_modifier=".cs")
    if tl.program_id(0) == 0:  # one program per row block writes the scales
        tl.store(scale_ptr + rows, scale, mask=row_mask)


def _check(out: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int], transposed_ok: bool = False) -> None:
    unit = out.stride(-1) == 1 or (transposed_ok and out.stride(0) == 1 and out.stride(1) == shape[0])
    if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != tuple(shape) or not unit:
        raise ValueError(f"FP8 output must be float8_e4m3fn {tuple(shape)} with unit column stride"
                         f"{' (or the transposed layout)' if transposed_ok else ''}; got {out.dtype} "
                         f"{tuple(out.shape)} stride {out.stride()}.")
    if scales.dtype != torch.float32 or scales.shape != (shape[0],):
        raise ValueError(f"row scales must be float32 [{shape[0]}]; got {scales.dtype} {tuple(scales.shape)}.")


def _hardware_conversion() -> bool:
    """Whether the kernels round with the GPU's fp32 -> E4M3 and fp32 -> bf16 conversions (round to nearest even,
    as the integer code does). Not under the Triton interpreter, whose float8 conversion rounds wrongly."""
    return not settings.triton_interpret()


MAX_ONE_PASS = 16384  # widest row read in one tile (registers: 8 warps hold 16K fp32 values in 64 per thread)


_row_launchers: dict[tuple[int, bool], DirectLaunch] = {}  # (K, column scales) -> its launcher


def _rows_launcher(k: int, has_col: bool = False) -> DirectLaunch:
    entry = _row_launchers.get((k, has_col))
    if entry is None:
        block_k = triton.next_power_of_2(max(k, 16))
        one_pass = block_k <= MAX_ONE_PASS
        if not one_pass:
            block_k = 4096
        constants = dict(BLOCK_R=1, BLOCK_K=block_k, ONE_PASS=one_pass, HW=_hardware_conversion(), HAS_COL=has_col,
                         num_warps=8 if block_k >= 8192 else 4)
        entry = _row_launchers[(k, has_col)] = DirectLaunch(_rows_kernel, constants, outputs=(1, 2))
    return entry


def rows_fp8_into(out: torch.Tensor, scales: torch.Tensor, x: torch.Tensor,
                  col_scales: torch.Tensor | None = None) -> None:
    """Write E4M3 rows of 2-D bf16 ``x`` (unit column stride), each column first multiplied by ``col_scales`` (fp32
    ``[K]``) when given, into ``out`` and their scales into ``scales`` (shapes are the caller's to get right: this
    runs on every layer call)."""
    rows, k = x.shape
    col = x if col_scales is None else col_scales  # a pointer the kernel does not read without column scales
    _rows_launcher(k, col_scales is not None)((rows,), (x, out.view(torch.uint8), scales, col, rows, k, x.stride(0),
                                                         out.stride(0)))


def prepare_rows_fp8(out: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> Callable[[], None]:
    """A zero-argument launcher writing E4M3 rows of 2-D bf16 ``x`` into ``out`` and their scales into ``scales``."""
    _check(out, scales, tuple(x.shape))
    if x.stride(-1) != 1:
        raise ValueError("FP8 row quantization reads rows with unit column stride; make the input contiguous.")
    return lambda: rows_fp8_into(out, scales, x)


def prepare_int_fp8(out: torch.Tensor, scales: torch.Tensor, qw: QuantizedWeight, row_max) -> Callable[[], None]:
    """A zero-argument launcher writing the E4M3 rows of int-format ``qw``'s bf16 weight, and their scales.

    It works over the dequant kernel's tiles, so the whole GPU works on every layer. The rows' largest magnitudes
    (``row_max``, a :class:`squareq.kernels.fp8.RowMax`) are reduced by a first launch (an atomic max per row and
    tile) the first time only: the weight is frozen. From then on one launch reads the codes once and writes one
    byte per weight. ``out`` may be the transposed layout (strides ``(1, N)``: the input gradient's operand)."""
    _check(out, scales, qw.shape, transposed_ok=True)
    amax = row_max.values
    if amax.dtype != torch.float32 or amax.shape != scales.shape or amax.data_ptr() == scales.data_ptr():
        raise ValueError("row maxima must be their own float32 buffer of one value per row.")
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    block_n, block_k, warps = default_tile(spec.group_size, k, spec.bits, spec.smooth)
    vec6 = spec.bits == 6 and block_k % 64 == 0 and _vec6_ok(t["qweight"])
    qweight, group_scales, zeros, inv = packed_operands(qw, vec6)
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n))
    shared = (n, k, t["qweight"].shape[1], group_scales.shape[1], qweight.stride(0), group_scales.stride(0))
    kwargs = dict(BITS=spec.bits, GROUP=spec.group_size, HAS_ZERO="zeros" in t, HAS_SMOOTH="inv_smooth" in t,
                  BLOCK_N=block_n, BLOCK_K=block_k, VEC6=vec6, HW=_hardware_conversion(), num_warps=warps,
                  **rotation_constants(spec))
    args = (qweight, group_scales, zeros, inv, amax, out.view(torch.uint8), scales, *shared, out.stride(0),
            out.stride(1))
    direct = DirectLaunch(_int_fp8_kernel, kwargs, outputs=(5, 6))

    def launch() -> None:
        if not row_max.ready:
            amax.zero_()
            _int_amax_kernel[grid](qweight, group_scales, zeros, inv, amax, *shared, **kwargs)
            row_max.ready = True  # launches after it on this stream see the maxima
        direct(grid, args)

    return launch
