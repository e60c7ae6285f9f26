"""Edit pairs: each training image (the target) with its control images (the sources an edit model conditions on), in
the layouts musubi-tuner and ai-toolkit read.

* ``control_dir``: one folder (musubi-tuner's ``control_directory``) or a list of folders (ai-toolkit's
  ``control_path``). In each, a target's control has its file name with any image extension (``cat.png`` ↔
  ``control/cat.jpg``), in the same subfolder as below the data folder, or at the folder's top. A folder may give a
  target several, numbered ``cat_0.png``, ``cat_1.png`` (musubi's rule: the un-numbered one first, then by number; a
  numbered name that is itself a target's is that target's). Several folders give their controls in list order.
* ``metadata.jsonl``: a line's ``control_path``, or ``control_path_0``, ``control_path_1``, ... (in number order),
  each relative to the data folder.

A target without a control is skipped, named in a warning, as an image without a caption is; a control that cannot be
decoded skips its target the same way. ``control_resolution`` and ``no_resize_control`` (musubi's) say how a control
is brought to its training size (train/buckets.py ``control_bucket``). The keys other trainers have for controls that
SquareQ does not take are refused by name (:data:`UNSUPPORTED_KEYS`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections import Counter
from pathlib import Path

import torch

from ..models import ADAPTERS
from ..models.recipe import CONTROL_FIELD
from ..sources.encoder_source import EncoderSource
from ..sources.pipeline_encoders import pipeline_class
from .buckets import bucket_for, control_buckets, entries
from .clips import IMAGE_EXTENSIONS
from .data import METADATA, Control, DataError, Dataset, Item, Skipped, check_image, load_image, rgb_image

log = logging.getLogger("squareq.train")

# musubi-tuner's and ai-toolkit's names for the control keys (their legacy per-architecture ones too)
ALIASES = {"control_directory": "control_dir", "control_path": "control_dir",
           "flux_kontext_no_resize_control": "no_resize_control",
           "qwen_image_edit_no_resize_control": "no_resize_control",
           "qwen_image_edit_control_resolution": "control_resolution"}
# control keys of theirs SquareQ has no counterpart for, each refused with its sentence
UNSUPPORTED_KEYS = {
    "control_from_same_folder": "SquareQ takes a target's controls from control_dir or metadata.jsonl, not from other "
                                "images of its folder; move the controls into a folder of their own and name it with "
                                "control_dir",
    "num_controls_from_same_folder": "SquareQ takes a target's controls from control_dir or metadata.jsonl, not from "
                                     "other images of its folder; remove the key and name the controls' folder with "
                                     "control_dir",
    "full_size_control_images": "SquareQ brings controls to the target's bucket, or to control_resolution, or keeps "
                                "their size with no_resize_control; remove the key and set one of those",
    "control_transparent_color": "SquareQ lays a transparent control over white, as it does a target; remove the key "
                                 "(or flatten the controls yourself)",
}
NUMBERED_FOLDERS = re.compile(r"control_path_(\d+)")  # ai-toolkit's UI keys for a list of control folders
MIN_CONTROL_SIDE = 16  # one latent token of FLUX's 8x VAE and 2x2 packing
_NUMBERED = re.compile(r"(.+)_(\d+)")
_JSONL_FIELD = re.compile(r"control_path(?:_(\d+))?")


def unsupported_key(key: str) -> str | None:
    """The sentence refusing ``key`` where it is one of the other trainers' control keys SquareQ does not take."""
    if key in UNSUPPORTED_KEYS:
        return f"{key}: {UNSUPPORTED_KEYS[key]}."
    if NUMBERED_FOLDERS.fullmatch(key):
        return (f"{key}: SquareQ takes several control folders as one list in control_dir (ai-toolkit's control_path "
                "list), e.g. control_dir = [\"controls_a\", \"controls_b\"]; give them that way.")
    return None


