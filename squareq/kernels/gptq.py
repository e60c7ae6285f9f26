"""Which implementation of GPTQ's column sweep a device gets: the Triton kernel on CUDA, the torch reference
elsewhere (both give the same bits; on a CPU the interpreted kernel would only be slower)."""
from __future__ import annotations

import torch

from ..quant.gptq import BlockSweep
from .backend import backend_for


def gptq_sweep(device: torch.device | str) -> BlockSweep | None:
    """The block sweep to pass to :func:`squareq.quant.gptq_quantize` for weights on ``device`` (None: the
    reference)."""
    if backend_for(device) != "triton":
        return None
    from .triton_gptq import triton_sweep_block

    return triton_sweep_block
