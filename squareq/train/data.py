"""Training data for ``squareq train --data DIR``: find captioned images, bucket them, batch them.

A user points at a folder and gets every usable image in it, each with its caption, plus one warning
per file that was left out saying why and what to do. Two layouts are read:

* images (png, jpg, jpeg, webp, bmp, any letter case) with a same-name caption file next to each
  (``cat.png`` + ``cat.txt``; ``caption_ext`` picks another extension, e.g. kohya's ``.caption``), found
  recursively in subfolders; hidden files and folders (``.cache``, macOS ``._cat.png``) are ignored. kohya's
  repeat folders are read as kohya reads them: the images below ``10_sks dog/`` count 10 times an epoch, and
  one without a caption file is captioned ``sks dog`` (the folder's name after the count);
* a ``metadata.jsonl`` in the folder, one JSON object a line with ``file_name`` (relative to the folder)
  and the caption under ``caption`` (or ``text``). When it exists it wins: other images are left out, each
  with a warning.

Images are trained at several aspect ratios (kohya/SimpleTuner buckets) instead of being squashed or
cropped to a square; train/buckets.py's :class:`BucketBatches` builds batches from one bucket at a time in a
seeded order that a resumed run continues exactly.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

from .clips import CLIP_EXTENSIONS, IMAGE_EXTENSIONS, is_clip

log = logging.getLogger("squareq.train")

METADATA = "metadata.jsonl"
_HOW = "pass a folder of images with same-name .txt captions, or a folder with a metadata.jsonl"


class DataError(ValueError):
    """The training data folder is missing or holds no usable image."""


def refused_character(text: str) -> str | None:
    """The first control character a caption may not hold, as ``U+0000``, or None. Refused: U+0000-U+001F but tab,
    line feed and carriage return, and U+007F-U+009F: no caption writer puts them in text, so they are a binary
    file or a broken export, and would reach the text encoders as tokens that no caption means."""
    for c in text:
        if (ord(c) < 0x20 and c not in "\t\n\r") or 0x7F <= ord(c) <= 0x9F:
            return f"U+{ord(c):04X}"
    return None


@dataclass(frozen=True)
class Control:
    """A control (source) image of an edit pair (train/controls.py): its file, its size after EXIF rotation, and how it
    is brought to its training size (train/buckets.py ``control_bucket``): ``area`` musubi-tuner's
    ``control_resolution`` as a pixel area (None: not set), ``resize`` False for its ``no_resize_control``."""

    path: Path
    width: int
    height: int
    area: int | None = None
    resize: bool = True


@dataclass(frozen=True)
class Item:
    """One usable image, or one window of a clip: its path, caption, size (after EXIF rotation; a clip's first
    frame's) and how often an epoch trains on it; for an edit pair, its control images in order."""

    path: Path
    caption: str
    width: int
    height: int
    repeats: int = 1
    reg: bool = False  # a regularisation (prior) image: its loss counts prior_loss_weight times
    frames: tuple[int, ...] | None = None  # a clip's window: the frames it trains on (None: an image)
    group: int = 0  # the dataset (a [[datasets]] table, train/datasets.py) it belongs to: Dataset.groups[group]
    controls: tuple[Control, ...] = ()  # an edit pair's control images (train/controls.py); () for a plain image


@dataclass(frozen=True)
class DataGroup:
    """One dataset of several in a run (a ``[[datasets]]`` table): its folder, training sides and batch size."""

    root: Path
    resolution: tuple[int, ...]
    batch_size: int


@dataclass(frozen=True)
class Skipped:
    """A file left out of the dataset and the one-sentence reason (naming it and what to do)."""

    path: Path
    reason: str


@dataclass
class Dataset:
    """The usable images of a folder, sorted by path, and the files that were skipped."""

    root: Path
    items: list[Item] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    regularisation: Dataset | None = None  # the regularisation folder its ``reg`` items were taken from
    clips: list[tuple[Path, str, int]] = field(default_factory=list)  # (clip, caption, repeats): train/clip_items.py
    groups: list[DataGroup] = field(default_factory=list)  # several datasets (:func:`combined`); else the run's keys

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Item:
        return self.items[index]

    def without_repeats(self) -> Dataset:
        """The same images, each counted once (a validation set measures every image alike)."""
        return Dataset(self.root, [dataclasses.replace(it, repeats=1) for it in self.items], self.skipped,
                       groups=self.groups)

    @property
    def training_items(self) -> list[Item]:
        """What an epoch goes through: each image as many times as its folder's repeat count."""
        return [item for item in self.items for _ in range(item.repeats)]


# ---------------------------------------------------------------------------------------------- scanning

def scan_dataset(path, min_side: int = 64, caption_ext: str = ".txt", clips: bool = False) -> Dataset:
    """Read a data folder (``metadata.jsonl`` wins over caption files); :class:`DataError` if nothing is usable.

    Every image is fully decoded once, so truncated or corrupt files are reported here rather than
    halfway through training; images whose shorter side is below ``min_side`` are skipped. ``caption_ext``: the
    caption files' extension (``.txt``, kohya's ``.caption``). ``clips``: clips (train/clips.py) are gathered with
    their captions in ``Dataset.clips`` for the trainer to cut into windows (train/clip_items.py); without it they are
    skipped, each named.
    """
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"The data folder {root} does not exist: {_HOW}.")
    if not root.is_dir():
        raise DataError(f"The data path {root} is not a folder: {_HOW}.")
    data = Dataset(root)
    candidates = _from_jsonl(root, data) if (root / METADATA).is_file() else \
        _from_folder(root, data, caption_ext, clips)
    for image, caption, repeats in candidates:
        if clips and (image.is_dir() or is_clip(image)):
            data.clips.append((image, caption, repeats))
            continue
        problem = check_image(image, root, min_side)
        if isinstance(problem, str):
            data.skipped.append(Skipped(image, problem))
        else:
            data.items.append(Item(image, caption, *problem, repeats=repeats))
    data.items.sort(key=lambda it: _rel(it.path, root))
    _report_repeat_folders(data)
    for s in data.skipped:
        log.warning("skipped: %s", s.reason)
    if data.skipped:
        log.warning("%d of %d images in %s skipped (reasons above); training on %d.",
                    len(data.skipped), len(data.skipped) + len(data.items), root, len(data.items))
    if not data.items and not data.clips:
        found = f"none of the {len(data.skipped)} files found is usable (see the warnings)" if data.skipped \
            else "it holds no images"
        raise DataError(f"No training images in {root}: {found}; {_HOW}.")
    log.info("%d training images in %s", len(data.items), root)
    return data


