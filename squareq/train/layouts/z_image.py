"""Z-Image's kohya/ComfyUI layout: ``lora_unet_<block>_<i>_<module>`` with the original (ComfyUI's NextDiT) names,
``.lora_down.weight``, ``.lora_up.weight`` and ``.alpha``: q, k and v are one ``attention_qkv`` (stacked as
layouts/modules.py says, alpha × 3), the output projection ``attention_out``; ``feed_forward_w1/w2/w3`` and
``adaLN_modulation_0`` are 1:1. It is the layout musubi-tuner's ``convert_z_image_lora_to_comfy.py`` writes.
diffusers' ``ZImageLoraLoaderMixin`` reads it with ``_convert_non_diffusers_z_image_lora_to_diffusers``, which gives
each of q, k and v the whole stacked lora_down and its rows of lora_up (rank 3r, the same delta).

Layers outside the blocks and refiners (the embedders and the final layer) do not read back in diffusers and are
refused. LoKr does not stack onto the fused qkv: its keys are diffusers' names under ``diffusion_model.``, which
diffusers reads with ``_convert_non_diffusers_lokr_to_diffusers`` and ComfyUI maps onto the fused layer by row
offset (``comfy/utils.py`` ``z_image_to_diffusers``).
"""
from __future__ import annotations

from .modules import QKV, FamilyLayout, Table, kohya_key, rules, table_module_of

RULES = tuple(rule for block in ("layers", "noise_refiner", "context_refiner") for rule in rules(
    f"{block}.{{i}}.", f"{block}.{{i}}.", (
        ("attention.qkv", ("attention.to_q", "attention.to_k", "attention.to_v"), QKV),
        ("attention.out", "attention.to_out.0"),
        ("feed_forward.w1", "feed_forward.w1"), ("feed_forward.w2", "feed_forward.w2"),
        ("feed_forward.w3", "feed_forward.w3"), ("adaLN_modulation.0", "adaLN_modulation.0"))))
TABLE = Table(RULES, kohya_key)

Z_IMAGE = FamilyLayout(
    family="z-image", name="kohya's Z-Image layout (ComfyUI names)", network_module="networks.lora_zimage",
    implementation="https://github.com/Tongyi-MAI/Z-Image", pipeline="ZImagePipeline",
    converter="_convert_non_diffusers_z_image_lora_to_diffusers",
    module_of=table_module_of(TABLE, "Z-Image's kohya layout, which diffusers reads for the transformer blocks and "
                                     "refiners only"),
    lokr_key=lambda layer: "diffusion_model." + layer)
