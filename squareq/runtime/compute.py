"""Which arithmetic the frozen base layers run in: ``bf16``, ``fp8`` or ``auto``; and which 16-bit type the activations
and the dequantized weights are (:func:`resolve_dtype`: bf16, or fp16 on GPUs without bf16).

``fp8`` runs each quantized layer's forward (and a training step's checkpointed recompute) as an E4M3 x E4M3 matmul
with per-token and per-channel scales (kernels/fp8.py), where a call has at least ``kernels.fp8.FP8_MIN_ROWS`` rows;
the input gradient and the LoRA path stay in bf16/fp32.
``auto`` is ``fp8`` on GPUs with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell) and
``bf16`` elsewhere. Until the blocks ran as CUDA graphs it was ``bf16``: on the H100 a whole FLUX.1 step measured no
faster in FP8, because the host time of the extra launches ate what the faster matmuls saved. With the launches
replayed from graphs, FP8 measured faster at 1024² for training and sampling, and level at 512²
(docs/benchmarks.md, "CUDA graphs per block"). :data:`FP8_BY_DEFAULT` turns ``auto`` back to bf16. docs/tuning.md
says when to choose which.
"""
from __future__ import annotations

import torch

MODES = ("bf16", "fp8", "auto")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BF16_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores
FP8_CAPABILITY = (8, 9)
FP8_BY_DEFAULT = True  # see the module docstring
# Whether FP8 compute also runs the frozen layers' input gradients in FP8 (kernels/fp8.py fp8_input_grad: the gradient
# quantized per token with the weight's channel scales folded in; LoRA and its gradients stay bf16/fp32). Off until
# its gradients and speed are measured on a GPU against bf16's (issue 41).
FP8_BACKWARD = False


class ComputeError(ValueError):
    """A compute mode this device cannot run, or no mode at all."""


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def check_compute(mode: str) -> None:
    """Refuses (:class:`ComputeError`) a compute mode that does not exist, on any device."""
    if mode not in MODES:
        raise ComputeError(f"compute={mode!r}: choose one of {', '.join(MODES)}.")


def check_dtype(mode: str) -> None:
    """Refuses (:class:`ComputeError`) a dtype that does not exist, on any device."""
    if mode not in (*DTYPES, "auto"):
        raise ComputeError(f"dtype={mode!r}: choose one of bf16, fp16, auto.")


def resolve_compute(mode: str, device: torch.device | str, dtype: str = "bf16") -> tuple[str, str]:
    """``(mode, why)`` with ``auto`` settled for ``device`` and the run's settled ``dtype``; refuses
    (:class:`ComputeError`) ``fp8`` on a GPU without FP8 tensor cores, and in an fp16 run (the FP8 products return
    bf16, and the GPUs that need fp16 have no FP8), where ``auto`` is ``bf16``: no FP8.

    On the CPU ``fp8`` is allowed (torch emulates the FP8 matmul; tests use it) but ``auto`` stays ``bf16``."""
    device = torch.device(device)
    check_compute(mode)
    if dtype == "fp16":
        if mode == "fp8":
            raise ComputeError("fp8 compute runs in bf16 runs only (GPUs with FP8 tensor cores have bf16 too); "
                               "choose compute bf16 or auto with dtype fp16, or dtype bf16 with compute fp8.")
        return "bf16", "an fp16 run computes without FP8" if mode == "auto" else "asked for"
    if device.type != "cuda":
        if mode == "auto":
            return "bf16", f"{device.type} has no FP8 tensor cores"
        return mode, "asked for"
    capability = _capability(device)
    has_fp8 = capability >= FP8_CAPABILITY
    name = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    if mode == "fp8" and not has_fp8:
        raise ComputeError(f"the {name} has no FP8 tensor cores (they need compute capability 8.9 or newer); "
                           "choose compute bf16 or auto.")
    if mode == "auto":
        if not has_fp8:
            return "bf16", f"the {name} has no FP8 tensor cores"
        if not FP8_BY_DEFAULT:
            return "bf16", f"the {name} has FP8 tensor cores, but SquareQ's default is bf16; --compute fp8 uses them"
        return "fp8", f"the {name} has FP8 tensor cores"
    return mode, "asked for"


def resolve_dtype(mode: str, device: torch.device | str) -> tuple[str, str]:
    """``(dtype, why)`` with ``auto`` settled for ``device``: ``bf16``, or ``fp16`` on a GPU without bf16 tensor cores
    (compute capability below 8.0: T4, V100, RTX 20xx), where bf16 runs slowly or not at all. The CPU stays bf16."""
    device = torch.device(device)
    check_dtype(mode)
    if mode != "auto":
        return mode, "asked for"
    if device.type != "cuda":
        return "bf16", f"{device.type} computes bf16"
    capability = _capability(device)
    name = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    if capability < BF16_CAPABILITY:
        return "fp16", f"the {name} has no bf16 tensor cores (they need 8.0 or newer)"
    return "bf16", f"the {name} has bf16 tensor cores"
