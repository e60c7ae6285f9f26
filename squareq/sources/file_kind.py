"""What a file that safetensors cannot open is: a PyTorch pickle under a safetensors name is named as one, since
the way out differs (convert it, never load it) from a damaged download (fetch it again)."""
from __future__ import annotations

from pathlib import Path


def pickle_kind(path: Path | str) -> str | None:
    """"a zip archive (torch.save output)" or "a pickle" where ``path`` opens as one, else None (a safetensors file,
    or something else). A safetensors file opens with its header's length (8 bytes, little-endian) then the JSON
    header's ``{``; torch.save writes a zip archive (``PK``) or, in the legacy format, a raw pickle (protocol byte
    0x80)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return None
    if head[8:9] == b"{":
        return None
    if head.startswith(b"PK"):
        return "a zip archive (torch.save output)"
    return "a pickle" if head[:1] == b"\x80" else None


def unreadable(path: Path | str, reason: object) -> str:
    """The start of the sentence for a file safetensors refused with ``reason``: a pickle named as one (SquareQ never
    loads pickles: loading one can run code), anything else as an unreadable safetensors file."""
    kind = pickle_kind(path)
    if kind is not None:
        return (f"{path} is {kind}, not a safetensors file, and SquareQ never loads pickles (loading one can run "
                "code); get the .safetensors file, or convert it with safetensors.torch.save_file where you trust it")
    return f"{path} is not a readable safetensors file ({reason})"
