"""Triton kernel: packed W4/W6/W8 codes + group scales (+ zero points, + folded 1/s, + the Hadamard rotation) -> bf16.

It computes exactly what :func:`squareq.quant.dequantize` defines,
``bf16(float32(q - z) * float32(scale) [* inv_smooth])``, and for a rotated layer ``bf16(hadamard(...))`` with the
butterfly of :mod:`squareq.quant.hadamard` applied to the fp32 tile (:func:`_hadamard_groups`), so results match the
torch reference bit for bit. Rotated layers are launched with floating-point fusion off: a multiply-add fused into
one rounding would change the butterfly's first sums (of products). Importing this module imports triton;
:mod:`.dequant` decides whether to. Throughput against a device copy is measured by ``benchmarks/dequant.py``
(rotated layers too: docs/benchmarks.md).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..quant import QuantizedWeight
from ..quant.hadamard import check_group, scale_factor


@triton.jit
def _split4(v, BLOCK_N: tl.constexpr, NC: tl.constexpr):
    """The four int32 words of ``v [BLOCK_N, NC, 4]`` (a 16-byte vector per chunk) as separate tensors."""
    even, odd = tl.split(tl.reshape(v, (BLOCK_N, NC, 2, 2)))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def _join16(g0, g1, g2, g3, g4, g5, g6, g7, g8, g9, g10, g11, g12, g13, g14, g15):
    """Stack 16 tensors on new trailing axes so that flattening them gives the order g0, g1, ..., g15.

    ``tl.join`` adds a new last axis, so the innermost join selects the highest index bit.
    """
    return tl.join(
        tl.join(tl.join(tl.join(g0, g8), tl.join(g4, g12)), tl.join(tl.join(g2, g10), tl.join(g6, g14))),
        tl.join(tl.join(tl.join(g1, g9), tl.join(g5, g13)), tl.join(tl.join(g3, g11), tl.join(g7, g15))))


@triton.jit
def _biased_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes,
                  BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr):
    """int32 codes + 2^(BITS-1) (so 0 ≤ value < 2^BITS) for columns [k0, k0 + BLOCK_K) of ``rows``; out-of-row
    bytes read as 0.

    Packed bytes are read once and not reused, so they are loaded with evict_first.
    """
    base = q_ptr + rows[:, None].to(tl.int64) * q_row_stride
    if BITS == 8:
        cols = k0 + tl.arange(0, BLOCK_K)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        q = tl.load(base + cols[None, :], mask=m, other=0, eviction_policy="evict_first").to(tl.int32) + 128
    elif BITS == 4:
        cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        b = tl.load(base + cols[None, :], mask=m, other=0, eviction_policy="evict_first").to(tl.int32)
        q = tl.reshape(tl.join(b & 0xF, b >> 4), (BLOCK_N, BLOCK_K))
    elif VEC6:
        # 6-bit, vectorised: 64 codes = 48 bytes = three 16-byte vectors of int32 words per chunk.
        # q_ptr is an int32 view here (the wrapper checks rows are whole 48-byte chunks, 16-byte aligned)
        # and q_row_stride counts words. The byte loads at stride 3 below need 10x the L1 load requests
        # (ncu: 1.15M vs 0.115M for 3072x15360), stall on the LSU queues (mio/lg throttle) and ran at
        # about a fifth of the copy bandwidth on an H200; this path runs at 70-80% on large layers.
        NC: tl.constexpr = BLOCK_K // 64
        c = k0 // 64 + tl.arange(0, NC)
        j = tl.arange(0, 4)
        m = row_mask[:, None, None] & (c[None, :, None] < row_bytes // 48)
        p = base[:, :, None] + 12 * c[None, :, None] + j[None, None, :]
        a0, a1, a2, a3 = _split4(tl.load(p, mask=m, other=0, eviction_policy="evict_first"), BLOCK_N, NC)
        a4, a5, a6, a7 = _split4(tl.load(p + 4, mask=m, other=0, eviction_policy="evict_first"), BLOCK_N, NC)
        a8, a9, a10, a11 = _split4(tl.load(p + 8, mask=m, other=0, eviction_policy="evict_first"), BLOCK_N, NC)
        # Each 3 words hold four little-endian 24-bit groups of 4 codes; masks drop sign-extended bits.
        g = _join16(a0, ((a0 >> 24) & 0xFF) | (a1 << 8), ((a1 >> 16) & 0xFFFF) | (a2 << 16), a2 >> 8,
                    a3, ((a3 >> 24) & 0xFF) | (a4 << 8), ((a4 >> 16) & 0xFFFF) | (a5 << 16), a5 >> 8,
                    a6, ((a6 >> 24) & 0xFF) | (a7 << 8), ((a7 >> 16) & 0xFFFF) | (a8 << 16), a8 >> 8,
                    a9, ((a9 >> 24) & 0xFF) | (a10 << 8), ((a10 >> 16) & 0xFFFF) | (a11 << 16), a11 >> 8)
        v = tl.join(tl.join(g & 0x3F, (g >> 12) & 0x3F), tl.join((g >> 6) & 0x3F, (g >> 18) & 0x3F))
        q = tl.reshape(v, (BLOCK_N, BLOCK_K))
    else:  # 6-bit, any layout: 4 codes in 3 bytes, little-endian 24-bit word
        cols = (k0 // 4) * 3 + 3 * tl.arange(0, BLOCK_K // 4)
        m = row_mask[:, None] & (cols[None, :] < row_bytes)
        p = base + cols[None, :]
        word = (tl.load(p, mask=m, other=0).to(tl.int32)
                | (tl.load(p + 1, mask=m, other=0).to(tl.int32) << 8)
                | (tl.load(p + 2, mask=m, other=0).to(tl.int32) << 16))
        v0 = word & 0x3F
        v1 = (word >> 6) & 0x3F
        v2 = (word >> 12) & 0x3F
        v3 = (word >> 18) & 0x3F
        # join stacks on a new last axis, so the outer join must pair (v0, v1) and (v2, v3).
        q = tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (BLOCK_N, BLOCK_K))
    return q


@triton.jit
def _load_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes,
                BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr):
    """Signed int32 codes for columns [k0, k0 + BLOCK_K) of ``rows`` (out-of-row bytes read as byte 0; their
    scales are masked)."""
    u = _biased_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes, BITS, BLOCK_N, BLOCK_K, VEC6)
    return u - (1 << (BITS - 1))


@triton.jit
def _bf16_bits_rne(x):
    """Round fp32 to bf16 (nearest, ties to even) and return the bits as int16.

    Done in integer arithmetic because the Triton interpreter truncates in ``.to(tl.bfloat16)``;
    this keeps CPU-interpreted and CUDA results identical to torch's rounding.
    """
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _hadamard_groups(w, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
                     SCALE: tl.constexpr):
    """fp32 ``w [ROWS, BLOCK_K]`` times the normalized Hadamard matrix within each group of GROUP columns, in the
    order of :func:`squareq.quant.hadamard.hadamard`: STAGES = log2(GROUP) times, entries 2i and 2i + 1 of a group
    become its entries i (their sum) and i + GROUP/2 (their difference), then one multiplication by SCALE."""
    NG: tl.constexpr = BLOCK_K // GROUP
    HALF: tl.constexpr = GROUP // 2
    y = tl.reshape(w, (ROWS, NG, HALF, 2))
    for _ in tl.static_range(STAGES):
        even, odd = tl.split(y)
        # join pairs (sum, difference) on a new last axis; moving it in front of the HALF axis puts the sums first
        y = tl.reshape(tl.permute(tl.join(even + odd, even - odd), (0, 1, 3, 2)), (ROWS, NG, HALF, 2))
    return tl.reshape(y, (ROWS, BLOCK_K)) * SCALE


def rotation_constants(spec) -> dict:
    """The kernels' ROT_STAGES (0: not rotated) and ROT_SCALE for ``spec``, and the launch option a rotated layer
    needs (floating-point fusion off, so each product and sum of the butterfly is rounded as the reference rounds
    it)."""
    if not spec.rotate:
        return {"ROT_STAGES": 0, "ROT_SCALE": 1.0}
    return {"ROT_STAGES": check_group(spec.group_size), "ROT_SCALE": scale_factor(spec.group_size),
            "enable_fp_fusion": False}


@triton.jit
def _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, rows, row_mask, k0, K, row_bytes, n_groups, q_row_stride,
                 s_row_stride, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr,
                 HAS_SMOOTH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr,
                 ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    """The fp32 weights (before bf16 rounding) of ``rows`` x columns [k0, k0 + BLOCK_K), rotated back when
    ROT_STAGES > 0 (a rotated layer's K is whole groups, so padding columns are whole groups of zeros)."""
    q = _load_codes(q_ptr, rows, row_mask, k0, q_row_stride, row_bytes, BITS, BLOCK_N, BLOCK_K, VEC6)
    # BLOCK_K is a multiple of GROUP, so a tile holds whole groups: view it as [N, groups, GROUP].
    NG: tl.constexpr = BLOCK_K // GROUP
    g = k0 // GROUP + tl.arange(0, NG)
    gm = row_mask[:, None] & (g[None, :] < n_groups)
    g_off = rows[:, None].to(tl.int64) * s_row_stride + g[None, :]
    s = tl.load(s_ptr + g_off, mask=gm, other=1.0).to(tl.float32)
    q3 = tl.reshape(q, (BLOCK_N, NG, GROUP))
    if HAS_ZERO:
        z = tl.load(z_ptr + g_off, mask=gm, other=0).to(tl.int32)
        q3 = q3 - z[:, :, None]
    w = tl.reshape(q3.to(tl.float32) * s[:, :, None], (BLOCK_N, BLOCK_K))
    if HAS_SMOOTH:
        cols = k0 + tl.arange(0, BLOCK_K)
        inv = tl.load(inv_ptr + cols, mask=cols < K, other=1.0)
        w = w * inv[None, :]
    if ROT_STAGES > 0:
        w = _hadamard_groups(w, BLOCK_N, BLOCK_K, GROUP, ROT_STAGES, ROT_SCALE)
    return w


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, z_ptr, inv_ptr, out_ptr,
                    N, K, row_bytes, n_groups, q_row_stride, s_row_stride, out_row_stride,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_SMOOTH: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC6: tl.constexpr, K_MAJOR: tl.constexpr,
                    ROT_STAGES: tl.constexpr, ROT_SCALE: tl.constexpr):
    if K_MAJOR:  # consecutive programs walk along K within one row block
        pid_k = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k0 = pid_k * BLOCK_K
    w = _weight_tile(q_ptr, s_ptr, z_ptr, inv_ptr, rows, row_mask, k0, K, row_bytes, n_groups, q_row_stride,
                     s_row_stride, BITS, GROUP, HAS_ZERO, HAS_SMOOTH, BLOCK_N, BLOCK_K, VEC6, ROT_STAGES, ROT_SCALE)
    cols = k0 + tl.arange(0, BLOCK_K)
    out_off = rows[:, None].to(tl.int64) * out_row_stride + cols[None, :]
    # Streaming (.cs, evict-first) stores together with evict_first packed loads measured 5-9 points of
    # copy bandwidth better than plain ones on an H200 (either alone gained about half of that). The
    # lines still land in L2, so a matmul that reads the weight right after can hit them.
    tl.store(out_ptr + out_off, _bf16_bits_rne(w), mask=row_mask[:, None] & (cols[None, :] < K), cache_modifier=".cs")


