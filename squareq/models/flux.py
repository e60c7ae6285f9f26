"""FLUX.1 family (diffusers ``FluxTransformer2DModel``): 19 double-stream + 38 single-stream blocks at 12B."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import CalibrationBatch, FamilyAdapter, ModelError
from .flux_latents import image_ids, pack_latents, text_ids
from .prompts import CALIBRATION_PROMPTS
from .recipe import TextFields, TrainingRecipe, unpack_2x2_output


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


def _load_component(folder: Path, device, dtype: torch.dtype):
    """A transformers text encoder from a pipeline component folder (offline), by its config's architecture."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or ["AutoModel"])[0]
    cls = getattr(transformers, arch, None) or transformers.AutoModel
    model = cls.from_pretrained(folder, local_files_only=True, dtype=dtype).to(device).eval()
    return model


def flux_prompt_inputs(model, samples: int, seed: int, pipeline: Path, device="cpu",
                       dtype: torch.dtype = torch.float32) -> CalibrationBatch:
    """Built-in prompts through the pipeline's own CLIP (pooled) and T5 (sequence) encoders, with noise
    latents at timesteps spread across the schedule. The encoders are dropped before returning."""
    from transformers import AutoTokenizer

    cfg = model.config
    synthetic = flux_synthetic_inputs(model, samples, seed, dtype=dtype, device=device)
    text_tokens = synthetic.kwargs["encoder_hidden_states"].shape[1]
    prompts = [CALIBRATION_PROMPTS[(seed + i) % len(CALIBRATION_PROMPTS)] for i in range(samples)]
    encoder_dtype = dtype if torch.device(device).type == "cpu" else torch.bfloat16
    with torch.no_grad():
        clip_tok = AutoTokenizer.from_pretrained(pipeline / "tokenizer", local_files_only=True)
        clip = _load_component(pipeline / "text_encoder", device, encoder_dtype)
        ids = clip_tok(prompts, padding="max_length", max_length=min(77, clip_tok.model_max_length),
                       truncation=True, return_tensors="pt").input_ids.to(device)
        pooled = clip(ids).pooler_output.to(dtype)
        del clip
        t5_tok = AutoTokenizer.from_pretrained(pipeline / "tokenizer_2", local_files_only=True)
        t5 = _load_component(pipeline / "text_encoder_2", device, encoder_dtype)
        ids = t5_tok(prompts, padding="max_length", max_length=text_tokens, truncation=True,
                     return_tensors="pt").input_ids.to(device)
        sequence = t5(ids).last_hidden_state.to(dtype)
        del t5
    if pooled.shape[-1] != cfg.pooled_projection_dim or sequence.shape[-1] != cfg.joint_attention_dim:
        raise ModelError(f"{pipeline}: the text encoders give {pooled.shape[-1]}/{sequence.shape[-1]} features but "
                         f"the transformer expects {cfg.pooled_projection_dim}/{cfg.joint_attention_dim}; "
                         "the pipeline's components do not belong together.")
    kwargs = {**synthetic.kwargs, "encoder_hidden_states": sequence, "pooled_projections": pooled}
    description = {**synthetic.description, "kind": "text-encoders",
                   "why": "built-in prompts through the pipeline's CLIP and T5 encoders; noise latents",
                   "prompts": prompts}
    return CalibrationBatch(kwargs, description)


