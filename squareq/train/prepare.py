"""A run's data and cache: the dataset scanned (with its regularisation and validation images), captions in every
order they are trained in, each image's bucket and loss mask, and every latent and text embedding a run needs
computed once into the cache by the encoders of the run's model (``squareq cache`` runs this alone)."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import ADAPTERS
from ..models.cache_entry import model_problem
from ..progress import Progress, wanted
from ..runtime.compute import resolve_dtype
from ..slab.digest import content_key, file_sha256
from ..sources.encoder_placement import EncoderRun
from ..sources.encoder_source import EncoderSource, slab_encoders
from ..sources.encoders import Encoders, encoder_dtype, open_encoders
from .buckets import entries, entry_buckets, make_buckets
from .cache import EmbeddingCache
from .clip_items import clip_digest, cut_clips, load_clip
from .clips import TEMPORAL_STRIDE
from .config import TrainConfig
from .controls import (
    attach_controls,
    caption_control_tokens,
    check_edit_folder,
    check_pairs,
    control_images,
    control_latents,
    control_mark,
    control_text_mark,
    pairs_line,
)
from .data import (
    TRIGGER_TOKEN,
    DataError,
    DataGroup,
    caption_for,
    caption_orders,
    combined,
    hold_out,
    load_image,
    scan_dataset,
    with_regularisation,
)
from .feed import text_key
from .host_plan import HostPlan, train_host_plan
from .masks import ALPHA, latent_mask, load_mask, mask_sources
from .run_samples import sample_prompts
from .run_summary import data_lines


@dataclass
class PreparedData:
    """The scanned dataset, its buckets and captions, and the cache keys of every latent and text embedding."""

    dataset: object
    buckets: list
    cache: EmbeddingCache
    captions: list[list[str]]  # per entry: its caption with the trigger word, or its shuffled orders
    dropped: str  # what a dropped caption becomes
    keys: tuple[list[str], dict[str, str]] | None  # latent keys: the training entries', then the validation ones
    computed: int = 0
    validation: list[str] = field(default_factory=list)  # the caption of each validation entry


def prepare_data(cfg: TrainConfig, model, device: torch.device, echo=print, encode: bool = True,
                 progress: bool | None = None, encoder_source: EncoderSource | None = None,
                 describe: list[str] | None = None, host: HostPlan | None = None) -> PreparedData:
    """Scan ``cfg.data`` and, with ``encode``, fill the cache through ``encoder_source`` (a run's plan resolved it;
    default: the encoders of ``cfg.model`` or the slab's source, with ``cfg``'s single files), for the slab's model
    record ``model`` (family and config; what ``squareq cache`` runs on its own). A family SquareQ cannot train has no
    encoders, which ``open_encoders`` says. ``progress``: the fill's bar on stderr (default: when stderr is a
    terminal). ``describe``: a run's summary opens with these lines (its device), then says the dataset (images,
    repeats, buckets, upscaled images); once the folder is read (a data error comes alone), before the cache fills.
    ``host``: the run's host plan (train/host_plan.py; default: the cache's own, made and said here, before any
    work)."""
    if encode and encoder_source is None:  # squareq cache, and the callers without a run's plan
        encoder_source = slab_encoders(model, cfg.model, cfg.revision, cfg.encoder_files)
    if host is None and encode:
        host = train_host_plan(cfg, "cache", device, encoder_source=encoder_source, family=model.family)
        echo(host.line())
    dataset = _training_data(cfg, getattr(model, "family", None), echo)
    held = None
    if cfg.validation_data:
        try:
            held = scan_dataset(cfg.validation_data, caption_ext=cfg.caption_ext).without_repeats()
        except DataError as exc:
            raise DataError(f"validation_data (--validation-data): {exc}") from None
    elif cfg.validation_split:
        dataset, held = hold_out(dataset, cfg.validation_split, cfg.seed)
    if cfg.reg_data:
        try:
            reg = scan_dataset(cfg.reg_data, caption_ext=cfg.caption_ext)
        except DataError as exc:
            raise DataError(f"reg_data (--reg-data): {exc}") from None
        dataset = with_regularisation(dataset, reg)
        echo(f"regularisation: {sum(it.repeats for it in dataset.items if it.reg) * len(cfg.resolution)} entries an "
             f"epoch from {reg.root}, loss weight {cfg.prior_loss_weight:g}")
    if held is not None:
        echo(f"validation: {len(held)} held-out images from {held.root}")
    placeholders = [item for item in dataset.items + (held.items if held else []) if TRIGGER_TOKEN in item.caption]
    if placeholders and not (cfg.trigger or "").strip():
        raise DataError(f"{len(placeholders)} captions use {TRIGGER_TOKEN} (e.g. the one of {placeholders[0].path}) "
                        "but no trigger word is set; pass --trigger WORD.")
    buckets = [make_buckets(r) for r in cfg.resolution]  # one list per resolution (several datasets: their own)
    item_buckets = entry_buckets(dataset, buckets, cfg.no_upscale)
    if describe is not None:
        for line in describe + data_lines(dataset, buckets, cfg.resolution, cfg.no_upscale, pairs_line):
            echo(line)
    items = [item for item, _ in entries(dataset, buckets)]  # what the batches index: entry i is this item
    # a regularisation image's caption is the class's own: the trigger word is the training images' alone
    orders = {(c, reg): caption_orders(c, None if reg else cfg.trigger, cfg.keep_tokens,
                                       cfg.caption_orders if cfg.shuffle_caption else 0, cfg.seed)
              for c, reg in {(item.caption, item.reg) for item in items}}
    captions = [orders[(item.caption, item.reg)] for item in items]
    if cfg.shuffle_caption:
        echo(f"shuffle_caption: {sum(map(len, orders.values()))} orders of {len(orders)} captions go into the cache")
    dropped = caption_for("", cfg.trigger, dropout=0.0) if cfg.trigger else ""
    # validation entries come after the training entries in the cache keys: every image once per resolution
    held_items = [item for item, _ in entries(held, buckets)] if held else []
    held_buckets = entry_buckets(held, buckets, cfg.no_upscale) if held else []
    held_captions = [caption_for(item.caption, cfg.trigger) for item in held_items]
    # images held out of --data keep their masks, so the validation loss measures what training does
    held_masks = _masks(cfg, held, held_items) if cfg.validation_split else [None] * len(held_items)
    cache = _cache(cfg, model, echo)
    keys = None
    if encode:
        masks = _masks(cfg, dataset, items) + held_masks  # read (and refused) before the encoders load
        check_edit_folder(dataset, model.family, encoder_source)
        from diffusers.configuration_utils import FrozenDict  # attribute access to the recorded config, as on a model

        with open_encoders(encoder_source, device, model.family, FrozenDict(model.config),
                           _encoder_run(cfg, items, host, model.family),
                           encoder_dtype(device, resolve_dtype(cfg.dtype, device)[0])) as encoders:
            if encoders.placement is not None:
                echo(encoders.placement.describe())
                cache.record_encoders(encoders.text_identity, encoders.placement.record())
            texts, own = _texts(cfg, model.family, encoders, items + held_items,
                                [orders + [dropped] for orders in captions] + [[c] for c in held_captions])
            keys = _fill_cache(cfg, items + held_items, item_buckets + held_buckets, texts, encoders, cache, echo,
                               flipped=len(items) if cfg.flip_aug else 0,
                               masks=masks, progress=progress, own_texts=own)
        image_keys, text_keys, _ = keys
        cache.record_pairs([(image_keys[i], text_key(text_keys, i, c[0])) for i, c in enumerate(captions)])
    return PreparedData(dataset, buckets, cache, captions, dropped, keys, cache.computed, held_captions)


def _texts(cfg: TrainConfig, family: str, encoders, items, entry_texts: list[list[str]]):
    """The captions to encode alone, sorted, and those of each item whose text encoder reads its control images beside
    them (Qwen-Image-Edit: its own entries, :func:`_fill_cache`), by item; ``entry_texts``: each item's captions."""
    own = {i: texts for i, (texts, item) in enumerate(zip(entry_texts, items, strict=True))
           if item.controls and getattr(encoders, "control_text", None) is not None}
    # the sample prompts too: sample images then need the VAE only, never the text encoders again
    return sorted({t for i, entry in enumerate(entry_texts) if i not in own for t in entry}
                  | {t for p in sample_prompts(cfg, family) for t in p.texts}), own


