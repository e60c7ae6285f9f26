"""What SquareQ reads from a model folder on disk: safetensors only, and a cheap identity of the folder.

``refuse_pickled`` is the one place a component folder holding only pickled weights (``pytorch_model.bin`` and kin)
is refused, before any loader sees it: transformers and diffusers would unpickle such a file (``weights_only`` limits
what a pickle may build, but it still runs the unpickler on a stranger's bytes, and a refused payload ends in a
traceback). Every loader also passes ``use_safetensors=True``; this check is what turns the refusal into a sentence.

``source_identity`` is what a slab records for each local folder or file it names (``model.source_identity``), so a
later command that picks that folder by default can tell that it changed since the compile (docs/guarantees.md).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path

from ..models.base import ModelError
from .hub import MODEL_FILES

__all__ = ["PICKLE_SUFFIXES", "refuse_pickled", "source_identity"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
# a safetensors file's identity reads its header and this many evenly spaced chunks of its data, so a 10 GB file
# costs about a megabyte of reading while a swapped or re-trained file (whose every tensor differs) still shows
_SAMPLES, _SAMPLE_BYTES = 16, 1 << 16


def refuse_pickled(*folders: str | Path) -> None:
    """Refuse, in one sentence naming the file and how to convert it, the first of ``folders`` that holds pickled
    weights and no ``*.safetensors`` file; folders that do not exist are left to the loader to report."""
    for folder in map(Path, folders):
        if not folder.is_dir() or any(folder.glob("*.safetensors")):
            continue
        pickles = sorted(f for f in folder.iterdir() if f.suffix in PICKLE_SUFFIXES and f.is_file())
        if not pickles:
            continue
        first = pickles[0]
        target = folder / (re.sub(r"^pytorch_model", "model", first.stem) + ".safetensors")  # transformers' name
        command = (f"python -c \"import torch; from safetensors.torch import save_file; save_file({{k: v.contiguous()"
                   f".clone() for k, v in torch.load({str(first)!r}, weights_only=True).items()}}, {str(target)!r})\"")
        shards = (f" (and each of its {len(pickles) - 1} other pickled files, then write a .safetensors.index.json, or "
                  "re-save the model with save_pretrained(..., safe_serialization=True))" if len(pickles) > 1 else "")
        raise ModelError(f"{first} holds pickled weights and {folder} has no .safetensors file; SquareQ reads "
                         f"safetensors only (unpickling a file can run code), so convert it once with {command}"
                         f"{shards}.")


def source_identity(where: str | Path) -> str | None:
    """sha256 identity of a local model source: a file, or a folder (the pipeline around it when its parent holds
    ``model_index.json``) with its direct subfolders' model files (configs, tokenizer files, safetensors). None for
    what is not an absolute path that exists (a built-in name, a Hub ID: pinned to a commit already)."""
    path = Path(where)
    if not path.is_absolute() or not path.exists():
        return None
    if path.is_file():
        root, files = path.parent, [path]
    else:
        root = path.parent if (path.parent / "model_index.json").is_file() else path
        folders = [root, *sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))]
        files = [f for d in folders for f in sorted(d.iterdir()) if f.is_file() and not f.name.startswith(".")
                 and any(fnmatch.fnmatch(f.name, p) for p in MODEL_FILES)]
    digest = hashlib.sha256()
    for f in files:
        digest.update(json.dumps([f.relative_to(root).as_posix(), *_file_identity(f)]).encode() + b"\n")
    return digest.hexdigest()


def _file_identity(path: Path) -> list:
    """A file's size and sha256: of all its bytes, or for a safetensors file of its header and sampled data."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if path.suffix != ".safetensors" or not 0 <= n <= size - 8:  # not (readable as) safetensors: all of it
            f.seek(0)
            while chunk := f.read(1 << 20):
                digest.update(chunk)
            return [size, digest.hexdigest()]
        digest.update(head + f.read(n))
        start, data = 8 + n, size - 8 - n
        if data <= _SAMPLES * _SAMPLE_BYTES:  # small enough to read whole
            spans = [(start, data)]
        else:  # the first and last chunk and those evenly between
            step = (data - _SAMPLE_BYTES) / (_SAMPLES - 1)
            spans = [(start + int(i * step), _SAMPLE_BYTES) for i in range(_SAMPLES)]
        for offset, length in spans:
            f.seek(offset)
            digest.update(f.read(length))
    return [size, digest.hexdigest()]
