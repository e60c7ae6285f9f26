"""Model families: one adapter per family, plus built-in tiny models that need no download."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .base import FamilyAdapter, ModelError
from .chroma import CHROMA, build_tiny_chroma
from .flux import FLUX
from .flux2 import FLUX2, build_tiny_flux2
from .hunyuan_video import HUNYUAN_VIDEO, build_tiny_hunyuan_video
from .ltx_video import LTX_VIDEO, build_tiny_ltx_video
from .qwen_image import QWEN_IMAGE, build_tiny_qwen_image
from .sd3 import SD3, build_tiny_sd3
from .tiny import TINY_FLUX_CONFIG, build_tiny_flux, tiny_flux_inputs
from .tiny_pipeline import build_tiny_flux_pipeline, write_tiny_flux_pipeline
from .unet import SD_UNET, build_tiny_sd15, build_tiny_sdxl
from .wan import WAN, build_tiny_wan
from .wuerstchen import (
    WUERSTCHEN_DECODER,
    WUERSTCHEN_PRIOR,
    build_tiny_wuerstchen_decoder,
    build_tiny_wuerstchen_prior,
)
from .z_image import Z_IMAGE, build_tiny_z_image

ADAPTERS: dict[str, FamilyAdapter] = {a.family: a for a in (FLUX, FLUX2, CHROMA, SD3, QWEN_IMAGE, WAN, HUNYUAN_VIDEO,
                                                              LTX_VIDEO, Z_IMAGE, SD_UNET, WUERSTCHEN_PRIOR,
                                                              WUERSTCHEN_DECODER)}

BUILTIN_MODELS: dict[str, tuple[str, Callable[[], nn.Module]]] = {
    "tiny-flux": ("flux", build_tiny_flux),
    "tiny-sd3": ("sd3", build_tiny_sd3),
    "tiny-qwen-image": ("qwen-image", build_tiny_qwen_image),
    "tiny-wan": ("wan", build_tiny_wan),
    "tiny-flux2": ("flux2", build_tiny_flux2),
    "tiny-chroma": ("chroma", build_tiny_chroma),
    "tiny-hunyuan-video": ("hunyuan-video", build_tiny_hunyuan_video),
    "tiny-ltx-video": ("ltx-video", build_tiny_ltx_video),
    "tiny-z-image": ("z-image", build_tiny_z_image),
    "tiny-sd15": ("sd-unet", build_tiny_sd15),
    "tiny-sdxl": ("sd-unet", build_tiny_sdxl),
    "tiny-wuerstchen-prior": ("wuerstchen-prior", build_tiny_wuerstchen_prior),
    "tiny-wuerstchen-decoder": ("wuerstchen-decoder", build_tiny_wuerstchen_decoder),
}


def adapter_for(model: nn.Module) -> FamilyAdapter:
    """The adapter whose diffusers class is ``model``'s class."""
    for adapter in ADAPTERS.values():
        if adapter.matches(model):
            return adapter
    known = ", ".join(a.class_name for a in ADAPTERS.values())
    raise ModelError(f"no SquareQ family adapter for {type(model).__name__}; supported classes: {known}.")


CAPABILITIES = ("compile", "stream", "train", "train on clips", "train on pairs", "sample")
# the families whose edit models take control images SquareQ does not train on yet (none since FLUX.2's reference
# images and Qwen-Image-Edit); the others have none ("-")
EDITS_TO_COME: tuple[str, ...] = ()


def families_table() -> str:
    """What ``squareq families`` prints: every family adapter, its class, blocks, built-in tiny model and what
    SquareQ supports for it, rendered from the adapters themselves."""
    builtin: dict[str, list[str]] = {}
    for name, (family, _) in BUILTIN_MODELS.items():
        builtin.setdefault(family, []).append(f"`{name}`")
    rows = ["| family | diffusers class | streamed blocks | built-in | " + " | ".join(CAPABILITIES) + " |",
            "|---|---|---|---|" + "---|" * len(CAPABILITIES)]
    for a in ADAPTERS.values():
        # clips are for the families whose latents carry frames: the others have nothing to do there
        marks = ["yes" if c in a.supports else "-" if c == "train on clips" and a.recipe and not a.recipe.frames
                 or c == "train on pairs" and a.family not in EDITS_TO_COME else "not yet" for c in CAPABILITIES]
        rows.append(f"| {a.family} | `{a.class_name}` | {', '.join(f'`{b}`' for b in a.block_lists)} | "
                    f"{', '.join(builtin.get(a.family, ['-']))} | " + " | ".join(marks) + " |")
    return "\n".join(rows) + "\n"


def load_builtin(name: str) -> tuple[nn.Module, FamilyAdapter]:
    """Build a built-in model by name (``tiny-flux``) with its family adapter."""
    try:
        family, build = BUILTIN_MODELS[name]
    except KeyError:
        raise ModelError(f"{name!r} is not a built-in model; built-in names: {', '.join(BUILTIN_MODELS)}.") from None
    return build(), ADAPTERS[family]


__all__ = [
    "ADAPTERS",
    "BUILTIN_MODELS",
    "FLUX",
    "TINY_FLUX_CONFIG",
    "FamilyAdapter",
    "ModelError",
    "adapter_for",
    "build_tiny_flux",
    "build_tiny_flux_pipeline",
    "families_table",
    "load_builtin",
    "tiny_flux_inputs",
    "write_tiny_flux_pipeline",
]
