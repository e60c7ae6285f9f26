"""LTX-Video (diffusers ``LTXVideoTransformer3DModel``): DiT blocks with cross-attention to T5 text over packed
video tokens."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded

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


def ltx_video_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """Video tokens of 121 frames (16 latent frames) at ``resolution``² with the 32x VAE; text is cross-attended."""
    side = resolution // 32
    return 16 * side * side, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


LTX_VIDEO = FamilyAdapter(family="ltx-video", class_name="LTXVideoTransformer3DModel",
                          block_lists=("transformer_blocks",), calibration_inputs=ltx_video_synthetic_inputs,
                          sequence_shape=ltx_video_sequence_shape)
