"""HunyuanVideo's ComfyUI layout: the original model's module names under ``diffusion_model.`` with PEFT's
``.lora_A.weight`` / ``.lora_B.weight`` and alpha baked into lora_B (no ``.alpha``). It is what musubi-tuner's
``convert_lora.py --target other`` and diffusion-pipe write, what ComfyUI's HunyuanVideo loader maps, and what
diffusers' ``HunyuanVideoLoraLoaderMixin`` reads (``_convert_hunyuan_video_lora_to_diffusers``). musubi-tuner's own
``lora_unet_`` file is not readable by diffusers (the converter takes its lora_down for a lora_B), so it is not
written.

The converter leaves ``.alpha`` keys behind (diffusers then refuses the file, and on a qkv module it fails outright),
hence the baking. It routes a file by an ``img_attn_qkv`` key: a file without one would load nothing, so a zero
rank-1 ``double_blocks.0.img_attn_qkv`` is written when q, k and v are not targeted. Two kinds of layers are refused:
the text refiner's fused ``self_attn_qkv`` (the converter splits its lora_A too, so no file reads back in both
diffusers and ComfyUI) and the final ``adaLN_modulation.1`` (the converter swaps the halves of lora_A as well as
lora_B). The converter splits a single block's ``linear1`` at HunyuanVideo's hidden size 3072.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..lora_factors import LoraFileError
from .modules import PEFT_NAMES_BAKED, QKV, QKV_MLP, FamilyLayout, Table, config_value, rules, table_module_of

PREFIX = "diffusion_model."
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_ADD_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")
_REFINER = "context_embedder.token_refiner.refiner_blocks.{i}."
_EMBED = "time_text_embed."

RULES = (
    *rules("double_blocks.{i}.", "transformer_blocks.{i}.", (
        ("img_attn_qkv", _QKV, QKV), ("txt_attn_qkv", _ADD_QKV, QKV),
        ("img_attn_proj", "attn.to_out.0"), ("txt_attn_proj", "attn.to_add_out"),
        ("img_mlp.fc1", "ff.net.0.proj"), ("img_mlp.fc2", "ff.net.2"),
        ("txt_mlp.fc1", "ff_context.net.0.proj"), ("txt_mlp.fc2", "ff_context.net.2"),
        ("img_mod.linear", "norm1.linear"), ("txt_mod.linear", "norm1_context.linear"))),
    *rules("single_blocks.{i}.", "single_transformer_blocks.{i}.", (
        ("linear1", (*_QKV, "proj_mlp"), QKV_MLP), ("linear2", "proj_out"), ("modulation.linear", "norm.linear"))),
    *rules("txt_in.individual_token_refiner.blocks.{i}.", _REFINER, (
        ("self_attn_proj", "attn.to_out.0"), ("mlp.fc1", "ff.net.0.proj"), ("mlp.fc2", "ff.net.2"),
        ("adaLN_modulation.1", "norm_out.linear"))),
    *rules("", "", (
        ("final_layer.linear", "proj_out"),
        ("time_in.mlp.0", _EMBED + "timestep_embedder.linear_1"),
        ("time_in.mlp.2", _EMBED + "timestep_embedder.linear_2"),
        ("vector_in.in_layer", _EMBED + "text_embedder.linear_1"),
        ("vector_in.out_layer", _EMBED + "text_embedder.linear_2"),
        ("guidance_in.mlp.0", _EMBED + "guidance_embedder.linear_1"),
        ("guidance_in.mlp.2", _EMBED + "guidance_embedder.linear_2"),
        ("txt_in.input_embedder", "context_embedder.proj_in"),
        ("txt_in.t_embedder.mlp.0", "context_embedder." + _EMBED + "timestep_embedder.linear_1"),
        ("txt_in.t_embedder.mlp.2", "context_embedder." + _EMBED + "timestep_embedder.linear_2"),
        ("txt_in.c_embedder.linear_1", "context_embedder." + _EMBED + "text_embedder.linear_1"),
        ("txt_in.c_embedder.linear_2", "context_embedder." + _EMBED + "text_embedder.linear_2"))),
)

_REFUSED = {
    r"context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn\.to_[qkv]$":
        "the text refiner's fused self_attn_qkv, whose lora_A diffusers' _convert_hunyuan_video_lora_to_diffusers "
        "splits as if it were a lora_B, so no file reads back alike in diffusers and ComfyUI",
    r"norm_out\.linear$":
        "the final adaLN_modulation.1, whose lora_A diffusers' _convert_hunyuan_video_lora_to_diffusers swaps in "
        "halves as if it were a lora_B",
}
TABLE = Table(RULES, lambda native: PREFIX + native, _REFUSED)
# modules whose input is the transformer's hidden state: the width of a zero img_attn_qkv when no config is known
_HIDDEN_INPUT = re.compile(r"\.(double_blocks\.\d+\.(img|txt)_(attn_qkv|attn_proj|mod\.linear|mlp\.fc1)"
                           r"|single_blocks\.\d+\.(linear1|modulation\.linear))\.lora_A\.weight$")


def _routed(tensors: dict[str, torch.Tensor], config: Mapping | None) -> None:
    """A zero rank-1 ``double_blocks.0.img_attn_qkv`` where the LoRA has none: diffusers routes the file by it."""
    if any("img_attn_qkv" in k for k in tensors):
        return
    heads, head_dim = config_value(config, "num_attention_heads"), config_value(config, "attention_head_dim")
    hidden = int(heads) * int(head_dim) if heads and head_dim else next(
        (int(t.shape[1]) for k, t in tensors.items() if _HIDDEN_INPUT.search(k)), None)
    if hidden is None:
        raise LoraFileError("this HunyuanVideo LoRA targets no layer of the transformer's hidden width, so SquareQ "
                            "cannot size the img_attn_qkv module diffusers recognises the layout by; export it from "
                            "the run's own diffusers file (which records the model's config) or add to_q to targets.")
    key = PREFIX + "double_blocks.0.img_attn_qkv"
    tensors[key + PEFT_NAMES_BAKED.down] = torch.zeros(1, hidden)
    tensors[key + PEFT_NAMES_BAKED.up] = torch.zeros(3 * hidden, 1)


WHAT = "the HunyuanVideo layout ComfyUI and diffusers read"
HUNYUAN_VIDEO = FamilyLayout(
    family="hunyuan-video", name="musubi-tuner's converted (diffusion-pipe) HunyuanVideo layout",
    network_module="networks.lora", implementation="https://github.com/Tencent/HunyuanVideo",
    pipeline="HunyuanVideoPipeline", converter="_convert_hunyuan_video_lora_to_diffusers",
    module_of=table_module_of(TABLE, WHAT), style=PEFT_NAMES_BAKED, finish=_routed)
