"""What a file's first bytes say it is, where safetensors cannot open it: a PyTorch pickle under a safetensors name
is named as one, since the way out differs (convert it, never load it) from a damaged download (fetch it again)."""
from __future__ import annotations

PICKLE, ZIP = "pickle", "zip"


def pickled_format(head: bytes) -> str | None:
    """:data:`ZIP` (torch.save's archive, ``PK``), :data:`PICKLE` (the legacy format's raw pickle, protocol byte
    0x80), or None (anything else). ``head``: the file's first bytes; where it holds nine, a safetensors header's
    ``{`` after its 8-byte length wins, since that length may itself begin with either."""
    if head[8:9] == b"{":
        return None
    if head.startswith(b"PK"):
        return ZIP
    return PICKLE if head[:1] == b"\x80" else None
