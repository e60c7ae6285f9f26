"""Real tensors into a meta-device module as it is loaded, and linear layers that compute in another dtype than
they store.

``materialize`` gives a module built on the meta device the tensors read for it and ties its shared weights again;
``own_copy`` places each tensor in an allocation of its own. ``cast_while_running`` lets a linear layer keep its
weight as stored (an FP8 or bf16 checkpoint's) and cast it to its input's dtype only while it runs.
"""
from __future__ import annotations

import types
import weakref
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..models import ModelError
from ..models.skeleton import place_tensor
from .tensors import few


def materialize(module: nn.Module, state: Mapping[str, torch.Tensor], device, dtype, unread=frozenset(),
                keep=frozenset()) -> None:
    """Give a meta-device module real tensors: ``state`` for its state dict (all of it but ``unread``, which stays on
    the meta device; those in ``keep`` in their own dtype), moved non-persistent buffers."""
    aliases = alias_groups(module)
    result = module.load_state_dict({n: own_copy(t, device, None if n in keep else dtype) for n, t in state.items()},
                                    strict=False, assign=True)
    if set(result.missing_keys) != set(unread) or result.unexpected_keys:
        raise ModelError(f"{type(module).__name__}: the tensors read do not match its state dict (missing "
                         f"{few(set(result.missing_keys) - set(unread))}, unexpected {few(result.unexpected_keys)}).")
    for names in {tuple(g) for g in aliases.values()}:  # assign=True unties shared parameters; tie them again
        shared = module.get_parameter(names[0])
        for name in names[1:]:
            place_tensor(module, name, shared)
    for sub in module.modules():  # non-persistent buffers were built real on the host
        for name, buf in sub._buffers.items():
            if buf is not None and not buf.is_meta:
                sub._buffers[name] = own_copy(buf, device, dtype)
    tensors = list(module.named_parameters()) + list(module.named_buffers())
    left = [n for n, t in tensors if t.is_meta and n not in unread]
    if left:
        raise ModelError(f"{type(module).__name__} still has tensors on the meta device after loading ({few(left)}).")


def alias_groups(model: nn.Module) -> dict[str, list[str]]:
    """Parameter names that share one tensor (tied weights), each name -> its whole group."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor[id(p)].append(name)
    return {name: names for names in by_tensor.values() if len(names) > 1 for name in names}


def own_copy(t: torch.Tensor, device, dtype) -> torch.Tensor:
    """``t`` on ``device``, floating tensors in ``dtype`` (None: as stored), always in an allocation of its own. A
    tensor read through the safetensors mmap sits wherever its file put it, a split BFL projection at an offset into
    the fused one, and a CPU matmul on such an address takes another path: the same model read from a BFL file and
    from a diffusers folder gave outputs 1.2e-6 apart, and a compile's measured effects with them, until both were
    copied."""
    return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True)


class _UpcastLinear(torch.autograd.Function):
    """``linear(x, weight.to(x.dtype), bias)`` for a frozen weight, returning the input's gradient only (the
    weight and bias take none), with the weight saved as stored: autograd would keep the cast copy for the backward
    pass, a float32 copy of every layer of the block (measured: 5 GB of a FLUX.2 block's effects pass)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _upcast_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    frozen = not (self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad))
    if frozen and torch.is_grad_enabled() and x.requires_grad:
        return _UpcastLinear.apply(x, self.weight, self.bias)
    return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias)


def cast_while_running(linears: Iterable[nn.Linear]) -> None:
    """Each linear casts its weight to its input's dtype while it runs (the weight stays as stored)."""
    for mod in linears:
        # bound to a weak proxy: a method bound to the module itself, kept in the module, is a reference cycle, and
        # a loaded block would then wait for the garbage collector (measured: the previous 2 GB FLUX.2 block still
        # held while the next one was searched)
        mod.forward = types.MethodType(_upcast_forward, weakref.proxy(mod))
