"""The sentence for a file safetensors cannot open: a PyTorch pickle under a safetensors name named as one."""
from __future__ import annotations

from pathlib import Path

from ..slab.file_head import PICKLE, ZIP, pickled_format


def pickle_kind(path: Path | str) -> str | None:
    """"a zip archive (torch.save output)" or "a pickle" where ``path`` opens as one (slab/file_head.py), else None
    (a safetensors file, something else, or no file)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return None
    return {PICKLE: "a pickle", ZIP: "a zip archive (torch.save output)"}.get(pickled_format(head))


def unreadable(path: Path | str, reason: object) -> str:
    """The start of the sentence for a file safetensors refused with ``reason``: a pickle named as one (SquareQ never
    loads pickles: loading one can run code), anything else as an unreadable safetensors file."""
    kind = pickle_kind(path)
    if kind is not None:
        return (f"{path} is {kind}, not a safetensors file, and SquareQ never loads pickles (loading one can run "
                "code); get the .safetensors file, or convert it with safetensors.torch.save_file where you trust it")
    return f"{path} is not a readable safetensors file ({reason})"
