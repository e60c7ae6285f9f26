"""Model signature: a hash of the model class, its config and every parameter's name and shape.

The runtime refuses to attach a slab to a skeleton whose signature differs.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

import torch


def jsonable_config(config: Any) -> dict[str, Any]:
    """A model config as plain JSON types, without diffusers' private ``_`` keys."""
    items = dict(config or {})
    return json.loads(json.dumps({k: v for k, v in items.items() if not str(k).startswith("_")}, default=list))


def signature_from_shapes(class_name: str, config: dict[str, Any], shapes: Iterable[tuple[str, list[int]]]) -> str:
    """sha256 over (class name, config, sorted parameter names and shapes)."""
    payload = {
        "class": class_name,
        "config": config,
        "params": sorted([name, [int(d) for d in shape]] for name, shape in shapes),
    }
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_signature(model: torch.nn.Module) -> str:
    """Signature of a live (or meta-device) model: works without touching weight values."""
    shapes = [(name, list(t.shape)) for name, t in model.state_dict(keep_vars=True).items()]
    return signature_from_shapes(type(model).__name__, jsonable_config(getattr(model, "config", {})), shapes)