def flux_cache_inputs(model, samples: int, seed: int, cache_dir, device="cpu",
                      dtype: torch.dtype = torch.float32) -> CalibrationBatch:
    """Latents and text embeddings from a training cache (docs/train.md: ``latents/*.safetensors`` with
    ``latents``, ``text/*.safetensors`` with ``prompt_embeds`` and ``pooled_prompt_embeds``), noised at
    timesteps spread across the schedule: the images and captions the LoRA will be trained on."""
    from collections import Counter

    from safetensors.torch import load_file

    cache_dir = Path(cache_dir)
    cfg = model.config
    latent_files = sorted((cache_dir / "latents").glob("*.safetensors"))
    text_files = sorted((cache_dir / "text").glob("*.safetensors"))
    if not latent_files or not text_files:
        raise ModelError(f"{cache_dir} holds no cached latents or text embeddings; fill it first with "
                         f"`squareq cache SLAB --data DIR --cache-dir {cache_dir}` or a training run.")
    latents = [load_file(str(f))["latents"] for f in latent_files]
    shape, _ = Counter(tuple(x.shape) for x in latents).most_common(1)[0]  # one bucket, so they stack
    used = [f.stem for f, x in zip(latent_files, latents, strict=True) if tuple(x.shape) == shape][:samples]
    x0 = torch.stack([x for x in latents if tuple(x.shape) == shape][:samples]).float()
    texts = [load_file(str(f)) for f in text_files]
    tokens, _ = Counter(t["prompt_embeds"].shape[0] for t in texts).most_common(1)[0]
    texts = [t for t in texts if t["prompt_embeds"].shape[0] == tokens]
    texts = [texts[i % len(texts)] for i in range(len(x0))]
    if 4 * shape[0] != cfg.in_channels or texts[0]["prompt_embeds"].shape[-1] != cfg.joint_attention_dim or \
            texts[0]["pooled_prompt_embeds"].shape[-1] != cfg.pooled_projection_dim:
        raise ModelError(f"{cache_dir} was made with other encoders than this model's (latents {list(shape)}, text "
                         f"width {texts[0]['prompt_embeds'].shape[-1]}); fill a cache with this model's pipeline.")
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, len(x0))
    x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * torch.randn(x0.shape, generator=g)
    kwargs = dict(hidden_states=pack_latents(x_t), timestep=t,
                  encoder_hidden_states=torch.stack([e["prompt_embeds"] for e in texts]).float(),
                  pooled_projections=torch.stack([e["pooled_prompt_embeds"] for e in texts]).float(),
                  img_ids=image_ids(shape[1], shape[2]), txt_ids=text_ids(tokens))
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((len(x0),), 3.5)
    kwargs = {k: v.to(device=device, dtype=dtype if k not in ("img_ids", "txt_ids") else torch.float32)
              for k, v in kwargs.items()}
    description = {"kind": "training-cache", "why": "cached training latents and text embeddings, noised",
                   "cache": str(cache_dir), "samples": len(x0), "entries": used, "latent_shape": list(shape),
                   "text_tokens": tokens, "timesteps": [round(float(v), 4) for v in t], "seed": seed}
    return CalibrationBatch(kwargs, description)


def has_text_encoders(pipeline: Path) -> bool:
    return all((pipeline / part / "config.json").is_file() for part in ("text_encoder", "text_encoder_2")) and all(
        (pipeline / part).is_dir() for part in ("tokenizer", "tokenizer_2"))


def flux_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """FLUX.1 runs (resolution/16)² image tokens (8x VAE, 2x2 packing) plus the text tokens, at heads x head_dim."""
    side = resolution // (16 * int(config.get("patch_size", 1)))
    return side * side + text_tokens, int(config["num_attention_heads"]) * int(config["attention_head_dim"])


def flux_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """2x2-packed latents with (0, row, column) position ids, T5 sequence + CLIP pooled text, t in [0, 1] (the
    model scales by 1000 itself), the guidance scale as is for guidance-distilled models."""
    prompt = text["prompt_embeds"]
    kwargs = dict(hidden_states=pack_latents(x_t), encoder_hidden_states=prompt,
                  pooled_projections=text["pooled_prompt_embeds"], timestep=t,
                  img_ids=image_ids(*x_t.shape[-2:], device=x_t.device), txt_ids=text_ids(prompt.shape[1], device=x_t.device))
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full_like(t, guidance)
    return kwargs


FLUX_RECIPE = TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                             text_fields=lambda cfg: TextFields(cfg.joint_attention_dim, cfg.pooled_projection_dim),
                             forward=flux_forward, prediction=unpack_2x2_output)


FLUX = FamilyAdapter(
    family="flux",
    class_name="FluxTransformer2DModel",
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    calibration_inputs=flux_synthetic_inputs,
    prompt_inputs=flux_prompt_inputs,
    has_text_encoders=has_text_encoders,
    sequence_shape=flux_sequence_shape,
    cache_inputs=flux_cache_inputs,
    recipe=FLUX_RECIPE,
    samples=True,
)