def combined(datasets: list[Dataset], groups: list[DataGroup]) -> Dataset:
    """Several datasets as one, each item marked with its group (``groups[i]`` is ``datasets[i]``'s), under the
    folders' common parent; one dataset stays as it was."""
    if len(datasets) == 1:
        return datasets[0]
    root = Path(os.path.commonpath([os.path.abspath(d.root) for d in datasets]))
    items = [dataclasses.replace(it, group=g) for g, d in enumerate(datasets) for it in d.items]
    return Dataset(root, items, [s for d in datasets for s in d.skipped], groups=groups)


def hold_out(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(training, validation): ``fraction`` of the images (at least one; kohya's ``validation_split``) held out of
    training, chosen by a hash of (seed, path) so that the same folder and seed always hold out the same images.
    Held-out images count once, whatever their repeat count."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation_split must be between 0 and 1, got {fraction}.")
    paths = list(dict.fromkeys(item.path for item in dataset.items))  # a clip's windows are held out together
    n = len(paths)
    held = max(1, round(fraction * n))
    if held >= n:
        raise DataError(f"validation_split = {fraction} holds out {held} of the {n} images and clips in "
                        f"{dataset.root}, leaving none to train on; add images or clips, or lower validation_split.")

    def rank(path: Path) -> str:
        return hashlib.sha256(f"{seed}:{_rel(path, dataset.root)}".encode()).hexdigest()

    chosen = set(sorted(paths, key=rank)[:held])
    train = Dataset(dataset.root, [it for it in dataset.items if it.path not in chosen], dataset.skipped,
                    groups=dataset.groups)
    valid = Dataset(dataset.root, [it for it in dataset.items if it.path in chosen], groups=dataset.groups)
    return train, valid.without_repeats()


def with_regularisation(dataset: Dataset, reg: Dataset) -> Dataset:
    """``dataset`` with the regularisation images of ``reg`` added, marked ``reg``, as kohya's DreamBooth datasets
    mix them in: an epoch holds as many regularisation entries as training entries, taken in order from ``reg``'s
    entries (each image as often as its repeat folder says) and cycled when there are fewer (those left over are not
    used, with a warning)."""
    wanted = len(dataset.training_items)
    pool = reg.training_items
    counts: dict[Path, int] = {}
    for i in range(wanted):
        item = pool[i % len(pool)]
        counts[item.path] = counts.get(item.path, 0) + 1
    used = [dataclasses.replace(item, repeats=counts[item.path], reg=True) for item in reg.items if item.path in counts]
    if len(pool) > wanted:
        log.warning("reg_data %s: %d regularisation entries an epoch for %d training entries; %d of them are not "
                    "used (kohya does the same).", reg.root, len(pool), wanted, len(pool) - wanted)
    log.info("regularisation: %d images from %s, %d entries an epoch", len(used), reg.root, wanted)
    return Dataset(dataset.root, dataset.items + used, dataset.skipped + reg.skipped, reg)


def _report_repeat_folders(data: Dataset) -> None:
    """One line per kohya repeat folder: how many images and how often; a warning when the count looks like a
    name (``2024_trip/`` would train each image 2024 times an epoch)."""
    folders: dict[str, list[Item]] = {}
    for item in data.items:
        if repeat_folder(item.path.relative_to(data.root)):
            folders.setdefault(item.path.relative_to(data.root).parts[0], []).append(item)
    for name, items in sorted(folders.items()):
        repeats = items[0].repeats
        line = f"{name}/: {len(items)} images, each {repeats} times an epoch (a kohya repeat folder)"
        if repeats > 100:
            log.warning("%s; if %d is not a repeat count, rename the folder so it does not start with digits and _.",
                        line, repeats)
        else:
            log.info(line)


def _rel(p: Path, root: Path) -> str:
    return Path(os.path.abspath(p)).relative_to(os.path.abspath(root)).as_posix()


def _confined(path: Path, root: Path, named_by: str) -> None:
    """Refuse a file that leads outside the data folder (``../``, an absolute name, a link): a data folder from
    someone else must not make training read, and cache the contents of, files elsewhere on the machine."""
    target = path.resolve()
    if not target.is_relative_to(root.resolve()):
        raise DataError(f"{named_by} leads to {target}, outside the data folder {root}; copy the file into the folder "
                        "and name it relative to it.")


# kohya sd-scripts' "<repeats>_<class tokens>" folder directly in the data folder
REPEAT_FOLDER = re.compile(r"(\d+)_(.+)")


def repeat_folder(rel: Path) -> tuple[int, str] | None:
    """(repeats, the folder's caption) when ``rel`` (relative to the data folder) lies in a kohya repeat folder."""
    match = REPEAT_FOLDER.fullmatch(rel.parts[0]) if len(rel.parts) > 1 else None
    return (int(match[1]), match[2].strip()) if match else None


def _from_folder(root: Path, data: Dataset, caption_ext: str = ".txt",
                 clips: bool = False) -> list[tuple[Path, str, int]]:
    found = []
    paths = [p for p in sorted(root.rglob("*")) if not any(part.startswith(".") for part in p.relative_to(root).parts)]
    frame_folders = _frame_folders(root, paths, caption_ext) if clips else set()
    media = IMAGE_EXTENSIONS + (CLIP_EXTENSIONS if clips else ())
    for image in paths:
        rel = image.relative_to(root)
        if any(folder in frame_folders for folder in image.parents):
            continue  # a frame of a clip
        if image in frame_folders:
            txt = image.parent / (image.name + caption_ext)
        elif image.is_file() and image.suffix.lower() in media:
            txt = image.with_suffix(caption_ext)
        else:
            continue
        rel_txt = txt.relative_to(root).as_posix()
        _confined(image, root, rel.as_posix())
        if txt.exists():
            _confined(txt, root, rel_txt)
        folder = repeat_folder(rel)
        if folder is not None and folder[0] < 1:
            data.skipped.append(Skipped(image, f"{rel.as_posix()} is in {rel.parts[0]}/, whose repeat count is 0: "
                                               "rename the folder with a count of at least 1 to train on it."))
            continue
        repeats = folder[0] if folder else 1
        if not txt.is_file() and folder is not None and folder[1]:
            found.append((image, folder[1], repeats))  # kohya captions an uncaptioned image by its folder's name
            continue
        if not txt.is_file():
            data.skipped.append(Skipped(image, f"{rel.as_posix()} has no caption: add {rel_txt} "
                                               f"or a {METADATA} line for it."))
            continue
        try:
            caption = txt.read_text(encoding="utf-8-sig").strip()  # -sig: editors on Windows add a BOM
        except (OSError, UnicodeDecodeError) as exc:
            data.skipped.append(Skipped(image, f"{rel_txt} could not be read as UTF-8 text ({exc}): "
                                               f"save it as UTF-8."))
            continue
        if not caption:
            data.skipped.append(Skipped(image, f"{rel_txt} is empty: write a caption for "
                                               f"{rel.as_posix()} in it."))
            continue
        if char := refused_character(caption):
            data.skipped.append(Skipped(image, f"{rel_txt} holds the control character {char}, so it is not a "
                                               "plain-text caption: rewrite it as text (tabs and line breaks are "
                                               "fine)."))
            continue
        found.append((image, caption, repeats))
    return found


def _frame_folders(root: Path, paths: list[Path], caption_ext: str) -> set[Path]:
    """The folders of frames among ``paths``: those a caption file beside them names (walk/ and walk.txt), as
    musubi-tuner reads a clip's folder; a kohya repeat folder named so is read as a clip too, and said."""
    found = {p for p in paths if p.is_dir() and (p.parent / (p.name + caption_ext)).is_file()}
    for folder in sorted(found):
        if folder.parent == root and REPEAT_FOLDER.fullmatch(folder.name):
            log.warning("%s/ is read as one clip of frames because %s names it; rename that caption file to train its "
                        "images as a repeat folder.", folder.name, folder.name + caption_ext)
    return found


def _from_jsonl(root: Path, data: Dataset) -> list[tuple[Path, str, int]]:
    meta = root / METADATA
    found, seen, named = [], set(), set()

    def bad(reason: str, p: Path = meta) -> None:
        data.skipped.append(Skipped(p, reason))

    try:
        lines = meta.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{meta} could not be read as UTF-8 text ({exc}): fix it or remove it to use .txt "
                        "captions.") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{METADATA} line {n}"
        try:
            entry = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "it nests too deeply to read"
            bad(f"{where} is not valid JSON ({why}): fix or remove that line.")
            continue
        name = entry.get("file_name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            bad(f"{where} has no file_name: give each line a file_name relative to {root}.")
            continue
        if "\0" in name:  # no file name holds a NUL, and the path functions refuse one with a traceback
            bad(f"{where} has a NUL character in its file_name, which no file name can hold: fix that line.")
            continue
        caption = entry.get("caption", entry.get("text"))
        image = root / name
        _confined(image, root, f"{meta} line {n}: file_name {name!r}")
        named.add(image.resolve())
        if not image.is_file():
            bad(f"{where} names {name}, which is not a file in {root}: fix the file_name or add the image.", image)
        elif image in seen:
            bad(f"{where} repeats {name}: keep one line per image.", image)
        elif not isinstance(caption, str):
            bad(f"{name} has no caption in {where}: add a \"caption\" (or \"text\") string.", image)
        elif not caption.strip():
            bad(f"{name} has an empty caption in {where}: write a caption for it.", image)
        elif char := refused_character(caption):
            bad(f"{name} has a caption with the control character {char} in {where}: write it as plain text (tabs "
                "and line breaks are fine).", image)
        else:
            seen.add(image)
            found.append((image, caption.strip(), 1))
    for image in sorted(root.rglob("*")):
        rel = image.relative_to(root)
        if image.suffix.lower() in IMAGE_EXTENSIONS and image.is_file() and image.resolve() not in named \
                and not any(p.startswith(".") for p in rel.parts):
            bad(f"{rel.as_posix()} is not listed in {METADATA}, which decides the images when it exists: add a line "
                "for it, or move it out of the folder.", image)
    return found


def check_image(image: Path, root: Path, min_side: int) -> tuple[int, int] | str:
    """(width, height) of a fully decodable image, or the reason it cannot be used."""
    rel = _rel(image, root)
    try:
        with Image.open(image) as img:
            img.load()  # decodes every byte: truncated files raise here (LOAD_TRUNCATED_IMAGES stays off)
            w, h = _oriented_size(img)
    except Exception as exc:  # any decode failure (OSError, SyntaxError, DecompressionBombError...) skips one file
        msg = str(exc).rstrip(".") or type(exc).__name__
        return f"{rel} could not be decoded as an image ({msg}): re-export it or remove it."
    if min(w, h) < min_side:
        return f"{rel} is {w}x{h}, below the {min_side}-pixel minimum side: use a larger version or remove it."
    return w, h


def _oriented_size(img: Image.Image) -> tuple[int, int]:
    # Phone photos store portrait shots as landscape pixels plus an EXIF rotation; load_image applies it.
    w, h = img.size
    return (h, w) if img.getexif().get(0x0112) in (5, 6, 7, 8) else (w, h)


# ---------------------------------------------------------------------------------------------- buckets

# ---------------------------------------------------------------------------------------------- images and captions

def rgb_image(path) -> Image.Image:
    """The image at ``path`` upright (its EXIF rotation applied) in RGB, transparency over white."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
        if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
            # Transparent pixels often hide black; a white backdrop is what viewers show.
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return img.convert("RGB")


def load_image(path, bucket: tuple[int, int], crop_only: bool = False, area: int | None = None) -> torch.Tensor:
    """RGB float32 (3, height, width) in [-1, 1]: scaled to cover the bucket, then center-cropped; ``crop_only``: only
    center-cropped (a control image kept at its own size, musubi-tuner's ``no_resize_control``), scaled down first to
    ``area`` pixels where it is larger (sides truncated, LANCZOS: Flux2Pipeline's ``_resize_to_target_area``)."""
    img = rgb_image(path)
    if crop_only and area is not None and img.width * img.height > area:
        scale = math.sqrt(area / (img.width * img.height))
        img = img.resize((int(img.width * scale), int(img.height * scale)), Image.Resampling.LANCZOS)
    if crop_only and img.width >= bucket[0] and img.height >= bucket[1]:
        left, top = (img.width - bucket[0]) // 2, (img.height - bucket[1]) // 2
        img = img.crop((left, top, left + bucket[0], top + bucket[1]))
    else:
        img = cover_crop(img, bucket, Image.Resampling.LANCZOS)
    pixels = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)
    return pixels.float().div_(127.5).sub_(1.0)


def cover_crop(img: Image.Image, bucket: tuple[int, int], resample) -> Image.Image:
    """``img`` scaled to cover the bucket ``(width, height)``, then center-cropped to it (a mask goes through the
    same geometry as its image)."""
    bw, bh = bucket
    w, h = img.size
    scale = max(bw / w, bh / h)
    size = (max(bw, round(w * scale)), max(bh, round(h * scale)))
    if size != (w, h):
        img = img.resize(size, resample)
    left, top = (size[0] - bw) // 2, (size[1] - bh) // 2
    return img.crop((left, top, left + bw, top + bh))


TRIGGER_TOKEN = "[trigger]"  # ai-toolkit's place-holder for the trigger word in a caption


def caption_for(caption: str, trigger: str | None = None, dropout: float = 0.0,
                generator: torch.Generator | None = None) -> str:
    """The caption to train on: ``"trigger, caption"``, or with probability ``dropout`` only the trigger ("" if none).

    Dropout keeps the trigger (like kohya's keep_tokens) so the LoRA still learns what the trigger alone
    means; a caption that already starts with the trigger (as a whole word, case-sensitive) is left as is, and
    one with ``[trigger]`` gets the trigger there instead of in front.
    """
    if not 0.0 <= dropout <= 1.0:
        raise ValueError(f"caption dropout must be between 0 and 1, got {dropout}.")
    trigger = (trigger or "").strip()
    caption = caption.strip()
    if dropout > 0 and torch.rand((), generator=generator).item() < dropout:
        return trigger
    if not trigger:
        return caption
    if TRIGGER_TOKEN in caption:
        return caption.replace(TRIGGER_TOKEN, trigger)
    rest = caption[len(trigger):]
    if caption.startswith(trigger) and not (rest[:1].isalnum() or rest[:1] == "_"):
        return caption
    return f"{trigger}, {caption}" if caption else trigger


def caption_orders(caption: str, trigger: str | None, keep_tokens: int, count: int, seed: int) -> list[str]:
    """Up to ``count`` distinct shuffles of the comma-separated tags of ``caption_for(caption, trigger)`` (kohya's
    ``shuffle_caption``): the first ``keep_tokens`` tags stay in front, and so does a trigger word put there, which
    ``keep_tokens`` does not count. Seeded by ``seed`` and the caption, so every run, rank and resumed run encodes
    the same orders (the cache holds each). ``count`` 0 or a caption of one tag: the caption as written."""
    full = caption_for(caption, trigger)
    tags = [t.strip() for t in full.split(",") if t.strip()]
    trigger = (trigger or "").strip()
    # a caption starting with the trigger ("sks, ...", "sks person, ...", a trigger of several tags) keeps those tags
    lead = len([t for t in trigger.split(",") if t.strip()]) if trigger and full.startswith(trigger) else 0
    fixed = keep_tokens + lead
    head, tail = tags[:fixed], tags[fixed:]
    if count < 1 or len(tail) < 2:
        return [full]
    rng = np.random.default_rng([seed, int.from_bytes(hashlib.sha256(full.encode()).digest()[:8], "little")])
    orders: list[str] = []
    possible = math.factorial(min(len(tail), 8))  # enough to stop early for a few tags
    for _ in range(4 * count):  # repeated draws are dropped; a few tags have fewer orders than asked
        order = ", ".join(head + [tail[i] for i in rng.permutation(len(tail))])
        if order not in orders:
            orders.append(order)
        if len(orders) in (count, possible):
            break
    return orders
