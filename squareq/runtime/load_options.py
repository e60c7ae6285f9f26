"""``LoadOptions``: how :func:`squareq.runtime.load` runs a slab, as one frozen object (as torchao's configs are), and
the arguments ``load`` took before it (keywords, or positional after ``device``), which still work for one release with
a ``FutureWarning``.

docs/runtime.md's table says more about each field; fields that ``auto`` resolves at load report the choice and why
on ``runtime_of(model)``.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

from ..slab.reader import verify_mode
from .attention_choice import check_attention
from .compute import check_compute, check_dtype

HOSTS = ("pinned", "shared", "disk", "auto")


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`squareq.runtime.load` runs a slab: ``runtime.load(slab, device, options=LoadOptions(...))``."""

    prefetch: int = 2
    """K, the device slots of the block ring: K-1 blocks are copied ahead of the one computing (1: no overlap)."""
    host: str = "pinned"
    """Where block blobs wait: "pinned" RAM, "shared" (one pinned copy per host), "disk" or "auto" (host/budget.py)."""
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
        check_compute(self.compute)
        check_attention(self.attention)
        check_dtype(self.dtype)
        # open_slab's sentence, here too: a Slab handed to load is never opened by it
        verify_mode(self.verify)


# load's signature at 43312c4, after ``device``: the order its options could be passed in by position
OLD_ORDER = ("prefetch", "host", "stream", "verify", "trace", "compute", "cuda_graphs", "fused_attention",
             "compile_blocks", "attention", "dtype")
# the old arguments warn once per process, however many loads use them (a training run loads more than once)
_old_arguments_warned = False


def options_from_old_arguments(options: LoadOptions | None, positional: tuple, keywords: dict) -> LoadOptions:
    """The :class:`LoadOptions` that ``load``'s old arguments ask for: ``positional`` ones after ``device`` (in
    :data:`OLD_ORDER`) and ``keywords`` (``prefetch=...``, ``host=...``), with one ``FutureWarning`` per process that
    points at ``load``'s caller; refused beside ``options``, and for arguments ``load`` never had."""
    global _old_arguments_warned
    if any(isinstance(p, LoadOptions) for p in positional):
        raise TypeError("load() takes its LoadOptions by name, not as a positional argument: "
                        "load(slab, device, options=LoadOptions(...)).")
    if len(positional) > len(OLD_ORDER):
        raise TypeError(f"load() takes from 1 to {2 + len(OLD_ORDER)} positional arguments but "
                        f"{2 + len(positional)} were given")
    unknown = sorted(set(keywords) - set(OLD_ORDER))
    if unknown:
        raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r}")
    named = dict(zip(OLD_ORDER, positional, strict=False))
    twice = sorted(set(named) & set(keywords))
    if twice:
        raise TypeError(f"load() got multiple values for argument {twice[0]!r}")
    named.update(keywords)
    if options is not None:
        raise TypeError(f"load() takes options=LoadOptions(...) or the old keywords ({', '.join(sorted(named))}), "
                        "not both; move them into the LoadOptions.")
    if not _old_arguments_warned:
        _old_arguments_warned = True
        kind = " and ".join(k for k, given in (("positional options", positional), ("keywords", keywords)) if given)
        warnings.warn(f"runtime.load's {kind} ({', '.join(named)}) are deprecated and will be removed in the next "
                      "release; pass options=LoadOptions(...) instead.", FutureWarning, stacklevel=3)
    return LoadOptions(**named)
