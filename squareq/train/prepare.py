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
from ..progress import Progress
from ..progress import wanted as wanted_bar
from ..runtime.compute import resolve_dtype
from ..slab.digest import content_key, file_sha256
from ..sources.encoder_files_key import encoder_files_key
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
        # the sample prompts too: sample images then need the VAE only, never the text encoders again
        # the dropped caption is one shared entry; an item whose captions are read with its controls
        # (Qwen-Image-Edit) gets its own only where caption_dropout can draw it, since each is a pass of the encoder
        own_dropped = [dropped] if cfg.caption_dropout > 0 else []
        wanted = CacheWants(cfg, items + held_items, item_buckets + held_buckets,
                            [orders + own_dropped for orders in captions] + [[c] for c in held_captions],
                            {dropped} | {t for p in sample_prompts(cfg, model.family) for t in p.texts},
                            flipped=len(items) if cfg.flip_aug else 0, masks=masks)
        keys = _fill_cache(cfg, model, device, encoder_source, host, wanted, cache, echo, progress)
        image_keys, text_keys, _ = keys
        cache.record_pairs([(image_keys[i], text_key(text_keys, i, c[0])) for i, c in enumerate(captions)])
    return PreparedData(dataset, buckets, cache, captions, dropped, keys, cache.computed, held_captions)


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
        dataset = attach_controls(dataset, view, family)  # an edit pair's control images (train/controls.py)
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