def control_area(control_resolution: list[int] | None) -> int | None:
    """musubi-tuner's ``control_resolution`` (``[width, height]``, or one side) as a pixel area; None when unset."""
    if not control_resolution:
        return None
    return math.prod(control_resolution) if len(control_resolution) == 2 else control_resolution[0] ** 2


def attach_controls(dataset: Dataset, view, family: str | None = None) -> Dataset:
    """``dataset`` (one scanned data folder) with each target's controls found as ``view`` (its configuration: its
    ``control_dir``, ``control_resolution``, ``no_resize_control``) or its ``metadata.jsonl`` say, sized as
    :func:`control_fit` says for ``family``; a dataset without controls is returned as it is. Targets without their
    controls are skipped, each named in a warning; :class:`DataError` when none is left, or for keys that cannot
    work."""
    listed = _jsonl_controls(dataset.root)
    folders = [Path(f).expanduser() for f in view.control_dir or []]
    if listed and folders:
        raise DataError(f"control_dir and {dataset.root / METADATA}'s control_path fields both give control images; "
                        "keep one of the two.")
    if not listed and not folders:
        if view.control_resolution or view.no_resize_control:
            key = "control_resolution" if view.control_resolution else "no_resize_control"
            raise DataError(f"{key} sizes control images, and {dataset.root} has none (no control_dir, no "
                            f"control_path in a {METADATA}); set control_dir or remove {key}.")
        return dataset
    area, resize = control_fit(view, family)
    found = _from_jsonl(dataset, listed) if listed else _from_folders(dataset, folders)
    items, skipped = [], list(dataset.skipped)
    for item in dataset.items:
        paths = found.get(item.path)
        why = paths if isinstance(paths, str) else _check_controls(paths or [], item, dataset.root)
        if isinstance(why, str):
            skipped.append(Skipped(item.path, why))
            log.warning("skipped: %s", why)
            continue
        items.append(dataclasses.replace(item, controls=tuple(Control(p, w, h, area, resize) for p, (w, h) in why)))
    if not items:
        raise DataError(f"No edit pairs in {dataset.root}: none of its {len(dataset.items)} images has a usable "
                        "control image (see the warnings); put each target's control beside it under the same name in "
                        "control_dir, or name it with control_path in metadata.jsonl.")
    if len(items) < len(dataset.items):
        log.warning("%d of %d images in %s have no usable control image and are skipped (reasons above); training on "
                    "%d pairs.", len(dataset.items) - len(items), len(dataset.items), dataset.root, len(items))
    return dataclasses.replace(dataset, items=items, skipped=skipped)


def _check_controls(paths: list[Path], item: Item, root: Path) -> list[tuple[Path, tuple[int, int]]] | str:
    """Each control with its size, or why the target cannot train (one sentence naming the file)."""
    rel = item.path.relative_to(root).as_posix()
    if not paths:
        return (f"{rel} has no control image: add one of its name (any image extension, or numbered "
                f"{item.path.stem}_0, {item.path.stem}_1, ...) to the control folder, or move the image out of the "
                "data folder.")
    out = []
    for path in paths:
        size = check_image(path, path.parent, MIN_CONTROL_SIDE)
        if isinstance(size, str):
            return f"{rel}'s control image {path}: {size}"
        out.append((path, size))
    return out


def control_fit(view, family: str | None) -> tuple[int | None, bool]:
    """How ``view``'s controls are brought to their training size, as :class:`Control`'s ``area`` and ``resize``:
    musubi-tuner's ``control_resolution`` and ``no_resize_control`` where either is set; else the rule of ``family``'s
    edit pipeline where it has one (FLUX.2: its own size up to 1024², never enlarged, its recipe's ``control_area``),
    else its target's bucket."""
    recipe = ADAPTERS[family].recipe if family in ADAPTERS else None
    if not view.control_resolution and not view.no_resize_control and recipe is not None and recipe.control_area:
        return recipe.control_area, False
    return control_area(view.control_resolution), not view.no_resize_control