def default_tile(spec_group: int, k: int, bits: int | None = None, smooth: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a layer; BLOCK_K is a multiple of the group size.

    Every program covers 64 outputs per thread. Chosen from the tile sweep of benchmarks/dequant.py on
    FLUX shapes (H200): 8 x 512 with 2 warps was best for W4/W6, 16 x 512 with 4 warps for W8 and for
    smoothed layers (which also read 1/s per column); narrow K falls back to shorter BLOCK_K.
    """
    block_k = max(spec_group, 512 if k >= 512 else 256 if k >= 256 else 64)
    if bits in (4, 6) and not smooth:
        return max(1, 4096 // block_k), block_k, 2
    return max(1, 8192 // block_k), block_k, 4


def _vec6_ok(qweight: torch.Tensor) -> bool:
    """Whether 6-bit rows can be read as 16-byte vectors: whole 48-byte chunks, 16-byte aligned."""
    return (qweight.shape[1] % 48 == 0 and qweight.stride(0) % 16 == 0 and qweight.data_ptr() % 16 == 0)


def packed_operands(qw: QuantizedWeight, vec6: bool):
    """(codes, scales, zeros, inv_smooth) as the kernels read them: W8 codes as int8, vectorized W6 rows as int32
    words; a tensor the layer lacks is stood in by ``scales`` (its pointer goes unused when the flag says so)."""
    qweight, scales = qw.tensors["qweight"], qw.tensors["scales"]
    if qw.spec.bits == 8:
        qweight = qweight.view(torch.int8)
    elif vec6:
        qweight = qweight.view(torch.int32)
    return qweight, scales, qw.tensors.get("zeros", scales), qw.tensors.get("inv_smooth", scales)


def _launch(out: torch.Tensor, qw: QuantizedWeight, tile: tuple[int, int, int] | None):
    """(grid, positional args, keyword args) of the dequant kernel for ``qw`` into ``out``."""
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    block_n, block_k, warps = tile or default_tile(spec.group_size, k, spec.bits, spec.smooth)
    if block_k % spec.group_size:
        raise ValueError(f"BLOCK_K={block_k} must be a multiple of group_size={spec.group_size}.")
    row_bytes = t["qweight"].shape[1]
    vec6 = spec.bits == 6 and block_k % 64 == 0 and _vec6_ok(t["qweight"])
    qweight, scales, zeros, inv = packed_operands(qw, vec6)
    # W4/W6 launch programs K-block fastest (measured: up to +12 points of copy bandwidth for W6 on an
    # H200, neutral for W4, slightly worse for W8); grid axis 1 is limited to 65535 programs.
    k_major = spec.bits in (4, 6) and triton.cdiv(n, block_n) <= 65535
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    if k_major:
        grid = grid[::-1]
    args = (qweight, scales, zeros, inv, out.view(torch.int16),
            n, k, row_bytes, scales.shape[1], qweight.stride(0), scales.stride(0), out.stride(0))
    kwargs = dict(BITS=spec.bits, GROUP=spec.group_size, HAS_ZERO="zeros" in t, HAS_SMOOTH="inv_smooth" in t,
                  BLOCK_N=block_n, BLOCK_K=block_k, VEC6=vec6, K_MAJOR=k_major, num_warps=warps,
                  **rotation_constants(spec))
    return grid, args, kwargs


def triton_dequantize_into(out: torch.Tensor, qw: QuantizedWeight,
                           tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Launch the dequant kernel writing ``qw``'s effective weight into ``out`` (bf16 [N, K], unit column stride)."""
    grid, args, kwargs = _launch(out, qw, tile)
    _dequant_kernel[grid](*args, **kwargs)
    return out


# Compiled kernels whose direct launch was checked against the dispatcher's, by id: True if it matched.
_direct_ok: dict[int, bool] = {}


def prepare_triton_dequantize(out: torch.Tensor, qw: QuantizedWeight,
                              tile: tuple[int, int, int] | None = None) -> Callable[[], torch.Tensor]:
    """A zero-argument launcher of ``triton_dequantize_into(out, qw)`` for a layer that runs thousands of times.

    Triton's dispatcher re-derives the specialization key from every argument on each call, which costs more
    host time than the kernel takes on the GPU (a FLUX step launches ~1,500 of them). The launch arguments are
    fixed here, and after the first launch the compiled kernel is called directly. That direct call is checked
    once per compiled kernel against the dispatcher's output; if it differs, the dispatcher is kept.
    """
    grid, args, kwargs = _launch(out, qw, tile)
    state: dict = {}

    def launch() -> torch.Tensor:
        direct = state.get("direct")
        if direct is not None:
            direct()
            return out
        compiled = _dequant_kernel[grid](*args, **kwargs)
        if "direct" not in state:
            state["direct"] = _direct_launcher(compiled, grid, args, kwargs, out)
        return out

    return launch


def _direct_launcher(compiled, grid, args, kwargs, out: torch.Tensor) -> Callable[[], None] | None:
    try:
        runner = compiled[grid]
        names = _dequant_kernel.arg_names
        values = list(args) + [kwargs[name] for name in names[len(args):]]
    except Exception:  # an interpreter or a Triton without this API: keep the dispatcher
        return None

    def direct() -> None:
        runner(*values)

    key = id(compiled)
    if key not in _direct_ok:
        expected = out.clone()
        out.view(torch.int16).fill_(-1)  # a NaN pattern no dequantized weight has, so an idle launch shows
        try:
            direct()
            _direct_ok[key] = bool(torch.equal(out.view(torch.int16), expected.view(torch.int16)))
        except Exception:
            _direct_ok[key] = False
        if not _direct_ok[key]:
            out.copy_(expected)
    return direct if _direct_ok[key] else None
