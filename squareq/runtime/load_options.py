"""``LoadOptions``: how :func:`squareq.runtime.load` runs a slab, as one frozen object (as torchao's configs are), and
the keywords ``load`` took before it, which still work for one release with a ``DeprecationWarning``.

docs/runtime.md's table says more about each field; fields that ``auto`` resolves at load report the choice and why
on ``runtime_of(model)``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, fields

HOSTS = ("pinned", "shared", "disk", "auto")


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`squareq.runtime.load` runs a slab: ``runtime.load(slab, device, options=LoadOptions(...))``."""

    prefetch: int = 2
    """K, the device slots of the block ring: K-1 blocks are copied ahead of the one computing (1: no overlap)."""
    host: str = "pinned"
    """Where block blobs wait: "pinned" RAM, "shared" (one pinned copy per host), "disk" or "auto" (host_choice.py)."""
    stream: bool = True
    """Stream blocks through the ring; False keeps every block on the device (the resident reference)."""
    verify: str | bool = "eager"
    """The slab's sha256 checks: "eager" hashes every block before load returns, "lazy" at first read, "off" never."""
    trace: str | os.PathLike | None = None
    """A Chrome trace to write (None: the ``SQUAREQ_TRACE`` environment variable's path, if set)."""
    compute: str = "bf16"
    """The base layers' matmul: "bf16", "fp8" (E4M3, per-token and per-channel scales) or "auto" (compute.py)."""
    cuda_graphs: bool = False
    """Capture each streamed block's forward and recompute + backward as CUDA graphs, and replay them (CUDA only)."""
    fused_attention: bool = True
    """Give FLUX attention the processor that fuses query and key norm with rotary embedding (flux_attention.py)."""
    compile_blocks: bool = False
    """Run each block's forward under torch.compile, one graph per block class and grad mode (block_compile.py)."""
    attention: str = "auto"
    """Attention kernels preferred: "auto" (cuDNN's where measured faster), "cudnn" or "default" (torch's order)."""
    dtype: str = "bf16"
    """Activations' and dequantized weights' type: "bf16", "fp16" (GPUs without bf16) or "auto"; autocast to it."""

    def __post_init__(self) -> None:
        if self.host not in HOSTS:
            raise ValueError(f"host={self.host!r}: choose one of {', '.join(HOSTS)}.")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"prefetch={self.prefetch!r}: the number of block slots must be an integer of at least 1.")


_OLD_KEYWORDS = frozenset(f.name for f in fields(LoadOptions))
# the old keywords warn once per process, however many loads use them (a training run loads more than once)
_keywords_warned = False


def options_from_keywords(options: LoadOptions | None, keywords: dict) -> LoadOptions:
    """The :class:`LoadOptions` that ``load``'s old ``keywords`` (``prefetch=...``, ``host=...``) ask for, with one
    ``DeprecationWarning`` per process; refused beside ``options``, and for a keyword ``load`` never had."""
    global _keywords_warned
    unknown = sorted(set(keywords) - _OLD_KEYWORDS)
    if unknown:
        raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r}")
    if options is not None:
        raise TypeError(f"load() takes options=LoadOptions(...) or the old keywords ({', '.join(sorted(keywords))}), "
                        "not both; move them into the LoadOptions.")
    if not _keywords_warned:
        _keywords_warned = True
        warnings.warn(f"runtime.load's keywords ({', '.join(sorted(keywords))}) are deprecated and will be removed "
                      "in the next release; pass options=LoadOptions(...) instead.", DeprecationWarning, stacklevel=3)
    return LoadOptions(**keywords)