def controls_per_target(view) -> int:
    """The most control images a target of ``view``'s dataset may have, as far as the configuration and the control
    files' names say before any image is read (the memory plan counts them): in each control folder, the most files
    one name has (``car.png``, ``car_0.png``, ``car_1.png``: 3), else the most a ``metadata.jsonl`` line names; 0
    without controls."""
    if view.control_dir:
        return sum(_most_of_one_name(Path(f).expanduser()) for f in view.control_dir)
    listed = _jsonl_controls(Path(view.data).expanduser()) if view.data else {}
    return max((len(fields) for fields in listed.values()), default=0)


def control_tokens(cfg, family: str | None = None) -> int:
    """The control tokens beside one target that the memory plan counts (FLUX's 16 pixels a token side): each control
    at the area :func:`control_fit` gives (``control_resolution``'s, FLUX.2's 1024² by default), else at the largest
    training side (a control kept at its own size with ``no_resize_control`` alone is counted so too), times
    :func:`controls_per_target` (at most ``family``'s); the most of any dataset. For a ``family`` whose text encoder
    reads the controls (Qwen-Image-Edit), the tokens they add to the caption too (:func:`caption_control_tokens`)."""
    recipe = ADAPTERS[family].recipe if family in ADAPTERS else None

    def tokens(view) -> int:
        area = control_fit(view, family)[0] or max(view.resolution) ** 2
        count = controls_per_target(view)
        return (min(count, recipe.controls) if recipe is not None else count) * (int(math.sqrt(area)) // 16) ** 2

    return max(map(tokens, cfg.dataset_views()), default=0) + caption_control_tokens(cfg, family)


def caption_control_tokens(cfg, family: str | None) -> int:
    """The most tokens the control images of one target add to its caption, where ``family``'s edit pipeline reads
    them beside it (its recipe's ``control_text_tokens``: Qwen-Image-Edit's vision tokens); 0 elsewhere."""
    recipe = ADAPTERS[family].recipe if family in ADAPTERS else None
    count = recipe.control_text_tokens if recipe is not None else None
    return max((count(n) for n in map(controls_per_target, cfg.dataset_views()) if n), default=0) if count else 0


# ---------------------------------------------------------------------------------------------- folders

def _from_folders(dataset: Dataset, folders: list[Path]) -> dict[Path, list[Path] | str]:
    """Each target's controls from ``folders`` in order, or why it has none (a folder without one, two of the same
    name)."""
    for folder in folders:
        if not folder.is_dir():
            raise DataError(f"control_dir {folder} is not a folder; give the folder that holds the control images.")
    targets: dict[str, set[str]] = {}
    for item in dataset.items:
        rel = item.path.relative_to(dataset.root)
        targets.setdefault(rel.parent.as_posix(), set()).add(rel.stem)
    found: dict[Path, list[Path] | str] = {}
    for folder in folders:
        exact, numbered = _index(folder)
        for item in dataset.items:
            if isinstance(found.get(item.path), str):
                continue
            rel = item.path.relative_to(dataset.root)
            own = _controls_in(folder, rel, exact, numbered, targets)
            if isinstance(own, str) or not own:
                found[item.path] = own or (f"{rel.as_posix()} has no control image in {folder}: add "
                                           f"{rel.with_suffix('.png').as_posix()} (any image extension) there, or move "
                                           "the image out of the data folder.")
                continue
            found[item.path] = found.get(item.path, []) + own
    return found


def _controls_in(folder: Path, rel: Path, exact: dict, numbered: dict, targets: dict) -> list[Path] | str:
    """The controls of the target at ``rel`` in ``folder``: under its subfolder, else at the folder's top."""
    places = [rel.parent.as_posix()] + (["."] if rel.parent.as_posix() != "." else [])
    for place in places:
        same = exact.get((place, rel.stem), [])
        # a numbered name that is itself a target's stem there belongs to that target (musubi's longest match)
        taken = targets.get(rel.parent.as_posix(), set())
        more = sorted((n, p) for n, p, stem in numbered.get((place, rel.stem), []) if stem not in taken)
        if len(same) > 1:
            return (f"{folder} holds {' and '.join(p.name for p in same)} for {rel.as_posix()}: keep one control of "
                    "that name.")
        numbers = [n for n, _ in more]
        if len(set(numbers)) < len(numbers):
            return (f"{folder} numbers two controls of {rel.as_posix()} alike "
                    f"({', '.join(p.name for _, p in more)}): keep one of each number.")
        if same or more:
            return same + [p for _, p in more]
    return []


def _most_of_one_name(folder: Path) -> int:
    """The most control files one name has in ``folder`` (itself and its numbered ones); 0 for an empty folder."""
    if not folder.is_dir():
        return 0
    exact, numbered = _index(folder)
    return max((int(key in exact) + len(numbered.get(key, [])) for key in {*exact, *numbered}), default=0)


def _index(folder: Path) -> tuple[dict, dict]:
    """The image files below ``folder`` by (subfolder, stem), and the numbered ones (``name_3``) by (subfolder,
    name) with their number and stem; hidden files and folders are left out."""
    exact: dict[tuple[str, str], list[Path]] = {}
    numbered: dict[tuple[str, str], list[tuple[int, Path, str]]] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.suffix.lower() not in IMAGE_EXTENSIONS or any(p.startswith(".") for p in rel.parts) \
                or not path.is_file():
            continue
        place = rel.parent.as_posix()
        exact.setdefault((place, path.stem), []).append(path)
        match = _NUMBERED.fullmatch(path.stem)
        if match:
            numbered.setdefault((place, match[1]), []).append((int(match[2]), path, path.stem))
    return exact, numbered


# ---------------------------------------------------------------------------------------------- metadata.jsonl

def _jsonl_controls(root: Path) -> dict[Path, dict[int, object]]:
    """The control fields of each ``metadata.jsonl`` line that has any, by its target's path: ``control_path`` as
    number -1 and ``control_path_N`` as N. Lines data.py skipped are left out; another ``control`` key is refused by
    name."""
    meta = root / METADATA
    if not meta.is_file():
        return {}
    try:
        lines = meta.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}  # scan_dataset has refused the file already
    out: dict[Path, dict[int, object]] = {}
    for n, line in enumerate(lines, start=1):
        try:
            entry = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str):
            continue
        fields = {}
        for key, value in entry.items():
            match = _JSONL_FIELD.fullmatch(key)
            if match:
                fields[int(match[1]) if match[1] else -1] = value
            elif key.startswith("control"):
                raise DataError(f"{meta} line {n} has the key {key}, which SquareQ does not read; a line names its "
                                "controls with control_path, or control_path_0, control_path_1, ...: rename it.")
        if fields:
            out[(root / entry["file_name"]).resolve()] = fields
    return out


