"""How the trainer drives a family's denoiser: what a cached latent and caption look like, which forward arguments a
noised latent becomes, and what the output means.

The trainer (``squareq.train``) owns the objective's arithmetic (noising, targets, loss); a recipe only translates
between that and one model class. Conventions every recipe follows:

* A cached latent is one image's VAE latent, normalized as the family's pipeline normalizes it: ``[C, h, w]``, or
  ``[C, 1, h, w]`` for the video families (an image is one latent frame).
* ``t`` is what the objective draws: for ``"flow"`` a float in (0, 1) with x_t = (1 - t)·x0 + t·noise and the target
  noise - x0; for ``"epsilon"`` / ``"v_prediction"`` an integer DDPM step in [0, 999]; for ``"cosine_epsilon"``
  (Würstchen) a float ratio in (0, 1) on a cosine schedule, target the noise. ``forward`` maps ``t`` onto the
  model's own timestep scale and direction; ``prediction`` maps the output back onto the target's layout and sign.
* A caption is a dict of tensors: ``prompt_embeds`` ``[L, D]`` always, ``pooled_prompt_embeds`` ``[P]`` and
  ``prompt_mask`` ``[L]`` (1 = token, 0 = padding) where the family uses them. Batched, each gains a leading axis.
* An edit pair's control images (``controls`` > 0: FLUX.1 Kontext, FLUX.2's references, Qwen-Image-Edit) come with
  the caption as ``control_0``, ``control_1``, ... (:data:`CONTROL_FIELD`): clean latents normalized as the
  target's, each of its own size. ``forward`` appends them after the target's tokens, as the family's edit pipeline
  does; the prediction is the target's tokens alone (:func:`unpack_2x2_output` takes the first), so the loss sees the
  target only. Where the edit pipeline's text encoder sees the control images too (:class:`EditText`:
  Qwen-Image-Edit's Qwen2.5-VL), the caption's entry is encoded with them, so it is one per caption and control
  images.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .flux_latents import unpack_latents

OBJECTIVES = ("flow", "epsilon", "v_prediction", "cosine_epsilon")
PACKED_PATCH = 2  # FLUX packs 2x2 latent patches into one token; the flow transformers' patch size
CONTROL_FIELD = "control_{}"  # an edit pair's n-th control latent, in a latent cache entry and beside a caption


def split_controls(text: dict) -> tuple[dict, list[torch.Tensor]]:
    """``text`` without its control latents, and those in order (``control_0``, ``control_1``, ...)."""
    controls = []
    while CONTROL_FIELD.format(len(controls)) in text:
        controls.append(text[CONTROL_FIELD.format(len(controls))])
    names = {CONTROL_FIELD.format(n) for n in range(len(controls))}
    return {k: v for k, v in text.items() if k not in names}, controls


@dataclass(frozen=True)
class TextFields:
    """The caption tensors a family's denoiser takes, with their widths for a model config."""

    width: int  # D of prompt_embeds
    pooled: int | None = None  # P of pooled_prompt_embeds, None: not used
    mask: bool = False  # prompt_mask is passed to the model


