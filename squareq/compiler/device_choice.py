"""Where `squareq compile` and `squareq accept` run: ``--device auto`` (the default) takes the GPU when PyTorch sees
one.

A model over :data:`CPU_LIMIT_PARAMETERS` is not run on a CPU unless ``--device cpu`` says so: a 12B FLUX.1 compile
takes about ten minutes on an H100 and a day or more on a workstation's CPU. The refusal says how long, from this
machine's measured matrix-multiply speed on the model's largest layer shape and the least arithmetic the command
does (a compile: every block's linear layers over every calibration sample once, and over the held-out quarter
``probes`` times in the effects pass's forward, recompute and backward). That is a lower bound: it leaves out
attention, the GPTQ statistics and the search.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ..devices import DeviceError, parse_device
from ..models.calibration_set import DEFAULT_CAPTION_TOKENS, HELDOUT_FRACTION
from .inputs import DEFAULT_IMAGE_SAMPLES, DEFAULT_TEXT_SAMPLES, DEFAULT_TEXT_TOKENS, is_text_model

CPU_LIMIT_PARAMETERS = 1_000_000_000
_PROBE_ROWS = 256  # rows of the timed matmul: enough to run at the machine's matmul speed, short enough to be quick
_PROBE_ELEMENTS = 1 << 26  # the timed weight at most this large (256 MB in float32)


def choose_device(requested: str | None, source, least_flops: Callable[[nn.Module], float],
                  doing: str = "compiling it") -> str:
    """``requested`` as the device a command on ``source`` runs on: ``auto`` (or None) is CUDA when available, else
    the CPU, which a model over :data:`CPU_LIMIT_PARAMETERS` gets only when asked for by name. ``least_flops(skeleton)``
    is the arithmetic the command cannot avoid, for the time the refusal states."""
    named = parse_device(requested)
    if named is not None:
        return str(named)
    if torch.cuda.is_available():
        return "cuda"
    skeleton = source.skeleton()
    parameters = sum(p.numel() for p in skeleton.parameters())
    if parameters <= CPU_LIMIT_PARAMETERS:
        return "cpu"
    flops, rate = least_flops(skeleton), matmul_rate(skeleton)
    raise DeviceError(
        f"{source.description} has {parameters / 1e9:.1f}B parameters and PyTorch sees no CUDA GPU here, and {doing} "
        f"on this CPU would take at least {_duration(flops / rate)} (this machine multiplies at {rate / 1e9:.0f} "
        f"GFLOP/s, measured, and that is {flops / 1e15:.1f} PFLOP at the least); run it where PyTorch sees a GPU, or "
        "pass --device cpu to run here anyway.")


def compile_flops(source, skeleton: nn.Module, opts, resolution: int) -> float:
    """The matrix-multiply FLOPs a compile with ``opts`` (CompileOptions; ``resolution``: its calibration images'
    side) cannot avoid: every block linear over every calibration sample, plus three passes (forward, recompute,
    backward) over the held-out quarter for each effect probe."""
    samples, tokens = calibration_size(source, skeleton, opts, resolution)
    passes = samples + 3 * opts.effect_probes * max(1, round(samples * HELDOUT_FRACTION))
    return 2.0 * block_weights(source, skeleton) * tokens * passes


def block_weights(source, skeleton: nn.Module) -> int:
    """The weights of the linear layers inside ``source``'s streamed blocks."""
    prefixes = tuple(p + "." for p in source.block_paths)
    return sum(m.in_features * m.out_features for n, m in skeleton.named_modules()
               if isinstance(m, nn.Linear) and (n + ".").startswith(prefixes))


def tokens_per_sample(source, skeleton: nn.Module, resolution: int, text_tokens: int = DEFAULT_CAPTION_TOKENS) -> int:
    """Tokens a ``resolution``-pixel image with ``text_tokens`` caption tokens carries through the blocks (the family's
    rule; else the image's 2x2 patches of an 8x VAE latent)."""
    adapter = source.family_adapter
    if adapter is not None and adapter.sequence_shape is not None:
        return adapter.sequence_shape(skeleton.config, resolution, text_tokens)[0]
    return (resolution // 16) ** 2


def calibration_size(source, skeleton: nn.Module, opts, resolution: int) -> tuple[int, int]:
    """(samples, tokens per sample) of a compile's calibration: text samples of ``calib_tokens`` for a text model,
    else images at ``resolution`` with their captions."""
    if is_text_model(skeleton):
        return opts.calib_samples or DEFAULT_TEXT_SAMPLES, opts.calib_tokens or DEFAULT_TEXT_TOKENS
    return opts.calib_samples or DEFAULT_IMAGE_SAMPLES, tokens_per_sample(source, skeleton, resolution)


def matmul_rate(skeleton: nn.Module) -> float:
    """FLOP/s of a float32 matmul on this CPU at the model's largest linear shape (its weight capped in size)."""
    k, n = max(((m.in_features, m.out_features) for m in skeleton.modules() if isinstance(m, nn.Linear)),
               key=lambda kn: kn[0] * kn[1], default=(1024, 1024))
    n = max(1, min(n, _PROBE_ELEMENTS // max(k, 1)))
    x, w = torch.randn(_PROBE_ROWS, k), torch.randn(k, n)
    best = float("inf")
    for _ in range(3):  # the first warms the allocator and the thread pool
        start = time.perf_counter()
        torch.mm(x, w)
        best = min(best, time.perf_counter() - start)
    return 2.0 * _PROBE_ROWS * k * n / max(best, 1e-9)


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    if hours >= 48:
        return f"{hours / 24:.0f} days"
    if hours >= 1:
        return f"{hours:.0f} hours"
    return f"{max(1, round(seconds / 60))} minutes"
