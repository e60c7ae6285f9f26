"""Wan 2.x video (diffusers ``WanTransformer3DModel``): DiT blocks with cross-attention to UMT5 text, over frames."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, first_output

TINY_WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                       out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32)


def build_tiny_wan(seed: int = 0):
    """``tiny-wan``: the Wan 2.x architecture at toy size, seeded."""
    return build_seeded("WanTransformer3DModel", TINY_WAN_CONFIG, seed)


def wan_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                         frames: int | None = None, side: int | None = None, text_tokens: int | None = None,
                         height: int | None = None, width: int | None = None) -> CalibrationBatch:
    """Noise video latents [B, C, frames, height, width] (``side`` for both sides not given) and Gaussian text
    embeddings, at timesteps spread over [0, 1000]."""
    cfg = model.config
    big = cfg.text_dim >= 1024
    frames, side = frames or (21 if big else 3), side or (60 if big else 8)  # 81 frames at 480p, 4x/8x VAE
    height, width = height or side, width or side
    text_tokens = text_tokens or (512 if big else 8)
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    kwargs = dict(hidden_states=torch.randn(samples, cfg.in_channels, frames, height, width, generator=g),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.text_dim, generator=g),
                  timestep=1000 * t)
    kwargs = {k: v.to(device=device, dtype=dtype) for k, v in kwargs.items()}
    p = cfg.patch_size
    tokens = (frames // p[0]) * (height // p[1]) * (width // p[2])
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": "noise video latents and Gaussian text embeddings",
                                     "samples": samples, "image_tokens": tokens, "text_tokens": text_tokens,
                                     "frames": frames, "timesteps": [round(float(v), 4) for v in t], "seed": seed})


def wan_sequence_shape(config: dict, resolution: int, text_tokens: int, frames: int | None = None) -> tuple[int, int]:
    """Video tokens for ``frames`` pixel frames (default 81: 21 latent frames, the VAE's 4x in time) at
    ``resolution``² over 2x2 patches of the 8x VAE's latents (Wan 2.2's 48-channel 16x VAE: 4x4 pixels fewer); text
    is cross-attended, so the block stream carries only the video tokens."""
    side = resolution // (32 if int(config.get("in_channels", 16)) == 48 else 16)
    latent = 21 if frames is None else 1 + (frames - 1) // 4
    return latent * side * side, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def wan_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Video latents [B, C, F, h, w] as they are, UMT5 text (zero past its length, as the pipeline pads it, so no
    mask), timestep t·1000."""
    return dict(hidden_states=x_t, encoder_hidden_states=text["prompt_embeds"], timestep=1000 * t)


def wan_captions(pipe, texts, length, device):
    """UMT5's states, through ``WanPipeline.encode_prompt``."""
    return caption_entries(pipe.encode_prompt(texts, do_classifier_free_guidance=False, max_sequence_length=length,
                                              device=device)[0])


WAN = FamilyAdapter(family="wan", class_name="WanTransformer3DModel", block_lists=("blocks",),
                    calibration_inputs=wan_synthetic_inputs, sequence_shape=wan_sequence_shape,
                    recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels,
                                          text_fields=lambda cfg: TextFields(cfg.text_dim), forward=wan_forward,
                                          prediction=first_output, frames=True,
                                          latent_multiple=lambda cfg: max(cfg.patch_size[1:]),
                                          pipeline=PipelineFolder(("WanPipeline",), wan_captions)),
                    pipeline_samples=True)