@dataclass(frozen=True)
class EncoderIdentities:
    """What names a run's entries of its encoders: the VAE's and the text encoders' identities, and where the text
    encoder reads an edit pair's control images beside the caption (Qwen-Image-Edit), how it reads them
    (``control_text``: sources/pipeline_encoders.py ``control_text_identity``; None where it reads none)."""

    vae: str
    text: str
    control_text: list[str] | None = None

    @classmethod
    def of(cls, encoders) -> EncoderIdentities:
        reads = getattr(encoders, "control_text", None) is not None
        return cls(encoders.vae_identity, encoders.text_identity, encoders.control_text_identity if reads else None)

    def to_record(self) -> dict:
        """These identities as the JSON object the cache notes (``EmbeddingCache.remember_identities``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls, record) -> EncoderIdentities | None:
        """The identities a noted record (:meth:`to_record`) holds; None where it is not one (a field missing or
        unknown, a value of another type: a damaged note, or another version's), so the encoders load and their
        identities are noted again."""
        if not isinstance(record, dict) or set(record) != {f.name for f in dataclasses.fields(cls)}:
            return None
        control = record["control_text"]
        if not (isinstance(record["vae"], str) and isinstance(record["text"], str) and (
                control is None or isinstance(control, list) and all(isinstance(x, str) for x in control))):
            return None
        return cls(**record)


@dataclass
class CacheWants:
    """What a run's cache must hold: every item's latents at its bucket (with ``masks``' loss masks, each item's
    mask source or None; for the first ``flipped`` items, the training ones with ``flip_aug``, also flipped left to
    right), every item's captions (``entry_texts``, each item's) and the ``extra_texts`` (the sample prompts)."""

    cfg: TrainConfig
    items: list
    buckets: list
    entry_texts: list[list[str]]
    extra_texts: set[str]
    flipped: int = 0
    masks: list | None = None
    hashed: dict = field(default_factory=dict)  # a clip's windows (a repeated image, a shared control): hashed once

    def content_of(self, path, clip: bool = False) -> str:
        if path not in self.hashed:
            self.hashed[path] = clip_digest(path) if clip else file_sha256(path)
        return self.hashed[path]

    def keys(self, ids: EncoderIdentities) -> tuple[list[str], dict, list[str]]:
        """The latent keys per item, the text key per caption and the flipped latents' keys, for encoders of ``ids``.
        Where the text encoder reads an item's control images beside its captions (Qwen-Image-Edit), each of those
        captions is its own entry, keyed ``(item, caption)`` in the text keys (:func:`squareq.train.feed.text_key`)."""
        items, buckets = self.items, self.buckets
        digests = [self.content_of(item.path, item.frames is not None) for item in items]
        masks = self.masks or [None] * len(items)
        marks = [() if m is None else (ALPHA,) if m == ALPHA else ("mask", file_sha256(m)) for m in masks]
        # a clip's window: which of its frames (a changed frame key re-encodes only the windows it changes); an edit
        # pair's controls: their content and sizes (train/controls.py)
        marks = [(*mark, *control_mark(item, bucket, self.content_of)) if item.frames is None else
                 (*mark, "frames", list(item.frames)) for mark, item, bucket in zip(marks, items, buckets, strict=True)]
        image_keys = [content_key("latents", digest, ids.vae, list(bucket), *mark)
                      for digest, bucket, mark in zip(digests, buckets, marks, strict=True)]
        flipped_keys = [content_key("latents", digests[i], ids.vae, list(buckets[i]), "flipped", *marks[i])
                        for i in range(self.flipped)]
        own = {i: texts for i, (texts, item) in enumerate(zip(self.entry_texts, items, strict=True))
               if item.controls and ids.control_text is not None}
        alone = sorted({t for i, texts in enumerate(self.entry_texts) if i not in own for t in texts}
                       | self.extra_texts)
        length = self.cfg.max_sequence_length
        text_keys: dict = {c: content_key("text", c, ids.text, length) for c in alone}
        for i, texts in own.items():
            mark = control_text_mark(items[i], ids.control_text, self.content_of)
            text_keys.update({(i, c): content_key("text", c, ids.text, length, *mark) for c in texts})
        return image_keys, text_keys, flipped_keys


def _fill_cache(cfg: TrainConfig, model, device: torch.device, source: EncoderSource, host: HostPlan,
                wanted: CacheWants, cache: EmbeddingCache, echo, progress: bool | None):
    """The keys of ``wanted`` (:meth:`CacheWants.keys`), its missing entries computed. Where the cache noted the
    identities of these encoder files and holds every entry intact, the encoders are never loaded (a resumed run of
    FLUX.2 skips loading, pinning and checksumming its 24B Mistral); else they load and fill it, and their
    identities are noted."""
    from diffusers.configuration_utils import FrozenDict  # attribute access to the recorded config, as on a model

    dtype = encoder_dtype(device, resolve_dtype(cfg.dtype, device)[0])
    files_key = encoder_files_key(source, model.family, dtype)
    known = EncoderIdentities.from_record(cache.identities(files_key))
    if known is not None:
        keys = wanted.keys(known)
        entries = _entries(keys)
        # every entry there first (a stat each), and only then each one read and checked: with one missing, the
        # encoders load and the fill checks what is there, so nothing is read twice
        if all(cache.has(kind, key) for kind, key in entries) and all(cache.intact(kind, key, echo)
                                                                      for kind, key in entries):
            echo(f"cache {cache.root}: all {len(entries)} entries there; the VAE and text encoders were not loaded")
            return keys
    with open_encoders(source, device, model.family, FrozenDict(model.config),
                       _encoder_run(cfg, wanted.items, host, model.family), dtype) as encoders:
        if encoders.placement is not None:
            echo(encoders.placement.describe())
            cache.record_encoders(encoders.text_identity, encoders.placement.record())
        ids = EncoderIdentities.of(encoders)
        keys = wanted.keys(ids)
        _compute_missing(wanted, keys, encoders, cache, echo, progress)
        if files_key is not None:
            cache.remember_identities(files_key, ids.to_record())
    return keys


def _entries(keys) -> list[tuple[str, str]]:
    image_keys, text_keys, flipped_keys = keys
    return [("latents", k) for k in image_keys + flipped_keys] + [("text", k) for k in text_keys.values()]


def _compute_missing(wanted: CacheWants, keys, encoders: Encoders, cache: EmbeddingCache, echo,
                     progress: bool | None) -> None:
    """Every entry of ``keys`` the cache lacks (or holds damaged) computed by ``encoders``. The entries to compute
    are a bar on a terminal (or with ``progress``), then a line."""
    items, buckets, masks = wanted.items, wanted.buckets, wanted.masks or [None] * len(wanted.items)
    image_keys, text_keys, flipped_keys = keys

    def encoder_of(flip: bool):
        def encode_images(indices):
            out = []
            for i in indices:
                if items[i].frames is not None:
                    pixels = load_clip(items[i].path, items[i].frames, buckets[i])
                    e = encoders.encode_clip(pixels.flip(-1) if flip else pixels)
                else:
                    pixels = load_image(items[i].path, buckets[i])
                    e = encoders.encode_image(pixels.flip(-1) if flip else pixels)
                e = e if isinstance(e, dict) else {"latents": e}
                e.update(control_latents(items[i], buckets[i], encoders.encode_image))
                if masks[i] is not None:
                    mask = load_mask(items[i].path, masks[i], buckets[i])
                    e["loss_mask"] = latent_mask(mask.flip(-1) if flip else mask, e["latents"])
                out.append(e)
            return out

        return encode_images

    unique = list(text_keys)

    def encode_texts(indices):
        asked = [unique[i] for i in indices]
        pairs = [a for a in asked if isinstance(a, tuple)]
        plain = [a for a in asked if not isinstance(a, tuple)]
        length = wanted.cfg.max_sequence_length
        read = iter(encoders.encode_prompts(plain, length) if plain else [])
        loaded = {i: control_images(items[i]) for i, _ in pairs}  # a target's controls read once for its captions
        edited = iter(encoders.encode_prompts([c for _, c in pairs], length,
                                              images=[loaded[i] for i, _ in pairs]) if pairs else [])
        return [next(edited if isinstance(a, tuple) else read) for a in asked]

    fills = [("latents", image_keys, encoder_of(False)), ("latents", flipped_keys, encoder_of(True)),
             ("text", [text_keys[c] for c in unique], encode_texts)]
    todo = len({(kind, key) for kind, keys, _ in fills for key in keys if not cache.has(kind, key)})
    start = time.perf_counter()
    # the line below says what the finished bar would, so the bar is not left on the screen
    with Progress(todo, "cache", "entry", shown=todo > 0 and wanted_bar(progress), leave=False) as bar:
        made = sum(cache.fill(kind, keys, compute, progress=bar) for kind, keys, compute in fills)
    echo(f"cache {cache.root}: {made} new entries of {len(image_keys) + len(flipped_keys) + len(unique)} in "
         f"{time.perf_counter() - start:.1f} s")
