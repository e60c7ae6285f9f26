"""Loss masks (``masked_loss``): where each training image's loss counts, from its alpha channel (``alpha_mask``) or
from a mask image of the same name in another folder (``mask_dir``; kohya's ``conditioning_data_dir``, ai-toolkit's
``mask_path``).

A mask is grey levels: white (or opaque) trains, black (or transparent) is ignored, grey weighs in between. It goes
through its image's geometry (scaled to cover the bucket, center-cropped, flipped with a flipped copy) and is then
averaged down to the latent grid, as kohya does (``interpolate(..., mode="area")``); the loss multiplies each
latent element's squared error by it before the mean. The masks are cached with the latents they belong to.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .data import IMAGE_EXTENSIONS, cover_crop

log = logging.getLogger("squareq.train")

ALPHA = "alpha"  # the mask is the image's own alpha channel
LOSS_MASK = "loss_mask"  # a latent cache entry's mask, handed to the loss with the batch (train/feed.py)


def mask_sources(items, root: Path, alpha_mask: bool, mask_dir: str | None) -> list[Path | str | None]:
    """Each item's mask: :data:`ALPHA`, the mask file in ``mask_dir`` with the item's path relative to ``root``
    (any image extension), or None (trained unmasked; one warning lists how many)."""
    if alpha_mask:
        return [ALPHA] * len(items)
    if not mask_dir:
        return [None] * len(items)
    folder = Path(mask_dir).expanduser()
    found: list[Path | str | None] = []
    for item in items:
        rel = Path(item.path).relative_to(root)
        candidates = [folder / rel] + [folder / rel.with_suffix(ext) for ext in IMAGE_EXTENSIONS
                                       if ext != rel.suffix.lower()]
        found.append(next((c for c in candidates if c.is_file()), None))
    missing = [item for item, m in zip(items, found) if m is None]
    if missing:
        log.warning("mask_dir %s has no mask for %d of %d training images (e.g. %s, looked for as %s); they train "
                    "unmasked.", folder, len(missing), len(items), missing[0].path,
                    folder / Path(missing[0].path).relative_to(root))
    return found


def load_mask(image: Path, source: Path | str, bucket: tuple[int, int]) -> torch.Tensor:
    """``[1, height, width]`` float32 in [0, 1]: the mask of ``image`` (its alpha channel, or the file ``source``
    brought to the image's size) through the image's geometry. An image without alpha is all ones."""
    with Image.open(image) as img:
        img = ImageOps.exif_transpose(img)
        size = img.size
        if source == ALPHA:
            has_alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
            mask = img.convert("RGBA").getchannel("A") if has_alpha else Image.new("L", size, 255)
    if source != ALPHA:
        with Image.open(source) as m:
            mask = ImageOps.exif_transpose(m).convert("L")
            if mask.size != size:  # the same picture at another size: brought to the image's first
                mask = mask.resize(size, Image.Resampling.BILINEAR)
    mask = cover_crop(mask, bucket, Image.Resampling.BILINEAR)
    return torch.from_numpy(np.array(mask, dtype=np.uint8)).float().div_(255.0)[None]


def latent_mask(mask: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """``mask [1, H, W]`` averaged down to the grid of one item's ``latents`` (``[C, h, w]`` or ``[C, F, h, w]``):
    ``[1, h, w]`` or ``[1, 1, h, w]``, broadcast over channels (and frames) by the loss."""
    down = F.interpolate(mask[None].float(), size=tuple(latents.shape[-2:]), mode="area")[0]
    return down if latents.dim() == 3 else down[:, None]


def full_mask(latents: torch.Tensor) -> torch.Tensor:
    """The mask of an item trained everywhere, shaped as :func:`latent_mask` shapes one for ``latents``."""
    return torch.ones((1, *([1] if latents.dim() == 4 else []), *latents.shape[-2:]))
