"""FLUX.1's and Chroma's kohya layout (sd-scripts, ComfyUI, Forge), both ways: ``to_kohya`` writes it,
``from_kohya`` reads it (and kohya files from other tools) back into runtime naming.

``lora_unet_<BFL module, dots as underscores>`` with ``.lora_down.weight`` [rank, in], ``.lora_up.weight``
[out, rank] and a scalar ``.alpha``; the module names are Black Forest Labs' (``double_blocks_0_img_attn_qkv``),
where q, k, v (and a single block's MLP input) are one fused linear, stacked as layouts/modules.py says.
``from_kohya`` inverts this; a kohya LoRA trained on the fused layer (lora_up not block-diagonal) becomes, for each
part, (the fused lora_down, that part's rows of lora_up) at rank k·r, which reproduces the same delta. diffusers
reads it through ``FluxLoraLoaderMixin`` (``_convert_kohya_flux_lora_to_diffusers``), which Chroma's pipeline uses
too; that converter splits a single block's ``linear1`` at FLUX.1's hidden size 3072, which Chroma shares.

The diffusers <-> BFL names come from ``squareq.models.flux_bfl``; no table is repeated here.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ...models import flux_bfl
from ...models.base import ModelError
from ..lora_factors import LoraFileError, positive_number, with_one_alpha
from .modules import FamilyLayout, Module, lora_tensors

KOHYA_PREFIX = "lora_unet_"  # sd-scripts' networks/lora_flux.py prefix for the transformer
KOHYA_NETWORK_MODULE = "networks.lora_flux"
KOHYA_DOWN, KOHYA_UP, KOHYA_ALPHA = ".lora_down.weight", ".lora_up.weight", ".alpha"


def _fused_module(layer: str):
    """(BFL module, its rule, this layer's part, diffusers prefix of the group) for a diffusers layer name."""
    # flux_bfl's lookup table works on tensor names; a LoRA targets a linear, whose tensor is "<layer>.weight"
    found = flux_bfl.bfl_lookup(layer + ".weight")
    if found is None or found[4] != "weight":
        raise LoraFileError(f"LoRA layer {layer} has no linear counterpart in the kohya/BFL FLUX layout; drop it from "
                            "targets, or keep to the diffusers file, which holds every layer.")
    group, index, rule, part, _ = found
    return group.bfl.replace("{i}", index) + rule.bfl, rule, part, group.diffusers.replace("{i}", index)


def _kohya_stem(module: str) -> str:
    """A BFL module's kohya name: ``double_blocks.0.img_attn.qkv`` is ``lora_unet_double_blocks_0_img_attn_qkv``."""
    return KOHYA_PREFIX + module.replace(".", "_")


def flux_module(layer: str) -> Module:
    """Where a FLUX.1 (or Chroma) runtime layer goes in the kohya file: its BFL module, fused where BFL fuses."""
    module, rule, part, prefix = _fused_module(layer)
    return Module(_kohya_stem(module), tuple(prefix + d for d in rule.diffusers), part, rule.layout)


def to_kohya(lora: Mapping[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """The kohya sd-scripts / ComfyUI FLUX LoRA (``lora_unet_*.lora_down/.lora_up/.alpha``) of a runtime LoRA.

    Each layer's scale is alpha / its rank. Split diffusers layers are stacked onto their fused BFL layer (see
    layouts/modules.py), so every layer's delta scale·B·A is reproduced exactly; tensors stay in fp32.
    """
    return lora_tensors(lora, alpha, flux_module)


class _KohyaNames:
    """kohya module stem (``lora_unet_double_blocks_0_img_attn_qkv``) -> BFL module, from flux_bfl.GROUPS.

    Underscores are ambiguous (``img_attn`` vs ``img.attn``), so each group's prefix and each rule's module are
    rewritten the kohya way and matched whole."""

    def __init__(self) -> None:
        self.groups = []
        for g in flux_bfl.GROUPS:
            head = re.escape(KOHYA_PREFIX + g.bfl.replace(".", "_")).replace(r"\{i\}", r"(\d+)")
            rules = {r.bfl.replace(".", "_"): r for r in g.rules if ("weight", "weight") in r.params}
            self.groups.append((re.compile("^" + head + "(.+)$"), g, rules))

    def lookup(self, stem: str) -> str | None:
        """The dotted BFL module (``double_blocks.0.img_attn.qkv``), or None."""
        for pattern, group, rules in self.groups:
            m = pattern.match(stem)
            if not m:
                continue
            index, rest = (m.group(1), m.group(2)) if pattern.groups == 2 else ("", m.group(1))
            rule = rules.get(rest)
            if rule is None:
                if group.bfl:  # a block prefix matched, so no other group can
                    return None
                continue
            return group.bfl.replace("{i}", index) + rule.bfl
        return None


_KOHYA_NAMES = _KohyaNames()


def _off_block(up: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The columns of ``up`` outside [start, stop): zero when the part owns only its own rank block."""
    return torch.cat([up[:, :start], up[:, stop:]], dim=1)


def kohya_layers(sd: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{diffusers layer: (A, B, alpha)} of a kohya FLUX LoRA; each layer's scale is alpha / A's rows."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in sd.items():
        for suffix, slot in ((KOHYA_DOWN, "down"), (KOHYA_UP, "up"), (KOHYA_ALPHA, "alpha")):
            if key.endswith(suffix):
                modules.setdefault(key[: -len(suffix)], {})[slot] = t
                break
        else:
            raise LoraFileError(f"{where}: {key} is not a kohya LoRA tensor (<module>.lora_down.weight, "
                                ".lora_up.weight "
                                "or .alpha); SquareQ reads plain LoRA only (no LoHa, LoKr or DoRA).")
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for stem in sorted(modules):
        m = modules[stem]
        if stem.startswith("lora_te"):
            raise LoraFileError(f"{where} holds text-encoder LoRA ({stem}); SquareQ loads the FLUX transformer's LoRA "
                                "only, so save the file without the lora_te* tensors.")
        module = _KOHYA_NAMES.lookup(stem)
        if module is None:
            raise LoraFileError(f"{where}: {stem} is not a kohya FLUX.1 transformer module (expected names like "
                                "lora_unet_double_blocks_0_img_attn_qkv); this file is for another model or layout.")
        if "down" not in m or "up" not in m:
            lack = "lora_down" if "down" not in m else "lora_up"
            raise LoraFileError(f"{where}: {stem} has no {lack}.weight; every kohya LoRA module needs both factors.")
        down, up = m["down"].float(), m["up"].float()
        total = int(down.shape[0])
        if down.dim() != 2 or up.dim() != 2 or up.shape[1] != total:
            raise LoraFileError(f"{where}: {stem} has lora_down {list(down.shape)} and lora_up {list(up.shape)}; "
                                "expected [rank, in] and [out, rank] (a conv LoRA is not a FLUX LoRA).")
        # a missing .alpha means alpha = rank (scale 1), as kohya and diffusers read it
        alpha_fused = float(total)
        if "alpha" in m:
            if m["alpha"].numel() != 1 or not positive_number(float(m["alpha"].float().reshape(-1)[0])):
                raise LoraFileError(f"{where}: {stem}.alpha is not one positive number; re-save the LoRA.")
            alpha_fused = float(m["alpha"].float().reshape(-1)[0])
        # split lora_up rows by the fused layout; linear1's q/k/v are each as wide as its input (the hidden size),
        # which is all flux_bfl needs from a config
        config = {"num_attention_heads": 1, "attention_head_dim": int(down.shape[1])}
        try:
            ups = flux_bfl.bfl_to_diffusers({module + ".weight": up}, config)
        except ModelError as e:
            raise LoraFileError(f"{where}: {stem}: {e}") from None
        names = list(ups)  # in part order
        # untargeted parts were written as zero rows; an all-zero LoRA (untrained) keeps every part
        live = [n for n in names if ups[n].count_nonzero()] or names
        k = len(live)
        r = total // k
        diagonal = total % k == 0 and all(not _off_block(ups[n], j * r, (j + 1) * r).count_nonzero()
                                          for j, n in enumerate(live))
        for j, n in enumerate(live):
            layer = n[: -len(".weight")]
            if diagonal:  # stacked split layers: each part's own A rows and B block, alpha per part
                out[layer] = (down[j * r:(j + 1) * r].contiguous(), ups[n][:, j * r:(j + 1) * r].contiguous(),
                              alpha_fused / k)
            else:  # trained fused: the whole lora_down with this part's rows of lora_up, at rank k·r
                out[layer] = (down.contiguous(), ups[n].contiguous(), alpha_fused)
    if not out:
        raise LoraFileError(f"{where} holds no kohya LoRA modules.")
    return out


def from_kohya(sd: Mapping[str, torch.Tensor], where: str = "the kohya LoRA") -> tuple[dict[str, torch.Tensor], float]:
    """A kohya FLUX LoRA in runtime naming (``<layer>.lora_A.weight``, fp32) and its alpha.

    Each layer's scale is alpha / its rank (lora_A rows), as runtime.add_lora applies it. Block-diagonal fused
    modules (what ``to_kohya`` and sd-scripts' split-qkv write) split back to each part's own factors; a LoRA
    trained on the fused layer gives each part the fused lora_down and its rows of lora_up (rank k·r). Where
    layers' alphas differ, the ratio to the most common one is folded into lora_B.
    """
    lora, _, alpha = with_one_alpha(kohya_layers(sd, where))
    return lora, alpha


def _layout(family: str, implementation: str, pipeline: str) -> FamilyLayout:
    # LoKr cannot stack onto BFL's fused qkv, so its keys are LyCORIS's own for the diffusers model, which ComfyUI
    # maps onto the fused layers by row offset
    return FamilyLayout(family=family, name="kohya sd-scripts' FLUX.1 layout", network_module=KOHYA_NETWORK_MODULE,
                        implementation=implementation, pipeline=pipeline,
                        converter="_convert_kohya_flux_lora_to_diffusers", module_of=flux_module,
                        lokr_key=lambda layer: "lycoris_" + layer.replace(".", "_"))


FLUX = _layout("flux", "https://github.com/black-forest-labs/flux", "FluxPipeline")
CHROMA = _layout("chroma", "https://huggingface.co/lodestones/Chroma", "ChromaPipeline")
