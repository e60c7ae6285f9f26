"""Which scaled-dot-product-attention kernel the blocks prefer (``LoadOptions(attention=...)``).

torch picks its attention kernel by a fixed priority: flash first, cuDNN last. At FLUX.1's attention shapes (24 heads
of 128, 4,608 tokens at 1024²) cuDNN's kernels take about half of flash's time, forward and backward, with the same
error against an fp32 reference (benchmarks/attention_backends.py on an H200; docs/benchmarks.md). Attention is a
third of a compiled 1024² LoRA step, so the blocks run with cuDNN's kernel first in the priority where that was
measured, and torch's own order elsewhere. Where cuDNN cannot take a call (a mask, a shape it does not support),
torch goes on down the list as it always does.

* ``auto``: cuDNN first on CUDA GPUs of compute capability 9.0 and up (Hopper, Blackwell), for models whose
  attention heads have a width in :data:`AUTO_HEAD_DIMS` (FLUX.1, FLUX.2, Qwen-Image: 128); torch's order otherwise.
  The narrow heads of the tiny test models are left out: on the device image cuDNN's backward returns NaN for them
  (docs/train.md).
* ``cudnn``: cuDNN first on any CUDA GPU; ``default``: torch's order.
* A training run whose sequences carry an edit pair's control tokens settles ``auto`` as ``default``
  (:func:`edit_pair_attention`): the streamed FLUX.1 Kontext step at 1024² (8,704 tokens) with cuDNN first stopped on
  an illegal memory access in its first backward on the H200 (torch 2.11), twice, where torch's order ran; cuDNN's
  kernel alone at that shape did not fail, so the cause is not known yet (docs/train.md, "Edit pairs").

The fallback stays as it was: a cuDNN attention backward that raises or returns NaN turns cuDNN off for the process
(runtime/blocks.py :func:`disable_cudnn_attention`, which calls :func:`mark_cudnn_failed`), and then the preference
is dropped too. ``torch.backends.cuda.enable_cudnn_sdp(False)`` before loading is also honoured.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

MODES = ("auto", "cudnn", "default")
AUTO_CAPABILITY = (9, 0)
AUTO_HEAD_DIMS = (128,)  # measured: FLUX.1's heads (docs/benchmarks.md, "cuDNN attention in the streamed blocks")

_cudnn_failed = False  # set once cuDNN attention failed in this process


class AttentionModeError(ValueError):
    """An ``attention`` mode that does not exist."""


def mark_cudnn_failed() -> None:
    """cuDNN attention failed in this process: no block prefers it from now on."""
    global _cudnn_failed
    _cudnn_failed = True


def head_dim(model: nn.Module) -> int | None:
    """The width of ``model``'s attention heads from its config (diffusers' ``attention_head_dim``, or transformers'
    ``hidden_size / num_attention_heads``); None where the config does not say."""
    config = getattr(model, "config", None)
    get = (config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d))
    width = get("attention_head_dim", None) or get("head_dim", None)
    if width is None and get("hidden_size", None) and get("num_attention_heads", None):
        width = get("hidden_size") // get("num_attention_heads")
    return int(width) if isinstance(width, int) else None


def check_attention(mode: str) -> None:
    """Refuses (:class:`AttentionModeError`) an ``attention`` mode that does not exist, on any device."""
    if mode not in MODES:
        raise AttentionModeError(f"attention={mode!r}: choose one of {', '.join(MODES)}.")


def resolve_attention(mode: str, device: torch.device | str, width: int | None) -> tuple[bool, str]:
    """``(prefer_cudnn, why)`` with ``auto`` settled for ``device`` and heads of ``width``."""
    check_attention(mode)
    device = torch.device(device)
    if mode == "default":
        return False, "torch's own order (flash first), as asked"
    if device.type != "cuda":
        return False, f"cuDNN attention runs on CUDA GPUs only, not on {device.type}"
    if mode == "cudnn":
        return True, "asked for"
    capability = torch.cuda.get_device_capability(device)
    if capability < AUTO_CAPABILITY:
        return False, (f"cuDNN attention was measured faster on compute capability {AUTO_CAPABILITY[0]}."
                       f"{AUTO_CAPABILITY[1]} and up, not on this GPU ({capability[0]}.{capability[1]}); "
                       "attention='cudnn' tries it")
    if width not in AUTO_HEAD_DIMS:
        return False, (f"cuDNN attention was measured at head width {', '.join(map(str, AUTO_HEAD_DIMS))}, not at "
                       f"this model's ({width}); attention='cudnn' tries it")
    return True, (f"cuDNN's attention kernels measured about twice as fast as flash's at head width {width} on "
                  "GPUs of this generation (docs/benchmarks.md)")


EDIT_PAIR_REASON = ("the streamed step on an edit pair's control tokens with cuDNN attention first stopped on an "
                    "illegal memory access on the H200 (FLUX.1 Kontext at 1024²), and ran in torch's order "
                    "(docs/train.md); attention = \"cudnn\" tries it")


def edit_pair_attention(mode: str, controls: bool) -> tuple[str, str | None]:
    """(the mode a training run loads with, why ``auto`` was settled otherwise or None): ``auto`` with control tokens
    in the sequence (``controls``) loads as ``default`` (module docstring); every other mode as it is."""
    if mode == "auto" and controls:
        return "default", EDIT_PAIR_REASON
    return mode, None


def preferring_cudnn(forward, runtime):
    """``forward`` run with cuDNN attention first in torch's priority while ``runtime.prefer_cudnn`` holds, cuDNN
    attention is on and has not failed in this process; as it is otherwise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]  # built once per block, not at every call

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not getattr(runtime, "prefer_cudnn", False) or _cudnn_failed or not torch.backends.cuda.cudnn_sdp_enabled():
            return forward(*args, **kwargs)
        with sdpa_kernel(cudnn_first, set_priority=True):
            return forward(*args, **kwargs)

    return run
