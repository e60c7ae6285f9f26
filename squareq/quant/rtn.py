"""Round-to-nearest group quantization and its exact torch reference dequantization, for every format.

A quantized weight ``[N, K]`` is a dict of named tensors (the names are slab roles). The format of the spec
(squareq/quant/formats/) decides its own tensors and encodes and decodes a slice of rows; this module slices the
rows, applies smoothing and rounds to bf16 the same way for all of them. The ``int`` format stores:

* ``qweight``: packed codes, ``uint8 [N, packed_row_bytes(bits, K)]`` (see :mod:`.packing`)
* ``scales``: ``[N, ceil(K / group_size)]`` in the spec's scale dtype
* ``zeros``: ``int8 [N, G]`` zero points in the signed code domain (asymmetric specs only)

and every format may add ``inv_smooth``: ``float32 [K]`` = 1/s, folded back in at dequantization (smoothing specs
only); bf16 passthrough stores ``weight``: ``bfloat16 [N, K]``.

``int`` dequantization is defined as ``bf16(float32(q - z) * float32(scale) [* inv_smooth])`` evaluated in
exactly that order, so every kernel can reproduce it bit for bit; other formats define theirs in their module.
A rotated spec (``spec.rotate``) quantizes ``W·H`` (:mod:`.hadamard`, within each group of K) and applies ``H`` to
the float32 result of that rule, before the bf16 rounding: ``bf16(hadamard(float32(q - z) * float32(scale)
[* inv_smooth]))``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .hadamard import hadamard
from .packing import pack
from .registry import FORMATS
from .spec import QuantSpec, SpecError


@dataclass
class QuantizedWeight:
    """A layer's stored tensors together with the spec and logical shape that give them meaning."""

    spec: QuantSpec
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device) -> QuantizedWeight:
        """The same weight with its tensors on ``device``."""
        return QuantizedWeight(self.spec, self.shape, {k: v.to(device) for k, v in self.tensors.items()})

    @classmethod
    def placeholder(cls, spec: QuantSpec, shape: tuple[int, int]) -> QuantizedWeight:
        """Meta-device stand-ins of the right dtypes and shapes: enough to plan sizes and layouts without data."""
        return cls(spec, shape, {role: torch.empty(shp, dtype=dtype, device="meta")
                                 for role, (dtype, shp) in tensor_layout(spec, shape).items()})


def num_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w [N, K]`` as ``[N, G, group_size]``, the last group padded with zeros."""
    n, k = w.shape
    groups = num_groups(k, group_size)
    return torch.nn.functional.pad(w, (0, groups * group_size - k)).reshape(n, groups, group_size)


def per_column(t: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """A per-group ``t [N, G]`` repeated out to every one of the ``k`` columns, ``[N, k]``."""
    return t.repeat_interleave(group_size, dim=1)[:, :k]


def tensor_layout(spec: QuantSpec, shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Dtype and shape of every stored tensor for a weight of ``shape`` under ``spec``.

    Sizes depend only on shape and spec, so a slab's byte layout can be planned before quantizing.
    """
    n, k = shape
    if spec.is_passthrough:
        return {"weight": (torch.bfloat16, (n, k))}
    out = FORMATS[spec.format].layout(spec, (n, k))
    if spec.smooth:
        out["inv_smooth"] = (torch.float32, (k,))
    return out


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``, checked a slice of rows at a time: ``isfinite`` of a whole matrix makes several
    temporaries of its size (2.6 GB for a 15,360 x 15,360 float64 Hessian)."""
    if t.dim() < 2:
        return bool(torch.isfinite(t).all())
    flat = t.reshape(-1, t.shape[-1])
    return all(bool(torch.isfinite(flat[rows]).all()) for rows in row_chunks(*flat.shape))


def _check_weight(w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}.")
    if not all_finite(w):
        raise ValueError("the weight contains NaN or Inf values; fix the source checkpoint before quantizing.")


def _apply_smoothing(w: torch.Tensor, spec: QuantSpec, smooth_scale: torch.Tensor | None):
    if not spec.smooth:
        return w, None
    if smooth_scale is None:
        raise SpecError("spec.smooth is set but no smoothing scale was given.")
    s = smooth_scale.detach().to(device=w.device, dtype=torch.float32).reshape(-1)
    if s.numel() != w.shape[1] or not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"smoothing scale must be {w.shape[1]} positive finite values.")
    inv = (1.0 / s).contiguous()
    # Quantize W·diag(1/inv) so that folding inv back in is exact in the same fp32 arithmetic.
    return w * (1.0 / inv)[None, :], inv


def check_rotation(spec: QuantSpec, k: int) -> None:
    """Raise a ValueError sentence when a rotated ``spec`` cannot hold a weight with ``k`` inputs."""
    if spec.rotate and k % spec.group_size:
        raise ValueError(f"a rotated spec needs K to be a whole number of groups: K={k} is not a multiple of "
                         f"group_size={spec.group_size}; store this layer unrotated.")


def rotated(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``w·H`` (float32, a new tensor) for a rotated ``spec``, a slice of rows at a time; ``w`` itself otherwise."""
    if not spec.rotate:
        return w
    check_rotation(spec, w.shape[1])
    out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    for rows in row_chunks(*w.shape):
        out[rows] = hadamard(w[rows].float(), spec.group_size)
    return out


