"""A dataset's clips cut into training items: each clip's frames counted (thinned to the family's frame rate where
``source_fps`` says the clip's), cut into windows by the run's frame keys (train/clips.py), one item per window; and a
window's frames read back as the pixels the family's VAE encodes."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..slab.digest import content_key, file_sha256
from .clips import (
    FAMILY_FPS,
    TEMPORAL_STRIDE,
    ClipError,
    FrameSettings,
    frame_count,
    frame_files,
    read_frames,
    resampled,
    windows,
)
from .data import DataError, Dataset, Item, Skipped, cover_crop

log = logging.getLogger("squareq.train")

VIDEO_FAMILIES = "Wan, HunyuanVideo and LTX-Video"


def cut_clips(dataset: Dataset, settings: FrameSettings, family: str, min_side: int = 64, echo=print) -> Dataset:
    """``dataset`` with its clips (``Dataset.clips``) as one item per window; a clip that cannot be read, or is too
    short for any count, is skipped and named. :class:`DataError` for clips beside a model that is not a video
    family, and when nothing is left to train on."""
    if not dataset.clips:
        return dataset
    root = dataset.root
    if family not in TEMPORAL_STRIDE:
        n, path = len(dataset.clips), dataset.clips[0][0]
        raise DataError(f"{root} holds {n} clip{'s' * (n != 1)} (e.g. {path.relative_to(root).as_posix()}); SquareQ "
                        f"trains on clips for {VIDEO_FAMILIES}, and this slab holds a {family} model: train it on "
                        "images, or move the clips out of the folder.")
    settings.check("the frame keys")
    rounded, said = settings.for_family(family)
    if said:
        echo(said)
    if settings.source_fps is not None and settings.source_fps < FAMILY_FPS[family]:
        echo(f"source_fps {settings.source_fps:g} is below {family}'s {FAMILY_FPS[family]:g} fps: every frame is kept "
             "(frames are dropped to the family's rate, never repeated)")
    items, skipped = list(dataset.items), list(dataset.skipped)
    for path, caption, repeats in dataset.clips:
        try:
            width, height, frames = _windows(path, root, rounded, family, min_side)
        except _LeftOut as why:
            skipped.append(Skipped(path, str(why)))
            log.warning("skipped: %s", why)
            continue
        items += [Item(path, caption, width, height, repeats, frames=window) for window in frames]
    items.sort(key=lambda it: (it.path.relative_to(root).as_posix(), it.frames or ()))
    if not items:
        raise DataError(f"No training images or clip windows in {root}: none of its {len(dataset.clips)} clips is "
                        "long enough or readable (see the warnings); lower target_frames or add clips.")
    return dataclasses.replace(dataset, items=items, skipped=skipped, clips=[])


class _LeftOut(Exception):
    """A clip left out of training; the message is the one sentence that says why."""


def _windows(path, root, settings: FrameSettings, family: str, min_side: int):
    """(width, height, each window's frames) of the clip at ``path``; :class:`_LeftOut` when it has none."""
    rel = path.relative_to(root).as_posix()
    try:
        count = frame_count(path)
        first = read_frames(path, [0])[0] if count else None
    except ClipError as exc:
        raise _LeftOut(str(exc)) from None
    if first is None:
        raise _LeftOut(f"{rel} has no frames: re-export it, or leave it out of the data folder.")
    if min(first.size) < min_side:
        raise _LeftOut(f"{rel} is {first.size[0]}x{first.size[1]}, smaller than {min_side} px on a side: use a larger "
                       "clip or leave it out.")
    source = list(range(count))
    if settings.source_fps is not None:
        source = [source[i] for i in resampled(count, settings.source_fps, FAMILY_FPS[family])]
    cut = windows(len(source), settings, TEMPORAL_STRIDE[family])
    if not cut:
        at = f" at {FAMILY_FPS[family]:g} fps" if settings.source_fps is not None else ""
        raise _LeftOut(f"{rel} has {len(source)} frames{at}, fewer than any of target_frames "
                       f"{list(settings.target_frames)} ({settings.frame_extraction}): it is left out; lower "
                       "target_frames to train on it.")
    return first.size[0], first.size[1], [tuple(source[start:start + n]) for start, n in cut]


def clip_digest(path: Path) -> str:
    """The content hash of a clip: its file's, or for a folder of frames each frame's, in order."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    return content_key("frames", [[f.name, file_sha256(f)] for f in frame_files(path)])


def load_clip(path, frames, bucket: tuple[int, int]) -> torch.Tensor:
    """The ``frames`` of the clip at ``path`` as float32 pixels [3, F, height, width] in [-1, 1], each frame scaled to
    cover the bucket and center-cropped, as :func:`~squareq.train.data.load_image` does an image."""
    images = read_frames(path, list(frames))
    pixels = np.stack([np.array(cover_crop(im, bucket, Image.Resampling.LANCZOS), dtype=np.uint8) for im in images])
    return torch.from_numpy(pixels).permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)
