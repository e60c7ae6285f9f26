"""Stable Diffusion 1.5 and SDXL (diffusers ``UNet2DConditionModel``): the down and up blocks stream, the mid block
and the embeddings stay on the GPU, and the skip connections (activations the UNet's forward passes from each down
block to its up block) never leave it; only weights move."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, first_output

_TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                  cross_attention_dim=32, norm_num_groups=8)
TINY_SD15_CONFIG = dict(_TINY_UNET, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8)
TINY_SDXL_CONFIG = dict(_TINY_UNET, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(4, 8),
                        transformer_layers_per_block=(1, 2), addition_embed_type="text_time",
                        addition_time_embed_dim=8, projection_class_embeddings_input_dim=16 + 6 * 8,
                        use_linear_projection=True)


def build_tiny_sd15(seed: int = 0):
    """``tiny-sd15``: an SD 1.5-style UNet at toy size, seeded."""
    return build_seeded("UNet2DConditionModel", TINY_SD15_CONFIG, seed)


def build_tiny_sdxl(seed: int = 0):
    """``tiny-sdxl``: an SDXL-style UNet (pooled text + size conditioning) at toy size, seeded."""
    return build_seeded("UNet2DConditionModel", TINY_SDXL_CONFIG, seed)


def unet_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                          side: int | None = None, text_tokens: int = 77) -> CalibrationBatch:
    """Noise latents at the model's sample size, Gaussian text embeddings, timesteps spread over [0, 1000]; SDXL
    also gets pooled text embeddings and its six size/crop conditioning values."""
    cfg = model.config
    side = side or cfg.sample_size
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    kwargs = dict(sample=torch.randn(samples, cfg.in_channels, side, side, generator=g),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.cross_attention_dim, generator=g),
                  timestep=1000 * t)
    kwargs = {k: v.to(device=device, dtype=dtype) for k, v in kwargs.items()}
    if cfg.addition_embed_type == "text_time":
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        size = 8.0 * side
        kwargs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(samples, pooled, generator=g).to(device, dtype),
            "time_ids": torch.tensor([[size, size, 0.0, 0.0, size, size]] * samples, device=device, dtype=dtype)}
    return CalibrationBatch(kwargs, {"kind": "synthetic", "why": "noise latents and Gaussian text embeddings",
                                     "samples": samples, "image_tokens": side * side, "text_tokens": text_tokens,
                                     "timesteps": [round(float(v), 4) for v in t], "seed": seed})


def unet_sequence_shape(config: dict, resolution: int, text_tokens: int) -> tuple[int, int]:
    """The largest activation a streamed block passes on: (resolution / 8)² positions at the first level's
    channels (an upper bound for the plan; a UNet is not a token stream)."""
    side = resolution // 8
    return side * side, int(config["block_out_channels"][0])


def _pooled_width(cfg) -> int | None:
    """SDXL's pooled text width (its added embedding takes pooled text plus six size/crop values), else None."""
    if cfg.addition_embed_type != "text_time":
        return None
    return cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim


def unet_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """Latents and the integer DDPM step as they are, CLIP hidden states; SDXL also gets its pooled text and the
    time ids (original size, crop top-left, target size) of an uncropped image at the latent's size x 8."""
    kwargs = dict(sample=x_t, timestep=t, encoder_hidden_states=text["prompt_embeds"])
    if _pooled_width(cfg) is not None:
        h, w = (8 * s for s in x_t.shape[-2:])
        time_ids = torch.tensor([h, w, 0, 0, h, w], device=x_t.device, dtype=x_t.dtype).expand(x_t.shape[0], 6)
        kwargs["added_cond_kwargs"] = {"text_embeds": text["pooled_prompt_embeds"], "time_ids": time_ids}
    return kwargs


def unet_captions(pipe, texts, length, device):
    """CLIP's states (SDXL: both CLIPs', and the pooled vector), through the pipeline's ``encode_prompt``."""
    if type(pipe).__name__ == "StableDiffusionXLPipeline":
        embeds, _, pooled, _ = pipe.encode_prompt(texts, device=device, do_classifier_free_guidance=False)
        return caption_entries(embeds, pooled)
    embeds, _ = pipe.encode_prompt(texts, device, 1, False)
    return caption_entries(embeds)


# The DDPM schedule SquareQ trains the UNets with (squareq/train/objective.py); a scheduler config that differs is
# refused rather than trained against the wrong noise levels.
DDPM_DEFAULTS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012,
                 "beta_schedule": "scaled_linear", "rescale_betas_zero_snr": False}


def unet_objective(scheduler: dict) -> str:
    """What a UNet pipeline's scheduler config says the model predicts: epsilon or v_prediction (SD 2.x 768-v)."""
    kind = scheduler.get("prediction_type", "epsilon")
    if kind not in ("epsilon", "v_prediction"):
        raise ValueError(f"sets prediction_type = {kind!r}; SquareQ trains epsilon or v_prediction, so pass a pipeline "
                         "folder whose scheduler predicts one of them with --model.")
    other = {k: scheduler[k] for k, v in DDPM_DEFAULTS.items() if k in scheduler and scheduler[k] != v}
    if other:
        raise ValueError(f"sets {other}; SquareQ trains SD's noise schedule {DDPM_DEFAULTS} only, so pass a pipeline "
                         "folder with that schedule with --model.")
    return kind


SD_UNET = FamilyAdapter(family="sd-unet", class_name="UNet2DConditionModel", block_lists=("down_blocks", "up_blocks"),
                        calibration_inputs=unet_synthetic_inputs, sequence_shape=unet_sequence_shape, component="unet",
                        recipe=TrainingRecipe(objective="epsilon", latent_channels=lambda cfg: cfg.in_channels,
                                              text_fields=lambda cfg: TextFields(cfg.cross_attention_dim,
                                                                                 _pooled_width(cfg)),
                                              forward=unet_forward, prediction=first_output,
                                              latent_multiple=lambda cfg: 1,  # diffusers sizes its upsamplers
                                              pipeline=PipelineFolder(("StableDiffusionXLPipeline",
                                                                       "StableDiffusionPipeline"), unet_captions,
                                                                      objective=unet_objective)),
                        pipeline_samples=True)
