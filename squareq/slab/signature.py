"""Model signature: a hash of the model class, its config and every parameter's name and shape.

The runtime refuses to attach a slab to a skeleton whose signature differs.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch

# Keys that name the library version that saved a config rather than the model itself.
VERSION_KEYS = {"transformers_version"}


def jsonable_config(config: Any) -> dict[str, Any]:
    """A model config (diffusers dict or transformers ``PretrainedConfig``) as plain JSON types, without
    private ``_`` keys and library versions, so the signature depends on the model only."""
    items = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    kept = {k: v for k, v in items.items() if not str(k).startswith("_") and k not in VERSION_KEYS}
    return json.loads(json.dumps(kept, default=lambda o: o.to_dict() if hasattr(o, "to_dict") else list(o)))


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
