"""Z-Image (diffusers ``ZImageTransformer2DModel``): a single-stream DiT with noise and context refiners; its
forward takes lists of per-image latents and caption features."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe

TINY_Z_IMAGE_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                           n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[4, 6, 6],
                           axes_lens=[1024, 64, 64])  # caption positions up to 1024 tokens (the real one: 1536)


def build_tiny_z_image(seed: int = 0):
    """``tiny-z-image``: the Z-Image architecture at toy size, seeded."""
    return build_seeded("ZImageTransformer2DModel", TINY_Z_IMAGE_CONFIG, seed)


def z_image_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                             side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """One noise latent [C, 1, side, side] and one Gaussian caption feature [tokens, cap_feat_dim] per sample, at
    timesteps spread over (0, 1)."""
    cfg = model.config
    big = cfg.cap_feat_dim >= 1024
    side, text_tokens = side or (128 if big else 8), text_tokens or (128 if big else 6)
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    x = [torch.randn(cfg.in_channels, 1, side, side, generator=g).to(device, dtype) for _ in range(samples)]
    cap = [torch.randn(text_tokens, cfg.cap_feat_dim, generator=g).to(device, dtype) for _ in range(samples)]
    return CalibrationBatch(dict(x=x, t=t.to(device, dtype), cap_feats=cap),
                            {"kind": "synthetic", "why": "noise latents and Gaussian caption features",
                             "samples": samples, "image_tokens": (side // 2) ** 2, "text_tokens": text_tokens,
                             "timesteps": [round(float(v), 4) for v in t], "seed": seed})


def z_image_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """(resolution / 16)² image tokens plus the caption tokens, at the model width."""
    side = resolution // 16
    return side * side + text_tokens, int(config["dim"])


def z_image_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """One [C, 1, h, w] latent and one caption of its own length per sample (padding dropped by the mask), at
    model time 1 - t: Z-Image's time runs from noise (0) to data (1)."""
    prompt, mask = text["prompt_embeds"], text["prompt_mask"].bool()
    return dict(x=list(x_t.unsqueeze(2).unbind(0)), t=1 - t,
                cap_feats=[p[m] for p, m in zip(prompt, mask, strict=True)])


def z_image_prediction(output, x_t: torch.Tensor) -> torch.Tensor:
    """Z-Image predicts x0 - noise (its pipeline negates the output): negated, it is the flow target."""
    return -torch.stack(output[0]).squeeze(2)


def z_image_captions(pipe, texts, length, device):
    """Qwen3's states, one tensor per caption of its real tokens (the pipeline returns them unpadded)."""
    embeds, _ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False,
                                   max_sequence_length=length)
    return [{"prompt_embeds": e.float().cpu(), "prompt_mask": torch.ones(e.shape[0])} for e in embeds]


Z_IMAGE = FamilyAdapter(family="z-image", class_name="ZImageTransformer2DModel",
                        block_lists=("noise_refiner", "context_refiner", "layers"),
                        calibration_inputs=z_image_synthetic_inputs, sequence_shape=z_image_sequence_shape,
                        recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels,
                                              text_fields=lambda cfg: TextFields(cfg.cap_feat_dim, mask=True),
                                              forward=z_image_forward, prediction=z_image_prediction,
                                              pipeline=PipelineFolder(("ZImagePipeline",), z_image_captions)),
                        pipeline_samples=True)
