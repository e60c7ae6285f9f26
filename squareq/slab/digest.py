"""sha256 of what is later trusted: a file's bytes, and the tensors of a hashed safetensors file (a training cache
entry), whose hash travels in the file's own metadata and is checked when it is read."""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

import torch

from .safetensors_file import safetensors_bytes

ENTRY_HASH = "sha256"  # the metadata key of a hashed safetensors file


class DigestError(ValueError):
    """A hashed file is not as it was written; the message says how (``"does not match its hash"``)."""


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, read in chunks (never the whole file in memory)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def hashed_safetensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """``tensors`` as safetensors bytes (SquareQ's one writer, slab/safetensors_file.py), their hash in the
    metadata."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return safetensors_bytes(tensors, {ENTRY_HASH: tensors_sha256(tensors)})


def read_hashed(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a file :func:`hashed_safetensors` wrote, or :class:`DigestError` saying what is wrong."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            recorded = (f.metadata() or {}).get(ENTRY_HASH)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged headers and data
        raise DigestError(f"is unreadable ({' '.join(str(exc).split())[:100]})") from None
    if recorded is None:
        raise DigestError("carries no hash (an older SquareQ wrote it)")
    if tensors_sha256(tensors) != recorded:
        raise DigestError("does not match its hash (its bytes changed after it was written)")
    return tensors


def content_key(*parts) -> str:
    """sha256 over ``parts`` (bytes as they are; anything else as canonical JSON)."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, (bytes, bytearray)) else json.dumps(part, sort_keys=True).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