def _from_jsonl(dataset: Dataset, listed: dict[Path, dict[int, object]]) -> dict[Path, list[Path] | str]:
    """Each target's controls as its ``metadata.jsonl`` line names them, or why they cannot be used."""
    root = dataset.root
    found: dict[Path, list[Path] | str] = {}
    for item in dataset.items:
        fields = listed.get(item.path.resolve())
        rel = item.path.relative_to(root).as_posix()
        if not fields:
            found[item.path] = (f"{rel} has no control image: give its {METADATA} line a control_path (relative to "
                                "the data folder), or move the image out of the folder.")
            continue
        if -1 in fields and len(fields) > 1:
            found[item.path] = (f"{rel}'s {METADATA} line has control_path and numbered control_path_N fields: give "
                                "one control_path, or number them all.")
            continue
        paths = []
        for number in sorted(fields):
            value, key = fields[number], "control_path" if number < 0 else f"control_path_{number}"
            path = root / value if isinstance(value, str) and value and "\0" not in value else None
            if path is None or not path.is_file():
                paths = (f"{rel}'s {METADATA} line names {key} = {value!r}, which is not a file in {root}: fix the "
                         "path (relative to the data folder) or add the control image.")
                break
            if not path.resolve().is_relative_to(root.resolve()):
                paths = (f"{rel}'s {key} leads to {path.resolve()}, outside the data folder {root}; copy the control "
                         "into the folder and name it relative to it.")
                break
            paths.append(path)
        found[item.path] = paths
    return found


