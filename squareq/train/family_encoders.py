"""Caching through a diffusers pipeline folder of a family other than FLUX.1: the pipeline's own ``encode_prompt``
for captions and its VAE, normalized as the pipeline normalizes latents, for images.

The pipeline is loaded without its denoiser (the slab is the denoiser). What each family's pipeline returns and how
its latents are normalized follows diffusers 0.42's pipelines (docs/families.md lists them); a caption entry holds
``prompt_embeds`` ``[L, D]`` and, where the family uses them, ``pooled_prompt_embeds`` ``[P]`` and ``prompt_mask``
``[L]`` (squareq/models/recipe.py). Masked families store only the caption's real tokens where their pipeline
trims padding itself (Qwen-Image, Z-Image).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..models import ADAPTERS
from .cache import module_identity
from .encoder_source import EncoderError, dtype_tag, pipeline_folder

# family -> the pipeline classes its folders may hold
PIPELINES: dict[str, tuple[str, ...]] = {
    "flux2": ("Flux2Pipeline",),
    "chroma": ("ChromaPipeline",),
    "sd3": ("StableDiffusion3Pipeline",),
    "qwen-image": ("QwenImagePipeline",),
    "z-image": ("ZImagePipeline",),
    "wan": ("WanPipeline",),
    "hunyuan-video": ("HunyuanVideoPipeline",),
    "ltx-video": ("LTXPipeline",),
    "sd-unet": ("StableDiffusionXLPipeline", "StableDiffusionPipeline"),
}
# families whose latents a pipeline folder cannot produce, and what is missing
NO_FOLDER = {"wuerstchen-prior": "Würstchen's EfficientNet image encoder (the prior's latents are its embeddings)",
             "wuerstchen-decoder": "Würstchen's EfficientNet image encoder (the decoder is conditioned on its "
                                   "embeddings)"}
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
IMAGE_VAES = ("AutoencoderKL", "AutoencoderKLFlux2")
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo", "AutoencoderKLLTXVideo")
# The DDPM schedule SquareQ trains the UNets with (squareq/train/objective.py); a scheduler config that differs is
# refused rather than trained against the wrong noise levels.
DDPM_DEFAULTS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                 "beta_schedule": "scaled_linear", "rescale_betas_zero_snr": False}


def _entries(embeds: torch.Tensor, pooled: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             trim: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per-caption cache entries from batched pipeline outputs (fp32 on the CPU). ``trim``: keep only the tokens
    the mask marks (the pipeline pads to the batch's longest caption, so padding would depend on the neighbours)."""
    out = []
    for i, seq in enumerate(embeds):
        entry = {"prompt_embeds": seq.float().cpu()}
        if mask is not None:
            m = mask[i].float().cpu()
            if trim:
                entry["prompt_embeds"] = entry["prompt_embeds"][m.bool()]
                m = m[m.bool()]
            entry["prompt_mask"] = m
        if pooled is not None:
            entry["pooled_prompt_embeds"] = pooled[i].float().cpu()
        out.append(entry)
    return out


def _ones_mask(embeds: torch.Tensor) -> torch.Tensor:
    return torch.ones(embeds.shape[:2], device=embeds.device)


def _encode_sd_unet(pipe, texts, length, device):
    if type(pipe).__name__ == "StableDiffusionXLPipeline":
        embeds, _, pooled, _ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False)
        return _entries(embeds, pooled)
    embeds, _ = pipe.encode_prompt(texts, device, 1, False)
    return _entries(embeds)


def _encode_sd3(pipe, texts, length, device):
    embeds, _, pooled, _ = pipe.encode_prompt(texts, None, None, device=device, do_classifier_free_guidance=False,
                                              max_sequence_length=length)
    return _entries(embeds, pooled)


def _encode_qwen_image(pipe, texts, length, device):
    embeds, mask = pipe.encode_prompt(texts, device=device, max_sequence_length=length)
    return _entries(embeds, mask=_ones_mask(embeds) if mask is None else mask, trim=True)


def _encode_z_image(pipe, texts, length, device):
    embeds, _ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False,
                                   max_sequence_length=length)
    return [{"prompt_embeds": e.float().cpu(), "prompt_mask": torch.ones(e.shape[0])} for e in embeds]


def _encode_chroma(pipe, texts, length, device):
    embeds, _, mask, *_ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False,
                                             max_sequence_length=length)
    return _entries(embeds, mask=mask)


def _encode_ltx(pipe, texts, length, device):
    embeds, mask, *_ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=length,
                                          device=device)
    return _entries(embeds, mask=mask)


def _encode_hunyuan(pipe, texts, length, device):
    embeds, pooled, mask = pipe.encode_prompt(texts, prompt_2=None, device=device, max_sequence_length=length)
    return _entries(embeds, pooled, mask)


