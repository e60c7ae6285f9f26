"""``nf4``: 4-bit NormalFloat codes with an absmax scale per group of K (QLoRA's data type).

The 16 levels are the quantiles of a standard normal distribution scaled to [-1, 1], with an exact zero
(Dettmers et al. 2023, "QLoRA", appendix E; the table bitsandbytes uses). A group's scale is its largest
magnitude (times ``clip_ratio``), stored rounded up in the spec's scale dtype; each weight takes the level nearest
``w / scale`` (a tie takes the lower level). Codes are packed two to a byte, the even column in the low nibble, as
the ``int`` format's ``u4x2``.

Dequantization: ``bf16(float32(LEVELS[u]) * float32(scale) [* inv_smooth])``, evaluated in that order, which the
lookup kernel (squareq/kernels/formats/lookup.py) reproduces bit for bit.
"""
from __future__ import annotations

import torch

from ..packing import pack, packed_row_bytes, unpack
from ..registry import Format, register
from ..rtn import grouped, num_groups, per_column, store_scale

LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
          -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
          0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)


class NF4Format(Format):
    name = "nf4"
    bits = (4,)
    table = LEVELS
    zero_points = False

    def packing(self, spec) -> str:
        return "nf4x2"

    def label(self, spec) -> str:
        return f"NF4 g{spec.group_size}"

    def layout(self, spec, shape):
        n, k = shape
        return {"qweight": (torch.uint8, (n, packed_row_bytes(4, k))),
                "scales": (spec.torch_scale_dtype, (n, num_groups(k, spec.group_size)))}

    def encode(self, w, spec):
        n, k = w.shape
        wg = grouped(w, spec.group_size)
        scales = store_scale(wg.abs().amax(dim=-1) * float(spec.clip_ratio), spec)
        levels = torch.tensor(LEVELS, dtype=torch.float32, device=w.device)
        x = (wg / scales.float()[..., None]).clamp_(-1.0, 1.0)
        u = torch.searchsorted((levels[1:] + levels[:-1]) / 2, x.contiguous())  # nearest level; ties go down
        return {"qweight": pack(u.reshape(n, -1)[:, :k] - 8, 4), "scales": scales.contiguous()}

    def decode(self, tensors, spec, k):
        u = unpack(tensors["qweight"], 4, k) + 8
        levels = torch.tensor(LEVELS, dtype=torch.float32, device=u.device)
        return levels[u] * per_column(tensors["scales"].float(), spec.group_size, k)


register(NF4Format())
