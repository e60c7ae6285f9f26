"""What a model family adapter declares, and the block discovery every adapter shares."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .recipe import TrainingRecipe


@dataclass
class CalibrationBatch:
    """Keyword arguments for the model's forward (batch = calibration samples) and how they were made.

    ``heldout``: indices of the samples whose inputs the compiler keeps out of every fit and choice, to judge them
    (empty: the compiler holds out a share of rows instead). ``row_mask``: ``[samples, tokens]``, 1 where a token is
    real and 0 where it is padding, for inputs whose padding the model ignores (text models): padded rows are not
    statistics of the data. ``heldout_kwargs`` / ``heldout_row_mask``: the same for the held-out samples alone (the
    compiler measures each layer's effect on the model's output on them).
    """

    kwargs: dict[str, Any]
    description: dict[str, Any]
    heldout: tuple[int, ...] = ()
    row_mask: torch.Tensor | None = None
    heldout_kwargs: dict[str, Any] | None = None
    heldout_row_mask: torch.Tensor | None = None


def generic_token_inputs(model: nn.Module, samples: int, seed: int, tokens: int = 32, device="cpu",
                         dtype: torch.dtype = torch.float32) -> CalibrationBatch:
    """Random token ids for a transformers model with a vocabulary (text encoders in generic mode): the synthetic
    inputs of ``--calib-synthetic``; real text goes through the model's tokenizer (models/calibration_set.py)."""
    vocab = getattr(model.config, "vocab_size", None)
    if not vocab:
        raise ModelError(f"{type(model).__name__} has no vocab_size, so SquareQ cannot make synthetic inputs for "
                         "it; calibrate it on real data instead of --calib-synthetic.")
    tokens = min(tokens, getattr(model.config, "max_position_embeddings", None) or tokens)  # CLIP: 77 positions
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (samples, tokens), generator=g).to(device)
    return CalibrationBatch({"input_ids": ids}, {"kind": "synthetic", "why": "random token ids (generic mode)",
                                                 "samples": samples, "tokens": tokens, "seed": seed})


class ModelError(ValueError):
    """A model does not have the structure its family adapter expects."""


def read_json_object(path, remedy: str) -> dict:
    """A JSON file that must hold an object (a model's config, a pipeline's index); one sentence ending in ``remedy``
    when it does not."""
    import json

    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); {remedy}.") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} does not hold a JSON object; {remedy}.")
    return data


# A diffusers pipeline's components by name: the denoiser a slab replaces, and those that encode images and text
# (model_index.json names them; prefixes, since a pipeline may have several text encoders and tokenizers).
PIPELINE_DENOISER = "transformer"
# an edit pipeline's processor (Qwen-Image-Edit's Qwen2.5-VL reads its control images through it) has no weights
PIPELINE_ENCODER_PARTS = ("vae", "scheduler", "text_encoder", "tokenizer", "processor")