def store_scale(raw: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``raw`` scales in the spec's scale dtype, rounded up so the codes still cover each group; 1 for a group of
    zeros."""
    stored = raw.to(spec.torch_scale_dtype)
    # Round the stored scale up, never down, so the code range still covers the group's range.
    low = stored.float() < raw
    stored = torch.where(low, torch.nextafter(stored, torch.full_like(stored, torch.inf)), stored)
    if not torch.isfinite(stored).all():
        raise SpecError(
            f"weight magnitudes overflow scale_dtype={spec.scale_dtype}; use scale_dtype='bfloat16' or 'float32'."
        )
    # An all-zero (or underflowing) group gets scale 1: its codes are 0 and it dequantizes to exact zeros.
    return torch.where(stored == 0, torch.ones_like(stored), stored)


def group_params(wg: torch.Tensor, spec: QuantSpec):
    """Scale and zero point of each group of ``wg [..., g]`` (the groups along the last dimension).

    Returns ``(scales, zeros)``: ``scales [...]`` in the spec's stored dtype (clip ratio applied,
    rounded up, all-zero groups get 1) and ``zeros [...]`` as integral float32 codes, or ``None`` for
    symmetric specs. A partial group may be passed unpadded: zero padding would not change the result.
    """
    c = float(spec.clip_ratio)
    if spec.symmetric:
        amax = wg.abs().amax(dim=-1) * c
        return store_scale(amax / spec.qmax, spec), None
    lo = wg.amin(dim=-1).clamp(max=0) * c
    hi = wg.amax(dim=-1).clamp(min=0) * c
    scales = store_scale((hi - lo) / (2**spec.bits - 1), spec)
    z = torch.round(spec.qmin - lo / scales.float()).clamp_(spec.qmin, spec.qmax)
    return scales, z


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Codes (float32, integral) of ``w`` on fixed grids: ``scale`` (float32) and ``zero`` (or ``None``
    when symmetric) broadcast against ``w``. This is the rounding rule of :func:`quantize`."""
    if zero is None:
        return torch.round(w / scale).clamp_(-spec.qmax, spec.qmax)
    return torch.round(w / scale + zero).clamp_(spec.qmin, spec.qmax)


def codes_of(w: torch.Tensor, spec: QuantSpec):
    """Return (codes int32 [N, G*g], scales [N, G] stored dtype, zeros int32 [N, G] or None)."""
    n = w.shape[0]
    wg = grouped(w, spec.group_size)
    scales, z = group_params(wg, spec)
    q = round_to_grid(wg, scales.float()[..., None], None if z is None else z[..., None], spec)
    return q.to(torch.int32).reshape(n, -1), scales, None if z is None else z.to(torch.int32)


def decode_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, k: int, g: int) -> torch.Tensor:
    """float32 ``(q - z) * scale`` of integer codes, group by group (the ``int`` format's rule before bf16)."""
    s = per_column(scales.float(), g, k)
    if zeros is not None:
        q = q - per_column(zeros.to(torch.int32), g, k)
    return q.float() * s


# Rows of a weight handled at once by quantize, fake_quantize, dequantize and the metrics: about 16M weights (64 MB in
# float32), so a large layer's temporaries stay bounded (a FLUX.2 layer of 55,296 x 6,144 is 1.4 GB per float32
# copy). Rows are independent in every format, so slicing changes no quantized bit.
ROW_CHUNK_ELEMENTS = 1 << 24


