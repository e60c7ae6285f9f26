"""FLUX.1 family (diffusers ``FluxTransformer2DModel``): 19 double-stream + 38 single-stream blocks at 12B."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter


def flux_synthetic_inputs(model, samples: int, seed: int, side: int | None = None, text_tokens: int | None = None,
                          dtype: torch.dtype = torch.float32, device="cpu") -> CalibrationBatch:
    """Noise latents and Gaussian text embeddings at timesteps spread across the schedule.

    The documented fallback when no text encoder or training cache is available: the embeddings
    carry no prompt statistics, so the manifest records the calibration as synthetic.
    """
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024  # a real FLUX: 512² latents and 512 T5 tokens
    side = side or (32 if big else 8)
    text_tokens = text_tokens or (512 if big else 16)
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    timesteps = torch.linspace(0.05, 0.95, samples)
    kwargs = dict(
        hidden_states=torch.randn(samples, side * side, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(samples, text_tokens, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(samples, cfg.pooled_projection_dim, generator=g),
        timestep=timesteps,
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(text_tokens, 3),
    )
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((samples,), 3.5)
    kwargs = {k: v.to(device=device, dtype=dtype if k not in ("img_ids", "txt_ids") else torch.float32)
              for k, v in kwargs.items()}
    description = {
        "kind": "synthetic",
        "why": "no text encoder or training cache was given; noise latents and Gaussian text embeddings",
        "samples": samples,
        "image_tokens": side * side,
        "text_tokens": text_tokens,
        "timesteps": [round(float(t), 4) for t in timesteps],
        "seed": seed,
    }
    return CalibrationBatch(kwargs, description)


FLUX = FamilyAdapter(
    family="flux",
    class_name="FluxTransformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    calibration_inputs=flux_synthetic_inputs,
)
