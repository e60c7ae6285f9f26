"""Stable Diffusion 3 / 3.5 (diffusers ``SD3Transformer2DModel``): MM-DiT joint blocks over patchified latents."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, first_output

TINY_SD3_CONFIG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                       pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)


def build_tiny_sd3(seed: int = 0):
    """``tiny-sd3``: the SD3 architecture at toy size, seeded."""
    return build_seeded("SD3Transformer2DModel", TINY_SD3_CONFIG, seed)


def sd3_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                         side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """Noise latents and Gaussian text embeddings (CLIP + T5 widths of the config) at timesteps spread over
    the schedule (SD3 takes timesteps in [0, 1000])."""
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024
    side = side or (64 if big else cfg.sample_size)  # latent pixels: 512² images at 8x
    text_tokens = text_tokens or (333 if big else 8)  # 77 CLIP + 256 T5 tokens, as SD3's pipeline
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    kwargs = dict(hidden_states=torch.randn(samples, cfg.in_channels, side, side, generator=g),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(samples, cfg.pooled_projection_dim, generator=g),
                  timestep=1000 * t)
    kwargs = {k: v.to(device=device, dtype=dtype) for k, v in kwargs.items()}
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": "noise latents and Gaussian text embeddings",
                                     "samples": samples, "image_tokens": (side // cfg.patch_size) ** 2,
                                     "text_tokens": text_tokens, "timesteps": [round(float(v), 4) for v in t],
                                     "seed": seed})


def sd3_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """(resolution / 8 / patch)² image tokens plus the text tokens, at heads x head_dim."""
    side = resolution // (8 * int(config.get("patch_size", 2)))
    return side * side + text_tokens, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def sd3_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Latents as they are (the model patchifies), CLIP+T5 sequence and pooled CLIP text, timestep t·1000."""
    return dict(hidden_states=x_t, encoder_hidden_states=text["prompt_embeds"],
                pooled_projections=text["pooled_prompt_embeds"], timestep=1000 * t)


def sd3_captions(pipe, texts, length, device):
    """The joint CLIP + T5 states and the pooled CLIP vectors, through ``StableDiffusion3Pipeline.encode_prompt``."""
    embeds, _, pooled, _ = pipe.encode_prompt(texts, None, None, device=device, do_classifier_free_guidance=False,
                                              max_sequence_length=length)
    return caption_entries(embeds, pooled)


SD3 = FamilyAdapter(family="sd3", class_name="SD3Transformer2DModel", block_lists=("transformer_blocks",),
                    calibration_inputs=sd3_synthetic_inputs, sequence_shape=sd3_sequence_shape,
                    recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels,
                                          text_fields=lambda cfg: TextFields(cfg.joint_attention_dim,
                                                                             cfg.pooled_projection_dim),
                                          forward=sd3_forward, prediction=first_output,
                                          latent_multiple=lambda cfg: cfg.patch_size,
                                          pipeline=PipelineFolder(("StableDiffusion3Pipeline",), sd3_captions)),
                    pipeline_samples=True)
