"""Real calibration inputs: encoded images noised the way the family trains, and real text through a model's tokenizer.

A :class:`CalibrationSet` is images and their captions already encoded by the family's own VAE and text encoders
(``squareq.compiler.calibration_images`` encodes them; a training cache holds them too). :func:`image_batch` turns it
into the denoiser's forward arguments exactly as a training step does: a time from the family's training
distribution (stratified, so a few samples still span the schedule), seeded noise, ``x_t`` by the family's noising
(``models/noising.py``) and the recipe's forward. :func:`text_batch` does the same for a text model: real sentences
through its own tokenizer, padding masked out of the statistics.

Both hold samples out: whole images (all their noisy copies) or whole sentences, whose inputs the compiler keeps out
of every fit and choice, so that a transform is judged on data it was not tuned on.
"""
from __future__ import annotations

import inspect
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .base import CalibrationBatch, ModelError
from .cache_entry import model_problem, read_entry
from .noising import DEFAULT_GUIDANCE, DEFAULT_SHIFT, calibration_times, image_tokens, noised
from .recipe import TrainingRecipe, split_controls, stack_captions

HELDOUT_FRACTION = 0.25
DEFAULT_CAPTION_TOKENS = 512  # T5 tokens per calibration caption: the trainer's default, FLUX.1-dev's T5 length


@dataclass
class CalibrationSet:
    """Encoded images with their captions: ``latents[i]`` holds image i's normalized latent under ``"latents"`` (and
    any image conditioning the denoiser takes next to it, as the training cache stores it), ``texts[i]`` its
    caption's entry (``prompt_embeds`` and, where the family uses them, ``pooled_prompt_embeds``/``prompt_mask``).
    ``description`` says what the images are and where they came from (the manifest records it)."""

    latents: list[dict[str, torch.Tensor]]
    texts: list[dict[str, torch.Tensor]]
    description: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.latents or len(self.latents) != len(self.texts):
            raise ModelError(f"a calibration set needs one caption per image and at least one image; it has "
                             f"{len(self.latents)} images and {len(self.texts)} captions.")


def heldout_groups(groups: int, seed: int, fraction: float = HELDOUT_FRACTION) -> set[int]:
    """A seeded ``fraction`` of ``groups`` (at least one, never all): the groups kept out of the fit."""
    if groups < 2 or fraction <= 0:
        return set()
    count = min(groups - 1, max(1, round(fraction * groups)))
    return set(random.Random(seed).sample(range(groups), count))


def _on(value, device, dtype):
    if torch.is_tensor(value):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    return value


