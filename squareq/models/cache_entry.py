"""What a cache entry of each kind must hold, checked when it is read as well as its hash.

The hash catches damage; it does not catch an entry that was edited and re-hashed (resealed), or one a future
version wrote differently. Such an entry would otherwise surface as a ``KeyError`` deep in a step, a dtype error
in the model, or NaN losses. The rules are the kind's, not the run's:

* ``latents``: a floating ``latents`` tensor of 3 (``[C, h, w]``) or 4 (``[C, F, h, w]``) axes; a ``loss_mask``
  covers the same ``h`` and ``w``;
* ``text``: a floating ``prompt_embeds`` of 2 axes (``[L, D]``); a ``pooled_prompt_embeds`` of 1; a
  ``prompt_mask`` of ``L`` values, each 0 or 1;
* every tensor floating point and finite (the encoders write float32 or bfloat16 only);
* an edit pair's control latents (``control_0``, ``control_1``, ... numbered from 0 without gaps) have the
  ``latents``' axes and channels; their height and width are their own.

:func:`model_problem` adds the run's model's rules: the latent channels, a latent height and width its patches
divide (FLUX packs 2x2: a resealed latent of an odd side would end in a traceback in a step), the text widths.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from ..slab.digest import DigestError, read_hashed
from .recipe import CONTROL_FIELD

REQUIRED = {"latents": ("latents", (3, 4)), "text": ("prompt_embeds", (2,))}
AXES = {"pooled_prompt_embeds": (1,), "prompt_mask": (1,)}


def entry_problem(kind: str, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why ``tensors`` cannot be an entry of ``kind`` (``latents`` or ``text``), in a clause; None when they can."""
    name, axes = REQUIRED[kind]
    if name not in tensors:
        return f"has no {name} tensor (it holds {', '.join(sorted(tensors)) or 'none'})"
    for key, t in tensors.items():
        if not t.is_floating_point():
            return f"holds {key} as {str(t.dtype).removeprefix('torch.')}, where the encoders write floating point"
        want = axes if key == name else AXES.get(key)
        if want is not None and t.dim() not in want:
            return f"holds {key} with {t.dim()} axes, where a {kind} entry has {' or '.join(map(str, want))}"
        if t.numel() and not bool(torch.isfinite(t).all()):
            return f"holds NaN or Inf values in {key}"
    main = tensors[name]
    if kind == "latents" and "loss_mask" in tensors and tensors["loss_mask"].shape[-2:] != main.shape[-2:]:
        return f"holds a loss_mask of {tuple(tensors['loss_mask'].shape)} for latents of {tuple(main.shape)}"
    if kind == "latents":
        return _control_problem(tensors, main)
    mask = tensors.get("prompt_mask")
    if kind == "text" and mask is not None:
        if mask.shape[0] != main.shape[0]:
            return f"holds a prompt_mask of {mask.shape[0]} tokens for {main.shape[0]} embedded tokens"
        if not bool(((mask == 0) | (mask == 1)).all()):
            return "holds a prompt_mask with values other than 0 and 1"
    return None


_CONTROL = re.compile(CONTROL_FIELD.format(r"(\d+)"))


def _control_problem(tensors: dict[str, torch.Tensor], main: torch.Tensor) -> str | None:
    """Why an entry's control latents do not go with its ``latents``: a gap in their numbers, other axes or
    channels; None when they do (or there are none)."""
    numbers = sorted(int(m[1]) for key in tensors if (m := _CONTROL.fullmatch(key)))
    if numbers != list(range(len(numbers))):
        return f"holds control latents numbered {numbers}, where they are numbered from 0 without gaps"
    for n in numbers:
        control = tensors[CONTROL_FIELD.format(n)]
        if control.dim() != main.dim() or control.shape[0] != main.shape[0]:
            return (f"holds {CONTROL_FIELD.format(n)} of {tuple(control.shape)} beside latents of {tuple(main.shape)}, "
                    "where a control has the latents' axes and channels")
    return None


class EntryFormError(DigestError):
    """A cache entry whose hash holds but whose tensors do not fit its kind."""


def read_entry(path: str | os.PathLike, kind: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the cache entry at ``path``, its hash and its kind's rules checked (``kind``: by default the
    name of its folder, ``latents`` or ``text``); a :class:`DigestError` says what is wrong."""
    kind = kind or ("latents" if Path(path).parent.name == "latents" else "text")
    tensors = read_hashed(path)
    problem = entry_problem(kind, tensors)
    if problem is not None:
        raise EntryFormError(f"{problem}, so it is not a {kind} entry this version wrote")
    return tensors


def model_problem(kind: str, tensors: dict[str, torch.Tensor], recipe, config) -> str | None:
    """Why an entry of ``kind`` (of its kind's form) was not made by the encoders of the model whose training
    ``recipe`` and ``config`` are given: other latent channels, a latent height or width the denoiser cannot patch
    (an odd side for FLUX's 2x2 packing), another text width, or a pooled embedding missing or of another width; None
    when it fits."""
    if kind == "latents":
        controls = [t.shape for k, t in sorted(tensors.items()) if _CONTROL.fullmatch(k)]
        return next(filter(None, (_latent_problem(shape, recipe, config)
                                  for shape in [tensors["latents"].shape, *controls])), None)
    fields = recipe.text_fields(config)
    width = tensors["prompt_embeds"].shape[-1]
    if width != fields.width:
        return f"holds prompt_embeds {width} wide, where this model takes {fields.width}"
    pooled = tensors.get("pooled_prompt_embeds")
    if fields.pooled and (pooled is None or pooled.shape[-1] != fields.pooled):
        return f"has no pooled_prompt_embeds {fields.pooled} wide, which this model takes"
    return None


def _latent_problem(shape, recipe, config) -> str | None:
    """Why a latent of ``shape`` (``[C, h, w]`` or ``[C, F, h, w]``) does not fit the model: other channels, or sides
    that are not whole multiples of its patch (``recipe.latent_multiple``: the VAE turns every bucket into such sides,
    so an odd one was edited in, and would end in the model's patching)."""
    want, got = recipe.latent_channels(config), shape[0]
    if got != want:
        return f"holds latents of {got} channels, where this model takes {want}"
    multiple, (h, w) = int(recipe.latent_multiple(config)), shape[-2:]
    if h < multiple or w < multiple or h % multiple or w % multiple:
        return (f"holds latents {h}x{w} in size, where this model takes a height and width that are non-zero "
                f"multiples of {multiple}")
    return None
