"""LoKr and LoHa in LyCORIS's layout, the file kohya's and musubi-tuner's ``lycoris.kohya`` networks write and
ComfyUI reads: each module's factors under LyCORIS's suffixes, which are PEFT's parameter names without the adapter
(``.lokr_w1``, ``.lokr_w2_a``, ``.lokr_w2_b``, ...; ``.hada_w1_a``, ``.hada_w1_b``, ``.hada_w2_a``, ``.hada_w2_b``),
with the same shapes, and a scalar ``.alpha``.

**Keys.** LoHa uses the family's own module keys (layouts/__init__.py), stacked onto fused native layers exactly as
a LoRA is: each Hadamard pair is a low-rank product (``hada_w*_a`` [out, r] · ``hada_w*_b`` [r, in]), so the
``_a`` factors go block-diagonal, the ``_b`` factors concatenated, alpha × parts. LoKr does not stack (a stack of
Kronecker products is not one): for a family whose native layers fuse, its keys name the diffusers layers the way
its readers map them (``FamilyLayout.lokr_key``); elsewhere they are the family's module keys, and a LoKr on a layer
that is part of a fused module there is refused.

**Alpha.** PEFT scales both by alpha / r. LyCORIS and ComfyUI scale LoHa by alpha / rows of ``hada_w1_b`` (r, or
k·r stacked), the same; LoKr by alpha / rank only where a factor is decomposed (``lokr_w2_a``/``_b``), and by 1 where
both are full matrices, as diffusers' ``_bake_lokr_alpha_`` does too. So a LoKr module with both factors full has
alpha / r baked into ``lokr_w1`` and no ``.alpha``.

diffusers 0.42 reads LoKr back for Z-Image and FLUX.2 only, and has no LoHa reader at all; PEFT reads the run's
adapter folder for every family.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..lora_factors import LoraFileError
from .modules import ALPHA, FamilyLayout, group_layers, stack

LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
NETWORK_MODULE = "lycoris.kohya"


def adapter_kind(lora: Mapping[str, torch.Tensor]) -> str | None:
    """``lokr`` or ``loha`` for a LyCORIS state dict (``<layer>.lokr_w1``, ...), None for anything else."""
    factors = {key.rpartition(".")[2] for key in lora}
    return "lokr" if factors & set(LOKR) else "loha" if factors & set(LOHA) else None


def _layers(lora: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in lora.items():
        layer, _, factor = key.rpartition(".")
        if factor not in names:
            raise LoraFileError(f"{key} is not a {'LoKr' if names is LOKR else 'LoHa'} factor (PEFT's "
                                f"<layer>.{names[0]}, ...); SquareQ writes LyCORIS files of one adapter kind.")
        layers.setdefault(layer, {})[factor] = t.detach().float()
    return layers


def _loha(lora: Mapping[str, torch.Tensor], alpha: float, layout: FamilyLayout) -> dict[str, torch.Tensor]:
    out = {}
    grouped = group_layers(_layers(lora, LOHA), layout.module_of)
    for key in sorted(grouped):
        module, parts = grouped[key]
        if len({int(f["hada_w1_b"].shape[0]) for f in parts.values()}) > 1:
            raise LoraFileError(f"the LoHa layers stacked in {key} have different ranks; SquareQ stacks one rank.")
        down1, up1, times = stack(module, {p: (f["hada_w1_b"], f["hada_w1_a"]) for p, f in parts.items()})
        down2, up2, _ = stack(module, {p: (f["hada_w2_b"], f["hada_w2_a"]) for p, f in parts.items()})
        out.update({key + ".hada_w1_a": up1, key + ".hada_w1_b": down1, key + ".hada_w2_a": up2,
                    key + ".hada_w2_b": down2, key + ALPHA: torch.tensor(float(alpha * times))})
    return out


def lokr_key(layer: str, layout: FamilyLayout) -> str:
    """The LyCORIS key of a LoKr layer; :class:`LoraFileError` for one the layout cannot hold."""
    if layout.lokr_key is not None:
        return layout.lokr_key(layer)
    module = layout.module_of(layer)
    if len(module.parts) > 1:
        raise LoraFileError(f"LoKr layer {layer} is part of the fused module {module.key} in {layout.name}, and "
                            "Kronecker factors do not stack; drop it from targets, or keep the PEFT folder, which "
                            "holds every layer.")
    return module.key


def _lokr(lora: Mapping[str, torch.Tensor], rank: int, alpha: float, layout: FamilyLayout) -> dict[str, torch.Tensor]:
    out = {}
    for layer, factors in sorted(_layers(lora, LOKR).items()):
        key = lokr_key(layer, layout)
        decomposed = "lokr_w1_a" in factors or "lokr_w2_a" in factors
        for name, t in factors.items():
            # both factors full: LyCORIS applies no alpha, so PEFT's alpha / r goes into w1
            out[f"{key}.{name}"] = t if decomposed or name != "lokr_w1" else t * (alpha / rank)
        if decomposed:
            out[key + ALPHA] = torch.tensor(float(alpha))
    return out


def lycoris_tensors(lora: Mapping[str, torch.Tensor], rank: int, alpha: float,
                    layout: FamilyLayout) -> dict[str, torch.Tensor]:
    """The LyCORIS file's tensors (fp32) of a runtime LoKr or LoHa (``runtime.lora_state_dict``: ``<layer>.lokr_w1``,
    ...) trained at ``rank`` and ``alpha`` (scale alpha / rank, PEFT's)."""
    kind = adapter_kind(lora)
    if kind is None:
        raise LoraFileError("the state dict holds no LoKr or LoHa factors (<layer>.lokr_w1, <layer>.hada_w1_a, ...).")
    return _lokr(lora, rank, alpha, layout) if kind == "lokr" else _loha(lora, alpha, layout)
