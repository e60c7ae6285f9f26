"""Real diffusers pipeline folders around the built-in tiny denoisers (seeded, offline), for the trainer's
pipeline-folder path: each family's own pipeline class, text encoders and tokenizers, VAE and scheduler."""
from pathlib import Path

import torch

from squareq.models import load_builtin
from squareq.models.tiny_pipeline import (
    build_tiny_tokenizers,
    build_tiny_vae,
    tiny_clip_config,
    tiny_t5_config,
)


def _clip(tokenizer, width: int, projection: bool = False):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(CLIPTextConfig(**{**tiny_clip_config(len(tokenizer), width), "num_attention_heads": 2})).eval()


def _t5(tokenizer, width: int, umt5: bool = False):
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    if umt5:
        return UMT5EncoderModel(UMT5Config(**tiny_t5_config(len(tokenizer), width))).eval()
    return T5EncoderModel(T5Config(**tiny_t5_config(len(tokenizer), width))).eval()


def _wan_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0]).eval()


def build_pipeline(name: str, prediction_type: str = "epsilon"):
    """The diffusers pipeline of built-in model ``name`` (tiny-sd15, tiny-sdxl, tiny-sd3, tiny-chroma, tiny-wan)."""
    import diffusers

    torch.manual_seed(11)
    denoiser, _ = load_builtin(name)
    clip_tok, t5_tok = build_tiny_tokenizers()
    flow = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ddpm = diffusers.DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                   prediction_type=prediction_type)
    if name == "tiny-sd15":
        return diffusers.StableDiffusionPipeline(vae=build_tiny_vae(), text_encoder=_clip(clip_tok, 32),
                                                 tokenizer=clip_tok, unet=denoiser, scheduler=ddpm, safety_checker=None,
                                                 feature_extractor=None, requires_safety_checker=False)
    if name == "tiny-sdxl":
        return diffusers.StableDiffusionXLPipeline(vae=build_tiny_vae(), text_encoder=_clip(clip_tok, 16),
                                                   text_encoder_2=_clip(clip_tok, 16, projection=True),
                                                   tokenizer=clip_tok, tokenizer_2=clip_tok, unet=denoiser,
                                                   scheduler=ddpm)
    if name == "tiny-sd3":
        return diffusers.StableDiffusion3Pipeline(transformer=denoiser, scheduler=flow, vae=build_tiny_vae(),
                                                  text_encoder=_clip(clip_tok, 8, projection=True), tokenizer=clip_tok,
                                                  text_encoder_2=_clip(clip_tok, 8, projection=True),
                                                  tokenizer_2=clip_tok, text_encoder_3=_t5(t5_tok, 32),
                                                  tokenizer_3=t5_tok)
    if name == "tiny-chroma":
        return diffusers.ChromaPipeline(scheduler=flow, vae=build_tiny_vae(), text_encoder=_t5(t5_tok, 32),
                                        tokenizer=t5_tok, transformer=denoiser)
    if name == "tiny-wan":
        return diffusers.WanPipeline(tokenizer=t5_tok, text_encoder=_t5(t5_tok, 32, umt5=True), transformer=denoiser,
                                     vae=_wan_vae(), scheduler=flow)
    raise KeyError(name)


def write_pipeline(name: str, folder: Path, prediction_type: str = "epsilon") -> Path:
    """``build_pipeline(name)`` saved as a diffusers folder (safetensors)."""
    build_pipeline(name, prediction_type).save_pretrained(folder, safe_serialization=True)
    return folder
