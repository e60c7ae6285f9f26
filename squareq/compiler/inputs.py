"""What `squareq compile` calibrates on: real data, chosen in this order.

1. ``calib_synthetic``: the family's synthetic inputs (noise latents, Gaussian text), only when asked for by name:
   fine for speed runs, never for the compiler's choices.
2. ``calib_images``: images and captions already encoded by the family's own VAE and text encoders (the CLI encodes
   ``--calib-data DIR`` or the built-in photographs with ``squareq.compiler.calibration_images``), noised as the family
   trains.
3. ``calib_cache``: a training cache's latents and captions (``squareq cache`` / ``squareq train``), noised the same
   way.
4. A text model (one with a vocabulary): ``calib_text`` (one sample per line) or the built-in English sentences,
   through the model's own tokenizer.

A diffusion model given none of 1–3 is refused: the compiler itself cannot run a VAE or text encoder, and noise is
not calibration data.
"""
from __future__ import annotations

from pathlib import Path

from ..models import ModelError
from ..models.base import CalibrationBatch
from ..models.builtin_data import builtin_sentences, read_text_samples, text_source_name
from ..models.calibration_set import image_batch, load_tokenizer, read_training_cache, text_batch, tokenizer_folder

# Defaults chosen by measurement (docs/compiler.md, "How much data"): samples per batch and tokens per text sample.
DEFAULT_IMAGE_SAMPLES = 32
DEFAULT_TEXT_SAMPLES = 512
DEFAULT_TEXT_TOKENS = 128


def is_text_model(model) -> bool:
    """A model that reads token ids (it has a vocabulary): calibrated on text."""
    return bool(getattr(getattr(model, "config", None), "vocab_size", None))


def calibration_batch(source, skeleton, opts, phase: float = 0.5) -> CalibrationBatch:
    """The compiler's calibration batch for ``source`` under ``opts`` (a ``CompileOptions``), by the order above.
    ``phase`` places the images' noise levels in their quantile cells ((i + phase)/n: ``squareq accept`` draws fresh
    ones at another phase)."""
    family = source.family_adapter
    recipe = family.recipe if family is not None else None
    seed, device = opts.seed, opts.device
    if opts.calib_synthetic:
        batch = source.adapter.calibration_inputs(skeleton, opts.calib_samples or 4, seed, device=device)
        batch.description["why"] = "--calib-synthetic: " + batch.description.get("why", "synthetic inputs")
        return batch
    if opts.calib_images is not None or opts.calib_cache:
        if recipe is None:
            raise ModelError(f"{source.description} is a {type(skeleton).__name__}, which SquareQ does not know how to "
                             "noise images for; calibrate it on text (--calib-text FILE, or nothing for the built-in "
                             "text) instead.")
        images = opts.calib_images
        if images is None:
            images = read_training_cache(opts.calib_cache, recipe, skeleton.config, family.family)
        return image_batch(recipe, skeleton.config, images, opts.calib_samples or DEFAULT_IMAGE_SAMPLES, seed, device,
                           phase=phase)
    if is_text_model(skeleton):
        return _text(source, skeleton, opts)
    if opts.calib_text:
        raise ModelError(f"--calib-text is for text models, and {source.description} is a {type(skeleton).__name__}; "
                         "calibrate it on images with --calib-data DIR.")
    raise ModelError(f"{source.description} needs real calibration images, encoded by its family's VAE and text "
                     "encoders: pass a CalibrationSet (squareq.compiler.calibration_images.calibration_images) or a "
                     "training cache (--calib-cache DIR); `squareq compile` does this itself.")


def _text(source, skeleton, opts) -> CalibrationBatch:
    folder = tokenizer_folder(source.folder) if source.folder is not None else None
    if folder is None:
        where = source.folder or source.description
        raise ModelError(f"{where} has no tokenizer files (tokenizer.json, vocab.txt, spiece.model, ...), so SquareQ "
                         "cannot turn calibration text into token ids for it; copy the model's tokenizer files next "
                         "to its config.json.")
    if opts.calib_text:
        path = Path(opts.calib_text).expanduser()
        texts, name = read_text_samples(path), f"--calib-text {path}"
    else:
        texts, name = builtin_sentences(), text_source_name()
    batch = text_batch(skeleton, load_tokenizer(folder), texts, opts.calib_samples or DEFAULT_TEXT_SAMPLES, opts.seed,
                       opts.calib_tokens or DEFAULT_TEXT_TOKENS, name, device=opts.device)
    if opts.calib_text:
        batch.description["text_file"] = str(Path(opts.calib_text).expanduser().resolve())
    return batch
