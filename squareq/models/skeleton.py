"""Build a model class on the meta device: from a factory, or from the class name and config a slab records.

Parameters land on the meta device as they are registered, so a 12B model costs nothing to build.
Buffers stay real: non-persistent ones (position ids, rotary frequencies) are computed in ``__init__``
and are in no checkpoint or slab, so they must keep their values.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

from torch import nn

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


def skeleton_from_record(class_name: str, config: dict[str, Any]) -> nn.Module:
    """The diffusers or transformers class ``class_name`` built from a slab's recorded config, on meta."""
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
        raise ModelError(f"transformers cannot rebuild the {model_type} config this slab records ({exc}).") from None
    return build_meta(lambda: cls(cfg))
