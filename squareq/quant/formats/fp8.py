"""``fp8_e4m3``: FP8 E4M3 codes (the OCP "fn" variant: 4 exponent bits, 3 mantissa bits, no infinities, largest
value 448) with an absmax scale per group of K; a ``group_size`` of at least K gives one scale per row, the layout
``torch._scaled_mm`` takes.

A group's scale is its largest magnitude (times ``clip_ratio``) / 448, stored rounded up in the spec's scale dtype;
each weight is ``w / scale`` rounded to the nearest E4M3 value (ties to even, torch's conversion), one byte per
weight. Dequantization: ``bf16(float32(E4M3[u]) * float32(scale) [* inv_smooth])``, evaluated in that order; the
lookup kernel (squareq/kernels/formats/lookup.py) reproduces it bit for bit from the 256-entry table below.
"""
from __future__ import annotations

import torch

from ..registry import Format, register
from ..rtn import grouped, num_groups, per_column, store_scale

E4M3_MAX = 448.0
# the value of every byte read as E4M3 (bytes 0x7F and 0xFF are NaN, which no encoding produces)
VALUES = tuple(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist())


class FP8E4M3Format(Format):
    name = "fp8_e4m3"
    bits = (8,)
    table = VALUES
    zero_points = False

    def packing(self, spec) -> str:
        return "e4m3"

    def label(self, spec) -> str:
        return f"FP8 g{spec.group_size}"

    def short_label(self, spec) -> str:
        return "FP8"

    def layout(self, spec, shape):
        n, k = shape
        groups = num_groups(k, spec.group_size)
        return {"qweight": (torch.uint8, (n, k)), "scales": (spec.torch_scale_dtype, (n, groups))}

    def encode(self, w, spec):
        n, k = w.shape
        wg = grouped(w, _width(spec, k))
        scales = store_scale(wg.abs().amax(dim=-1) * float(spec.clip_ratio) / E4M3_MAX, spec)
        x = (wg / scales.float()[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
        codes = x.reshape(n, -1)[:, :k].to(torch.float8_e4m3fn).view(torch.uint8)
        return {"qweight": codes.contiguous(), "scales": scales.contiguous()}

    def decode(self, tensors, spec, k):
        values = tensors["qweight"].view(torch.float8_e4m3fn).float()
        return values * per_column(tensors["scales"].float(), _width(spec, k), k)


def _width(spec, k: int) -> int:
    """The columns one scale covers: a ``group_size`` past K is one scale per row, without padding the row to it."""
    return min(spec.group_size, max(k, 1))


register(FP8E4M3Format())
