"""Where a model's VAE and text encoders come from: the error when they cannot be found, the pipeline folder of a
model source, and the precision tag of a cache identity. Shared by the FLUX encoders (encoders.py) and the other
families' (family_encoders.py): the latter imports it, not encoders.py, so the two modules do not import each other.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..models import BUILTIN_MODELS


class EncoderError(ValueError):
    """The VAE or text encoders cannot be found; the message names where SquareQ looked."""


def pipeline_folder(source: str | Path) -> Path | None:
    """The diffusers pipeline folder holding the VAE and text encoders of ``source`` (None for a built-in tiny model,
    whose encoders are built in); raises :class:`EncoderError` naming ``source`` when there is none. Loads nothing."""
    if str(source) in BUILTIN_MODELS:
        return None
    source = Path(source).expanduser()
    folder = source.parent if (source.parent / "model_index.json").is_file() else source
    if not (folder / "model_index.json").is_file():
        raise EncoderError(f"{source} is not a diffusers pipeline folder (no model_index.json there or in its parent), "
                           "so SquareQ cannot find the VAE and text encoders; pass the pipeline folder with --model.")
    return folder


def dtype_tag(dtype: torch.dtype) -> str:
    """The part of an encoder's cache identity that says which precision computed its entries (bf16 on a GPU and
    fp32 on a CPU give different bits)."""
    return f":{dtype}".replace("torch.", "")