def image_batch(recipe: TrainingRecipe, config, cset: CalibrationSet, samples: int, seed: int, device="cpu",
                dtype: torch.dtype = torch.float32, guidance: float = DEFAULT_GUIDANCE,
                timestep_sampling: str = "shift", shift: float = DEFAULT_SHIFT, heldout: float = HELDOUT_FRACTION,
                phase: float = 0.5) -> CalibrationBatch:
    """``samples`` noisy inputs of the set's images for the denoiser, as its training step makes them.

    Sample i shows image ``i % len(images)``, each at its own time and noise. The held-out samples are all the
    samples of a seeded quarter of the images (of the samples when there is one image)."""
    shapes = Counter(tuple(e["latents"].shape) for e in cset.latents)
    if len(shapes) > 1:
        raise ModelError(f"the calibration latents have {len(shapes)} different shapes "
                         f"({', '.join(map(str, shapes))}); "
                         "encode every calibration image at one resolution.")
    n = len(cset.latents)
    image_of = [i % n for i in range(samples)]
    held_images = heldout_groups(n, seed, heldout)
    held = sorted(heldout_groups(samples, seed, heldout)) if not held_images else \
        [i for i, j in enumerate(image_of) if j in held_images]
    shape = cset.latents[0]["latents"].shape
    t = calibration_times(recipe.objective, samples, seed, timestep_sampling, shift, phase,
                          image_tokens=image_tokens(shape))
    x0 = torch.stack([cset.latents[j]["latents"] for j in image_of]).float()
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    x_t, _ = noised(recipe.objective, x0, noise, t)
    extra = {name: torch.stack([cset.latents[j][name] for j in image_of])  # a training cache's loss masks are not
             for name in cset.latents[0] if name not in ("latents", "loss_mask")}  # inputs of the model
    try:
        text = stack_captions([cset.texts[j] for j in image_of])
    except ValueError as exc:
        raise ModelError(f"cannot batch the calibration captions: {exc}; encode them with one "
                         "max_sequence_length.") from None
    place = lambda v: _on(v, device, dtype)  # noqa: E731
    fields = {**extra, **text}
    kwargs = recipe.forward(config, place(x_t), place(t), {k: place(v) for k, v in fields.items()}, guidance)
    pick = torch.tensor(held, dtype=torch.long)
    held_kwargs = recipe.forward(config, place(x_t[pick]), place(t[pick]),
                                 {k: place(v[pick]) if torch.is_tensor(v) else v for k, v in fields.items()},
                                 guidance) if held else None
    files = cset.description.get("files") or cset.description.get("entries") or list(range(n))
    description = {**cset.description, "samples": samples, "heldout_samples": len(held),
                   "heldout_images": [Path(str(files[j])).name for j in sorted(held_images)],
                   "noise_schedule": recipe.objective,
                   "timestep_sampling": timestep_sampling, "shift": shift, "guidance": guidance,
                   "timesteps": [round(float(v), 4) for v in t], "latent_shape": list(x0.shape[1:]),
                   "text_tokens": int(text["prompt_embeds"].shape[1]), "seed": seed}
    return CalibrationBatch(kwargs, description, heldout=tuple(held), heldout_kwargs=held_kwargs)


# ------------------------------------------------------------------------------------------------------------ text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")


def tokenizer_folder(model_folder: str | Path) -> Path | None:
    """Where a text model's tokenizer lives: its own folder, or, for a pipeline component (``text_encoder_2/``), the
    pipeline's matching ``tokenizer_2/``; None when neither has tokenizer files."""
    folder = Path(model_folder)
    candidates = [folder]
    if folder.name.startswith("text_encoder") and (folder.parent / "model_index.json").is_file():
        candidates.append(folder.parent / folder.name.replace("text_encoder", "tokenizer", 1))
    return next((c for c in candidates if any((c / f).is_file() for f in TOKENIZER_FILES)), None)


def load_tokenizer(folder: Path):
    """The tokenizer in ``folder``, loaded offline by transformers."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # transformers raises many types for unreadable tokenizer files
        raise ModelError(f"transformers cannot load the tokenizer in {folder} ({exc}); fix or replace its tokenizer "
                         "files.") from None


def text_batch(model, tokenizer, texts: list[str], samples: int, seed: int, max_tokens: int, source: str,
               device="cpu", heldout: float = HELDOUT_FRACTION) -> CalibrationBatch:
    """``samples`` of ``texts`` (a seeded spread over all of them) tokenized by the model's own ``tokenizer``, at most
    ``max_tokens`` each, padded to the longest; the padding is masked out of the compiler's statistics."""
    from .builtin_data import spread

    if not texts:
        raise ModelError(f"{source} holds no text to calibrate on.")
    chosen = spread(texts, samples, seed)
    limit = min(max_tokens, getattr(model.config, "max_position_embeddings", None) or max_tokens)
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    enc = tokenizer(chosen, padding="longest", truncation=True, max_length=limit, return_tensors="pt")
    kwargs = {"input_ids": enc["input_ids"].to(device)}
    accepts = inspect.signature(model.forward).parameters
    if "use_cache" in accepts:
        # a decoder's key/value cache would grow each time the compiler reruns a block on the same inputs
        kwargs["use_cache"] = False
    mask = enc.get("attention_mask")
    if mask is not None and "attention_mask" in accepts:
        kwargs["attention_mask"] = mask.to(device)
    else:
        mask = None  # the model attends to padding too, so its padded rows are real inputs
    held = tuple(sorted(heldout_groups(samples, seed, heldout)))
    real = int(mask.sum()) if mask is not None else int(enc["input_ids"].numel())
    description = {"kind": "text", "source": source, "samples": samples, "tokens": real, "max_tokens": limit,
                   "heldout_samples": len(held), "seed": seed, "examples": chosen[:3]}
    pick = torch.tensor(held, dtype=torch.long)
    held_kwargs = {k: v[pick.to(v.device)] if torch.is_tensor(v) else v for k, v in kwargs.items()} if held else None
    return CalibrationBatch(kwargs, description, heldout=held, row_mask=mask, heldout_kwargs=held_kwargs,
                            heldout_row_mask=None if mask is None or not held else mask[pick])


