"""Scaled dot-product attention that keeps no attention matrix for its backward pass, and a mode that routes a
model's ``F.scaled_dot_product_attention`` calls to it.

The compiler's effects pass needs every layer's output gradient, repeatably: two runs of a compile must give the
same bits, so that a tight VRAM budget builds the same slab. PyTorch's memory-efficient kernel adds its gradients
with atomics (not repeatable), FlashAttention takes no float32, and the math kernel keeps the probabilities and
their gradients, ``4 · heads · L · S`` bytes each: for one FLUX.1 sample at 512 px (24 heads, 1,536 tokens) that is
0.9 GB, more than the rest of a block's backward. Here the forward pass runs a few heads at a time and saves only
``q, k, v`` and the output; the backward pass recomputes each group's probabilities and applies the textbook
softmax gradient. Every step is a plain matrix product or elementwise operation, so the result is the same bits on
every run, and at most one group of heads' ``L × S`` matrices is alive at once (:data:`STEP_BYTES`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

STEP_BYTES = 64 << 20  # float32 bytes of one group of heads' L x S matrix


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _heads_per_step(heads: int, length: int, keys: int) -> int:
    return max(1, min(heads, STEP_BYTES // max(4 * length * keys, 1)))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """Probabilities ``softmax(q kᵀ · scale + mask)`` of one group of heads, in float32 at least; rows that see no
    key are 0."""
    s = (q @ k.transpose(-1, -2)).to(_wide(q.dtype)).mul_(scale)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            s.masked_fill_(~mask, float("-inf"))
        else:
            s.add_(mask.to(s.dtype))
    return torch.softmax(s, dim=-1).nan_to_num_(0.0)


class _LeanAttention(torch.autograd.Function):
    """``softmax(q kᵀ · scale + mask) v`` for ``q [B, H, L, E]``, ``k [B, H, S, E]``, ``v [B, H, S, Ev]`` and a
    mask broadcastable to ``[B, H, L, S]``, a group of heads at a time in both directions."""

    @staticmethod
    def forward(ctx, q, k, v, mask, causal: bool, scale: float):
        b, h, length, _ = q.shape
        step = _heads_per_step(h, length, k.shape[-2])
        mask = None if mask is None else mask.expand(b, h, length, k.shape[-2])
        out = q.new_empty((b, h, length, v.shape[-1]))
        for i in range(b):
            for h0 in range(0, h, step):
                part = slice(h0, h0 + step)
                p = _scores(q[i, part], k[i, part], None if mask is None else mask[i, part], causal, scale)
                out[i, part] = (p.to(v.dtype) @ v[i, part])
        ctx.save_for_backward(q, k, v, out, mask)
        ctx.causal, ctx.scale, ctx.step = causal, scale, step
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, mask = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        wide = _wide(q.dtype)
        for i in range(q.shape[0]):
            for h0 in range(0, q.shape[1], ctx.step):
                part = slice(h0, h0 + ctx.step)
                qi, ki, vi = q[i, part], k[i, part], v[i, part]
                gi = grad[i, part].to(wide)
                p = _scores(qi, ki, None if mask is None else mask[i, part], ctx.causal, ctx.scale)
                dv[i, part] = (p.transpose(-1, -2) @ gi).to(v.dtype)
                # dS = P ⊙ (dP − rowsum(dO ⊙ O)), with dP = dO vᵀ
                ds = (gi @ vi.to(wide).transpose(-1, -2)).sub_((gi * out[i, part].to(wide)).sum(-1, keepdim=True))
                ds.mul_(p).mul_(ctx.scale)
                dq[i, part] = (ds @ ki.to(wide)).to(q.dtype)
                dk[i, part] = (ds.transpose(-1, -2) @ qi.to(wide)).to(k.dtype)
        return dq, dk, dv, None, None, None


def lean_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention`'s result (same arguments; no dropout, a mask that
    takes no gradient), with a backward pass that keeps no attention matrix (module docstring)."""
    if dropout_p != 0.0 or (torch.is_tensor(attn_mask) and attn_mask.requires_grad):
        raise ValueError("lean_attention takes no dropout and no mask that requires a gradient.")
    if attn_mask is not None and is_causal:
        raise ValueError("lean_attention takes a mask or is_causal, not both (as scaled_dot_product_attention).")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    lead = query.shape[:-2]
    if enable_gqa and key.dim() >= 3 and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[-3:]) if t.dim() >= 4 else t.reshape(1, -1, *t.shape[-2:])

    q, k, v = four(query), four(key.expand(*lead, *key.shape[-2:])), four(value.expand(*lead, *value.shape[-2:]))
    mask = None
    if attn_mask is not None:
        mask = four(attn_mask.expand(*lead, query.shape[-2], key.shape[-2]))
    out = _LeanAttention.apply(q, k, v, mask, bool(is_causal), float(scale))
    return out.reshape(*lead, query.shape[-2], value.shape[-1])


class LeanAttentionMode(TorchFunctionMode):
    """Inside: every ``F.scaled_dot_product_attention`` call without dropout runs :func:`lean_attention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args))
            bound.update(kwargs)
            mask = bound.get("attn_mask")
            if bound.get("dropout_p", 0.0) == 0.0 and not (torch.is_tensor(mask) and mask.requires_grad):
                return lean_attention(**bound)
        return func(*args, **kwargs)
