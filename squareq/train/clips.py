"""Clips as training data: reading a clip's frames, and which of them a run trains on, with musubi-tuner's frame keys
and their meanings (docs/train.md, "Clips").

A clip is a video file (``.mp4``, ``.webm``, ``.mov``, ``.mkv``: PyAV, the optional extra ``video``), a GIF or an
animated WebP (Pillow), or a folder of frames (in name order) that a caption file beside it names (``walk/`` with
``walk.txt``): a folder without one is a folder of images, as kohya's repeat folders are.

Which frames (musubi-tuner's ``docs/dataset_config.md``; each window is ``count`` frames from ``start``):

* ``head``: the first N frames, for each N of ``target_frames``;
* ``chunk``: the clip cut into consecutive windows of N frames (a last, shorter piece is left out);
* ``slide``: windows of N frames starting every ``frame_stride`` frames;
* ``uniform``: ``frame_sample`` windows of N frames, their starts spread evenly from the first frame to the last
  start that fits (rounded down);
* ``full``: the whole clip up to ``max_frames``, rounded down to a count the family's VAE takes.

Each N is rounded down to a count the family's VAE takes (1 + 4k for Wan and HunyuanVideo, 1 + 8k for LTX-Video), as
musubi-tuner rounds them. With ``source_fps``, the clip is first thinned to the family's frame rate (16 for Wan, 24
for HunyuanVideo, 25 for LTX-Video: diffusers' default for its pipeline) by dropping the frames that land on an
already taken output frame, as musubi-tuner does.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageSequence

from ..extras import require

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # a data folder's still images, and a clip's frames

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")  # decoded by PyAV
ANIMATED_EXTENSIONS = (".gif", ".webp")  # decoded by Pillow (a WebP of one frame is an image)
CLIP_EXTENSIONS = VIDEO_EXTENSIONS + (".gif",)  # always clips (a WebP is one when it has several frames)
EXTRACTIONS = ("head", "chunk", "slide", "uniform", "full")
# a clip's frames are 1 + stride·k: the VAE's temporal compression (diffusers' pipelines round other counts)
TEMPORAL_STRIDE = {"wan": 4, "hunyuan-video": 4, "ltx-video": 8}
# the frame rate each family trains at: musubi-tuner's for Wan and HunyuanVideo, diffusers' LTXPipeline default
FAMILY_FPS = {"wan": 16.0, "hunyuan-video": 24.0, "ltx-video": 25.0}


class ClipError(ValueError):
    """A clip, or a frame setting, cannot be used; the message names the file or key and what to do."""


@dataclass(frozen=True)
class FrameSettings:
    """musubi-tuner's frame keys, with its defaults."""

    target_frames: tuple[int, ...] = (1,)
    frame_extraction: str = "head"
    frame_stride: int = 1
    frame_sample: int = 1
    max_frames: int = 129
    source_fps: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_frames", tuple(self.target_frames))

    def check(self, where: str = "the configuration") -> None:
        """Refuse, naming the key, values no clip can be cut by."""
        def bad(key: str, why: str) -> ClipError:
            return ClipError(f"{where}: {key} = {getattr(self, key)!r} {why}.")

        if not self.target_frames or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                         for n in self.target_frames):
            raise bad("target_frames", "must list whole numbers of frames of at least 1, e.g. [1, 25, 45]")
        if self.frame_extraction not in EXTRACTIONS:
            raise bad("frame_extraction", f"must be one of {', '.join(EXTRACTIONS)}")
        for key in ("frame_stride", "frame_sample", "max_frames"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, "must be a whole number of at least 1")
        if self.source_fps is not None and not (isinstance(self.source_fps, (int, float))
                                                and not isinstance(self.source_fps, bool) and self.source_fps > 0):
            raise bad("source_fps", "must be a frame rate above 0, e.g. 30.0, or left out to keep every frame")

    def longest(self, stride: int) -> int:
        """The most frames a window cut by these settings can hold, rounded down to 1 + ``stride``·k."""
        return round_down(self.max_frames if self.frame_extraction == "full" else max(self.target_frames), stride)

    def for_family(self, family: str) -> tuple[FrameSettings, str | None]:
        """These settings with every count rounded down to one the ``family``'s VAE takes (duplicates merged), and
        the sentence saying what changed (None when nothing did)."""
        stride = TEMPORAL_STRIDE.get(family, 1)
        rounded = tuple(sorted({round_down(n, stride) for n in self.target_frames}))
        settings = dataclasses.replace(self, target_frames=rounded)
        if rounded == tuple(sorted(set(self.target_frames))):
            return settings, None
        return settings, (f"target_frames {list(self.target_frames)} rounded down to {list(rounded)}: a {family} clip "
                          f"has 1 + {stride}·k frames")


def round_down(count: int, stride: int) -> int:
    """``count`` frames rounded down to 1 + stride·k."""
    return (count - 1) // stride * stride + 1


