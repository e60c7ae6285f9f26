"""Qwen-Image (diffusers ``QwenImageTransformer2DModel``): MM-DiT blocks over 2x2-packed latents, Qwen2.5-VL text.
Qwen-Image-Edit and Edit-Plus (2509, 2511) are the same class, trained on edit pairs from their pipelines' folders
(``QwenImageEditPipeline``, ``QwenImageEditPlusPipeline``), whose Qwen2.5-VL reads the control images beside the
caption."""
from __future__ import annotations

import torch

from .base import CalibrationBatch, FamilyAdapter, build_seeded, packed_noise_inputs
from .flux_latents import pack_latents
from .recipe import (
    EditText,
    PipelineFolder,
    TextFields,
    TrainingRecipe,
    caption_entries,
    split_controls,
    unpack_2x2_output,
)

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
    model scales by 1000). An edit pair's control latents are packed alike and appended after the target's tokens,
    each listed in ``img_shapes`` after the target's grid, as QwenImageEditPipeline and QwenImageEditPlusPipeline do:
    RoPE gives the k-th image frame index k, and a ``zero_cond_t`` transformer (Edit-2511) modulates the tokens past
    the first grid's with t = 0, both read from ``img_shapes``."""
    text, controls = split_controls(text)
    images = [x_t] + [c.to(x_t.dtype) for c in controls]
    grids = [(1, z.shape[-2] // 2, z.shape[-1] // 2) for z in images]
    return dict(hidden_states=torch.cat([pack_latents(z) for z in images], dim=1),
                encoder_hidden_states=text["prompt_embeds"], encoder_hidden_states_mask=text["prompt_mask"].long(),
                timestep=t, img_shapes=[grids] * x_t.shape[0])


def qwen_image_captions(pipe, texts, length, device):
    """Qwen2.5-VL's states of the caption's real tokens only (the pipeline trims its padding too)."""
    embeds, mask = pipe.encode_prompt(texts, device=device, max_sequence_length=length)
    return caption_entries(embeds, mask=mask, trim=True)


VISION_PIXELS_PER_TOKEN = 28 * 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 into one token


def _edit_caption(area: int, several: bool):
    """A caption encoded with its control images by an edit pipeline's ``encode_prompt``, each image brought to
    ``area`` pixels at its aspect (sides multiples of 32, the pipeline's ``calculate_dimensions``, stretched by its
    image processor) as its ``__call__`` brings it for the text encoder; ``several``: the images as a list (Edit-Plus,
    whose template names each "Picture i"), else the one image (Edit)."""
    def encode(pipe, caption: str, images: list, device) -> dict[str, torch.Tensor]:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        sized = []
        for image in images:
            width, height = calculate_dimensions(area, image.width / image.height)
            sized.append(pipe.image_processor.resize(image, height, width))
        embeds, mask = pipe.encode_prompt([caption], image=sized if several else sized[0], device=device)
        return caption_entries(embeds, mask=mask, trim=True)[0]

    return encode


# diffusers 0.42's qwenimage pipelines: Edit's __call__ sizes its one image to 1024² for the text encoder,
# Edit-Plus's each of its images to CONDITION_IMAGE_SIZE (384²); Plus takes up to three (Qwen's model cards)
QWEN_IMAGE_EDITS = {"QwenImageEditPipeline": EditText(1, 1024 * 1024, _edit_caption(1024 * 1024, several=False)),
                    "QwenImageEditPlusPipeline": EditText(3, 384 * 384, _edit_caption(384 * 384, several=True))}


def qwen_image_control_text(controls: int) -> int:
    """The most vision tokens ``controls`` control images add to a caption: the largest of the edit pipelines that
    take that many (one: Edit's 1024² image, about 1340 tokens)."""
    return max((controls * (e.area // VISION_PIXELS_PER_TOKEN) for e in QWEN_IMAGE_EDITS.values()
                if e.controls >= controls), default=0)


QWEN_IMAGE = FamilyAdapter(family="qwen-image", class_name="QwenImageTransformer2DModel",
                           block_lists=("transformer_blocks",), calibration_inputs=qwen_image_synthetic_inputs,
                           sequence_shape=qwen_image_sequence_shape,
                           recipe=TrainingRecipe(objective="flow", latent_channels=lambda cfg: cfg.in_channels // 4,
                                                 text_fields=lambda cfg: TextFields(cfg.joint_attention_dim, mask=True),
                                                 forward=qwen_image_forward, prediction=unpack_2x2_output,
                                                 pipeline=PipelineFolder(("QwenImagePipeline", *QWEN_IMAGE_EDITS),
                                                                         qwen_image_captions, edits=QWEN_IMAGE_EDITS),
                                                 controls=max(e.controls for e in QWEN_IMAGE_EDITS.values()),
                                                 edit_name="Qwen-Image-Edit", edit_word="Edit",
                                                 control_text_tokens=qwen_image_control_text),
                           pipeline_samples=True)
