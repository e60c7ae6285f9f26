"""Würstchen (v2): the text-conditional prior (stage C, ``WuerstchenPrior``) and the decoder (stage B,
``WuerstchenDiffNeXt``), each its own model, slab and LoRA.

diffusers 0.42 keeps both classes in ``pipelines/deprecated/wuerstchen`` (``base.diffusers_class`` finds them).
The prior's ``blocks`` stream; the decoder keeps one list of blocks per resolution level (``down_blocks.0``, ...),
each of which streams, while the skip activations between its levels stay on the GPU as the UNet's do. Both
forwards take ``(x, r, c)``-style arguments, return the predicted noise as one tensor and pick each block's
arguments by its class, which streaming keeps (a streamed block is the same object with another ``forward``).

Training: noise prediction at a continuous ratio r in (0, 1) over Würstchen's cosine schedule (diffusers'
``DDPMWuerstchenScheduler``; the Würstchen training examples draw r uniformly and regress the noise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import TextFields, TrainingRecipe, first_output

TINY_WUERSTCHEN_PRIOR_CONFIG = dict(c_in=4, c=32, c_cond=16, c_r=8, depth=2, nhead=2, dropout=0.0)
TINY_WUERSTCHEN_DECODER_CONFIG = dict(c_in=4, c_out=4, c_r=8, patch_size=2, c_cond=16, c_hidden=[16, 32],
                                      nhead=[-1, 2], blocks=[1, 1], level_config=["CT", "CTA"],
                                      inject_effnet=[False, True], effnet_embd=4, clip_embd=16, dropout=[0.0, 0.0])


def build_tiny_wuerstchen_prior(seed: int = 0):
    """``tiny-wuerstchen-prior``: Würstchen's stage C at toy size, seeded."""
    return build_seeded("WuerstchenPrior", TINY_WUERSTCHEN_PRIOR_CONFIG, seed)


def build_tiny_wuerstchen_decoder(seed: int = 0):
    """``tiny-wuerstchen-decoder``: Würstchen's stage B at toy size, seeded. The class initializes its output
    convolution (and each block's last layer) to zero, as a model about to be trained from scratch; the toy model
    gets small seeded values there instead, so its output depends on its blocks as a trained model's does."""
    model = build_seeded("WuerstchenDiffNeXt", TINY_WUERSTCHEN_DECODER_CONFIG, seed)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1)
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.normal_(0, 0.02)
    return model


def _synthetic(samples: int, seed: int, shapes: dict[str, tuple[int, ...]], device, dtype, why: str, tokens: int,
               text_tokens: int) -> CalibrationBatch:
    """Gaussian tensors of ``shapes`` (per sample) plus ratios r spread over (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.linspace(0.05, 0.95, samples)
    kwargs = {name: torch.randn(samples, *shape, generator=g).to(device, dtype) for name, shape in shapes.items()}
    kwargs["r"] = r.to(device, dtype)
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": why, "samples": samples, "image_tokens": tokens,
                                     "text_tokens": text_tokens, "timesteps": [round(float(v), 4) for v in r],
                                     "seed": seed})


def prior_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                           side: int | None = None, text_tokens: int = 77) -> CalibrationBatch:
    """Gaussian image embeddings [c_in, side, side] (24² for a 1024² image) and CLIP text features."""
    cfg = model.config
    side = side or (24 if cfg.c_cond >= 1024 else 6)
    return _synthetic(samples, seed, {"x": (cfg.c_in, side, side), "c": (text_tokens, cfg.c_cond)}, device, dtype,
                      "Gaussian image embeddings and text features", side * side, text_tokens)


def decoder_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                             side: int | None = None, text_tokens: int = 77) -> CalibrationBatch:
    """Noise latents [c_in, side, side], image embeddings at half the side and CLIP text features."""
    cfg = model.config
    side = side or (256 if cfg.clip_embd >= 1024 else 8)
    shapes = {"x": (cfg.c_in, side, side), "effnet": (cfg.effnet_embd, side // 2, side // 2),
              "clip": (text_tokens, cfg.clip_embd)}
    return _synthetic(samples, seed, shapes, device, dtype, "noise latents, Gaussian image embeddings and text",
                      (side // cfg.patch_size) ** 2, text_tokens)


def prior_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """Stage C works on 24 x 24 embeddings of a 1024² image (a 42.67x compression), at width c."""
    side = resolution * 3 // 128
    return side * side, int(config["c"])


def decoder_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """The largest activation: the first level's (resolution / 4 / patch)² positions at its channels."""
    side = resolution // (4 * int(config.get("patch_size", 2)))
    return side * side, int(config["c_hidden"][0])


def prior_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Image embeddings, the ratio t as is, the CLIP sequence."""
    return dict(x=x_t, r=t, c=text["prompt_embeds"])


def decoder_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Latents, the ratio t as is, the image's embeddings (cached with its latent) and the CLIP sequence."""
    return dict(x=x_t, r=t, effnet=text["effnet"], clip=text["prompt_embeds"])


def decoder_latent_multiple(cfg) -> int:
    """The decoder unshuffles ``patch_size`` pixels, then halves the side at each level after the first and adds the
    skips back unresized: a latent's sides are whole multiples of both."""
    return int(cfg.patch_size) * 2 ** (len(cfg.c_hidden) - 1)


def toy_image_embedding(latent: torch.Tensor) -> torch.Tensor:
    """The built-in decoder's stand-in for Würstchen's EfficientNet image embedding: the toy latent pooled 2x (its
    channels are the tiny decoder's ``effnet_embd``). Real embeddings need the EfficientNet encoder."""
    return F.avg_pool2d(latent[None], 2)[0]


NO_EFFNET = "Würstchen's EfficientNet image encoder"  # what no Würstchen pipeline folder holds

WUERSTCHEN_PRIOR = FamilyAdapter(
    family="wuerstchen-prior", class_name="WuerstchenPrior", block_lists=("blocks",),
    calibration_inputs=prior_synthetic_inputs, sequence_shape=prior_sequence_shape, component="prior",
    pipeline_samples=True,  # through both stages' pipelines, the decoder's folder given (train/wuerstchen_sample.py)
    recipe=TrainingRecipe(objective="cosine_epsilon", latent_channels=lambda cfg: cfg.c_in,
                          text_fields=lambda cfg: TextFields(cfg.c_cond), forward=prior_forward,
                          prediction=first_output, latent_multiple=lambda cfg: 1,
                          no_pipeline=NO_EFFNET + " (the prior's latents are its embeddings)"))

WUERSTCHEN_DECODER = FamilyAdapter(
    family="wuerstchen-decoder", class_name="WuerstchenDiffNeXt", block_lists=("down_blocks.*", "up_blocks.*"),
    calibration_inputs=decoder_synthetic_inputs, sequence_shape=decoder_sequence_shape, component="decoder",
    pipeline_samples=True,  # through both stages' pipelines, the prior's folder given (train/wuerstchen_sample.py)
    recipe=TrainingRecipe(objective="cosine_epsilon", latent_channels=lambda cfg: cfg.c_in,
                          text_fields=lambda cfg: TextFields(cfg.clip_embd), forward=decoder_forward,
                          prediction=first_output, image_conditioning=toy_image_embedding,
                          latent_multiple=decoder_latent_multiple,
                          no_pipeline=NO_EFFNET + " (the decoder is conditioned on its embeddings)"))
