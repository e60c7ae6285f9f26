"""``int``: integer codes of 4, 6 or 8 bits with a scale per group of K, and an int8 zero point unless symmetric.

The codes, packings and dequantization rule are :mod:`squareq.quant.rtn`'s and :mod:`squareq.quant.packing`'s
(GPTQ and the clip search round onto the same grids); this module presents them as a format.
"""
from __future__ import annotations

import torch

from ..packing import pack, packed_row_bytes, unpack
from ..registry import Format, register
from ..rtn import codes_of, decode_codes, group_params, grouped, num_groups

# Packing ids are part of the slab format: never renumber, only add.
PACKING_FOR_BITS = {4: "u4x2", 6: "u6x4", 8: "i8"}


class IntegerFormat(Format):
    name = "int"
    bits = (4, 6, 8)
    gptq = True
    rotate = True

    def packing(self, spec) -> str:
        return PACKING_FOR_BITS[spec.bits]

    def label(self, spec) -> str:
        return f"W{spec.bits} g{spec.group_size} {'sym' if spec.symmetric else 'asym'}"

    def short_label(self, spec) -> str:
        return f"W{spec.bits}"

    def layout(self, spec, shape):
        n, k = shape
        g = num_groups(k, spec.group_size)
        out = {"qweight": (torch.uint8, (n, packed_row_bytes(spec.bits, k))),
               "scales": (spec.torch_scale_dtype, (n, g))}
        if not spec.symmetric:
            out["zeros"] = (torch.int8, (n, g))
        return out

    def encode(self, w, spec):
        q, scales, zeros = codes_of(w, spec)
        tensors = {"qweight": pack(q[:, : w.shape[1]], spec.bits), "scales": scales.contiguous()}
        if zeros is not None:
            tensors["zeros"] = zeros.to(torch.int8).contiguous()
        return tensors

    def decode(self, tensors, spec, k):
        q = unpack(tensors["qweight"], spec.bits, k)
        return decode_codes(q, tensors["scales"], tensors.get("zeros"), k, spec.group_size)

    def scales(self, w, spec):
        return group_params(grouped(w, spec.group_size), spec)[0]

    def fake(self, w, spec):
        """decode(encode(w)) without packing: the searches try many specs."""
        q, scales, zeros = codes_of(w, spec)
        return decode_codes(q[:, : w.shape[1]], scales, zeros, w.shape[1], spec.group_size)


register(IntegerFormat())
