"""The fused query/key norm + rotary embedding (kernels/qk_rope.py) equals diffusers' RMSNorm then apply_rotary_emb."""
import os

import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb

from squareq.kernels.qk_rope import kernel_fits, qk_norm_rope, qk_norm_rope_into

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernel in the Triton interpreter (test_qk_rope_gpu.py: on CUDA)")


def _kernel(out, x, weight, eps, cos, sin):
    from squareq.kernels.triton_qk_rope import qk_norm_rope_into as launch

    assert kernel_fits(x, out, cos, sin)
    launch(out, x, weight, eps, cos, sin)


def _angles(tokens: int, head_dim: int, seed: int = 1):
    ang = torch.randn(tokens, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 3
    return ang.cos().repeat_interleave(2, 1), ang.sin().repeat_interleave(2, 1)


def _stock(x, weight, eps, cos, sin):
    norm = torch.nn.RMSNorm(x.shape[-1], eps=eps, elementwise_affine=weight is not None).to(x.dtype)
    if weight is not None:
        norm.weight.data.copy_(weight)
    return apply_rotary_emb(norm(x), (cos, sin), sequence_dim=1)


def _case(batch=2, tokens=37, heads=3, head_dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a projection's output viewed as heads, and a slice of it: token rows with a stride wider than heads x head_dim
    wide = (torch.randn(batch, tokens, heads * head_dim + 8, generator=g) * 4).bfloat16()
    x = wide[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    weight = (torch.rand(head_dim, generator=g) + 0.5).bfloat16()
    return x, weight, *_angles(tokens, head_dim)


def test_definition_is_diffusers_norm_then_rotation():
    x, weight, cos, sin = _case()
    assert torch.equal(qk_norm_rope(x, weight, 1e-6, cos, sin), _stock(x, weight, 1e-6, cos, sin))
    assert not torch.equal(qk_norm_rope(x, weight, 1e-6, sin, cos), _stock(x, weight, 1e-6, cos, sin))


@interpreted
@pytest.mark.parametrize("with_weight", [True, False])
def test_kernel_writes_the_stock_values_into_its_slice(with_weight):
    x, weight, cos, sin = _case()
    weight = weight if with_weight else None
    joint = torch.full((2, 37 + 5, 3, 32), 7.0, dtype=torch.bfloat16)
    target = joint[:, 5:]
    _kernel(target, x, weight, 1e-6, cos, sin)
    assert torch.equal(target, _stock(x, weight, 1e-6, cos, sin))
    assert torch.equal(joint[:, :5], torch.full_like(joint[:, :5], 7.0))  # the text part is left alone


@interpreted
def test_kernel_catches_a_wrong_angle():
    """Negative control: rotating by the wrong token's angles must not pass for the stock values."""
    x, weight, cos, sin = _case()
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    _kernel(out, x, weight, 1e-6, cos.roll(1, 0), sin.roll(1, 0))
    assert not torch.equal(out, _stock(x, weight, 1e-6, cos, sin))


def test_the_cpu_and_operands_the_kernel_does_not_take_go_to_the_definition():
    x, weight, cos, sin = _case()
    out = torch.empty(x.shape, dtype=torch.float32)
    assert not kernel_fits(x.float(), out, cos, sin)
    assert not kernel_fits(x, torch.empty(x.shape, dtype=torch.bfloat16).transpose(1, 2), cos, sin)
    bf16_out = torch.empty(x.shape, dtype=torch.bfloat16)
    assert kernel_fits(x, bf16_out, cos, sin, weight)  # the control: these operands fit
    assert not kernel_fits(x, bf16_out, cos[:-1], sin[:-1], weight)  # an angle table one token short
    assert not kernel_fits(x, bf16_out, cos, sin, weight[:-1])  # a weight of the wrong length
    qk_norm_rope_into(out, x.float(), weight.float(), 1e-6, cos, sin)
    assert torch.equal(out, _stock(x.float(), weight.float(), 1e-6, cos, sin))
    joint = torch.zeros((2, 40, 3, 32), dtype=torch.bfloat16)
    qk_norm_rope_into(joint[:, 3:], x, weight, 1e-6, cos, sin)  # bf16 on the CPU: the definition, written in place
    assert torch.equal(joint[:, 3:], _stock(x, weight, 1e-6, cos, sin)) and not joint[:, :3].any()
