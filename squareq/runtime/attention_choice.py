"""Which scaled-dot-product-attention kernel the blocks prefer (``LoadOptions(attention=...)``).

torch picks its attention kernel by a priority: flash first and cuDNN last, except that torch 2.11 with cuDNN 9.9 and
later puts cuDNN first itself on compute capability 9.0 and 10.0 at its first attention call. At FLUX.1's shapes (24
heads of 128, 4,608 tokens at 1024²) cuDNN's kernels take about half of flash's time, forward and backward, with the
same error against an fp32 reference (benchmarks/attention_backends.py on an H200; docs/benchmarks.md). Attention is a
third of a compiled 1024² LoRA step, so the blocks run with cuDNN's kernel first in the priority where that was
measured, and torch's own order elsewhere. Where cuDNN cannot take a call (a mask, a shape it does not support), torch
goes on down the list as it always does.

* ``auto``: cuDNN first on CUDA GPUs of compute capability 9.0 and up (Hopper, Blackwell), for models whose
  attention heads have a width in :data:`AUTO_HEAD_DIMS` (FLUX.1, FLUX.2, Qwen-Image: 128); torch's order otherwise.
  The narrow heads of the tiny test models are left out: on the device image cuDNN's backward returns NaN for them
  (docs/train.md).
* ``cudnn``: cuDNN first on any CUDA GPU; ``default``: torch's order.
* A block on a GPU with cuDNN attention on, eager or compiled, hands each attention backward its output gradient in
  the output's own layout (:class:`GradientInOutputLayout`). Why: torch 2.11 caches cuDNN's backward graph by the
  shapes and strides of the query, key and value only, and with cuDNN 9.5.1 and later it no longer copies the output
  gradient into the output's strides. FLUX.1's double and single blocks call attention with the same query, key and
  value but hand back gradients of other strides (rows of 3,072 after the double block's split, of 15,360 in the
  single block's concatenation with its MLP), so the double blocks' backward ran the single blocks' cached graph:
  wrong gradients at 4,608 tokens, an illegal memory access at Kontext's 8,704 (measured on the H200, docs/train.md
  "Edit pairs"). In torch's order too: torch 2.11 puts cuDNN first itself on compute capability 9.0 and 10.0 with
  cuDNN 9.9 and up (its sdp_utils.cpp, check_prefer_cudnn_attention). A compiled block is no exception: FLUX.1's
  blocks under ``torch.compile`` without the guard stopped on the same illegal memory access on the H200
  (tests/runtime/test_attention_layout_gpu.py).

The fallback stays as it was: a cuDNN attention backward that raises or returns NaN turns cuDNN off for the process
(runtime/blocks.py :func:`disable_cudnn_attention`, which calls :func:`mark_cudnn_failed`), and then the preference
is dropped too. ``torch.backends.cuda.enable_cudnn_sdp(False)`` before loading is also honoured.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

MODES = ("auto", "cudnn", "default")
AUTO_CAPABILITY = (9, 0)
AUTO_HEAD_DIMS = (128,)  # measured: FLUX.1's heads (docs/benchmarks.md, "cuDNN attention in the streamed blocks")

_cudnn_failed = False  # set once cuDNN attention failed in this process
_SDPA = F.scaled_dot_product_attention  # torch's own, as a mode receives it (a caller may wrap the name in F)


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
        return False, "torch's own order, as asked"
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


def same_layout(shape, strides, others) -> bool:
    """Whether two tensors of ``shape`` with these strides lay their elements out alike (a dimension of size 1 has
    any stride)."""
    return all(a == b for n, a, b in zip(shape, strides, others) if n > 1)


class _GradientAsOutput(torch.autograd.Function):
    """The identity, whose backward hands the gradient on laid out as the output was (its strides)."""

    @staticmethod
    def forward(ctx, out):
        ctx.shape, ctx.strides = out.shape, out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if same_layout(ctx.shape, grad.stride(), ctx.strides):
            return grad
        return torch.empty_strided(ctx.shape, ctx.strides, dtype=grad.dtype, device=grad.device).copy_(grad)


class GradientInOutputLayout(TorchFunctionMode):
    """Inside: each ``F.scaled_dot_product_attention`` output that needs a gradient gets it back in its own layout,
    so every backward that torch's cuDNN graph cache keys alike reads its gradient alike (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is _SDPA and isinstance(out, torch.Tensor) and out.requires_grad:
            return _GradientAsOutput.apply(out)
        return out


def preferring_cudnn(forward, runtime):
    """``forward`` run with cuDNN attention first in torch's priority while ``runtime.prefer_cudnn`` holds, cuDNN
    attention is on and has not failed in this process; and, on a GPU where cuDNN attention is on (torch 2.11 puts it
    first itself on Hopper and Blackwell with cuDNN 9.9 and up), with its attention gradients in their outputs'
    layout where it records a backward (:class:`GradientInOutputLayout`; traced into a compiled block)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn_first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]  # built once per block, not at every call
    on_gpu = torch.device(getattr(runtime, "device", "cpu")).type == "cuda"  # a runtime's device does not change

    @functools.wraps(forward)
    def run(*args, **kwargs):
        cudnn = torch.backends.cuda.cudnn_sdp_enabled()
        prefer = cudnn and getattr(runtime, "prefer_cudnn", False) and not _cudnn_failed
        guard = cudnn and on_gpu and torch.is_grad_enabled()
        with (sdpa_kernel(cudnn_first, set_priority=True) if prefer else contextlib.nullcontext()), \
                (GradientInOutputLayout() if guard else contextlib.nullcontext()):
            return forward(*args, **kwargs)

    return run
