"""Which files an encoder source's VAE and text encoders come from, as one key: the cache remembers the identities
its encoders had under that key, so a run whose cache holds every entry need not load them to name its entries."""
from __future__ import annotations

from pathlib import Path

import torch

from ..slab.digest import content_key
from .encoder_source import EncoderSource, dtype_tag, pipeline_folder
from .local_files import source_identity


def encoder_files_key(source: EncoderSource, family: str, dtype: torch.dtype) -> str | None:
    """A key of ``source``'s files (its pipeline folder's model files, each single file: their sizes and sampled
    content, sources/local_files.py), the family and the dtype the encoders run in; None for a built-in model,
    whose encoders are built in seconds and have no files."""
    folder = pipeline_folder(source)
    if folder is None:
        return None
    parts = [source_identity(folder.resolve())] + [[flag, source_identity(Path(path).expanduser().resolve())]
                                                   for flag, path in source.files]
    if parts[0] is None or any(identity is None for _, identity in parts[1:]):
        return None
    return content_key("encoder files", family, dtype_tag(dtype), parts)