def caption_entries(embeds: torch.Tensor, pooled: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    trim: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per-caption cache entries from a pipeline's batched ``encode_prompt`` outputs (fp32 on the CPU). ``trim``: keep
    only the tokens the mask marks (the pipeline pads to the batch's longest caption, so padding would depend on the
    neighbours). A mask of None with ``trim`` means every token is real."""
    if trim and mask is None:
        mask = torch.ones(embeds.shape[:2], device=embeds.device)
    out = []
    for i, seq in enumerate(embeds):
        entry = {"prompt_embeds": seq.float().cpu()}
        if mask is not None:
            m = mask[i].float().cpu()
            if trim:
                entry["prompt_embeds"] = entry["prompt_embeds"][m.bool()]
                m = m[m.bool()]
            entry["prompt_mask"] = m
        if pooled is not None:
            entry["pooled_prompt_embeds"] = pooled[i].float().cpu()
        out.append(entry)
    return out


@dataclass(frozen=True)
class EditText:
    """An edit pipeline class whose text encoder reads the control images beside the caption (Qwen-Image-Edit): how
    many it takes, the pixel area each is brought to for the text encoder (its aspect kept), and how a caption is
    encoded with them (``encode(pipeline, caption, images, device)``: one cache entry; ``images`` PIL, upright)."""

    controls: int
    area: int
    encode: Callable[..., dict[str, torch.Tensor]]


@dataclass(frozen=True)
class PipelineFolder:
    """Where a family's cache comes from: the diffusers pipeline classes its folders hold, and how one of them turns
    captions into cache entries (``encode(pipeline, captions, max_sequence_length, device)``, one entry per caption,
    the module docstring's caption layout). ``objective``: for families whose scheduler decides what the model
    predicts (the UNets), the objective a scheduler config means; it refuses one SquareQ cannot train with a
    ``ValueError`` sentence. ``edits``: the classes among them that edit control images and whose text encoder reads
    them (:class:`EditText`); the first class is the family's text-to-image pipeline, which draws a prompt without
    control images from an edit folder's components."""

    classes: tuple[str, ...]
    encode: Callable[..., list[dict[str, torch.Tensor]]]
    objective: Callable[[dict], str] | None = None
    edits: dict[str, EditText] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class TrainingRecipe:
    """A family's training interface (see the module docstring for the conventions). ``pipeline``: the pipeline
    folder its cache is encoded through; ``no_pipeline``: for a family no pipeline folder can encode, what is
    missing."""

    objective: str
    latent_channels: Callable[[Any], int]  # config -> VAE latent channels
    text_fields: Callable[[Any], TextFields]
    forward: Callable[..., dict]  # (config, x_t, t, text, guidance) -> the denoiser's keyword arguments
    prediction: Callable[[Any, torch.Tensor], torch.Tensor]  # (denoiser output, x_t) -> prediction shaped like x_t
    frames: bool = False  # latents carry a frame axis
    # The built-in toy encoders' stand-in for an image embedding the denoiser takes next to its latent (cached with
    # the latent as ``effnet``; Würstchen's decoder): latent -> embedding. None: the denoiser takes none.
    image_conditioning: Callable[[torch.Tensor], torch.Tensor] | None = None
    pipeline: PipelineFolder | None = None
    no_pipeline: str | None = None
    # config -> what a cached latent's height and width must be whole multiples of for the denoiser to take it: its
    # patch size (2: FLUX's 2x2 packing, the default), 1 for a model that takes any side (models/cache_entry.py)
    latent_multiple: Callable[[Any], int] = lambda cfg: PACKED_PATCH
    # the most control images one target of an edit pair may have (train/controls.py); 0: the family trains no pairs
    controls: int = 0
    edit_name: str = ""  # what the family is called when it trains on pairs (FLUX.1: "FLUX.1 Kontext")
    # the word an edit model's name has and its base model's lacks ("Kontext", "Edit"): a slab compiled from a model
    # whose name lacks it is said to train as the edit model; "" where the base model takes controls itself (FLUX.2)
    edit_word: str = ""
    # where a dataset sets neither control_resolution nor no_resize_control: each control keeps its own size up to
    # this area, cropped to 16s, as the family's edit pipeline takes it (FLUX.2: 1024²); None: the target's bucket
    control_area: int | None = None
    # PIL image -> why the family's edit pipeline refuses it as a control to draw from, None where it takes it
    control_problem: Callable[[Any], str | None] | None = None
    # n control images -> the most tokens they add to the caption (Qwen-Image-Edit: their vision tokens), which the
    # memory plan counts; None: the text encoder sees no control image
    control_text_tokens: Callable[[int], int] | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {OBJECTIVES}.")


# caption tensors with a token axis: padded to the batch's longest caption
TOKEN_FIELDS = ("prompt_embeds", "prompt_mask")


def pad_tokens(tensor: torch.Tensor, tokens: int) -> torch.Tensor:
    """``tensor`` zero-padded along its first (token) axis to ``tokens``."""
    if tensor.shape[0] == tokens:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(tokens - tensor.shape[0], *tensor.shape[1:])])


def stack_captions(texts: list[dict[str, torch.Tensor]], place=lambda t: t) -> dict[str, torch.Tensor]:
    """Caption entries batched: each field stacked on a new leading axis (after ``place`` moved each entry's tensor,
    e.g. onto the GPU), token fields zero-padded to the longest (their masks mark the padding). Entries of different
    lengths need a ``prompt_mask``: without one, zero padding would be read as tokens, so a ``ValueError`` says so."""
    tokens = max(e["prompt_embeds"].shape[0] for e in texts)
    if "prompt_mask" not in texts[0] and any(e["prompt_embeds"].shape[0] != tokens for e in texts):
        raise ValueError("the captions have different lengths and no prompt_mask, so they cannot be batched")
    return {name: torch.stack([place(pad_tokens(e[name], tokens) if name in TOKEN_FIELDS else e[name]) for e in texts])
            for name in texts[0]}


def first_output(output, x_t: torch.Tensor) -> torch.Tensor:
    """The denoiser's first output as it is (it already has the latent's layout); a model that returns one tensor
    (Würstchen) returns just that."""
    return output if isinstance(output, torch.Tensor) else output[0]


def unpack_2x2_output(output, x_t: torch.Tensor) -> torch.Tensor:
    """The first output of a model that packs 2x2 latent patches into tokens, back in the latent layout: the target's
    tokens, which come first (an edit pair's control tokens after them are no prediction)."""
    h, w = x_t.shape[-2:]
    return unpack_latents(output[0][:, : (h // PACKED_PATCH) * (w // PACKED_PATCH)], h, w)

