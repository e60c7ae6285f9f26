"""Per layer and call: the fused quantized matmul (:mod:`.triton_fused`) or dequantize + the vendor matmul.

The fused kernels read 4-8 bit codes instead of a bf16 weight, which wins while a matmul is bound by reading its
weight, i.e. for few rows M. Where the vendor matmul overtakes them depends on the device and the format, so the
largest M that still goes fused is looked up per device name (measured with ``benchmarks/matmul.py``, recorded in
docs/benchmarks.md) with :data:`DEFAULT_MAX_M` for devices not measured. ``SQUAREQ_FUSED_MAX_M`` overrides it for
experiments: one number for every format, or ``4:64,6:32,8:16`` per bit width; 0 turns the fused path off.
"""
from __future__ import annotations

import logging

import torch

from .. import settings
from ..quant import QuantizedWeight
from .backend import backend_for

log = logging.getLogger("squareq.kernels")

ENV = settings.FUSED_MAX_M
# Devices not measured keep the dequantize + vendor matmul path: never slower than before the fused kernels.
DEFAULT_MAX_M = {4: 0, 6: 0, 8: 0}
# device name (torch.cuda.get_device_name) -> {bits: the largest M of the benchmark's grid (1, 16, 64, ...) at which
# the fused kernels beat dequantize + matmul on every FLUX shape, forward and input gradient}, from
# benchmarks/matmul.py runs recorded in docs/benchmarks.md (H100: 2026-11-22, commits 4abf7fc and the W6 rerun).
CROSSOVERS: dict[str, dict[int, int]] = {
    "NVIDIA H100 80GB HBM3": {4: 64, 6: 16, 8: 64},
}
_said: set[str] = set()


def _parse(value: str) -> dict[int, int]:
    try:
        if ":" not in value:
            return dict.fromkeys((4, 6, 8), int(value))
        return {int(b): int(m) for b, m in (part.split(":") for part in value.split(","))}
    except ValueError:
        raise ValueError(f"{ENV}={value!r}: give one number (e.g. 16) or bits:M pairs (e.g. 4:64,6:32,8:16); "
                         "0 turns the fused kernels off.") from None


def fused_max_m(device: torch.device, bits: int) -> int:
    """The largest M that runs fused for a ``bits``-bit layer on ``device`` (0: never)."""
    override = settings.fused_max_m()
    if override is not None:
        return _parse(override).get(bits, 0)
    if device.type != "cuda":
        table, where = DEFAULT_MAX_M, "default"
    else:
        name = torch.cuda.get_device_name(device)
        measured = name in CROSSOVERS
        table, where = (CROSSOVERS[name], name) if measured else (DEFAULT_MAX_M, f"default ({name} not measured)")
        if name not in _said:
            _said.add(name)
            log.info("fused quantized matmuls up to M = %s on %s (%s).", table, name, where)
    return table.get(bits, 0)


def fused_limit(qw: QuantizedWeight, device: torch.device) -> int:
    """The largest number of input rows at which calls on ``qw`` go to the fused kernel (-1: never). A layer asks
    once and keeps the answer: every layer call of a training step would otherwise pay for the lookup."""
    if qw.spec.is_passthrough or qw.spec.format != "int" or backend_for(device) not in ("triton", "triton-interpret"):
        return -1  # the fused kernels read int codes only
    return fused_max_m(torch.device(device), qw.spec.bits)