# ---------------------------------------------------------------------------------------------- the cache

def control_geometry(control: Control) -> bool | str:
    """How a control is brought to its size, as its cache key records it: True only center-cropped
    (``no_resize_control`` within ``control_resolution``'s area or without one), ``"area, crop"`` scaled down to that
    area first (a larger one; FLUX.2's 1024² by default), False scaled to cover its bucket and cropped."""
    if control.resize:
        return False
    return True if control.area is None or control.width * control.height <= control.area else "area, crop"


def control_mark(item: Item, bucket: tuple[int, int], digest) -> tuple:
    """What a target's latent cache key adds for its controls (``digest(path)``: a file's sha256): each control's
    content and size, so that a changed, added or resized control re-encodes the entry; () for a plain image."""
    if not item.controls:
        return ()
    sizes = control_buckets(item, bucket)
    return ("controls", [[digest(c.path), list(size), control_geometry(c)] for c, size in zip(item.controls, sizes)])


def control_text_mark(item: Item, identity: list[str], digest) -> tuple:
    """What a caption's text cache key adds where the text encoder reads the target's controls beside it
    (Qwen-Image-Edit): their contents in order and ``identity``, how the pipeline reads them (its class, the area
    they are brought to, its template: sources/pipeline_encoders.py ``control_text_identity``)."""
    return ("controls", identity, [digest(c.path) for c in item.controls])


def control_images(item: Item) -> list:
    """A target's control images as the text encoder is given them: whole, upright, transparency over white (the
    edit pipeline sizes them itself)."""
    return [rgb_image(c.path) for c in item.controls]


def control_latents(item: Item, bucket: tuple[int, int], encode) -> dict[str, torch.Tensor]:
    """The latents of a target's controls beside its bucket, ``control_0``, ``control_1``, ...: each image brought to
    its size (:func:`control_bucket`) and encoded by ``encode`` (the VAE's mode, normalized as the target's)."""
    out = {}
    for n, (control, size) in enumerate(zip(item.controls, control_buckets(item, bucket), strict=True)):
        z = encode(load_image(control.path, size, crop_only=not control.resize, area=control.area))
        out[CONTROL_FIELD.format(n)] = z if isinstance(z, torch.Tensor) else z["latents"]
    return out


def check_pairs(dataset: Dataset, cfg, family: str | None) -> None:
    """Refuse edit pairs the run cannot train (:class:`DataError`, one sentence): a family that trains none, a target
    with more controls than its family takes (named), or keys that would lose the pairing."""
    pairs = [item for item in dataset.items if item.controls]
    if not pairs or family is None:
        return
    recipe = ADAPTERS[family].recipe if family in ADAPTERS else None
    limit = recipe.controls if recipe is not None else 0
    if not limit:
        raise DataError(f"{dataset.root} holds edit pairs (control images), and this slab holds a {family} model, "
                        f"which trains on none; edit pairs train {', '.join(edit_families())}: remove control_dir "
                        "(or the control_path fields) to train it on the images alone.")
    many = next((item for item in pairs if len(item.controls) > limit), None)
    if many is not None:
        names = ", ".join(c.path.name for c in many.controls)
        raise DataError(f"{many.path} has {len(many.controls)} control images ({names}), and {recipe.edit_name} takes "
                        f"{limit}; keep {'one' if limit == 1 else f'at most {limit}'} per image.")
    for key, why in (("flip_aug", "would flip the targets and not their controls"),
                     ("reg_data", "mixes in images without controls"),
                     ("validation_data", "holds images without controls; hold out pairs with validation_split")):
        if getattr(cfg, key):
            raise DataError(f"{key} with edit pairs {why}; remove {key}.")


