"""The effects pass's attention: the same values and gradients as scaled_dot_product_attention, a few heads at a
time, and the mode that routes a model's calls to it."""
import pytest
import torch
import torch.nn.functional as F

from squareq.kernels import lean_attention as lean
from squareq.kernels.lean_attention import LeanAttentionMode, lean_attention


def _grads(fn, *tensors, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    out.backward(g)
    return out.detach(), [t.grad for t in leaves]


def _qkv(shape_q, shape_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape_q, generator=g, dtype=torch.float64), torch.randn(shape_k, generator=g, dtype=torch.float64),
            torch.randn(shape_k, generator=g, dtype=torch.float64))


CASES = {
    "plain": dict(),
    "bool mask per key": dict(attn_mask=torch.tensor([True, True, False, True, True, False, True]).view(1, 1, 1, 7)),
    "float mask": dict(attn_mask=torch.randn(1, 3, 5, 7, generator=torch.Generator().manual_seed(2),
                                             dtype=torch.float64)),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_scaled_dot_product_attention_values_and_gradients(case, monkeypatch):
    monkeypatch.setattr(lean, "STEP_BYTES", 2 * 4 * 5 * 7)  # two heads per step: the groups must join correctly
    q, k, v = _qkv((2, 3, 5, 4), (2, 3, 7, 4))
    want, want_g = _grads(F.scaled_dot_product_attention, q, k, v, **CASES[case])
    got, got_g = _grads(lean_attention, q, k, v, **CASES[case])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_causal_three_dimensional_and_grouped_query_inputs_match():
    q, k, v = _qkv((2, 6, 4), (2, 6, 4))
    for a, b in zip(_grads(lean_attention, q, k, v, is_causal=True)[1],
                    _grads(F.scaled_dot_product_attention, q, k, v, is_causal=True)[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    q, k, v = _qkv((1, 4, 5, 4), (1, 2, 7, 4))
    for a, b in zip(_grads(lean_attention, q, k, v, enable_gqa=True)[1],
                    _grads(F.scaled_dot_product_attention, q, k, v, enable_gqa=True)[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_wrong_gradient_would_be_caught(monkeypatch):
    """Negative control: the comparison above fails when the softmax gradient drops its row-sum term."""
    q, k, v = _qkv((1, 2, 5, 4), (1, 2, 7, 4))
    real = torch.Tensor.sub_
    monkeypatch.setattr(torch.Tensor, "sub_", lambda self, other: self)  # dP − rowsum(dO ⊙ O) becomes dP
    got = _grads(lean_attention, q, k, v)[1]
    monkeypatch.setattr(torch.Tensor, "sub_", real)
    want = _grads(F.scaled_dot_product_attention, q, k, v)[1]
    assert not torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_the_mode_routes_attention_calls_and_leaves_dropout_alone():
    q, k, v = _qkv((1, 2, 5, 4), (1, 2, 7, 4))
    calls = []
    real = lean.lean_attention
    with LeanAttentionMode():
        lean_spy = lambda *a, **kw: (calls.append(kw), real(*a, **kw))[1]
        lean.lean_attention = lean_spy
        try:
            out = F.scaled_dot_product_attention(q, k, v, scale=0.5)
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        finally:
            lean.lean_attention = real
    assert len(calls) == 1 and calls[0]["scale"] == 0.5
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, scale=0.5))


def test_refuses_what_it_cannot_compute():
    q, k, v = _qkv((1, 2, 5, 4), (1, 2, 7, 4))
    with pytest.raises(ValueError, match="dropout"):
        lean_attention(q, k, v, dropout_p=0.1)
