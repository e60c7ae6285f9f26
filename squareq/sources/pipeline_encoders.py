"""Caching through a diffusers pipeline folder of a family other than FLUX.1: the pipeline's own ``encode_prompt``
for captions and its VAE, normalized as the pipeline normalizes latents, for images.

The pipeline is loaded without its denoiser (the slab is the denoiser). Which pipeline classes a family's folder
holds and how its captions become cache entries are the family's own (its adapter's ``recipe.pipeline``,
squareq/models/<family>.py). Latent normalization is the VAE class's (several families share a VAE), following
diffusers 0.42's pipelines (docs/families.md lists them).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import inspect
from collections.abc import Iterator
from pathlib import Path

import torch

from ..models import ADAPTERS
from ..models.base import PIPELINE_ENCODER_PARTS
from ..models.recipe import EditText, PipelineFolder
from ..runtime.host.budget import anonymous_memory
from .boundary import reading
from .encoder_files import as_loaded, mapped_dtypes
from .encoder_identity import module_identity
from .encoder_placement import DEFAULT_RUN, EncoderRun, Placement, placed
from .encoder_source import EncoderError, EncoderSource, dtype_tag, pipeline_folder
from .hub import read_index
from .single_files import load_single_files
from .vl_processor import processor_stand_in

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
IMAGE_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo", "AutoencoderKLLTXVideo")
def _channel(values, like: torch.Tensor) -> torch.Tensor:
    """Per-channel statistics shaped to broadcast over a [B, C, ...] latent."""
    v = torch.as_tensor(values, dtype=torch.float32, device=like.device)
    return v.view(1, -1, *([1] * (like.ndim - 2)))


def normalize_latent(vae, z: torch.Tensor) -> torch.Tensor:
    """A VAE's raw latent [B, C, ...] normalized as the family's pipeline feeds it to the denoiser (fp32)."""
    z, cfg, name = z.float(), vae.config, type(vae).__name__
    if name == "AutoencoderKLFlux2":
        # FLUX.2 normalizes 2x2-patchified channels (c, dy, dx) with its batch-norm statistics
        b, c, h, w = z.shape
        p = z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
        mean = _channel(vae.bn.running_mean, p)
        std = torch.sqrt(_channel(vae.bn.running_var, p) + cfg.batch_norm_eps)
        p = (p - mean) / std
        return p.view(b, c, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h, w)
    if name in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):
        return (z - _channel(cfg.latents_mean, z)) / _channel(cfg.latents_std, z)
    if name == "AutoencoderKLLTXVideo":
        return (z - _channel(vae.latents_mean, z)) * cfg.scaling_factor / _channel(vae.latents_std, z)
    if name == "AutoencoderKLHunyuanVideo":
        return z * cfg.scaling_factor
    if getattr(cfg, "latents_mean", None) is not None and getattr(cfg, "latents_std", None) is not None:
        return (z - _channel(cfg.latents_mean, z)) * cfg.scaling_factor / _channel(cfg.latents_std, z)
    return (z - (getattr(cfg, "shift_factor", None) or 0.0)) * cfg.scaling_factor


class PipelineEncoders:
    """A family pipeline's VAE and text encoders, for the cache."""

    def __init__(self, pipe, family: str, device: torch.device, dtype: torch.dtype,
                 placement: Placement | None = None, source: str = "") -> None:
        self.pipeline, self.family = pipe, family
        self.recipe = ADAPTERS[family].recipe
        self.device, self.dtype = device, dtype
        vae = type(pipe.vae).__name__
        if vae not in IMAGE_VAES + VIDEO_VAES:
            raise EncoderError(f"the pipeline's VAE is a {vae}, whose latent normalization SquareQ does not know; it "
                               f"knows {', '.join(IMAGE_VAES + VIDEO_VAES)}.")
        self.video_vae = vae in VIDEO_VAES
        self.source = source
        self.placement = placement

    # Taken when the cache first asks, not on opening: a checksum over every weight (FLUX.2's 24B Mistral: minutes
    # on a CPU) that sampling, which reads no cache, never needs.
    @functools.cached_property
    def vae_identity(self) -> str:
        return module_identity(self.pipeline.vae, "vae", source=self.source) + dtype_tag(self.dtype)

    @functools.cached_property
    def text_identity(self) -> str:
        pipe = self.pipeline
        return self.family + "".join(module_identity(getattr(pipe, n), n, self.dtype, self.source)
                                     for n in TEXT_ENCODERS if getattr(pipe, n, None) is not None) \
            + dtype_tag(self.dtype)

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """[3, H, W] in [-1, 1] -> the normalized latent: [C, h, w], or [C, 1, h, w] for the video families (the
        distribution's mode, so an entry is the same every time it is computed)."""
        x = image[None].to(self.device, self.dtype)
        if self.video_vae:
            x = x[:, :, None]  # [B, 3, 1, H, W]: one frame
        z = normalize_latent(self.pipeline.vae, self.pipeline.vae.encode(x).latent_dist.mode())[0].cpu()
        if self.video_vae and not self.recipe.frames:
            z = z[:, 0]  # Qwen-Image: a video VAE, an image model
        return z

    @torch.no_grad()
    def encode_clip(self, frames: torch.Tensor) -> torch.Tensor:
        """[3, F, H, W] in [-1, 1] -> the normalized latent [C, f, h, w] through the family's video VAE (f = 1 + (F -
        1) / its temporal stride)."""
        z = self.pipeline.vae.encode(frames[None].to(self.device, self.dtype)).latent_dist.mode()
        return normalize_latent(self.pipeline.vae, z)[0].cpu()

    @property
    def control_text(self) -> EditText | None:
        """How the pipeline's text encoder reads a caption's control images (an edit pipeline's folder:
        Qwen-Image-Edit's), or None where it reads the caption alone."""
        return self.recipe.pipeline.edits.get(type(self.pipeline).__name__)

    @functools.cached_property
    def control_text_identity(self) -> list[str]:
        """What a caption's entry read with control images depends on beside the caption, the images and the text
        encoder: the pipeline class and the area the images are brought to, its prompt template and the image
        processor's settings (how many vision tokens an image becomes); a cache-key part."""
        pipe, edit = self.pipeline, self.control_text
        processor = pipe.processor.image_processor
        rules = f"{pipe.prompt_template_encode}|{pipe.prompt_template_encode_start_idx}|" \
                f"{type(processor).__name__}|{processor.to_json_string()}"
        return [type(pipe).__name__, str(edit.area), hashlib.sha256(rules.encode()).hexdigest()]

    @torch.no_grad()
    def encode_prompts(self, texts: list[str], max_sequence_length: int,
                       images: list[list] | None = None) -> list[dict[str, torch.Tensor]]:
        """One cache entry per caption through the pipeline's ``encode_prompt``; with ``images`` (each caption's
        control images, PIL), through the edit pipeline's, which reads them beside the caption
        (:attr:`control_text`). A caption without them in an edit pipeline's folder is read by the family's
        text-to-image pipeline on the same components (:func:`plain_pipeline`), as sampling draws it."""
        if images is not None:
            return [self.control_text.encode(self.pipeline, text, list(shown), self.device)
                    for text, shown in zip(texts, images, strict=True)]
        pipe = plain_pipeline(self.pipeline, self.recipe.pipeline)
        return self.recipe.pipeline.encode(pipe, list(texts), max_sequence_length, self.device)