def row_chunks(n: int, k: int) -> list[slice]:
    """Slices of the ``n`` rows of an ``[n, k]`` weight, each about :data:`ROW_CHUNK_ELEMENTS` weights."""
    step = max(1, ROW_CHUNK_ELEMENTS // max(k, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)] or [slice(0, 0)]


def quantize(w: torch.Tensor, spec: QuantSpec, smooth_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantize ``w [N, K]`` under ``spec``; ``smooth_scale`` is ``s`` when ``spec.smooth``."""
    _check_weight(w)
    n, k = w.shape
    w = w.detach().float()
    if spec.is_passthrough:
        if spec.smooth:
            raise SpecError("smoothing applies to 4/6/8-bit formats only, not bf16 passthrough.")
        return QuantizedWeight(spec, (n, k), {"weight": w.to(torch.bfloat16).contiguous()})
    fmt = FORMATS[spec.format]
    check_rotation(spec, k)
    parts = []
    for rows in row_chunks(n, k):
        ws, inv = _apply_smoothing(_rotate_rows(w[rows], spec), spec, smooth_scale)
        tensors = fmt.encode(ws, spec)
        if inv is not None:
            tensors["inv_smooth"] = inv
        parts.append(QuantizedWeight(spec, (ws.shape[0], k), tensors))
    return _concat_rows(parts)


def scale_rows(qw: QuantizedWeight, scale: torch.Tensor) -> QuantizedWeight:
    """``qw`` with output row ``n`` multiplied by ``scale[n]``: folded into the stored group scales (every format's
    decoding is linear in them; rotation and smoothing act on the input side), or into a passthrough weight; rounded
    to the stored dtype, as :func:`quantize` rounds."""
    scale = scale.detach().to(torch.float32).reshape(-1)
    if scale.shape[0] != qw.shape[0] or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"a row scale needs {qw.shape[0]} finite values, got {tuple(scale.shape)}.")
    role = "weight" if qw.spec.is_passthrough else "scales"
    t = qw.tensors[role]
    scaled = (t.float() * scale.to(t.device)[:, None]).to(t.dtype)
    return QuantizedWeight(qw.spec, qw.shape, {**qw.tensors, role: scaled.contiguous()})


def _rotate_rows(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``w·H`` of a slice of float32 rows for a rotated spec (``w`` itself otherwise)."""
    return hadamard(w, spec.group_size) if spec.rotate else w


def _concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    first = parts[0]
    if len(parts) == 1:
        return first
    tensors = {role: t if role == "inv_smooth" else torch.cat([p.tensors[role] for p in parts])
               for role, t in first.tensors.items()}
    return QuantizedWeight(first.spec, (sum(p.shape[0] for p in parts), first.shape[1]), tensors)


def group_scales(w: torch.Tensor, spec: QuantSpec, smooth_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The stored group scales :func:`quantize` would choose for ``w`` (``smooth_scale`` applied when given),
    without the codes."""
    n, k = w.shape
    fmt = FORMATS[spec.format]
    check_rotation(spec, k)
    out = []
    for rows in row_chunks(n, k):
        part = _rotate_rows(w[rows].detach().float(), spec)
        if smooth_scale is not None:
            part = part * smooth_scale.float()[None, :]
        out.append(fmt.scales(part, spec))
    return torch.cat(out)


def assemble(spec: QuantSpec, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             inv_smooth: torch.Tensor | None) -> QuantizedWeight:
    """Pack already-chosen ``codes [N, K]`` (signed ints), ``scales [N, G]`` (stored dtype), integral
    ``zeros [N, G]`` (asymmetric) and ``inv_smooth [K]`` (smoothing) into the stored tensors."""
    n, k = codes.shape
    packed = [pack(codes[rows], spec.bits) for rows in row_chunks(n, k)]  # pack's int32 temporaries, a slice at a time
    tensors = {"qweight": packed[0] if len(packed) == 1 else torch.cat(packed), "scales": scales.contiguous()}
    if zeros is not None:
        tensors["zeros"] = zeros.to(torch.int8).contiguous()
    if inv_smooth is not None:
        tensors["inv_smooth"] = inv_smooth
    return QuantizedWeight(spec, (n, k), tensors)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """Exact reference dequantization to a ``bfloat16 [N, K]`` weight (the effective ``W``)."""
    spec, (n, k), t = qw.spec, qw.shape, qw.tensors
    if spec.is_passthrough:
        return t["weight"].to(torch.bfloat16)
    fmt = FORMATS[spec.format]
    out = torch.empty((n, k), dtype=torch.bfloat16, device=t["qweight"].device)
    for rows in row_chunks(n, k):
        w = fmt.decode({role: v[rows] for role, v in t.items() if role != "inv_smooth"}, spec, k)
        if spec.smooth:
            w = w * t["inv_smooth"].float()[None, :]
        out[rows] = _rotate_rows(w, spec).to(torch.bfloat16)
    return out


def fake_quantize(w: torch.Tensor, spec: QuantSpec, smooth_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(w))`` in float32 without packing (before the final bf16 rounding).

    Used by searches that try many specs; shares the code path of :func:`quantize`.
    """
    _check_weight(w)
    w = w.detach().float()
    if spec.is_passthrough:
        return w.to(torch.bfloat16).float()
    n, k = w.shape
    fmt = FORMATS[spec.format]
    check_rotation(spec, k)
    out = torch.empty_like(w)
    for rows in row_chunks(n, k):
        ws, inv = _apply_smoothing(_rotate_rows(w[rows], spec), spec, smooth_scale)
        part = fmt.fake(ws, spec)
        out[rows] = _rotate_rows(part * inv[None, :] if inv is not None else part, spec)
    return out
