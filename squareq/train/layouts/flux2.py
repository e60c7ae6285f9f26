"""FLUX.2's kohya layout: ``lora_unet_<BFL module, dots as underscores>`` with ``.lora_down.weight``,
``.lora_up.weight`` and ``.alpha``, the module names Black Forest Labs' (``double_blocks_0_img_attn_qkv``, whose q, k
and v stack as layouts/modules.py says; a single block's ``linear1`` is one layer in diffusers too). ComfyUI maps
``lora_unet_`` keys of the original names; diffusers' ``Flux2LoraLoaderMixin`` reads the file with
``_convert_kohya_flux2_lora_to_diffusers``, which takes the block counts from the keys and splits a stacked qkv back
into each part's own rank.

That converter has no place for the guidance embedder, the shared modulation layers or the final adaLN: it drops
them with a log line only, so they are refused here. LoKr keys are LyCORIS's for the diffusers model
(``lycoris_transformer_blocks_0_attn_to_q``), which diffusers reads with ``_convert_lycoris_flux2_lokr_to_diffusers``
for the blocks' layers.
"""
from __future__ import annotations

from ..lora_factors import LoraFileError
from .modules import QKV, FamilyLayout, Table, kohya_key, rules, table_module_of

_EMBED = "time_guidance_embed.timestep_embedder."
RULES = (
    *rules("double_blocks.{i}.", "transformer_blocks.{i}.", (
        ("img_attn.qkv", ("attn.to_q", "attn.to_k", "attn.to_v"), QKV),
        ("txt_attn.qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), QKV),
        ("img_attn.proj", "attn.to_out.0"), ("txt_attn.proj", "attn.to_add_out"),
        ("img_mlp.0", "ff.linear_in"), ("img_mlp.2", "ff.linear_out"),
        ("txt_mlp.0", "ff_context.linear_in"), ("txt_mlp.2", "ff_context.linear_out"))),
    *rules("single_blocks.{i}.", "single_transformer_blocks.{i}.", (
        ("linear1", "attn.to_qkv_mlp_proj"), ("linear2", "attn.to_out"))),
    *rules("", "", (
        ("img_in", "x_embedder"), ("txt_in", "context_embedder"), ("final_layer.linear", "proj_out"),
        ("time_in.in_layer", _EMBED + "linear_1"), ("time_in.out_layer", _EMBED + "linear_2"))),
)
_DROPPED = "a layer diffusers' _convert_kohya_flux2_lora_to_diffusers drops with only a log line"
TABLE = Table(RULES, kohya_key, {r"time_guidance_embed\.guidance_embedder\.": _DROPPED,
                                 r"(double|single)_stream_modulation": _DROPPED, r"norm_out\.linear$": _DROPPED})
# the block layers diffusers' LyCORIS reader knows (its _LYCORIS_FLUX2_SUBPATH_MAP)
_LOKR_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def lokr_key(layer: str) -> str:
    if not layer.startswith(_LOKR_BLOCKS):
        raise LoraFileError(f"LoKr layer {layer} cannot be written for FLUX.2: diffusers' LyCORIS reader "
                            "(_convert_lycoris_flux2_lokr_to_diffusers) knows the blocks' layers only; drop it from "
                            "targets, or keep the PEFT folder, which holds every layer.")
    return "lycoris_" + layer.replace(".", "_")


FLUX2 = FamilyLayout(
    family="flux2", name="kohya's FLUX.2 layout (BFL names)", network_module="networks.lora_flux_2",
    implementation="https://github.com/black-forest-labs/flux2", pipeline="Flux2Pipeline",
    converter="_convert_kohya_flux2_lora_to_diffusers",
    module_of=table_module_of(TABLE, "kohya's FLUX.2 layout"), lokr_key=lokr_key)
