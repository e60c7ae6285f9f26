"""Loss masks (``masked_loss``): where each training image's loss counts, from its alpha channel (``alpha_mask``) or
from a mask image of the same name in another folder (``mask_dir``; kohya's ``conditioning_data_dir``, ai-toolkit's
``mask_path``).

A mask is grey levels: white (or opaque) trains, black (or transparent) is ignored, grey weighs in between. It goes
through its image's geometry (scaled to cover the bucket, center-cropped, flipped with a flipped copy) and is then
averaged down to the latent grid, as kohya does (``interpolate(..., mode="area")``); the loss multiplies each
latent element's squared error by it before the mean. The masks are cached with the latents they belong to.
"""
from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from .data import IMAGE_EXTENSIONS, DataError, cover_crop

log = logging.getLogger("squareq.train")

ALPHA = "alpha"  # the mask is the image's own alpha channel
MAX_MASK_PIXELS = 89_478_485  # PIL's MAX_IMAGE_PIXELS (it warns past it, raises at twice it): our sentence first
LOSS_MASK = "loss_mask"  # a latent cache entry's mask, handed to the loss with the batch (train/feed.py)


def mask_sources(items, root: Path, alpha_mask: bool, mask_dir: str | None) -> list[Path | str | None]:
    """Each item's mask: :data:`ALPHA`, the mask file in ``mask_dir`` with the item's path relative to ``root``
    (any image extension), or None (trained unmasked; one warning lists how many). Each mask is read once here
    (:func:`check_masks`): one that cannot be read is refused naming it, a black one is named in a warning, and
    masks that are all black are refused, since the run would train nothing."""
    if alpha_mask:
        return check_masks(items, [ALPHA] * len(items))
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
    return check_masks(items, found)


def check_masks(items, sources: list) -> list:
    """``sources`` (each item's mask, :func:`mask_sources`), each read for its brightest pixel: a mask that cannot
    be read is refused in one sentence naming it; black ones are named in a warning (those images train nothing),
    and all black refused (the run would train nothing); with ``alpha_mask``, images without an alpha channel are
    named in a warning (they train everywhere)."""
    black, opaque, read = [], [], 0
    for item, source in zip(items, sources, strict=True):
        if source is None:
            continue
        brightest, has_alpha = _brightest(item.path, source)
        read += 1
        if brightest == 0:
            black.append(source if source != ALPHA else item.path)
        if source == ALPHA and not has_alpha:
            opaque.append(item.path)
    if opaque:
        log.warning("alpha_mask: %d of %d images have no alpha channel (e.g. %s), so all of each trains; save them "
                    "with transparency where they should not, or give masks with mask_dir.", len(opaque), read,
                    opaque[0])
    if black and len(black) == read:
        raise DataError(f"every one of the {read} loss masks is black (e.g. {black[0]}), so masked_loss would train "
                        "nothing: white (or opaque) is where the loss counts; fix the masks or train without "
                        "masked_loss.")
    if black:
        log.warning("%d of %d loss masks are black (e.g. %s): those images train nothing; white (or opaque) is where "
                    "the loss counts.", len(black), read, black[0])
    return sources


def _brightest(image: Path, source: Path | str) -> tuple[int, bool]:
    """The largest value of ``image``'s mask (its alpha, or the file ``source``), and whether it has an alpha
    channel; a file that cannot be read is one sentence naming it."""
    path = image if source == ALPHA else Path(source)
    with _reading(path):
        with Image.open(path) as img:
            if img.width * img.height > MAX_MASK_PIXELS:
                raise DataError(f"the mask {path} is {img.width}x{img.height} pixels, more than SquareQ reads "
                                f"({MAX_MASK_PIXELS // 10**6} million); give a mask the size of its image.")
            if source != ALPHA:
                return int(greyscale(img).getextrema()[1]), False
            has_alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
            return (int(img.convert("RGBA").getchannel("A").getextrema()[1]) if has_alpha else 255), has_alpha


def greyscale(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit greyscale, a 16- or 32-bit greyscale mask scaled to it (PIL's own conversion clips such
    values at 255: half of 65535 would read as white)."""
    if img.mode.startswith("I"):  # I, I;16, I;16B, ...: integers of more than 8 bits
        top = 65535.0 if img.mode.startswith("I;16") or int(np.asarray(img).max(initial=0)) <= 65535 else 2**31 - 1
        values = np.asarray(img, dtype=np.float64) * (255.0 / top)
        return Image.fromarray(np.clip(values.round(), 0, 255).astype(np.uint8), "L")
    return img.convert("L")


@contextlib.contextmanager
def _reading(path: Path):
    """Within: a failure to decode the mask ``path`` (or the image whose alpha is the mask) as one sentence naming
    it."""
    try:
        yield
    except DataError:
        raise
    except Image.DecompressionBombError as exc:  # PIL refuses past twice its limit, before our size check can run
        pixels = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(pixels[1]):,} pixels" if pixels else "too many pixels"
        raise DataError(f"the mask {path} is {size}, more than SquareQ reads ({MAX_MASK_PIXELS // 10**6} million); "
                        "give a mask the size of its image.") from None
    except Exception as exc:  # any decode failure (OSError, SyntaxError, PIL's DecompressionBombError ...)
        raise DataError(f"the mask {path} cannot be read ({type(exc).__name__}: {str(exc)[:120]}); replace it with a "
                        "greyscale image, or remove it to train that image unmasked.") from None


def load_mask(image: Path, source: Path | str, bucket: tuple[int, int]) -> torch.Tensor:
    """``[1, height, width]`` float32 in [0, 1]: the mask of ``image`` (its alpha channel, or the file ``source``
    brought to the image's size) through the image's geometry. An image without alpha is all ones."""
    with _reading(image), Image.open(image) as img:
        img = ImageOps.exif_transpose(img)
        size = img.size
        if source == ALPHA:
            has_alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
            mask = img.convert("RGBA").getchannel("A") if has_alpha else Image.new("L", size, 255)
    if source != ALPHA:
        with _reading(Path(source)), Image.open(source) as m:
            mask = greyscale(ImageOps.exif_transpose(m))
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
