"""Dequantize a stored layer into a bf16 buffer, choosing the Triton kernel or the torch reference.

Backends, picked per device:

* ``triton``: CUDA tensors and an importable triton.
* ``triton-interpret``: CPU tensors with ``TRITON_INTERPRET=1`` (how CI runs the kernels).
* ``torch``: everything else; the exact reference from :mod:`squareq.quant`.

``SQUAREQ_KERNELS=torch`` forces the reference. The choice is logged once per device type.
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from .. import quant, settings
from ..quant import QuantizedWeight

log = logging.getLogger("squareq.kernels")
_announced: set[tuple[str, str]] = set()


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(device: torch.device | str) -> str:
    """Name of the backend :func:`dequantize_into` uses for tensors on ``device``."""
    device = torch.device(device)
    if settings.torch_kernels_forced():
        choice, why = "torch", "SQUAREQ_KERNELS=torch is set"
    elif not _triton_available():
        choice, why = "torch", "triton is not installed"
    elif device.type == "cuda":
        choice, why = "triton", "CUDA device"
    elif settings.triton_interpret():
        choice, why = "triton-interpret", "TRITON_INTERPRET=1 on a CPU tensor"
    else:
        choice, why = "torch", f"no CUDA for {device.type} tensors and TRITON_INTERPRET is not set"
    if (device.type, choice) not in _announced:
        _announced.add((device.type, choice))
        log.info("dequantization on %s uses the %s backend (%s).", device.type, choice, why)
    return choice


def _check_out(out: torch.Tensor, shape: tuple[int, int]) -> None:
    if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(shape) or out.stride(-1) != 1:
        raise ValueError(
            f"output buffer must be bfloat16 {tuple(shape)} with unit column stride; got {out.dtype} "
            f"{tuple(out.shape)} stride {out.stride()}."
        )


def _check_inputs(out: torch.Tensor, qw: QuantizedWeight) -> None:
    for name, t in qw.tensors.items():
        if t.device != out.device or t.stride(-1) != 1:
            raise ValueError(f"tensor {name!r} must be on {out.device} with unit column stride.")


def dequantize_into(out: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """Write ``qw``'s effective bf16 weight into ``out`` (bf16 ``[N, K]``, may be a view of a scratch buffer)."""
    _check_out(out, qw.shape)
    if qw.spec.is_passthrough:
        return out.copy_(qw.tensors["weight"])
    if qw.spec.format == "int" and backend_for(out.device) != "torch":
        # one launch, without the prepared launcher's one-time check (the compiler calls this for every candidate)
        _check_inputs(out, qw)
        from .triton_dequant import triton_dequantize_into

        return triton_dequantize_into(out, qw)
    return prepare_dequantize(out, qw)()


def _triton_kernel(qw: QuantizedWeight):
    """The Triton ``prepare`` for ``qw``'s format, or None where only the torch reference serves it."""
    if qw.spec.format == "int":
        from .triton_dequant import prepare_triton_dequantize

        return prepare_triton_dequantize
    from .formats import kernel_for

    prepare = kernel_for(quant.FORMATS[qw.spec.format])
    if prepare is None and ("no-kernel", qw.spec.format) not in _announced:
        _announced.add(("no-kernel", qw.spec.format))
        log.info("format %s has no Triton kernel; it dequantizes through its torch reference.", qw.spec.format)
    return prepare


def prepare_dequantize(out: torch.Tensor, qw: QuantizedWeight) -> Callable[[], torch.Tensor]:
    """A zero-argument callable that writes ``qw``'s bf16 weight into ``out`` and returns it (bf16 layers return
    their stored tensor and leave ``out`` alone). Checks and launch parameters are worked out once, here."""
    _check_out(out, qw.shape)
    if qw.spec.is_passthrough:
        weight = qw.tensors["weight"]
        return lambda: weight
    prepare = None if backend_for(out.device) == "torch" else _triton_kernel(qw)
    if prepare is None:
        return lambda: out.copy_(quant.dequantize(qw))
    _check_inputs(out, qw)
    return prepare(out, qw)


def dequantize(qw: QuantizedWeight, device: torch.device | str | None = None) -> torch.Tensor:
    """Allocate a bf16 ``[N, K]`` tensor and dequantize ``qw`` into it."""
    device = torch.device(device) if device is not None else next(iter(qw.tensors.values())).device
    out = torch.empty(qw.shape, dtype=torch.bfloat16, device=device)
    return dequantize_into(out, qw)
