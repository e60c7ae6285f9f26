"""An encoder's identity in cache keys: which weights computed an entry, so that other weights (a fine-tuned VAE, an
fp8 T5) never read entries another encoder wrote."""
from __future__ import annotations

import json
import math

import torch

from ..slab.digest import content_key
from .encoder_source import EncoderError


class NonFiniteWeights(EncoderError):
    """An encoder's weights hold NaN or Inf: every entry it computed would be NaN."""


def module_identity(module: torch.nn.Module, name: str, dtype: torch.dtype | None = None, source: str = "") -> str:
    """A short, stable identity for an encoder: its class, config and every parameter's name, shape and a
    checksum of its values (float64 sum and sum of squares), so different weights give different keys. ``dtype``:
    the dtype it runs in, in which the values and the config's dtype are taken, as if it had been loaded in it: an
    encoder loaded in its file's own dtype and cast block by block (sources/encoder_files.py) keeps the key it had
    when it was cast on load. The same sums check the weights: a tensor with NaN or Inf is refused
    (:class:`NonFiniteWeights`), naming it and ``source``, where its file came from."""
    config = getattr(module, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    config = {k: v for k, v in config.items() if not str(k).startswith("_") and k != "transformers_version"}
    if dtype is not None:
        config.update({k: str(dtype).removeprefix("torch.") for k in ("torch_dtype", "dtype") if k in config})
    sums = []
    with torch.no_grad():
        for pname, p in module.state_dict().items():
            total, squares = _sums(p.detach(), dtype if dtype is not None and p.is_floating_point() else None)
            if not (math.isfinite(total) and math.isfinite(squares)):
                raise NonFiniteWeights(
                    f"the {name} of {source or 'the encoders'} holds NaN or Inf values in its tensor {pname}, so "
                    "every latent or text embedding it computed would be NaN; replace that file (download or export "
                    "it again) and run the command again.")
            sums.append([pname, list(p.shape), round(total, 6), round(squares, 6)])
    return content_key(name, type(module).__name__, json.loads(json.dumps(config, default=str)), sums)[:16]


IDENTITY_CHUNK = 1 << 24  # elements summed at a time: float64 copies of one chunk, never of a whole embedding table


def _sums(t: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[float, float]:
    """float64 sum and sum of squares of ``t``, a chunk at a time: a 131072 x 5120 embedding on the GPU would
    otherwise take two 5.4 GB float64 copies beside the encoder it identifies (measured: 16.7 GB allocated while
    caching for FLUX.2 on a 24 GB card, against 12 GB planned)."""
    flat = t.reshape(-1)
    cast = (lambda x: x.to(dtype).double()) if dtype is not None else (lambda x: x.double())  # noqa: E731
    if flat.numel() <= IDENTITY_CHUNK:  # one chunk: the sums as they were always taken
        values = cast(flat)
        return float(values.sum()), float(values.square().sum())
    total = squares = 0.0
    for start in range(0, flat.numel(), IDENTITY_CHUNK):
        values = cast(flat[start:start + IDENTITY_CHUNK])
        total += float(values.sum())
        squares += float(values.square().sum())
    return total, squares
