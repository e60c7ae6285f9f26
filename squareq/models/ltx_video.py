"""LTX-Video (diffusers ``LTXVideoTransformer3DModel``): DiT blocks with cross-attention to T5 text over packed
video tokens."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, ModelError, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries

TINY_LTX_VIDEO_CONFIG = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16,
                             cross_attention_dim=32, num_layers=2, caption_channels=16)


def build_tiny_ltx_video(seed: int = 0):
    """``tiny-ltx-video``: the LTX-Video architecture at toy size, seeded."""
    return build_seeded("LTXVideoTransformer3DModel", TINY_LTX_VIDEO_CONFIG, seed)


def ltx_video_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                               frames: int | None = None, side: int | None = None,
                               text_tokens: int | None = None) -> CalibrationBatch:
    """Packed noise video latents (frames x side² tokens of in_channels) and Gaussian text embeddings with a
    full mask, at timesteps spread over [0, 1000]."""
    cfg = model.config
    big = cfg.caption_channels >= 1024
    frames, side = frames or (9 if big else 2), side or (16 if big else 4)  # 121 frames at 512², 8x/32x VAE
    text_tokens = text_tokens or (128 if big else 8)
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    tokens = frames * side * side
    kwargs = dict(hidden_states=torch.randn(samples, tokens, cfg.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.caption_channels, generator=g),
                  timestep=1000 * t)
    kwargs = {k: v.to(device=device, dtype=dtype) for k, v in kwargs.items()}
    kwargs.update(encoder_attention_mask=torch.ones(samples, text_tokens, device=device), num_frames=frames,
                  height=side, width=side)
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": "noise video latents and Gaussian text embeddings",
                                     "samples": samples, "image_tokens": tokens, "text_tokens": text_tokens,
                                     "frames": frames, "timesteps": [round(float(v), 4) for v in t], "seed": seed})


def ltx_video_sequence_shape(config: dict, resolution: int, text_tokens: int,
                             frames: int | None = None) -> tuple[int, int]:
    """Video tokens of ``frames`` pixel frames (default 121: 16 latent frames, the VAE's 8x in time) at
    ``resolution``² with the 32x VAE; text is cross-attended."""
    side = resolution // 32
    latent = 16 if frames is None else 1 + (frames - 1) // 8
    return latent * side * side, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


# The pipeline's rope scale for its 8x temporal / 32x spatial VAE at its default 25 frames per second.
LTX_ROPE_SCALE = (8 / 25, 32, 32)


def ltx_video_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Video latents [B, C, F, h, w] as tokens in (frame, row, column) order (patch size 1), T5 text with its mask,
    timestep t·1000."""
    if cfg.patch_size != 1 or cfg.patch_size_t != 1:
        raise ModelError(f"LTX-Video with patch size {cfg.patch_size}x{cfg.patch_size_t} packs latents in a way "
                         "SquareQ's recipe does not; the released models use 1x1.")
    frames, h, w = x_t.shape[-3:]
    return dict(hidden_states=x_t.flatten(2).transpose(1, 2), encoder_hidden_states=text["prompt_embeds"],
                timestep=1000 * t, encoder_attention_mask=text["prompt_mask"], num_frames=frames, height=h, width=w,
                rope_interpolation_scale=LTX_ROPE_SCALE)


def ltx_video_prediction(output, x_t: torch.Tensor) -> torch.Tensor:
    """Tokens [B, F·h·w, C] back to [B, C, F, h, w]."""
    return output[0].transpose(1, 2).reshape(x_t.shape)


def ltx_video_captions(pipe, texts, length, device):
    """T5's states with their attention mask, through ``LTXPipeline.encode_prompt``."""
    embeds, mask, *_ = pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=length,
                                          device=device)
    return caption_entries(embeds, mask=mask)


LTX_VIDEO = FamilyAdapter(family="ltx-video", class_name="LTXVideoTransformer3DModel",
                          block_lists=("transformer_blocks",), calibration_inputs=ltx_video_synthetic_inputs,
                          sequence_shape=ltx_video_sequence_shape,
                          recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels,
                                                text_fields=lambda cfg: TextFields(cfg.caption_channels, mask=True),
                                                forward=ltx_video_forward, prediction=ltx_video_prediction,
                                                latent_multiple=lambda cfg: 1,  # patch size 1, as forward checks
                                                frames=True, pipeline=PipelineFolder(("LTXPipeline",),
                                                                                     ltx_video_captions)),
                          pipeline_samples=True)
