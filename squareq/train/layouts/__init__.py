"""Each family's kohya/ComfyUI LoRA layout (the file `export-lora --format kohya` and `save_format = kohya` write),
by family: FLUX.1 and Chroma in kohya's FLUX.1 layout (flux.py), FLUX.2 and Z-Image in kohya's layouts of their
original names (flux2.py, z_image.py), Wan and Qwen-Image as musubi-tuner writes them (wan.py, qwen_image.py),
HunyuanVideo as musubi-tuner's converter and diffusion-pipe write it (hunyuan_video.py), LTX-Video and SD3 as
ComfyUI reads them (ltx_video.py, sd3.py); each is read back by the family's diffusers pipeline. What every layout
shares is modules.py; LoKr and LoHa in LyCORIS's layout, lycoris.py.

SD 1.5 / SDXL UNets and Würstchen have no layout here: their LoRA stays the diffusers/PEFT file.
"""
from __future__ import annotations

from ..lora_factors import LoraFileError
from .flux import CHROMA, FLUX
from .flux2 import FLUX2
from .hunyuan_video import HUNYUAN_VIDEO
from .ltx_video import LTX_VIDEO
from .modules import FamilyLayout
from .qwen_image import QWEN_IMAGE
from .sd3 import SD3
from .wan import WAN
from .z_image import Z_IMAGE

LAYOUTS: dict[str, FamilyLayout] = {layout.family: layout for layout in (
    FLUX, CHROMA, FLUX2, WAN, HUNYUAN_VIDEO, QWEN_IMAGE, LTX_VIDEO, SD3, Z_IMAGE)}


def layout_for(family: str, where: str = "this LoRA") -> FamilyLayout:
    """The family's layout; :class:`LoraFileError` in one sentence for a family that has none."""
    layout = LAYOUTS.get(family)
    if layout is None:
        raise LoraFileError(f"{where} is for a {family} model, for which SquareQ writes no kohya/ComfyUI layout (it "
                            f"has one for {', '.join(sorted(LAYOUTS))}); keep to the diffusers file.")
    return layout


__all__ = ["LAYOUTS", "FamilyLayout", "layout_for"]
