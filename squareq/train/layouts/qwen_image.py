"""Qwen-Image's layout as musubi-tuner writes it (``networks.lora_qwen_image``): ``lora_unet_<layer, dots as
underscores>`` with ``.lora_down.weight``, ``.lora_up.weight`` and ``.alpha``. The original model's module names
are diffusers' own, so every linear maps 1:1 and nothing fuses; ComfyUI maps ``lora_unet_`` keys of the original
names, and diffusers' ``QwenImageLoraLoaderMixin`` reads the file with
``_convert_non_diffusers_qwen_lora_to_diffusers``, which re-dots the names (its table names the few outside the
blocks) and consumes ``.alpha``.
"""
from __future__ import annotations

from .modules import FamilyLayout, OneToOne, kohya_key, table_module_of

# outside the blocks, the converter knows exactly these (its top_level_modules)
_TOP = ("img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
        "time_text_embed.timestep_embedder.linear_2")

TABLE = OneToOne(kohya_key, lambda layer: layer.startswith("transformer_blocks.") or layer in _TOP)
QWEN_IMAGE = FamilyLayout(
    family="qwen-image", name="musubi-tuner's Qwen-Image layout", network_module="networks.lora_qwen_image",
    implementation="https://github.com/QwenLM/Qwen-Image", pipeline="QwenImagePipeline",
    converter="_convert_non_diffusers_qwen_lora_to_diffusers",
    module_of=table_module_of(TABLE, "musubi-tuner's Qwen-Image layout, whose diffusers reader knows the blocks and "
                                     f"{', '.join(_TOP)} only"))