def _cache(cfg: TrainConfig, model, echo) -> EmbeddingCache:
    """The run's cache, whose entries are checked against the run's model too (models/cache_entry.py)."""
    from diffusers.configuration_utils import FrozenDict  # attribute access to the recorded config, as on a model

    if model is None or model.family not in ADAPTERS:
        return EmbeddingCache(cfg.cache_dir or Path(cfg.output) / "cache", echo)
    recipe, config = ADAPTERS[model.family].recipe, FrozenDict(model.config)
    fits = lambda kind, tensors: model_problem(kind, tensors, recipe, config)  # noqa: E731
    return EmbeddingCache(cfg.cache_dir or Path(cfg.output) / "cache", echo, fits)


def _encoder_run(cfg: TrainConfig, items, host: HostPlan, family: str) -> EncoderRun:
    """What the cache's encoders are placed for: the largest entry, whose VAE feature maps grow with a clip window's
    frames as with its pixels (all of them, or a chunk at a time: sources/vae_memory.py), the longest caption with
    the vision tokens of its control images where the text encoder reads them (Qwen-Image-Edit), and the host plan's
    room."""
    frames = max((len(it.frames) for it in items if it.frames is not None), default=1)
    tokens = cfg.max_sequence_length + caption_control_tokens(cfg, family)
    return EncoderRun(cfg.vram_budget_bytes, tokens, cfg.largest_resolution ** 2,
                      "vram_budget", host_budget=host.encoder_budget, frames=frames)


