"""Qwen-Image (diffusers ``QwenImageTransformer2DModel``): MM-DiT blocks over 2x2-packed latents, Qwen2.5-VL text."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs
from .flux_latents import pack_latents
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, unpack_2x2_output

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


def qwen_image_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """2x2-packed latents with their token grid, Qwen2.5-VL hidden states with their mask, t in [0, 1] (the
    model scales by 1000)."""
    h, w = x_t.shape[-2:]
    return dict(hidden_states=pack_latents(x_t), encoder_hidden_states=text["prompt_embeds"],
                encoder_hidden_states_mask=text["prompt_mask"].long(), timestep=t,
                img_shapes=[[(1, h // 2, w // 2)]] * x_t.shape[0])


def qwen_image_captions(pipe, texts, length, device):
    """Qwen2.5-VL's states of the caption's real tokens only (the pipeline trims its padding too)."""
    embeds, mask = pipe.encode_prompt(texts, device=device, max_sequence_length=length)
    return caption_entries(embeds, mask=mask, trim=True)


QWEN_IMAGE = FamilyAdapter(family="qwen-image", class_name="QwenImageTransformer2DModel",
                           block_lists=("transformer_blocks",), calibration_inputs=qwen_image_synthetic_inputs,
                           sequence_shape=qwen_image_sequence_shape,
                           recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                                                 text_fields=lambda cfg: TextFields(cfg.joint_attention_dim, mask=True),
                                                 forward=qwen_image_forward, prediction=unpack_2x2_output,
                                                 pipeline=PipelineFolder(("QwenImagePipeline",), qwen_image_captions)),
                           pipeline_samples=True)
