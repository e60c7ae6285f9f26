"""LTX-Video's ComfyUI layout: ``diffusion_model.<layer>.lora_A.weight`` / ``.lora_B.weight`` with alpha baked
into lora_B (no ``.alpha``), the layout of Lightricks' LTX-Video-Trainer files. The blocks' module names are the
same in the original model, ComfyUI and diffusers; diffusers' ``LTXVideoLoraLoaderMixin`` reads the file with
``_convert_non_diffusers_ltxv_lora_to_diffusers``, which only swaps the prefix: it renames none of the layers
outside the blocks (the original ``patchify_proj``, ``adaln_single``, ... are diffusers' ``proj_in``,
``time_embed``, ...), so those are refused, and it would leave ``.alpha`` keys behind (then refused by its loader),
hence the baking.
"""
from __future__ import annotations

from .modules import PEFT_NAMES_BAKED, FamilyLayout, OneToOne, table_module_of

PREFIX = "diffusion_model."

TABLE = OneToOne(lambda layer: PREFIX + layer, lambda layer: layer.startswith("transformer_blocks."))
LTX_VIDEO = FamilyLayout(
    family="ltx-video", name="LTX-Video's ComfyUI layout", network_module="networks.lora",
    implementation="https://github.com/Lightricks/LTX-Video", pipeline="LTXPipeline",
    converter="_convert_non_diffusers_ltxv_lora_to_diffusers", style=PEFT_NAMES_BAKED,
    module_of=table_module_of(TABLE, "LTX-Video's ComfyUI layout, which diffusers reads for the transformer blocks "
                                     "only (the names outside them differ from the original model's)"))
