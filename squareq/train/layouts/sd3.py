"""SD3 / SD3.5's ComfyUI file. diffusers has no non-diffusers SD3 layout (``SD3LoraLoaderMixin.lora_state_dict``
converts nothing), and ComfyUI maps diffusers' own names for SD3 (``transformer.<layer>``, split q, k, v placed
in its fused qkv by row offset). So the file is the diffusers file with the two changes ComfyUI needs: alpha baked
into lora_B, since ComfyUI reads alpha only from ``.alpha`` tensors and diffusers' SD3 loader would leave those
behind, and no ``lora_adapter_metadata`` header, which diffusers would apply again. Every linear maps.
"""
from __future__ import annotations

from .modules import PEFT_NAMES_BAKED, FamilyLayout, Module

PREFIX = "transformer."

SD3 = FamilyLayout(
    family="sd3", name="ComfyUI's SD3 layout (diffusers names, alpha baked)", network_module="networks.lora_sd3",
    implementation="https://github.com/Stability-AI/sd3.5", pipeline="StableDiffusion3Pipeline",
    converter="SD3LoraLoaderMixin.lora_state_dict", style=PEFT_NAMES_BAKED,
    module_of=lambda layer: Module(PREFIX + layer, (layer,)))