def plain_pipeline(pipe, folder: PipelineFolder):
    """``pipe``, or for an edit pipeline (``folder.edits``) the family's text-to-image pipeline (its first class) on
    the same components, which draws and encodes a prompt without control images (Qwen-Image-Edit's folder: a
    ``QwenImagePipeline`` of its VAE, Qwen2.5-VL, tokenizer and transformer)."""
    if type(pipe).__name__ not in folder.edits:
        return pipe
    import diffusers

    plain = getattr(diffusers, folder.classes[0])
    takes = inspect.signature(plain.__init__).parameters
    return plain(**{name: part for name, part in pipe.components.items() if name in takes})


def pipeline_class(source: EncoderSource | str | Path) -> str | None:
    """The pipeline class ``source``'s folder holds (its model_index.json's ``_class_name``); None for a built-in
    model, whose encoders are built in."""
    folder = pipeline_folder(source)
    return None if folder is None else read_index(folder).get("_class_name")


@contextlib.contextmanager
def open_family_pipeline(source: EncoderSource | str | Path, family: str, device: torch.device,
                         dtype: torch.dtype, run: EncoderRun = DEFAULT_RUN) -> Iterator[PipelineEncoders]:
    """The VAE and text encoders of the ``family`` pipeline of ``source`` (a folder or Hub ID, and single files), on
    ``device``: whole, or the text encoders that do not fit ``run``'s budget streamed (sources/encoder_placement.py)."""
    from diffusers import DiffusionPipeline

    folder = pipeline_folder(source)
    if folder is None:
        raise EncoderError(f"{source} is a built-in model of another family than {family}; pass the {family} "
                           "pipeline folder with --model.")
    recipe = ADAPTERS[family].recipe
    if recipe.pipeline is None:
        raise EncoderError(f"{folder}: training {family} from a pipeline folder needs {recipe.no_pipeline}, which the "
                           "folder does not hold; train the built-in tiny model, or fill the cache yourself.")
    classes = recipe.pipeline.classes
    index = read_index(folder)
    found = index.get("_class_name", "pipeline without a _class_name")
    if found not in classes:
        raise EncoderError(f"{folder} holds a {found}, not a {' or '.join(classes)}; pass the {family} pipeline "
                           "folder with --model.")
    # only the VAE and the text encoders: the denoiser is the slab, and a second expert (Wan 2.2's transformer_2),
    # a safety checker or an image encoder would only take memory
    unused = {name: None for name in index if not name.startswith(("_",) + PIPELINE_ENCODER_PARTS)}
    source = EncoderSource.of(source)
    # text encoders in their files' own dtype load as views of the files (sources/encoder_files.py)
    mapped = mapped_dtypes(source, folder, index, TEXT_ENCODERS)
    before = anonymous_memory()
    given = load_single_files(source, folder, index, dtype, dtypes=mapped) | processor_stand_in(folder, index)
    with reading(f"the VAE and text encoders of {source} from {folder}", f"pass a complete {found} folder with "
                 "--model", EncoderError):
        pipe = DiffusionPipeline.from_pretrained(str(folder), **unused, **given,
                                                 torch_dtype={"default": dtype, **mapped}, local_files_only=True,
                                                 use_safetensors=True)  # never a pickle
    mapped = as_loaded(mapped, before, pipe, ("vae", *TEXT_ENCODERS), dtype)
    try:
        with placed(pipe, ("vae", *TEXT_ENCODERS), device, dtype, run, mapped) as placement:
            yield PipelineEncoders(pipe, family, device, dtype, placement, str(source))
    finally:
        for name in ("vae", *TEXT_ENCODERS):
            setattr(pipe, name, None)
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
