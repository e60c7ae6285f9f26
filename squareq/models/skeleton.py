"""Build a model class on the meta device: from a factory, or from the class name and config a slab records.

Parameters land on the meta device as they are registered, so a 12B model costs nothing to build.
Buffers stay real: non-persistent ones (position ids, rotary frequencies) are computed in ``__init__``
and are in no checkpoint or slab, so they must keep their values.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from .base import ModelError


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside this context lands on the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param):
        if param is not None and not param.is_meta:
            param = param.__class__(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with its parameters on the meta device, in eval mode."""
    with parameters_on_meta():
        model = build()
    return model.eval()


class _TooLarge(Exception):
    pass


@contextlib.contextmanager
def registrations_at_most(limit: int | None):
    """Abort a model build (``_TooLarge``) once it has registered more than ``limit`` modules, parameters and
    buffers: a config from a file can ask for 200,000 layers, and the build would fill memory before any check
    could compare it with what the file holds."""
    if limit is None:
        yield
        return
    count = 0

    def counted(*_):
        nonlocal count
        count += 1
        if count > limit:
            raise _TooLarge

    handles = [nn_module.register_module_module_registration_hook(counted),
               nn_module.register_module_parameter_registration_hook(counted),
               nn_module.register_module_buffer_registration_hook(counted)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def build_within(build: Callable[[], nn.Module], tensors: int | None, refusal: str) -> nn.Module:
    """``build()``, stopped with :class:`ModelError` (``refusal``) once it has registered far more modules,
    parameters and buffers than the ``tensors`` its weights hold (None: no limit)."""
    try:
        with registrations_at_most(None if tensors is None else 8 * tensors + 1024):
            return build()
    except _TooLarge:
        raise ModelError(refusal) from None


def skeleton_from_record(class_name: str, config: dict[str, Any], tensors: int | None = None,
                         where: str = "the slab") -> nn.Module:
    """The diffusers or transformers class ``class_name`` built from a slab's recorded config, on meta.

    ``tensors``: how many parameters and buffers the slab holds; a config that builds far more (the build is
    stopped early, before it can exhaust memory) is refused with :class:`ModelError` naming ``where``.
    """
    try:
        return build_within(lambda: _skeleton_from_record(class_name, config), tensors,
                            f"{where}: the recorded {class_name} config builds far more than the {tensors} tensors the "
                            "slab holds (e.g. an edited layer count), so it was not built; recompile the slab.")
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError,
            RecursionError) as exc:
        raise ModelError(f"{where}: {class_name} cannot be built from the recorded config ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]}); the manifest is damaged or needs another library "
                         "version, recompile the slab.") from None


def _skeleton_from_record(class_name: str, config: dict[str, Any]) -> nn.Module:
    import diffusers

    from .base import diffusers_class

    cls = diffusers_class(class_name)
    if cls is not None and hasattr(cls, "from_config"):
        return build_meta(lambda: cls.from_config(dict(config)))
    import transformers

    cls = getattr(transformers, class_name, None) if class_name.isidentifier() else None
    model_type = config.get("model_type")
    if cls is None or not model_type:
        raise ModelError(f"neither diffusers {diffusers.__version__} nor transformers {transformers.__version__} has "
                         f"the class {class_name!r} this slab was compiled from; install the library version that has "
                         "it, or recompile the slab.")
    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **rest)
    except (ValueError, KeyError) as exc:
        raise ModelError(f"transformers cannot rebuild the {model_type} config this slab records "
                         f"({' '.join(str(exc).split())[:200]}).") from None
    return build_meta(lambda: cls(cfg))


def place_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put ``value`` at the parameter or buffer ``name`` (dotted, from ``model``) in place of what is there (on a
    skeleton, a meta tensor). A parameter slot takes an ``nn.Parameter`` as it is (tied weights stay tied) and
    wraps a plain tensor as a frozen one."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    if attr in owner._parameters:
        owner._parameters[attr] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value
