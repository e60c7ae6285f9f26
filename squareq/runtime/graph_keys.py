"""What a CUDA graph of a streamed block depends on beyond its tensors' values (runtime/block_graphs.py keys on it).

A replay launches the kernels captured, with the arguments they had: addresses, shapes, strides, and every Python
number the block's code turned into a kernel argument. So a key holds the shapes, dtypes and strides of the tensor
arguments, the other arguments, the autocast state, the attention backends torch may choose from, and per module of
the block: its parameters' and buffers' addresses (and which parameters train), and the LoRA state that is plain
Python (SquareQ's ``lora_scale``, PEFT's scaling, active, disabled and merged adapters). A block that draws random
numbers (an active dropout) cannot be keyed at all: a replay would repeat its mask.
"""
from __future__ import annotations

import enum
from typing import Any

import torch
from torch import nn

# The flags torch reads to pick a scaled-dot-product-attention kernel; a graph holds the kernel picked at capture.
_SDPA_FLAGS = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled")
# Non-tensor arguments a key can hold by value. Anything else (an object hashed by identity, a cache holding tensors)
# would make every call a new key, or hide tensors the graph reads at their old addresses.
PRIMITIVES = (type(None), bool, int, float, str, torch.dtype, torch.device, enum.Enum)


class NotKeyable(Exception):
    """This call cannot be graphed; the message says why, for the log."""


def sdpa_backends() -> tuple:
    """Which attention backends torch may use now."""
    return tuple(getattr(torch.backends.cuda, flag)() for flag in _SDPA_FLAGS)


def autocast_state(device_type: str) -> tuple:
    """The autocast switch and dtype for ``device_type`` (a graph holds the casts it captured)."""
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def tensor_signature(t: torch.Tensor) -> tuple:
    """What a captured kernel depends on in a tensor argument: shape, dtype, strides, and whether it needs a
    gradient."""
    return tuple(t.shape), t.dtype, t.stride(), t.requires_grad


def spec_key(spec) -> Any:
    """A hashable stand-in for a pytree spec: the spec itself where torch makes it hashable, else its text (which
    spells out the whole structure)."""
    try:
        hash(spec)
    except TypeError:
        return repr(spec)
    return spec


def argument_values(values: tuple) -> tuple:
    """``values`` (a call's non-tensor arguments) if each is a plain value a key can hold; else :class:`NotKeyable`."""
    for v in values:
        if not isinstance(v, PRIMITIVES):
            raise NotKeyable(f"a streamed block got a {type(v).__name__} argument, which a CUDA graph cannot hold by "
                             "value; that block runs without a graph")
    return values


def module_state(module: nn.Module) -> tuple:
    """Per module of block ``module``: its training flag, parameter addresses and whether they train, buffer
    addresses, and its LoRA state held in Python; :class:`NotKeyable` for an active dropout."""
    state = []
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            raise NotKeyable("a streamed block holds an active dropout, whose random numbers a CUDA graph would "
                             "repeat; blocks with dropout run without graphs (set lora_dropout to 0 to graph them)")
        state.append((m.training,
                      tuple((p.data_ptr(), p.requires_grad) for p in m._parameters.values() if p is not None),
                      tuple(b.data_ptr() for b in m._buffers.values() if b is not None), _lora_state(m)))
    return tuple(state)


def _lora_state(m: nn.Module) -> tuple:
    """The Python numbers and switches of a LoRA layer that its kernels take: SquareQ's QuantLinear, or PEFT's."""
    own = getattr(m, "lora_scale", None), getattr(m, "exact_weight", None)
    scaling = getattr(m, "scaling", None)
    if not isinstance(scaling, dict):
        return own
    return (*own, tuple(sorted(scaling.items())), bool(getattr(m, "disable_adapters", False)),
            bool(getattr(m, "merged", False)), tuple(getattr(m, "active_adapters", ()) or ()))
