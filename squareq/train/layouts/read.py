"""Reading a family's kohya/ComfyUI file back into runtime naming through the family's own diffusers reader (its
pipeline's ``lora_state_dict``, the converter the layout is written for), so the file is read exactly as diffusers
reads it. FLUX.1 and Chroma files are read by ``flux.kohya_layers`` instead, which splits fused modules itself.

What the converter gives is each layer's (A, B) at scale 1 (alpha baked in); three steps make it the LoRA that was
written: rank columns whose B column is zero are dropped (a stacked module gives each part the whole lora_down, and
a part's own rank is where its B is nonzero), layers that are all zero are dropped (the zero modules a layout's
reader needs, when some layer is not), and B is divided by the file's nominal alpha / rank (``squareq.alpha`` or
``ss_network_alpha`` in the header) so that every layer carries that alpha again.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from ..lora_factors import LORA_A, LoraFileError, factor_pairs, positive_number
from . import LAYOUTS


def _nominal_alpha(header: Mapping[str, str]) -> float | None:
    for key in ("squareq.alpha", "ss_network_alpha"):
        try:
            value = json.loads(header.get(key, "null"))
        except ValueError:
            continue
        if positive_number(value):
            return float(value)
    return None


def _trimmed(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) without the rank columns where B is zero (the same delta)."""
    live = b.abs().sum(dim=0) != 0
    if bool(live.any()) and not bool(live.all()):
        return a[live].contiguous(), b[:, live].contiguous()
    return a, b


def family_layers(tensors: Mapping[str, torch.Tensor], header: Mapping[str, str], family: str,
                  where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{runtime layer: (A, B, alpha)} of a ``family`` kohya/ComfyUI file, through diffusers' reader for it."""
    import diffusers

    layout = LAYOUTS[family]
    try:
        state = getattr(diffusers, layout.pipeline).lora_state_dict(dict(tensors))
    except (ValueError, KeyError, IndexError, RuntimeError) as exc:
        raise LoraFileError(f"{where}: diffusers' {layout.converter} cannot read it as {layout.name} "
                            f"({str(exc)[:200]!r}); it is damaged or for another model.") from None
    prefix = "transformer."
    named = {k[len(prefix):]: v.float() for k, v in state.items() if k.startswith(prefix)}
    pairs = {layer: _trimmed(a, b) for layer, (a, b) in factor_pairs(named, where).items()}
    live = {layer: ab for layer, ab in pairs.items() if ab[0].count_nonzero() and ab[1].count_nonzero()}
    alpha = _nominal_alpha(header)
    out = {}
    for layer, (a, b) in (live or pairs).items():
        rank = int(a.shape[0])
        # the converter's scale is 1: with alpha α, B·rank/α gives the same delta at scale α/rank
        out[layer] = (a, b * (rank / alpha), alpha) if alpha else (a, b, float(rank))
    return out


def key_of(family: str, layer: str, factor: str) -> str:
    """The key of runtime layer ``layer``'s factor (``LORA_A`` or ``LORA_B``) in the family's file: its module's
    lora_down or lora_up. :class:`LoraFileError` for a layer the layout has no module for."""
    layout = LAYOUTS[family]
    return layout.module_of(layer).key + (layout.style.down if factor == LORA_A else layout.style.up)