def _training_data(cfg: TrainConfig, family: str | None, echo):
    """The run's datasets scanned (``cfg.data``, or each ``[[datasets]]`` table's folder with its own keys,
    train/datasets.py) and combined; for a video family, their clips too, cut into windows (train/clip_items.py). An
    image family's folder reads as it always has (an animated WebP as its first frame; video files and GIFs are no
    images)."""
    clips = family in TEMPORAL_STRIDE
    views = cfg.dataset_views()
    found = []
    for view in views:
        dataset = scan_dataset(view.data, caption_ext=view.caption_ext, clips=clips)
        dataset = cut_clips(dataset, view.frame_settings, family, echo=echo) if clips else dataset
        dataset = attach_controls(dataset, view)  # an edit pair's control images (train/controls.py)
        if view.num_repeats > 1:
            dataset.items = [dataclasses.replace(it, repeats=it.repeats * view.num_repeats) for it in dataset.items]
        if cfg.masked_loss and any(it.frames is not None for it in dataset.items):
            raise DataError(f"masked_loss (--masked-loss) weighs an image's pixels, and {view.data} holds clips: "
                            "train the clips without it, or move them out of the folder.")
        found.append(dataset)
    dataset = combined(found, [DataGroup(d.root, tuple(v.resolution), v.batch_size) for d, v in zip(found, views)])
    check_pairs(dataset, cfg, family)
    return dataset


def _masks(cfg: TrainConfig, dataset, items) -> list:
    """Each training entry's loss-mask source (train/masks.py), or Nones without ``masked_loss``."""
    if not cfg.masked_loss:
        return [None] * len(items)
    unique = list({item.path: item for item in items if not item.reg}.values())  # regularisation images: unmasked
    found = dict(zip((item.path for item in unique), mask_sources(unique, dataset.root, cfg.alpha_mask,
                                                                  cfg.mask_dir)))
    return [None if item.reg else found.get(item.path) for item in items]


