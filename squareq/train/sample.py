"""``squareq sample``: images from the streamed slab (optionally with a LoRA), through the family's pipeline.

The transformer is the runtime model (blocks streamed forward only, under ``no_grad``); the VAE, text
encoders and scheduler come from the slab's recorded source or ``--model``, as for caching.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .. import runtime
from ..runtime.residency import StreamTuner
from ..models import ADAPTERS
from ..slab import open_slab
from .encoders import open_encoders
from .lora_files import attach_lora, load_lora


# ring slots that hide a forward-only pass's copies of FLUX.1-dev at 1024² on an H100 (two do not: docs/benchmarks.md);
# `squareq sample --prefetch auto` starts there, the trainer's sample images use at least as many
FORWARD_SLOTS = 3


class SampleError(ValueError):
    """The slab's family cannot be sampled yet; the message says which can."""


def draw_image(pipe, prompt: str, resolution: int, steps: int, guidance: float, seed: int, max_sequence_length: int,
               device: torch.device, on_step_end=None):
    """One image from a FLUX pipeline whose transformer is a runtime model (bf16 autocast, no gradients);
    ``on_step_end``: diffusers' ``callback_on_step_end`` (a StreamTuner's)."""
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        return pipe(prompt, height=resolution, width=resolution, num_inference_steps=steps, guidance_scale=guidance,
                    max_sequence_length=max_sequence_length, callback_on_step_end=on_step_end,
                    generator=torch.Generator(device).manual_seed(seed)).images[0]


def sample_images(slab: str | Path, prompts: list[str], lora: str | Path | None = None, model: str | None = None,
                  resolution: int = 1024, steps: int = 20, guidance: float = 3.5, seed: int = 42,
                  max_sequence_length: int = 512, prefetch: int | str = "auto", host: str = "pinned", device=None,
                  resident_blocks: int | str = 0):
    """One PIL image per prompt, each from ``seed`` (so a prompt gives the same image with and without a LoRA,
    but for the LoRA's effect). prefetch "auto" starts the ring at :data:`FORWARD_SLOTS` slots and grows it
    after the second step if the copies were not hidden; resident_blocks ("auto" or a count) keeps blocks on the
    GPU from then on (runtime/residency.py)."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = open_slab(slab, verify="eager")
    family = s.manifest.model.family
    if family not in ADAPTERS or not ADAPTERS[family].samples:
        sampled = ", ".join(f for f, a in ADAPTERS.items() if a.samples)
        raise SampleError(f"{slab} holds a {family} model; squareq sample draws images for {sampled} only so far.")
    start = FORWARD_SLOTS if prefetch == "auto" else prefetch
    transformer = runtime.load(s, device, prefetch=start, host=host, verify="off")
    tuner = None
    if prefetch == "auto" or resident_blocks:
        tuner = StreamTuner(transformer, prefetch=prefetch, resident=resident_blocks)
    if lora is not None:
        attach_lora(transformer, *load_lora(lora))
    images = []
    try:
        with open_encoders(model or s.manifest.model.source, device, family) as encoders:
            pipe = encoders.pipeline
            pipe.transformer = transformer
            for prompt in prompts:
                images.append(draw_image(pipe, prompt, resolution, steps, guidance, seed, max_sequence_length, device,
                                         tuner.pipeline_callback if tuner is not None else None))
            pipe.transformer = None
    finally:
        runtime.runtime_of(transformer).close()
    return images
