"""A FLUX attention processor with each query's and key's RMS norm and rotary embedding in one kernel.

diffusers' ``FluxAttnProcessor`` runs ``torch.nn.RMSNorm`` and then ``apply_rotary_emb`` on the query and the key of
every block: a norm kernel and about eight elementwise kernels per tensor, with float32 temporaries, and a
``torch.cat`` joining the text and image parts. On an H200 at 1024² these took about a sixth of a denoising step
(docs/benchmarks.md, "Sampling at 1024² with fused attention"). :class:`FusedFluxAttnProcessor` computes the same
values with :func:`squareq.kernels.qk_rope.qk_norm_rope_into`, which writes each part straight into its place in the
joint sequence. Everything else (the projections, SDPA through diffusers' attention dispatcher, the output projections)
is the stock processor's.

It takes over only where its result is the stock one's in value: no autograd, eval mode and no streamed training
pass (training keeps the stock ops, whose backward it does not have, also in a checkpointed forward that runs
without autograd), the rotary embedding given as ``(cos, sin)`` of the joint sequence's length, no attention mask
and unfused projections; any other call goes to the stock processor. :func:`install_fused_attention` sets it on a
model's FLUX attention modules that run the stock processor; ``squareq.runtime.load`` does this unless told not to.
"""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.qk_rope import qk_norm_rope_into
from .blocks import in_training_pass


def _stock_processor_class():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    return FluxAttnProcessor


def _eps(norm: nn.Module, dtype: torch.dtype) -> float:
    return norm.eps if norm.eps is not None else torch.finfo(dtype).eps  # torch.nn.RMSNorm's own default


def _heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, head_dim))


class FusedFluxAttnProcessor:
    """``FluxAttnProcessor`` with the query/key norm and rotary embedding fused (module docstring)."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self) -> None:
        self.stock = _stock_processor_class()()

    def _fits(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states, attention_mask,
              image_rotary_emb) -> bool:
        if torch.compiler.is_compiling():  # inductor fuses the stock ops itself (runtime/block_compile.py)
            return False
        if (torch.is_grad_enabled() or attn.training or in_training_pass() or attention_mask is not None
                or self._parallel_config is not None or getattr(attn, "fused_projections", False)
                or hidden_states.dtype != torch.bfloat16
                or (encoder_hidden_states is not None and attn.added_kv_proj_dim is None)):
            return False
        norms = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if encoder_hidden_states is not None else ())
        if not all(isinstance(getattr(attn, n, None), nn.RMSNorm) for n in norms):
            return False
        if not isinstance(image_rotary_emb, tuple | list) or len(image_rotary_emb) != 2:
            return False
        length = hidden_states.shape[1] + (0 if encoder_hidden_states is None else encoder_hidden_states.shape[1])
        # the stock processor broadcasts (or refuses) any other table; leave those to it
        return all(t.shape == (length, attn.head_dim) for t in image_rotary_emb)

    def _stock(self, *args) -> torch.Tensor:
        self.stock._attention_backend, self.stock._parallel_config = self._attention_backend, self._parallel_config
        return self.stock(*args)

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None) -> torch.Tensor:
        if not self._fits(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb):
            return self._stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        joint = encoder_hidden_states is not None
        parts = [(hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)]
        if joint:  # the text part comes first in the joint sequence
            parts.insert(0, (encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                             attn.norm_added_q, attn.norm_added_k))
        projected = [(states, _heads(to_q(states), attn.head_dim), _heads(to_k(states), attn.head_dim),
                      _heads(to_v(states), attn.head_dim), norm_q, norm_k)
                     for states, to_q, to_k, to_v, norm_q, norm_k in parts]
        q0 = projected[0][1]
        shape = (q0.shape[0], sum(p[0].shape[1] for p in parts), *q0.shape[2:])
        query = torch.empty(shape, dtype=q0.dtype, device=q0.device)
        key = torch.empty_like(query)
        cos, sin = (t.to(q0.device) for t in image_rotary_emb)  # as apply_rotary_emb moves them
        start = 0
        for states, q, k, _, norm_q, norm_k in projected:
            end = start + states.shape[1]
            qk_norm_rope_into(query[:, start:end], q, norm_q.weight, _eps(norm_q, q.dtype), cos[start:end],
                              sin[start:end])
            qk_norm_rope_into(key[:, start:end], k, norm_k.weight, _eps(norm_k, k.dtype), cos[start:end],
                              sin[start:end])
            start = end
        values = [p[3] for p in projected]
        value = values[0] if len(values) == 1 else torch.cat(values, dim=1)
        out = dispatch_attention_fn(query, key, value, attn_mask=None, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if not joint:
            return out
        text, image = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def install_fused_attention(model: nn.Module) -> int:
    """Give every FLUX attention module of ``model`` that runs the stock ``FluxAttnProcessor`` a
    :class:`FusedFluxAttnProcessor`; returns how many took it (0 for other families)."""
    try:
        stock = _stock_processor_class()
    except ImportError:  # a diffusers without FLUX
        return 0
    count = 0
    for module in model.modules():
        if type(getattr(module, "processor", None)) is stock and hasattr(module, "set_processor"):
            module.set_processor(FusedFluxAttnProcessor())
            count += 1
    return count