# ------------------------------------------------------------------------------------------------ training cache

PAIRS_FILE = "pairs.json"  # written by the trainer's cache fill: [[latent key, text key], ...] per image


def _entry(path: Path, root: Path) -> dict[str, torch.Tensor]:
    """A cache entry's tensors, its hash and its kind's rules checked (models/cache_entry.py)."""
    from ..slab.digest import DigestError

    try:
        return read_entry(path)
    except DigestError as exc:
        raise ModelError(f"cache entry {path} {exc}; fill the cache again with `squareq cache SLAB --data DIR "
                         f"--cache-dir {root}` (it re-encodes what is damaged) or a training run.") from None


def read_training_cache(cache_dir: str | Path, recipe: TrainingRecipe, config, family: str) -> CalibrationSet:
    """The images and captions of a training cache (``squareq cache`` / ``squareq train``: ``latents/<key>.safetensors``
    and ``text/<key>.safetensors``), each image with its own caption as the trainer's last fill paired them
    (``pairs.json``; a cache without it pairs them in file order). Only the most common latent shape is kept (one
    bucket, so they batch)."""
    import json

    root = Path(cache_dir).expanduser()
    latent_files = sorted((root / "latents").glob("*.safetensors"))
    text_files = sorted((root / "text").glob("*.safetensors"))
    if not latent_files or not text_files:
        raise ModelError(f"{root} holds no cached latents or text embeddings; fill it first with "
                         f"`squareq cache SLAB --data DIR --cache-dir {root}` or a training run.")
    pairing = "file order"
    pairs = list(zip(latent_files, (text_files[i % len(text_files)] for i in range(len(latent_files)))))
    if (root / PAIRS_FILE).is_file():
        recorded = [(root / "latents" / f"{a}.safetensors", root / "text" / f"{b}.safetensors")
                    for a, b in json.loads((root / PAIRS_FILE).read_text())]
        recorded = [(a, b) for a, b in recorded if a.is_file() and b.is_file()]
        if recorded:
            pairs, pairing = list(dict.fromkeys(recorded)), "each image with its caption"
    latents = [_entry(a, root) for a, _ in pairs]
    # an edit pair's controls batch only with controls of their sizes: they are part of the shape
    shapes = [(tuple(e["latents"].shape), *(tuple(c.shape) for c in split_controls(e)[1])) for e in latents]
    common, _ = Counter(shapes).most_common(1)[0]
    shape = common[0]
    keep = [i for i, e in enumerate(shapes) if e == common]
    texts = [_entry(pairs[i][1], root) for i in keep]
    width = texts[0]["prompt_embeds"].shape[-1]
    if model_problem("latents", latents[keep[0]], recipe, config) or model_problem("text", texts[0], recipe, config):
        raise ModelError(f"{root} was made with other encoders than this {family} model's (latents {list(shape)}, text "
                         f"width {width}); fill a cache with this model's pipeline.")
    description = {"kind": "images", "source": f"training cache {root}", "cache": str(root), "images": len(keep),
                   "entries": [pairs[i][0].stem for i in keep], "pairing": pairing}
    return CalibrationSet([latents[i] for i in keep], texts, description)