# family -> encode(pipeline, captions, max_sequence_length, device) -> one cache entry per caption
ENCODE: dict[str, Callable] = {
    "flux2": lambda pipe, texts, length, device: _entries(
        pipe.encode_prompt(texts, device=device, max_sequence_length=length)[0]),
    "chroma": _encode_chroma,
    "sd3": _encode_sd3,
    "qwen-image": _encode_qwen_image,
    "z-image": _encode_z_image,
    "wan": lambda pipe, texts, length, device: _entries(
        pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=length, device=device)[0]),
    "hunyuan-video": _encode_hunyuan,
    "ltx-video": _encode_ltx,
    "sd-unet": _encode_sd_unet,
}


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

    def __init__(self, pipe, family: str, device: torch.device, dtype: torch.dtype) -> None:
        self.pipeline, self.family = pipe, family
        self.recipe = ADAPTERS[family].recipe
        self.device, self.dtype = device, dtype
        vae = type(pipe.vae).__name__
        if vae not in IMAGE_VAES + VIDEO_VAES:
            raise EncoderError(f"the pipeline's VAE is a {vae}, whose latent normalization SquareQ does not know; it "
                               f"knows {', '.join(IMAGE_VAES + VIDEO_VAES)}.")
        self.video_vae = vae in VIDEO_VAES
        where = dtype_tag(dtype)
        self.vae_identity = module_identity(pipe.vae, "vae") + where
        self.text_identity = family + "".join(module_identity(getattr(pipe, n), n) for n in TEXT_ENCODERS
                                              if getattr(pipe, n, None) is not None) + where
        self.streamed_text_encoder = False

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
    def encode_prompts(self, texts: list[str], max_sequence_length: int) -> list[dict[str, torch.Tensor]]:
        """One cache entry per caption through the pipeline's ``encode_prompt``."""
        return ENCODE[self.family](self.pipeline, list(texts), max_sequence_length, self.device)


def training_objective(source: str | Path, family: str) -> str:
    """The objective a ``family`` model from ``source`` trains with: the family's, except that a UNet pipeline's
    scheduler decides between epsilon and v-prediction (SD 2.x 768-v predicts v)."""
    import json

    default = ADAPTERS[family].recipe.objective
    if default not in ("epsilon", "v_prediction"):  # flow matching, Würstchen: the family decides alone
        return default
    try:
        folder = pipeline_folder(source)
    except EncoderError:
        return default
    config = folder / "scheduler" / "scheduler_config.json" if folder is not None else None
    if config is None or not config.is_file():
        return default
    settings = json.loads(config.read_text())
    kind = settings.get("prediction_type", default)
    if kind not in ("epsilon", "v_prediction"):
        raise EncoderError(f"{config} sets prediction_type = {kind!r}; SquareQ trains epsilon or v_prediction, so "
                           "pass a pipeline folder whose scheduler predicts one of them with --model.")
    other = {k: settings[k] for k, v in DDPM_DEFAULTS.items() if k in settings and settings[k] != v}
    if other:
        raise EncoderError(f"{config} sets {other}; SquareQ trains SD's noise schedule {DDPM_DEFAULTS} only, so pass a "
                           "pipeline folder with that schedule with --model.")
    return kind


@contextlib.contextmanager
def open_family_pipeline(source: str | Path, family: str, device: torch.device,
                         dtype: torch.dtype) -> Iterator[PipelineEncoders]:
    """The VAE and text encoders of the ``family`` pipeline folder holding ``source``, on ``device``."""
    import json

    from diffusers import DiffusionPipeline

    folder = pipeline_folder(source)
    if folder is None:
        raise EncoderError(f"{source} is a built-in model of another family than {family}; pass the {family} "
                           "pipeline folder with --model.")
    if family not in PIPELINES:
        raise EncoderError(f"{folder}: training {family} from a pipeline folder needs {NO_FOLDER[family]}, which the "
                           "folder does not hold; train the built-in tiny model, or fill the cache yourself.")
    classes = PIPELINES[family]
    index = json.loads((folder / "model_index.json").read_text())
    found = index.get("_class_name", "pipeline without a _class_name")
    if found not in classes:
        raise EncoderError(f"{folder} holds a {found}, not a {' or '.join(classes)}; pass the {family} pipeline "
                           "folder with --model.")
    # only the VAE and the text encoders: the denoiser is the slab, and a second expert (Wan 2.2's transformer_2),
    # a safety checker or an image encoder would only take memory
    kept = ("_", "vae", "scheduler", "text_encoder", "tokenizer")
    unused = {name: None for name in index if not name.startswith(kept)}
    try:
        pipe = DiffusionPipeline.from_pretrained(str(folder), **unused, torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise EncoderError(f"cannot load the VAE and text encoders from {folder} ({exc}); pass a complete {found} "
                           "folder with --model.") from None
    pipe.to(device)
    try:
        yield PipelineEncoders(pipe, family, device, dtype)
    finally:
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
