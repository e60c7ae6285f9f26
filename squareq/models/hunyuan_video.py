"""HunyuanVideo (diffusers ``HunyuanVideoTransformer3DModel``): double- and single-stream blocks over video
tokens, a token refiner on the LLaMA text features, CLIP pooled guidance."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, first_output

TINY_HUNYUAN_VIDEO_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                 num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2,
                                 patch_size_t=1, text_embed_dim=32, pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))


def build_tiny_hunyuan_video(seed: int = 0):
    """``tiny-hunyuan-video``: the HunyuanVideo architecture at toy size, seeded."""
    return build_seeded("HunyuanVideoTransformer3DModel", TINY_HUNYUAN_VIDEO_CONFIG, seed)


def hunyuan_video_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                                   frames: int | None = None, side: int | None = None,
                                   text_tokens: int | None = None) -> CalibrationBatch:
    """Noise video latents [B, C, frames, side, side], Gaussian text features with a full mask and pooled CLIP
    features, at timesteps spread over [0, 1000], guidance 6."""
    cfg = model.config
    big = cfg.text_embed_dim >= 1024
    frames, side = frames or (9 if big else 3), side or (40 if big else 8)
    text_tokens = text_tokens or (256 if big else 8)
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    kwargs = dict(hidden_states=torch.randn(samples, cfg.in_channels, frames, side, side, generator=g),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.text_embed_dim, generator=g),
                  pooled_projections=torch.randn(samples, cfg.pooled_projection_dim, generator=g),
                  timestep=1000 * t)
    kwargs = {k: v.to(device=device, dtype=dtype) for k, v in kwargs.items()}
    kwargs["encoder_attention_mask"] = torch.ones(samples, text_tokens, device=device)
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((samples,), 6000.0, device=device, dtype=dtype)  # 6.0 x 1000, as the pipeline
    tokens = frames * (side // cfg.patch_size) ** 2
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": "noise video latents and Gaussian text features",
                                     "samples": samples, "image_tokens": tokens, "text_tokens": text_tokens,
                                     "frames": frames, "timesteps": [round(float(v), 4) for v in t], "seed": seed})


def hunyuan_video_sequence_shape(config: dict, resolution: int, text_tokens: int,
                                 frames: int | None = None) -> tuple[int, int]:
    """Video tokens of ``frames`` pixel frames (default 33: 9 latent frames, the VAE's 4x in time) at ``resolution``²
    over 2x2 patches, plus the text tokens."""
    side = resolution // 16
    latent = 9 if frames is None else 1 + (frames - 1) // 4
    return latent * side * side + text_tokens, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def hunyuan_video_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Video latents as they are, LLaMA text with its mask plus pooled CLIP, timestep t·1000 and guidance x 1000
    (the pipeline scales both; the model does not)."""
    kwargs = dict(hidden_states=x_t, timestep=1000 * t, encoder_hidden_states=text["prompt_embeds"],
                  encoder_attention_mask=text["prompt_mask"].to(x_t.dtype),
                  pooled_projections=text["pooled_prompt_embeds"])
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full_like(t, 1000 * guidance)
    return kwargs


def hunyuan_video_captions(pipe, texts, length, device):
    """Llama's states with their mask and CLIP's pooled vector, through ``HunyuanVideoPipeline.encode_prompt``."""
    embeds, pooled, mask = pipe.encode_prompt(texts, prompt_2=None, device=device, max_sequence_length=length)
    return caption_entries(embeds, pooled, mask)


HUNYUAN_VIDEO = FamilyAdapter(family="hunyuan-video", class_name="HunyuanVideoTransformer3DModel",
                              block_lists=("transformer_blocks", "single_transformer_blocks"),
                              calibration_inputs=hunyuan_video_synthetic_inputs,
                              sequence_shape=hunyuan_video_sequence_shape,
                              recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels,
                                                    text_fields=lambda cfg: TextFields(cfg.text_embed_dim,
                                                                                       cfg.pooled_projection_dim,
                                                                                       mask=True),
                                                    forward=hunyuan_video_forward, prediction=first_output,
                                                    latent_multiple=lambda cfg: cfg.patch_size,
                                                    frames=True, pipeline=PipelineFolder(("HunyuanVideoPipeline",),
                                                                                         hunyuan_video_captions)),
                              pipeline_samples=True)