def windows(frame_count: int, settings: FrameSettings, stride: int = 1) -> list[tuple[int, int]]:
    """(start, count) of every window ``settings`` (counts already rounded: :meth:`FrameSettings.for_family`) cut
    from a clip of ``frame_count`` frames, in musubi-tuner's order; empty when the clip is too short for any."""
    s = settings
    if s.frame_extraction == "full":
        count = round_down(min(frame_count, s.max_frames), stride)
        return [(0, count)] if frame_count >= 1 else []
    extraction = "head" if s.frame_extraction == "uniform" and s.frame_sample == 1 else s.frame_extraction
    out = []
    for n in s.target_frames:
        if frame_count < n:
            continue
        if extraction == "head":
            out.append((0, n))
        elif extraction == "chunk":
            out += [(start, n) for start in range(0, frame_count - n + 1, n)]
        elif extraction == "slide":
            out += [(start, n) for start in range(0, frame_count - n + 1, s.frame_stride)]
        else:  # uniform
            out += [(int(start), n) for start in np.linspace(0, frame_count - n, s.frame_sample, dtype=int)]
    return out


def resampled(frame_count: int, source_fps: float, target_fps: float) -> list[int]:
    """The source frames kept when a clip of ``frame_count`` frames at ``source_fps`` is thinned to ``target_fps``:
    each source frame advances the output by target/source of a frame, and one that lands on an output frame already
    taken is dropped (musubi-tuner's rule, its fraction summed the same way)."""
    delta = target_fps / source_fps
    kept, position, previous = [], 0.0, -1
    for i in range(frame_count):
        index = int(position)
        position += delta
        if index != previous:
            kept.append(i)
            previous = index
    return kept


def is_clip(path: Path) -> bool:
    """Whether the file ``path`` is a clip: a video file, a GIF, or a WebP of more than one frame (a folder of frames
    is a clip where a caption file names it: the data scan decides)."""
    suffix = path.suffix.lower()
    if suffix in VIDEO_EXTENSIONS:
        return True
    if suffix not in ANIMATED_EXTENSIONS:
        return False
    try:
        with Image.open(path) as img:
            return getattr(img, "n_frames", 1) > 1 or suffix == ".gif"
    except OSError:
        return suffix == ".gif"  # a damaged GIF is reported as a clip that cannot be read


def frame_files(folder: Path) -> list[Path]:
    """A folder of frames' images, in name order, numbers by value (``2.png`` before ``10.png``); hidden files left
    out."""
    def natural(p: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", p.name)]

    return sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
                   and not p.name.startswith(".")), key=natural)


def read_frames(path: Path, indices: list[int] | None = None) -> list[Image.Image]:
    """The RGB frames ``indices`` (all of them when None) of the clip at ``path``; :class:`ClipError` naming the
    file when it cannot be read, and the pip command for a video file without PyAV."""
    path = Path(path)
    wanted = None if indices is None else set(indices)
    with _reading(path):
        if path.is_dir():
            files = frame_files(path)
            chosen = files if indices is None else [files[i] for i in sorted(wanted)]
            frames = []
            for f in chosen:
                with Image.open(f) as img:
                    frames.append(_rgb(img))
        elif path.suffix.lower() in VIDEO_EXTENSIONS:
            frames = _video_frames(path, wanted)
        else:
            with Image.open(path) as img:
                frames = [_rgb(f) for i, f in enumerate(ImageSequence.Iterator(img)) if wanted is None or i in wanted]
    if wanted is not None and len(frames) != len(wanted):
        raise ClipError(f"{path} has fewer frames than it had when the data folder was read; read the folder again "
                        "(run the command again).")
    if wanted is not None:  # in the order asked for, repeats included
        order = {i: k for k, i in enumerate(sorted(wanted))}
        frames = [frames[order[i]] for i in indices]
    return frames


def frame_count(path: Path) -> int:
    """How many frames the clip at ``path`` has (a video file is decoded to count them: containers' own counts are
    often missing or wrong)."""
    path = Path(path)
    with _reading(path):
        if path.is_dir():
            return len(frame_files(path))
        if path.suffix.lower() in VIDEO_EXTENSIONS:
            return sum(1 for _ in _decoded(path))
        with Image.open(path) as img:
            return getattr(img, "n_frames", 1)


@contextlib.contextmanager
def _reading(path: Path):
    """Within: an error of the file's reader becomes the one :class:`ClipError` sentence naming ``path``."""
    try:
        yield
    except ClipError:
        raise
    except (OSError, ValueError, IndexError) as exc:
        raise ClipError(f"{path} could not be read as a clip ({type(exc).__name__}: {exc}); re-export it, or leave "
                        "it out of the data folder.") from None


def _rgb(frame: Image.Image) -> Image.Image:
    return frame.convert("RGB")


def _decoded(path: Path):
    av = require("av", f"the video file {path}")
    try:
        container = av.open(str(path))
    except av.error.FFmpegError as exc:  # noqa: B030 - PyAV's own error type
        raise ClipError(f"{path} could not be opened as a video ({exc}); re-export it, or leave it out of the data "
                        "folder.") from None
    with container:
        try:
            yield from container.decode(video=0)
        except av.error.FFmpegError as exc:
            raise ClipError(f"{path} is damaged ({exc}); re-export it, or leave it out of the data folder.") from None


def _video_frames(path: Path, wanted: set[int] | None) -> list[Image.Image]:
    last = max(wanted) if wanted else None
    frames = []
    with contextlib.closing(_decoded(path)) as decoded:  # closes the container at once when the last frame is read
        for i, frame in enumerate(decoded):
            if wanted is None or i in wanted:
                frames.append(frame.to_image().convert("RGB"))
            if last is not None and i >= last:
                break
    return frames
