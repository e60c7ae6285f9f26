"""FLUX.1 family (diffusers ``FluxTransformer2DModel``): 19 double-stream + 38 single-stream blocks at 12B."""
from __future__ import annotations

from .base import FamilyAdapter

FLUX = FamilyAdapter(
    family="flux",
    class_name="FluxTransformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
)
