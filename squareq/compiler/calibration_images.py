"""Calibration images for `squareq compile`: the user's captioned images, or the built-in photographs, encoded by the
model family's own VAE and text encoders exactly as the trainer's cache encodes them.

``compile_slab`` takes the images already encoded (``CompileOptions.calib_images``): the CLI calls
:func:`calibration_images` and hands its result over, so the compile itself never holds a VAE or text encoder
(squareq/sources opens them; the images are read as train/data.py reads a dataset). The images are
the trainer's layouts (``--calib-data DIR``: images with same-name ``.txt`` captions, or a ``metadata.jsonl``),
center-cropped to one square ``resolution``; each caption goes through the text encoders at ``max_sequence_length``.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..models.builtin_data import builtin_photos, skimage_version, spread
from ..models.calibration_set import DEFAULT_CAPTION_TOKENS, CalibrationSet
from ..runtime.host.budget import encoder_room
from ..sources.encoder_placement import EncoderRun
from ..sources.encoder_source import EncoderSource
from ..sources.encoders import EncoderError, open_encoders
from ..train.data import load_image, scan_dataset

# The calibration resolution: FLUX LoRAs are trained at 512-1024 px, and block statistics at 512 px (1024 image
# tokens for FLUX.1) keep a 12B compile within its time budget (docs/compiler.md).
DEFAULT_RESOLUTION = 512
DEFAULT_MAX_SEQUENCE_LENGTH = DEFAULT_CAPTION_TOKENS
TEXT_BATCH = 8


def calibration_images(source, data: str | Path | None = None, encoders: EncoderSource | str | None = None,
                       resolution: int = DEFAULT_RESOLUTION, max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
                       device: str | torch.device = "cpu", limit: int | None = None, seed: int = 0,
                       echo: Callable[[str], None] = lambda s: None, vram_budget: int | None = None,
                       host_budget: int | None = None) -> CalibrationSet:
    """The images of ``data`` (the built-in photographs when None) with their captions, encoded for ``source`` (a
    compiler ``Source`` of a family SquareQ trains) by the VAE and text encoders of ``encoders`` (a pipeline folder or
    built-in model name or Hub ID, with any single files; default: the source's own). A folder with more than
    ``limit`` images gives a seeded spread of ``limit`` of them (the compile uses no more). The encoders run within
    ``vram_budget`` (--vram-budget; default what the device has free), the large text encoders streamed if need be,
    and within ``host_budget`` (--host-budget; default what the machine has available): a streamed encoder pinned whole
    where it fits, else read from its file through a ring (sources/encoder_placement.py)."""
    family = source.family_adapter
    if family is None or family.recipe is None:
        raise EncoderError(f"{source.description} is not a model family SquareQ trains, so it has no VAE and text "
                           "encoders to encode calibration images with; calibrate it on text, or with --calib-cache.")
    where = encoders or source.encoder_source
    if where is None:
        raise EncoderError(f"{source.description} is not inside a diffusers pipeline folder, so SquareQ cannot find "
                           "the VAE and text encoders to encode calibration images with; pass them as files with "
                           "--clip-l, --t5 and --vae, or their pipeline's folder or Hub ID with --encoders, or a "
                           "filled training cache with --calib-cache DIR.")
    if data is not None:
        dataset = scan_dataset(data)
        items = [(it.path, it.caption) for it in dataset.items]
        if limit is not None and len(items) > limit:
            items = spread(items, limit, seed)
        origin = {"source": f"user data {Path(data).expanduser()}", "data": str(Path(data).expanduser().resolve())}
    else:
        photos = builtin_photos()
        items = [(p.path, p.caption) for p in photos]
        origin = {"source": f"built-in: {len(photos)} photographs from scikit-image {skimage_version()} with the "
                            "captions of its data docstrings"}
    device = torch.device(device)
    config = source.skeleton().config
    # a CPU has no VRAM to budget: the compile's own plan refuses a --vram-budget it cannot work within
    run = EncoderRun(vram_budget if device.type == "cuda" else None, max_sequence_length, resolution * resolution,
                     "--vram-budget", host_budget=encoder_room(host_budget, device),
                     host_flag="--host-budget")
    with open_encoders(where, device, family.family, config, run) as enc:
        if enc.placement is not None:
            echo(enc.placement.describe())
        echo(f"encoding {len(items)} calibration images at {resolution} px with the encoders of {where}")
        latents = [_entry(enc.encode_image(load_image(path, (resolution, resolution)))) for path, _ in items]
        captions = [caption for _, caption in items]
        texts = []
        for start in range(0, len(captions), TEXT_BATCH):
            texts += enc.encode_prompts(captions[start:start + TEXT_BATCH], max_sequence_length)
    description = {"kind": "images", **origin, "images": len(items), "files": [str(p) for p, _ in items],
                   "captions": captions, "encoders": str(where), "resolution": resolution,
                   "max_sequence_length": max_sequence_length}
    return CalibrationSet(latents, texts, description)


def _entry(encoded) -> dict[str, torch.Tensor]:
    """A latent as the training cache stores it: ``{"latents": ...}`` plus any image conditioning."""
    return encoded if isinstance(encoded, dict) else {"latents": encoded}
