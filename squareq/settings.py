"""Every environment variable SquareQ reads, in one place.

Each is read when asked, not at import, so a test or a long-lived process that sets one sees it. The exception is
the fused kernels' autotuning list (``fused_autotune`` and ``triton_interpret``), which Triton fixes when
``squareq.kernels.triton_fused`` is imported.
"""
from __future__ import annotations

import os
from pathlib import Path

KERNELS = "SQUAREQ_KERNELS"  # "torch": the torch references instead of the Triton kernels
FUSED_MAX_M = "SQUAREQ_FUSED_MAX_M"  # the largest M of the fused matmuls: one number, or bits:M pairs
FUSED_VARIANT = "SQUAREQ_FUSED_VARIANT"  # gemv | mma: force one fused kernel shape (experiments)
FUSED_AUTOTUNE = "SQUAREQ_FUSED_AUTOTUNE"  # "0": one fixed configuration instead of autotuning
TRACE = "SQUAREQ_TRACE"  # a Chrome trace path for every runtime.load
SHM_DIR = "SQUAREQ_SHM_DIR"  # where the host-shared copy of a slab lives (default /dev/shm)
TRITON_INTERPRET = "TRITON_INTERPRET"  # "1": Triton kernels run on the CPU (how CI tests them)
HF_HUB_OFFLINE = "HF_HUB_OFFLINE"  # "1": Hub IDs resolve from the local cache only (huggingface_hub's own switch)
HF_HUB_CACHE = "HF_HUB_CACHE"  # the Hugging Face cache folder (huggingface_hub's; unset: its default)


def torch_kernels_forced() -> bool:
    """``SQUAREQ_KERNELS=torch``: every kernel call goes to its torch reference."""
    return os.environ.get(KERNELS, "").lower() == "torch"


def triton_interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels on CPU tensors, in its interpreter. Read as Triton reads it (1,
    true, on or yes, in any case), so SquareQ and Triton never disagree on whether the interpreter runs."""
    return os.environ.get(TRITON_INTERPRET, "0").strip().lower() in ("1", "true", "on", "yes")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (1, true, on or yes), read now: huggingface_hub itself reads it
    once, when first imported."""
    return os.environ.get(HF_HUB_OFFLINE, "0").strip().lower() in ("1", "true", "on", "yes")


def hub_cache() -> str | None:
    """``HF_HUB_CACHE`` read now (None: huggingface_hub's default, which also follows HF_HOME)."""
    return os.environ.get(HF_HUB_CACHE) or None


def fused_max_m() -> str | None:
    """The raw ``SQUAREQ_FUSED_MAX_M`` override (parsed by squareq.kernels.crossover), or None."""
    return os.environ.get(FUSED_MAX_M)


def fused_variant() -> str | None:
    return os.environ.get(FUSED_VARIANT) or None


def fused_autotune() -> bool:
    return os.environ.get(FUSED_AUTOTUNE) != "0"


def trace_path() -> str | None:
    return os.environ.get(TRACE) or None


def shm_dir() -> Path:
    return Path(os.environ.get(SHM_DIR) or "/dev/shm")
