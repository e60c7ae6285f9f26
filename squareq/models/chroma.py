"""Chroma (diffusers ``ChromaTransformer2DModel``): FLUX.1-schnell's blocks without CLIP, modulation from a small
approximator network, T5 text."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs
from .flux import flux_sequence_shape
from .flux_latents import image_ids, pack_latents, text_ids
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, unpack_2x2_output

TINY_CHROMA_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                          num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
                          approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1)


def build_tiny_chroma(seed: int = 0):
    """``tiny-chroma``: the Chroma architecture at toy size, seeded."""
    return build_seeded("ChromaTransformer2DModel", TINY_CHROMA_CONFIG, seed)


def chroma_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                            side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """Packed noise latents ((side/2)² tokens) and Gaussian T5 embeddings at timesteps spread over (0, 1)."""
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024
    side, text_tokens = side or (64 if big else 8), text_tokens or (512 if big else 8)
    kwargs, description = packed_noise_inputs(cfg, samples, seed, side, text_tokens, device, dtype)
    kwargs.update(img_ids=image_ids(side, side, device=device), txt_ids=text_ids(text_tokens, device=device))
    return CalibrationBatch(kwargs, description)


def chroma_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """FLUX.1's packing and ids, T5 text only; padding masked out of attention ([text | image] order, as the
    pipeline's mask, but boolean: diffusers' float 0/1 mask becomes an additive bias that masks nothing)."""
    prompt, tokens = text["prompt_embeds"], pack_latents(x_t)
    image = torch.ones(tokens.shape[:2], dtype=torch.bool, device=x_t.device)
    return dict(hidden_states=tokens, encoder_hidden_states=prompt, timestep=t,
                img_ids=image_ids(*x_t.shape[-2:], device=x_t.device),
                txt_ids=text_ids(prompt.shape[1], device=x_t.device),
                attention_mask=torch.cat([text["prompt_mask"].bool(), image], dim=1))


def chroma_captions(pipe, texts, length, device):
    """T5's states with their attention mask, through ``ChromaPipeline.encode_prompt``."""
    embeds, _, mask, *_ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False,
                                             max_sequence_length=length)
    return caption_entries(embeds, mask=mask)


CHROMA = FamilyAdapter(family="chroma", class_name="ChromaTransformer2DModel",
                       block_lists=("transformer_blocks", "single_transformer_blocks"),
                       calibration_inputs=chroma_synthetic_inputs, sequence_shape=flux_sequence_shape,
                       recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                                             text_fields=lambda cfg: TextFields(cfg.joint_attention_dim, mask=True),
                                             forward=chroma_forward, prediction=unpack_2x2_output,
                                             pipeline=PipelineFolder(("ChromaPipeline",), chroma_captions)),
                       pipeline_samples=True)
