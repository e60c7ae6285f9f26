"""Qwen-Image (diffusers ``QwenImageTransformer2DModel``): MM-DiT blocks over 2x2-packed latents, Qwen2.5-VL text."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs

TINY_QWEN_IMAGE_CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def build_tiny_qwen_image(seed: int = 0):
    """``tiny-qwen-image``: the Qwen-Image architecture at toy size, seeded."""
    return build_seeded("QwenImageTransformer2DModel", TINY_QWEN_IMAGE_CONFIG, seed)


def qwen_image_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                                side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """Packed noise latents ((side/2)² tokens of in_channels) and Gaussian text embeddings with a full mask, at
    timesteps spread over (0, 1)."""
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024
    side = side or (64 if big else 8)  # latent pixels before 2x2 packing
    text_tokens = text_tokens or (256 if big else 8)
    kwargs, description = packed_noise_inputs(cfg, samples, seed, side, text_tokens, device, dtype)
    kwargs.update(encoder_hidden_states_mask=torch.ones(samples, text_tokens, dtype=torch.long, device=device),
                  img_shapes=[[(1, side // 2, side // 2)]] * samples)
    return CalibrationBatch(kwargs, description)


def qwen_image_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """(resolution / 16)² image tokens (8x VAE, 2x2 packing) plus the text tokens, at heads x head_dim."""
    side = resolution // 16
    return side * side + text_tokens, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


QWEN_IMAGE = FamilyAdapter(family="qwen-image", class_name="QwenImageTransformer2DModel",
                           block_lists=("transformer_blocks",), calibration_inputs=qwen_image_synthetic_inputs,
                           sequence_shape=qwen_image_sequence_shape)
