"""FLUX.2 (diffusers ``Flux2Transformer2DModel``): double- and single-stream blocks with shared modulation, a
Mistral text encoder, 4-axis rotary positions."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs
from .flux import flux_sequence_shape
from .flux_latents import image_ids, packed_with_controls
from .recipe import PipelineFolder, TextFields, TrainingRecipe, caption_entries, split_controls, unpack_2x2_output

TINY_FLUX2_CONFIG = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                         num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                         axes_dims_rope=(4, 4, 4, 4))
# Reference images (FLUX.2's edits): BFL's largest count, FLUX.2 [pro]/[flex]/[max] in its playground (its API takes
# 8, [dev] is advised at 6 or fewer, [klein] at 4; diffusers' Flux2Pipeline and musubi-tuner set no limit)
MAX_REFERENCES = 10
REFERENCE_AREA = 1024 * 1024  # Flux2Pipeline brings a larger reference down to this area, a smaller one not up
REFERENCE_SCALE = 10  # the k-th reference's ids have time coordinate 10 + 10k (Flux2Pipeline's _prepare_image_ids)


def build_tiny_flux2(seed: int = 0):
    """``tiny-flux2``: the FLUX.2 architecture at toy size, seeded."""
    return build_seeded("Flux2Transformer2DModel", TINY_FLUX2_CONFIG, seed)


def _text_ids(tokens: int, device) -> torch.Tensor:
    """FLUX.2's (t, h, w, l) position ids of the text tokens: along l, as Flux2Pipeline's ``_prepare_text_ids``."""
    txt = torch.zeros(tokens, 4, device=device)
    txt[:, 3] = torch.arange(tokens, device=device)
    return txt


def reference_index(k: int) -> int:
    """The time coordinate of the k-th reference image's ids (Flux2Pipeline's ``_prepare_image_ids``, scale 10)."""
    return REFERENCE_SCALE + REFERENCE_SCALE * k


def flux2_synthetic_inputs(model, samples: int, seed: int, device="cpu", dtype: torch.dtype = torch.float32,
                           side: int | None = None, text_tokens: int | None = None) -> CalibrationBatch:
    """Packed noise latents and Gaussian text embeddings at timesteps spread over (0, 1), guidance 4."""
    cfg = model.config
    big = cfg.joint_attention_dim >= 1024
    side, text_tokens = side or (64 if big else 8), text_tokens or (512 if big else 8)
    kwargs, description = packed_noise_inputs(cfg, samples, seed, side, text_tokens, device, dtype)
    kwargs.update(img_ids=image_ids(side, side, device=device, axes=4), txt_ids=_text_ids(text_tokens, device))
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full((samples,), 4.0, device=device, dtype=dtype)
    return CalibrationBatch(kwargs, description)


def flux2_forward(cfg, x_t: torch.Tensor, t: torch.Tensor, text: dict, guidance: float) -> dict:
    """2x2-packed latents (FLUX.2's patchify is the same channel order) with (t, h, w, l) ids, the stacked Mistral
    hidden states, t in [0, 1] (scaled by the model), the guidance scale as is. Reference images (``control_0``,
    ``control_1``, ...) are packed alike and appended after the target's tokens, the k-th with ids (10 + 10k, row,
    column, 0) on its own grid, as Flux2Pipeline's ``prepare_image_latents`` and its loop's ``torch.cat`` do."""
    text, references = split_controls(text)
    prompt = text["prompt_embeds"]
    tokens, img_ids = packed_with_controls(x_t, references, reference_index, axes=4)
    kwargs = dict(hidden_states=tokens, encoder_hidden_states=prompt, timestep=t, img_ids=img_ids,
                  txt_ids=_text_ids(prompt.shape[1], x_t.device))
    if cfg.guidance_embeds:
        kwargs["guidance"] = torch.full_like(t, guidance)
    return kwargs


def flux2_reference_problem(image) -> str | None:
    """Why Flux2Pipeline would refuse a reference image (PIL) it is given to draw from (its image processor's
    ``check_image_input``), None where it takes it."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    try:
        Flux2ImageProcessor.check_image_input(image)
    except ValueError:
        return (f"it is {image.width}x{image.height}, and Flux2Pipeline takes sides of 64 or more at an aspect of 8 at "
                "most")
    return None


def flux2_captions(pipe, texts, length, device):
    """Mistral's stacked hidden states, through ``Flux2Pipeline.encode_prompt``."""
    return caption_entries(pipe.encode_prompt(texts, device=device, max_sequence_length=length)[0])


FLUX2 = FamilyAdapter(family="flux2", class_name="Flux2Transformer2DModel",
                      block_lists=("transformer_blocks", "single_transformer_blocks"),
                      calibration_inputs=flux2_synthetic_inputs, sequence_shape=flux_sequence_shape,
                      recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                                            text_fields=lambda cfg: TextFields(cfg.joint_attention_dim),
                                            forward=flux2_forward, prediction=unpack_2x2_output,
                                            pipeline=PipelineFolder(("Flux2Pipeline",), flux2_captions),
                                            controls=MAX_REFERENCES, edit_name="FLUX.2",
                                            control_area=REFERENCE_AREA, control_problem=flux2_reference_problem),
                      pipeline_samples=True)
