"""FLUX.1 family (diffusers ``FluxTransformer2DModel``): 19 double-stream + 38 single-stream blocks at 12B."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter
from .flux_latents import packed_with_controls, text_ids
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, split_controls, unpack_2x2_output


def flux_synthetic_inputs(model, samples: int, seed: int, side: int | None = None, text_tokens: int | None = None,
                          dtype: torch.dtype = torch.float32, device="cpu") -> CalibrationBatch:
    """Noise latents and Gaussian text embeddings at timesteps spread across the schedule: inputs of the right
    shapes for speed runs and streaming tests (``--calib-synthetic``); they carry no image or prompt statistics."""
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
        "why": "noise latents and Gaussian text embeddings",
        "samples": samples,
        "image_tokens": side * side,
        "text_tokens": text_tokens,
        "timesteps": [round(float(t), 4) for t in timesteps],
        "seed": seed,
    }
    return CalibrationBatch(kwargs, description)


def flux_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """FLUX.1 runs (resolution/16)² image tokens (8x VAE, 2x2 packing) plus the text tokens, at heads x head_dim."""
    side = resolution // (16 * int(config.get("patch_size", 1)))
    return side * side + text_tokens, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def flux_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """2x2-packed latents with (0, row, column) position ids, T5 sequence + CLIP pooled text, t in [0, 1] (the
    model scales by 1000 itself), the guidance scale as is for guidance-distilled models. An edit pair's control
    latents (FLUX.1 Kontext) are packed alike and appended after the target's tokens with ids (1, row, column), as
    FluxKontextPipeline does (its ``prepare_latents`` and the ``torch.cat([latents, image_latents], dim=1)`` of its
    loop)."""
    text, controls = split_controls(text)
    prompt = text["prompt_embeds"]
    tokens, ids = packed_with_controls(x_t, controls, lambda k: 1)
    kwargs = dict(hidden_states=tokens, encoder_hidden_states=prompt,
                  pooled_projections=text["pooled_prompt_embeds"], timestep=t, img_ids=ids,
                  txt_ids=text_ids(prompt.shape[1], device=x_t.device))
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full_like(t, guidance)
    return kwargs


def flux_captions(pipe, texts, length, device):
    """T5's ``prompt_embeds`` and CLIP's ``pooled_prompt_embeds``, through ``FluxPipeline.encode_prompt``."""
    prompt, pooled, _ = pipe.encode_prompt(list(texts), prompt_2=None, device=device, max_sequence_length=length)
    return caption_entries(prompt, pooled)


FLUX_RECIPE = TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                             text_fields=lambda cfg: TextFields(cfg.joint_attention_dim, cfg.pooled_projection_dim),
                             forward=flux_forward, prediction=unpack_2x2_output,
                             pipeline=PipelineFolder(("FluxPipeline",), flux_captions),
                             # Kontext is FLUX.1's class with one control
                             controls=1, edit_name="FLUX.1 Kontext", edit_word="Kontext")


# Every attention and MLP linear of both streams, the adaLN modulation left out: kohya sd-scripts' FLUX.1 default
# (networks/lora_flux.py wraps each Linear of the double and single blocks, and excludes img_mod, txt_mod and
# modulation by default since 2025) in diffusers' names. BFL's fused qkv (and a single block's linear1 = qkv + MLP
# input) are diffusers' to_q, to_k, to_v (+ proj_mlp); linear2 is the single block's proj_out.
def flux_reference_pipeline(config) -> str:
    """FLUX.1-dev's pipeline for a guidance-distilled transformer, else FLUX.1-schnell's (diffusers' choice for their
    single files)."""
    guidance = config.get("guidance_embeds") if isinstance(config, dict) else getattr(config, "guidance_embeds", None)
    return "black-forest-labs/FLUX.1-dev" if guidance else "black-forest-labs/FLUX.1-schnell"


FLUX_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
                     "proj_out")

FLUX = FamilyAdapter(
    family="flux",
    class_name="FluxTransformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    calibration_inputs=flux_synthetic_inputs,
    sequence_shape=flux_sequence_shape,
    recipe=FLUX_RECIPE,
    samples=True,
    lora_targets=FLUX_LORA_TARGETS,
    reference_pipeline=flux_reference_pipeline,
    single_file_encoders=("clip_l", "t5", "vae"),
)
