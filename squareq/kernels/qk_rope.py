"""A query's or key's per-head RMS norm and rotary embedding as one operation (FLUX's attention, before SDPA).

:func:`qk_norm_rope` is the definition, in torch ops and in the order the diffusers FLUX attention processor runs
them: ``torch.nn.RMSNorm`` over ``head_dim`` (its output rounded to the input's dtype), then the rotation of each pair
``(x[2i], x[2i+1])`` by the token's angle, in float32 (``x·cos + rotate(x)·sin``). :func:`qk_norm_rope_into` writes
the result into a slice of a larger tensor (the joint text + image sequence), by the Triton kernel of
:mod:`.triton_qk_rope` on a GPU and by the definition elsewhere: on a CPU the definition is the same values, and
the interpreted kernel would cost a tenth of a second a call (tests/kernels/test_qk_rope.py runs it there).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import backend_for


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` normalized per head (RMS, ``weight [D]``, ``eps``) and rotated by ``cos``/``sin``
    (``[S, D]``, each pair's value repeated), in ``x``'s dtype."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    even, odd = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-odd, even], dim=-1).flatten(3)
    return (y.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(x.dtype)


def kernel_fits(x: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                weight: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernel takes these operands: bf16 heads with contiguous ``head_dim`` (a power of two) and
    heads in ``x`` and ``out`` of one shape, float32 angles ``[S, D]`` with contiguous rows, a contiguous ``[D]``
    weight (or none), all on one device."""
    d = x.shape[-1]
    same_device = all(t.device == x.device for t in (out, cos, sin) + (() if weight is None else (weight,)))
    return (same_device and x.dim() == 4 and out.shape == x.shape and x.dtype == out.dtype == torch.bfloat16
            and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (x.shape[1], d)
            and d >= 2 and d & (d - 1) == 0 and x.stride(3) == 1 and x.stride(2) == d and out.stride(3) == 1
            and out.stride(2) == d and cos.stride(1) == 1 and sin.stride() == cos.stride()
            and (weight is None or (weight.shape == (d,) and weight.stride(0) == 1)))


def qk_norm_rope_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Write :func:`qk_norm_rope` of ``x`` into ``out`` (a ``[B, S, H, D]`` view, e.g. a slice of the joint
    sequence); returns ``out``."""
    if backend_for(x.device) == "triton" and kernel_fits(x, out, cos, sin, weight):
        from .triton_qk_rope import qk_norm_rope_into as launch

        launch(out, x, weight, eps, cos, sin)
    else:
        out.copy_(qk_norm_rope(x, weight, eps, cos, sin))
    return out
