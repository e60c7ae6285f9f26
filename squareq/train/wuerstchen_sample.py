"""Würstchen (v2) images: its prior pipeline turns a prompt into image embeddings, its decoder pipeline turns them
into an image. A slab holds one stage's denoiser; the other stage runs whole from its own pipeline folder
(``squareq sample --decoder`` beside a prior slab, ``--prior`` beside a decoder slab).

diffusers 0.42 cannot load the Hub's Würstchen folders whole: their ``model_index.json`` names the ``wuerstchen``
library, which it no longer resolves (huggingface/diffusers#14008), and a folder it saves itself names classes it no
longer exports. So each pipeline is loaded without its Würstchen components, which are then loaded by their own
classes (``models.base.diffusers_class``).
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..models.base import diffusers_class
from ..slab.errors import brief
from ..sources.encoder_source import EncoderError
from ..third_party import pipeline_bars

STAGES = {"wuerstchen-prior": "prior", "wuerstchen-decoder": "decoder"}  # family -> the stage its slab holds
HUB_IDS = {"prior": "warp-ai/wuerstchen-prior", "decoder": "warp-ai/wuerstchen"}  # each stage's pipeline on the Hub
# the prior's latents are 1/42.67 of the image's side, the decoder's 10.67 times those and Stage A's pixels 4 times
# the decoder's: only multiples of 128 come back at the size asked (others are rounded up, or fail in the decoder)
SIDE_MULTIPLE = 128
# per stage: its pipeline, and its components that diffusers cannot load (class names in the deprecated module)
_PIPELINES = {"prior": ("WuerstchenPriorPipeline", {"prior": "WuerstchenPrior"}),
              "decoder": ("WuerstchenDecoderPipeline", {"decoder": "WuerstchenDiffNeXt", "vqgan": "PaellaVQModel"})}


def other_stage(family: str) -> str:
    """The stage a ``family`` slab needs beside it: "decoder" for a prior slab, "prior" for a decoder slab."""
    return "decoder" if STAGES[family] == "prior" else "prior"


def stage_parameters(family: str):
    """The call parameters of the pipeline of the stage ``family``'s slab holds (the one its prompts' options set)."""
    import inspect

    import diffusers

    return inspect.signature(getattr(diffusers, _PIPELINES[STAGES[family]][0]).__call__).parameters


@contextlib.contextmanager
def open_stages(own: Path, other: Path, family: str, denoiser, device: torch.device,
                dtype: torch.dtype) -> Iterator[tuple]:
    """The prior and decoder pipelines on ``device``: the stage of ``family`` from ``own`` with ``denoiser`` (the
    streamed slab) as its denoiser, the other stage whole from ``other``; text encoders, VQGAN and the other stage's
    denoiser in ``dtype``. :class:`EncoderError` names the folder that does not load."""
    stage = STAGES[family]
    folders = {stage: own, other_stage(family): other}
    pipes: dict = {}
    try:
        for name in _PIPELINES:
            pipes[name] = _load_stage(name, folders[name], dtype, skip_denoiser=name == stage)
        for pipe in pipes.values():
            pipe.to(device)
        setattr(pipes[stage], stage, denoiser)
        yield pipes["prior"], pipes["decoder"]
    finally:
        if stage in pipes:
            setattr(pipes[stage], stage, None)
        del pipes
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _load_stage(stage: str, folder: Path, dtype: torch.dtype, skip_denoiser: bool):
    import diffusers

    pipeline, parts = _PIPELINES[stage]
    cls = getattr(diffusers, pipeline)
    try:
        pipe = cls.from_pretrained(str(folder), **dict.fromkeys(parts), torch_dtype=dtype, local_files_only=True,
                                   use_safetensors=True)  # never a pickle
        for part, class_name in parts.items():
            if part == stage and skip_denoiser:
                continue  # the slab's
            model = diffusers_class(class_name).from_pretrained(str(folder), subfolder=part, torch_dtype=dtype,
                                                                local_files_only=True, use_safetensors=True)
            setattr(pipe, part, model.eval())
    except (OSError, ValueError, TypeError) as exc:
        raise EncoderError(f"cannot load the Würstchen {stage} pipeline from {folder} ({brief(exc)}); pass a complete "
                           f"{pipeline} folder or Hub ID ({HUB_IDS[stage]}).") from None
    return pipe


def draw_stages(prior_pipe, decoder_pipe, family: str, prompt, device: torch.device, autocast: torch.dtype,
                step_end: Callable[[str], object]):
    """One PIL image of ``prompt`` (settled): the prior's image embeddings, then the decoder's image from them, with
    one seeded generator for both (as diffusers' combined pipeline draws). ``--s``/``--g`` set the slab's stage; the
    other keeps its pipeline's defaults. A negative prompt goes to both (each uses it where its guidance is above 1).
    ``step_end(stage)``: the ``callback_on_step_end`` for that stage's pipeline."""
    own = STAGES[family]
    steps = {own: {"num_inference_steps": prompt.steps, "guidance_scale": prompt.guidance}}
    negative = {"negative_prompt": prompt.negative} if prompt.negative else {}
    generator = torch.Generator(device).manual_seed(prompt.seed)
    pipeline_bars(prior_pipe), pipeline_bars(decoder_pipe)  # SquareQ's own bar counts the slab's stage's steps
    with torch.no_grad(), torch.autocast(device.type, dtype=autocast):
        embeddings = prior_pipe(prompt=prompt.text, height=prompt.height, width=prompt.width, generator=generator,
                                output_type="pt", callback_on_step_end=step_end("prior"), **negative,
                                **steps.get("prior", {})).image_embeddings
        return decoder_pipe(image_embeddings=embeddings, prompt=prompt.text, generator=generator, output_type="pil",
                            callback_on_step_end=step_end("decoder"), **negative,
                            **steps.get("decoder", {})).images[0]