def _fill_cache(cfg: TrainConfig, items, item_buckets, captions: list[str], encoders: Encoders,
                cache: EmbeddingCache, echo, flipped: int = 0, masks: list | None = None,
                progress: bool | None = None,
                own_texts: dict[int, list[str]] | None = None) -> tuple[list[str], dict, list[str]]:
    """Cache every image's latents and every caption's embeddings, and for the first ``flipped`` items (the training
    ones, with ``flip_aug``) the latents of the image flipped left to right; with ``masks`` (each item's mask source,
    train/masks.py, or None) each latent entry also holds its loss mask. ``own_texts``: the captions of the items
    whose text encoder reads their control images beside them (Qwen-Image-Edit), each encoded with them under a key
    of theirs too, ``(item, caption)`` in the text keys (:func:`squareq.train.feed.text_key`). The entries to compute
    are a bar on a terminal (or with ``progress``), then a line. Return the latent keys per item, the text key per
    caption and the flipped latents' keys."""
    vae_id, text_id = encoders.vae_identity, encoders.text_identity
    hashed: dict = {}  # a clip's windows (and a repeated image's entries, a shared control) are hashed once

    def content_of(path, clip: bool = False) -> str:
        if path not in hashed:
            hashed[path] = clip_digest(path) if clip else file_sha256(path)
        return hashed[path]

    digests = [content_of(item.path, item.frames is not None) for item in items]
    masks = masks or [None] * len(items)
    marks = [() if m is None else (ALPHA,) if m == ALPHA else ("mask", file_sha256(m)) for m in masks]
    # a clip's window: which of its frames (a changed frame key re-encodes only the windows it changes); an edit
    # pair's controls: their content and sizes (train/controls.py)
    marks = [(*mark, *control_mark(item, bucket, content_of)) if item.frames is None else
             (*mark, "frames", list(item.frames))
             for mark, item, bucket in zip(marks, items, item_buckets, strict=True)]
    image_keys = [content_key("latents", digest, vae_id, list(bucket), *mark)
                  for digest, bucket, mark in zip(digests, item_buckets, marks, strict=True)]
    flipped_keys = [content_key("latents", digests[i], vae_id, list(item_buckets[i]), "flipped", *marks[i])
                    for i in range(flipped)]

    def encoder_of(flip: bool):
        def encode_images(indices):
            out = []
            for i in indices:
                if items[i].frames is not None:
                    pixels = load_clip(items[i].path, items[i].frames, item_buckets[i])
                    e = encoders.encode_clip(pixels.flip(-1) if flip else pixels)
                else:
                    pixels = load_image(items[i].path, item_buckets[i])
                    e = encoders.encode_image(pixels.flip(-1) if flip else pixels)
                e = e if isinstance(e, dict) else {"latents": e}
                e.update(control_latents(items[i], item_buckets[i], encoders.encode_image))
                if masks[i] is not None:
                    mask = load_mask(items[i].path, masks[i], item_buckets[i])
                    e["loss_mask"] = latent_mask(mask.flip(-1) if flip else mask, e["latents"])
                out.append(e)
            return out

        return encode_images

    text_keys: dict = {c: content_key("text", c, text_id, cfg.max_sequence_length) for c in captions}
    for i, texts in (own_texts or {}).items():
        mark = control_text_mark(items[i], encoders.control_text_identity, content_of)
        text_keys.update({(i, c): content_key("text", c, text_id, cfg.max_sequence_length, *mark) for c in texts})
    unique = list(text_keys)

    def encode_texts(indices):
        asked = [unique[i] for i in indices]
        pairs = [a for a in asked if isinstance(a, tuple)]
        plain = [a for a in asked if not isinstance(a, tuple)]
        read = iter(encoders.encode_prompts(plain, cfg.max_sequence_length) if plain else [])
        edited = iter(encoders.encode_prompts([c for _, c in pairs], cfg.max_sequence_length,
                                              images=[control_images(items[i]) for i, _ in pairs]) if pairs else [])
        return [next(edited if isinstance(a, tuple) else read) for a in asked]

    fills = [("latents", image_keys, encoder_of(False)), ("latents", flipped_keys, encoder_of(True)),
             ("text", [text_keys[c] for c in unique], encode_texts)]
    todo = len({(kind, key) for kind, keys, _ in fills for key in keys if not cache.has(kind, key)})
    start = time.perf_counter()
    # the line below says what the finished bar would, so the bar is not left on the screen
    with Progress(todo, "cache", "entry", shown=todo > 0 and wanted(progress), leave=False) as bar:
        made = sum(cache.fill(kind, keys, compute, progress=bar) for kind, keys, compute in fills)
    echo(f"cache {cache.root}: {made} new entries of {len(image_keys) + len(flipped_keys) + len(unique)} in "
         f"{time.perf_counter() - start:.1f} s")
    return image_keys, text_keys, flipped_keys