def check_edit_folder(dataset: Dataset, family: str | None, source) -> None:
    """Refuse (:class:`DataError`, one sentence) what ``family``'s edit pipelines cannot train from the encoders of
    ``source`` (its pipeline folder's class; a built-in model's toy encoders read captions alone): edit pairs from a
    folder whose text encoder reads no control image (Qwen-Image's text-to-image pipeline), images without controls
    from an edit pipeline's folder, or more controls than its pipeline takes."""
    edits = folder_edits(family)
    pipeline = pipeline_class(source) if edits else None
    if pipeline is None:
        return
    where = EncoderSource.of(source).where
    pairs, edit = [item for item in dataset.items if item.controls], edits.get(pipeline)
    if pairs and edit is None:
        raise DataError(f"{dataset.root} holds edit pairs, and {where} holds a {pipeline}, whose text encoder reads no "
                        f"control image; train them from a {' or '.join(edits)} folder (--model).")
    if not pairs and edit is not None:
        raise DataError(f"{where} holds a {pipeline}, which edits control images, and {dataset.root} has none; give "
                        "each image its control (control_dir: docs/train.md, \"Edit pairs\"), or train from a "
                        f"{ADAPTERS[family].recipe.pipeline.classes[0]} folder (--model).")
    many = next((item for item in pairs if len(item.controls) > edit.controls), None)
    if many is not None:
        takes = [name for name, e in edits.items() if e.controls >= len(many.controls)]
        raise DataError(f"{many.path} has {len(many.controls)} control images, and {where}'s {pipeline} takes "
                        f"{edit.controls}; keep {edit.controls} per image" +
                        (f", or train from a {' or '.join(takes)} folder." if takes else "."))


def pairs_line(dataset: Dataset, bucket_sets, no_upscale: bool) -> str | None:
    """The run summary's line on edit pairs: how many targets have how many controls, and the controls' sizes with
    their entries an epoch (each size of each a batch never mixes); None without pairs."""
    listed = [(item, bucket_for(item.width, item.height, buckets, no_upscale))
              for item, buckets in entries(dataset, bucket_sets) if item.controls]
    if not listed:
        return None
    counts = Counter(len(item.controls) for item in {item.path: item for item, _ in listed}.values())
    sizes = Counter(control_buckets(item, bucket) for item, bucket in listed)
    said = ", ".join(f"{n} image{'s' if n > 1 else ''} with {k} control image{'s' if k > 1 else ''}"
                     for k, n in sorted(counts.items()))
    shown = ", ".join(" + ".join(f"{w}x{h}" for w, h in key) + f": {n}" for key, n in sorted(sizes.items()))
    return f"edit pairs: {said}; control sizes (entries an epoch): {shown}"


def folder_edits(family: str | None) -> dict:
    """The edit pipelines of ``family`` that are their own folders' classes (Qwen-Image-Edit's), by class name: what
    each takes (``PipelineFolder.edits``); empty for a family whose edits are drawn otherwise (FLUX.1, FLUX.2)."""
    recipe = ADAPTERS[family].recipe if family in ADAPTERS else None
    return recipe.pipeline.edits if recipe is not None and recipe.pipeline is not None else {}


def edit_families() -> list[str]:
    """The families that train on edit pairs, by the name they go by then."""
    return [a.recipe.edit_name or f for f, a in ADAPTERS.items() if a.recipe is not None and a.recipe.controls]
