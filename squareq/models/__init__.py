"""Model families: one adapter per family, plus built-in tiny models that need no download."""
from __future__ import annotations

from typing import Callable

from torch import nn

from .base import FamilyAdapter, ModelError
from .flux import FLUX
from .tiny import TINY_FLUX_CONFIG, build_tiny_flux, tiny_flux_inputs
from .tiny_pipeline import build_tiny_flux_pipeline, write_tiny_flux_pipeline

ADAPTERS: dict[str, FamilyAdapter] = {a.family: a for a in (FLUX,)}

BUILTIN_MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "tiny-flux": ("flux", build_tiny_flux),
}


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter whose diffusers class is ``model``'s class."""
    for adapter in ADAPTERS.values():
        if adapter.matches(model):
            return adapter
    known = ", ".join(a.class_name for a in ADAPTERS.values())
    raise ModelError(f"no SquareQ family adapter for {type(model).__name__}; supported classes: {known}.")


def load_builtin(name: str) -> tuple[nn.Module, FamilyAdapter]:
    """Build a built-in model by name (``tiny-flux``) with its family adapter."""
    try:
        family, build = BUILTIN_MODELS[name]
    except KeyError:
        raise ModelError(f"{name!r} is not a built-in model; built-in names: {', '.join(BUILTIN_MODELS)}.") from None
    return build(), ADAPTERS[family]


__all__ = [
    "ADAPTERS",
    "BUILTIN_MODELS",
    "FLUX",
    "TINY_FLUX_CONFIG",
    "FamilyAdapter",
    "ModelError",
    "adapter_for",
    "build_tiny_flux",
    "build_tiny_flux_pipeline",
    "load_builtin",
    "tiny_flux_inputs",
    "write_tiny_flux_pipeline",
]
