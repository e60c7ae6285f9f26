"""``squareq sample``: images from the streamed slab (optionally with a LoRA), through the family's pipeline.

The transformer is the runtime model (blocks streamed forward only, under ``no_grad``); the VAE, text
encoders and scheduler come from the slab's recorded source or ``--model``, as for caching.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import runtime
from ..models import ADAPTERS
from ..slab import open_slab
from .encoders import open_encoders


class SampleError(ValueError):
    """The slab's family cannot be sampled yet; the message says which can."""
from .lora_files import attach_lora, load_lora


def draw_image(pipe, prompt: str, resolution: int, steps: int, guidance: float, seed: int, max_sequence_length: int,
               device: torch.device):
    """One image from a FLUX pipeline whose transformer is a runtime model (bf16 autocast, no gradients)."""
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return pipe(prompt, height=resolution, width=resolution, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=max_sequence_length,
                    generator=torch.Generator(device).manual_seed(seed)).images[0]


def sample_images(slab: str | Path, prompts: list[str], lora: str | Path | None = None, model: str | None = None,
                  resolution: int = 1024, steps: int = 20, guidance: float = 3.5, seed: int = 42,
                  max_sequence_length: int = 512, prefetch: int = 3, host: str = "pinned", device=None):
    """One PIL image per prompt, each from ``seed`` (so a prompt gives the same image with and without a LoRA,
    but for the LoRA's effect)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = open_slab(slab, verify="eager")
    family = s.manifest.model.family
    if family not in ADAPTERS or not ADAPTERS[family].samples:
        sampled = ", ".join(f for f, a in ADAPTERS.items() if a.samples)
        raise SampleError(f"{slab} holds a {family} model; squareq sample draws images for {sampled} only so far.")
    transformer = runtime.load(s, device, prefetch=prefetch, host=host, verify="off")
    if lora is not None:
        attach_lora(transformer, *load_lora(lora))
    images = []
    try:
        with open_encoders(model or s.manifest.model.source, device, family) as encoders:
            pipe = encoders.pipeline
            pipe.transformer = transformer
            for prompt in prompts:
                images.append(draw_image(pipe, prompt, resolution, steps, guidance, seed, max_sequence_length, device))
            pipe.transformer = None
    finally:
        runtime.runtime_of(transformer).close()
    return images