@dataclass(frozen=True)
class FamilyAdapter:
    """A family's static facts: its diffusers class and the ``nn.ModuleList`` attributes holding its blocks."""

    family: str
    class_name: str
    block_lists: tuple[str, ...]
    # Synthetic inputs of the right shapes (noise latents, Gaussian text; random token ids for text models): for speed
    # runs and streaming tests, never for the compiler's choices (models/calibration_set.py makes the real ones).
    calibration_inputs: Callable[..., CalibrationBatch] = field(default=generic_token_inputs, compare=False)
    # (tokens per sample, hidden width) of the block stream for a config, an image side and a text length;
    # the runtime's memory plan needs it. None: the generic rule (text tokens, config hidden size).
    sequence_shape: Callable[[dict, int, int], tuple[int, int]] | None = field(default=None, compare=False)
    # How the trainer feeds the family's denoiser (models/recipe.py); None: the family cannot be trained yet.
    recipe: TrainingRecipe | None = field(default=None, compare=False)
    # SquareQ's own sampler draws the family (`squareq sample` and the trainer's sample images: FLUX.1)
    samples: bool = False
    # `squareq sample` draws the family through its diffusers pipeline folder (tested on the family's tiny pipeline)
    pipeline_samples: bool = False
    # the denoiser's attribute in the family's diffusers pipeline, and the key prefix of its diffusers LoRA files
    component: str = "transformer"
    # the layers `squareq train` wraps with LoRA by default (PEFT target_modules names); None: the attention
    # projections (runtime.DEFAULT_TARGETS)
    lora_targets: tuple[str, ...] | None = None
    # the Hub pipeline (for a recorded config) whose configs, tokenizers and scheduler go with the family's encoders
    # given as single files (ComfyUI's), as diffusers' from_single_file reads them; None: the user names one
    reference_pipeline: Callable[[Any], str] | None = field(default=None, compare=False)
    # the encoders a model file needs beside it as single files when that pipeline gives only configs (FLUX.1:
    # ComfyUI's clip_l, t5xxl and ae)
    single_file_encoders: tuple[str, ...] = ()

    @property
    def supports(self) -> tuple[str, ...]:
        """What SquareQ does for the family today (`squareq families` prints it): compile, stream, train (on clips too
        where its latents carry frames: train/clips.py; on edit pairs where it takes control images:
        train/controls.py), sample."""
        return ("compile", "stream") + (("train",) if self.recipe else ()) + (
            ("train on clips",) if self.recipe and self.recipe.frames else ()) + (
            ("train on pairs",) if self.recipe and self.recipe.controls else ()) + (
            ("sample",) if self.samples or self.pipeline_samples else ())

    def blocks(self, model: nn.Module) -> list[str]:
        """Module paths of the streamed blocks in definition order, e.g. ``transformer_blocks.0``."""
        found = []
        for attr in self._expand(model):
            try:
                container = model.get_submodule(attr)
            except AttributeError:
                lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n][:6]
                raise ModelError(f"{type(model).__name__} has no block list {attr!r} (family {self.family}); its "
                                 f"nn.ModuleLists are: {', '.join(lists) or 'none'}.") from None
            if not isinstance(container, nn.ModuleList):
                raise ModelError(f"{type(model).__name__}.{attr} is a {type(container).__name__}, not an "
                                 "nn.ModuleList.")
            found += [f"{attr}.{i}" for i in range(len(container))]
        if not found:
            raise ModelError(f"{type(model).__name__} has no blocks in {', '.join(self.block_lists)}.")
        return found

    def _expand(self, model: nn.Module) -> list[str]:
        """The block lists with ``name.*`` expanded to each list inside the ``nn.ModuleList`` ``name`` (Würstchen's
        decoder keeps one list of blocks per resolution level)."""
        out = []
        for attr in self.block_lists:
            if not attr.endswith(".*"):
                out.append(attr)
                continue
            outer = attr[:-2]
            try:
                out += [f"{outer}.{i}" for i in range(len(model.get_submodule(outer)))]
            except AttributeError:
                raise ModelError(f"{type(model).__name__} has no block list {outer!r} "
                                 f"(family {self.family}).") from None
        return out

    def matches(self, model: nn.Module) -> bool:
        return type(model).__name__ == self.class_name


# diffusers modules holding model classes the package no longer exports at its top level
DEPRECATED_MODULES = ("diffusers.pipelines.deprecated.wuerstchen",)


def diffusers_class(class_name: str):
    """The diffusers model class named ``class_name``: exported by the package, or one of the deprecated pipelines'
    (Würstchen's ``WuerstchenPrior``); None when this diffusers has no such class."""
    import importlib

    import diffusers

    if not isinstance(class_name, str) or not class_name.isidentifier():
        return None
    cls = getattr(diffusers, class_name, None)
    for module in DEPRECATED_MODULES:
        if cls is not None:
            break
        try:
            cls = getattr(importlib.import_module(module), class_name, None)
        except ImportError:
            continue
    return cls


def build_seeded(class_name: str, config: dict, seed: int) -> nn.Module:
    """The diffusers class ``class_name`` built from ``config`` with seeded initialization, in eval mode (how the
    built-in tiny models are made: the same weights on every machine)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return diffusers_class(class_name)(**config).eval()


def packed_noise_inputs(cfg, samples: int, seed: int, side: int, text_tokens: int, device, dtype: torch.dtype):
    """The synthetic inputs the packed-latent families share: noise latents packed 2x2 ((side/2)² tokens of
    ``cfg.in_channels``), Gaussian text embeddings of ``cfg.joint_attention_dim`` and timesteps spread over
    (0, 1); returns (forward kwargs, manifest description)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(0.05, 0.95, samples)
    tokens = (side // 2) ** 2
    kwargs = dict(hidden_states=torch.randn(samples, tokens, cfg.in_channels, generator=g).to(device, dtype),
                  encoder_hidden_states=torch.randn(samples, text_tokens, cfg.joint_attention_dim,
                                                    generator=g).to(device, dtype),
                  timestep=t.to(device, dtype))
    description = {"kind": "synthetic", "why": "noise latents and Gaussian text embeddings", "samples": samples,
                   "image_tokens": tokens, "text_tokens": text_tokens, "timesteps": [round(float(v), 4) for v in t],
                   "seed": seed}
    return kwargs, description
