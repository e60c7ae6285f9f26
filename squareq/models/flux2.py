"""FLUX.2 (diffusers ``Flux2Transformer2DModel``): double- and single-stream blocks with shared modulation, a
Mistral text encoder, 4-axis rotary positions."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs
from .flux import flux_sequence_shape
from .flux_latents import pack_latents
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, unpack_2x2_output

TINY_FLUX2_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                         num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                         axes_dims_rope=(4, 4, 4, 4))


def build_tiny_flux2(seed: int = 0):
    """``tiny-flux2``: the FLUX.2 architecture at toy size, seeded."""
    return build_seeded("Flux2Transformer2DModel", TINY_FLUX2_CONFIG, seed)


def _ids(rows: int, cols: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX.2's (t, h, w, l) position ids: image tokens on a grid, text tokens along l."""
    img = torch.zeros(rows, cols, 4, device=device)
    img[..., 1] = torch.arange(rows, device=device)[:, None]
    img[..., 2] = torch.arange(cols, device=device)[None, :]
    txt = torch.zeros(tokens, 4, device=device)
    txt[:, 3] = torch.arange(tokens, device=device)
    return img.reshape(-1, 4), txt


def flux2_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                           side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """Packed noise latents and Gaussian text embeddings at timesteps spread over (0, 1), guidance 4."""
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024
    side, text_tokens = side or (64 if big else 8), text_tokens or (512 if big else 8)
    kwargs, description = packed_noise_inputs(cfg, samples, seed, side, text_tokens, device, dtype)
    img_ids, txt_ids = _ids(side // 2, side // 2, text_tokens, device)
    kwargs.update(img_ids=img_ids, txt_ids=txt_ids)
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((samples,), 4.0, device=device, dtype=dtype)
    return CalibrationBatch(kwargs, description)


def flux2_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """2x2-packed latents (FLUX.2's patchify is the same channel order) with (t, h, w, l) ids, the stacked Mistral
    hidden states, t in [0, 1] (scaled by the model), the guidance scale as is."""
    prompt = text["prompt_embeds"]
    img_ids, txt_ids = _ids(x_t.shape[-2] // 2, x_t.shape[-1] // 2, prompt.shape[1], x_t.device)
    kwargs = dict(hidden_states=pack_latents(x_t), encoder_hidden_states=prompt, timestep=t, img_ids=img_ids,
                  txt_ids=txt_ids)
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full_like(t, guidance)
    return kwargs


def flux2_captions(pipe, texts, length, device):
    """Mistral's stacked hidden states, through ``Flux2Pipeline.encode_prompt``."""
    return caption_entries(pipe.encode_prompt(texts, device=device, max_sequence_length=length)[0])


FLUX2 = FamilyAdapter(family="flux2", class_name="Flux2Transformer2DModel",
                      block_lists=("transformer_blocks", "single_transformer_blocks"),
                      calibration_inputs=flux2_synthetic_inputs, sequence_shape=flux_sequence_shape,
                      recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                                            text_fields=lambda cfg: TextFields(cfg.joint_attention_dim),
                                            forward=flux2_forward, prediction=unpack_2x2_output,
                                            pipeline=PipelineFolder(("Flux2Pipeline",), flux2_captions)),
                      pipeline_samples=True)
