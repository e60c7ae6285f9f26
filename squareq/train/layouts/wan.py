"""Wan's layout as musubi-tuner writes it (``networks.lora_wan``): ``lora_unet_blocks_<i>_<module>`` with the
original model's module names (``self_attn_q``, ``cross_attn_o``, ``cross_attn_k_img``, ``ffn_0``, ...),
``.lora_down.weight``, ``.lora_up.weight`` and ``.alpha``. ComfyUI maps it as it maps any ``lora_unet_`` key of
the original names; diffusers' ``WanLoraLoaderMixin`` reads it with ``_convert_musubi_wan_lora_to_diffusers``.

That converter takes every module of every block, 0 to the last, alpha included (musubi-tuner trains them all), and
nothing else: a missing one is a KeyError. So the modules the LoRA does not target are written as zero rank-1
factors with alpha 1 (they change nothing), sized from the model's config (or from the LoRA's own layers), and a
layer outside the blocks (the head, the embedders) is refused: the converter cannot place it.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..lora_factors import LoraFileError
from .modules import ALPHA, KOHYA, FamilyLayout, Table, config_value, kohya_key, rules, table_module_of

_ATTENTION = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))
RULES = rules("blocks.{i}.", "blocks.{i}.", (
    *((f"self_attn.{n}", f"attn1.{d}") for n, d in _ATTENTION),
    *((f"cross_attn.{n}", f"attn2.{d}") for n, d in _ATTENTION),
    ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
    ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2")))
TABLE = Table(RULES, kohya_key)
_KEY = re.compile(r"^lora_unet_blocks_(\d+)_(.+)\.lora_(down|up)\.weight$")
# each block module's (rows, columns) in terms of the model's widths: dim, ffn_dim, img (the image context's)
_SHAPES = {**{f"{a}_{n}": ("dim", "dim") for a in ("self_attn", "cross_attn") for n in "qkvo"},
           "cross_attn_k_img": ("dim", "img"), "cross_attn_v_img": ("dim", "img"),
           "ffn_0": ("ffn_dim", "dim"), "ffn_2": ("dim", "ffn_dim")}

_CONFIG_NAMES = {"dim": "hidden size", "ffn_dim": "ffn_dim", "img": "added_kv_proj_dim"}


def _widths(tensors: Mapping[str, torch.Tensor], config: Mapping | None) -> dict[str, int]:
    """The model's widths, from its config where known, else from the LoRA's own modules."""
    heads, head_dim = config_value(config, "num_attention_heads"), config_value(config, "attention_head_dim")
    widths = {"dim": int(heads) * int(head_dim)} if heads and head_dim else {}
    for name, key in (("ffn_dim", "ffn_dim"), ("img", "added_kv_proj_dim")):
        if config_value(config, key):
            widths[name] = int(config[key])
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m:
            rows, cols = _SHAPES[m.group(2)]
            size = t.shape[1] if m.group(3) == "down" else t.shape[0]
            widths.setdefault(cols if m.group(3) == "down" else rows, int(size))
    return widths


def _zero_filled(tensors: dict[str, torch.Tensor], config: Mapping | None) -> None:
    """Every module of every block present, as musubi-tuner's reader in diffusers needs: zero rank-1 factors for
    those the LoRA does not target."""
    blocks = {int(m.group(1)) for k in tensors for m in [_KEY.match(k)] if m}
    count = max(int(config_value(config, "num_layers", default=0)), max(blocks) + 1)
    image = any("_img" in k for k in tensors) or bool(config_value(config, "added_kv_proj_dim"))
    widths = _widths(tensors, config)
    for i in range(count):
        for module, (rows, cols) in _SHAPES.items():
            key = f"lora_unet_blocks_{i}_{module}"
            if key + KOHYA.down in tensors or (module.endswith("_img") and not image):
                continue
            lack = [w for w in (rows, cols) if w not in widths]
            if lack:
                raise LoraFileError(f"Wan's musubi-tuner layout needs every block module, and SquareQ cannot size the "
                                    f"untargeted {module} without the model's {_CONFIG_NAMES[lack[0]]}; export from "
                                    "the run's own diffusers file (which records the model's config) or add that "
                                    "layer to targets.")
            tensors[key + KOHYA.down] = torch.zeros(1, widths[cols])
            tensors[key + KOHYA.up] = torch.zeros(widths[rows], 1)
            tensors[key + ALPHA] = torch.tensor(1.0)


WAN = FamilyLayout(
    family="wan", name="musubi-tuner's Wan layout", network_module="networks.lora_wan",
    implementation="https://github.com/Wan-Video/Wan2.1", pipeline="WanPipeline",
    converter="_convert_musubi_wan_lora_to_diffusers",
    module_of=table_module_of(TABLE, "musubi-tuner's Wan layout, which has only the blocks' modules"),
    finish=_zero_filled)
