"""What a CUDA graph of a streamed block depends on beyond its tensors' values (runtime/block_graphs.py keys on it).

A replay launches the kernels captured, with the arguments they had: addresses, shapes, strides, and every Python
number the block's code turned into a kernel argument. So a key holds the shapes, dtypes and strides of the tensor
arguments, the other arguments, the autocast state, the attention backends torch may choose from, and of the block
(:class:`ModuleState`): its training flag, its LoRA and trainable parameters' addresses (and which train), its
buffers' addresses, and the LoRA state that is plain Python (SquareQ's ``lora_scale``, PEFT's scaling, active,
disabled and merged adapters). A block that draws random numbers (an active dropout) cannot be keyed at all: a replay
would repeat its mask.
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


class ModuleState:
    """Per call, what of block ``module``'s modules a graph depends on: its training flag, the addresses of its LoRA
    and trainable parameters and whether they train, its buffers' addresses, and the LoRA numbers held in Python;
    :class:`NotKeyable` for an active dropout.

    Which modules and parameters to read is found by one walk over the block, done again only after a module,
    parameter or buffer was registered anywhere (torch's global registration hooks count them): a walk costs about
    0.3 ms per FLUX block on a slow host, the reads about 5% of that, and a step makes three calls per block. The
    block's own weights and parameters are views into its slot, bound without registration; the slot is in the key."""

    def __init__(self, module: nn.Module) -> None:
        count_registrations()
        self.module = module
        self.generation = -1

    def _walk(self) -> None:
        mods = list(self.module.modules())
        self.dropouts = [m for m in mods if isinstance(m, nn.modules.dropout._DropoutNd)]
        self.params = [p for name, p in self.module.named_parameters() if p.requires_grad or "lora" in name]
        self.buffers = [(m._buffers, name) for m in mods for name in m._buffers]
        self.lora = [m for m in mods if "lora_scale" in m.__dict__ or isinstance(m.__dict__.get("scaling"), dict)]
        self.generation = _registrations

    def __call__(self) -> tuple:
        if self.generation != _registrations:
            self._walk()
        for m in self.dropouts:
            if m.training and m.p > 0:
                raise NotKeyable("a streamed block holds an active dropout, whose random numbers a CUDA graph would "
                                 "repeat; blocks with dropout run without graphs (set lora_dropout to 0 to graph "
                                 "them)")
        return (self.module.training, tuple((p.data_ptr(), p.requires_grad) for p in self.params),
                tuple(None if d.get(n) is None else d[n].data_ptr() for d, n in self.buffers),
                tuple(_lora_state(m) for m in self.lora))


def _lora_state(m: nn.Module) -> tuple:
    """The Python numbers and switches of a LoRA layer that its kernels take: SquareQ's QuantLinear, or PEFT's."""
    own = m.__dict__.get("lora_scale"), m.__dict__.get("exact_weight")
    scaling = m.__dict__.get("scaling")
    if not isinstance(scaling, dict):
        return own
    return (*own, tuple(sorted(scaling.items())), bool(m.disable_adapters), bool(m.merged),
            tuple(m.active_adapters or ()))


_registrations = 0  # modules, parameters and buffers registered anywhere since count_registrations()
_counting = False


def _registered(module, name, value) -> None:
    global _registrations
    _registrations += 1


def count_registrations() -> None:
    """Count module, parameter and buffer registrations in this process (once; the hooks only add one)."""
    global _counting
    if not _counting:
        _counting = True
        from torch.nn.modules import module as torch_module

        torch_module.register_module_module_registration_hook(_registered)
        torch_module.register_module_parameter_registration_hook(_registered)
        torch_module.register_module_buffer_registration_hook(_registered)
