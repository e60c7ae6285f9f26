import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from squareq.quant import (
    QuantSpec,
    SpecError,
    dequantize,
    fake_quantize,
    quantize,
    rel_mse,
    smoothing_scale,
    sqnr_db,
    tensor_layout,
    weighted_sq_error,
)

specs = st.builds(
    QuantSpec,
    bits=st.sampled_from([4, 6, 8]),
    group_size=st.sampled_from([8, 16, 64]),
    symmetric=st.booleans(),
    scale_dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
)


@settings(max_examples=80, deadline=None)
@given(spec=specs, n=st.integers(1, 4), k=st.integers(1, 150), seed=st.integers(0, 2**31),
       magnitude=st.sampled_from([1e-3, 1.0, 300.0]))
def test_round_trip_error_is_within_half_a_step(spec, n, k, seed, magnitude):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * magnitude
    qw = quantize(w, spec)
    for role, (dtype, shape) in tensor_layout(spec, (n, k)).items():
        assert qw.tensors[role].dtype == dtype and tuple(qw.tensors[role].shape) == shape
    approx = fake_quantize(w, spec)
    assert torch.equal(approx.to(torch.bfloat16), dequantize(qw))
    step = qw.tensors["scales"].float().repeat_interleave(spec.group_size, dim=1)[:, :k]
    assert ((approx - w).abs() <= step * 0.5001 + 1e-30).all()


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 6, 8]), symmetric=st.booleans(), k=st.integers(1, 100), seed=st.integers(0, 2**31))
def test_values_on_the_grid_come_back_exactly(bits, symmetric, k, seed):
    assume(symmetric or k % 16 != 1)  # an asymmetric group needs room for both ends of the range
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric, scale_dtype="float32")
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-spec.qmax, spec.qmax + 1, (3, k), generator=g)
    q[:, ::16] = spec.qmax  # every group spans the full symmetric range
    if not symmetric:
        q[:, 1::16] = spec.qmin
    w = q.float() * 0.125
    assert torch.equal(dequantize(quantize(w, spec)).float(), w)


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_all_zero_groups_dequantize_to_zero(bits, symmetric):
    w = torch.randn(3, 40)
    w[:, 16:32] = 0
    w[1] = 0
    spec = QuantSpec(bits=bits, group_size=16, symmetric=symmetric)
    out = dequantize(quantize(w, spec))
    assert (out[:, 16:32] == 0).all() and (out[1] == 0).all()
    assert torch.isfinite(quantize(w, spec).tensors["scales"].float()).all()


def test_scale_overflow_is_refused_with_a_fix():
    w = torch.full((2, 16), 1e6)
    with pytest.raises(SpecError, match="scale_dtype"):
        quantize(w, QuantSpec(bits=4, group_size=16, scale_dtype="float16"))
    out = dequantize(quantize(w, QuantSpec(bits=4, group_size=16, scale_dtype="bfloat16")))
    assert float(rel_mse(w, out)) < 1e-4


def test_nan_weights_are_refused():
    w = torch.randn(2, 16)
    w[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize(w, QuantSpec())


def test_passthrough_keeps_bf16():
    w = torch.randn(5, 7)
    qw = quantize(w, QuantSpec(bits=16))
    assert list(qw.tensors) == ["weight"]
    assert torch.equal(dequantize(qw), w.to(torch.bfloat16))


def test_error_bounds_on_gaussian_weights():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    w8 = dequantize(quantize(w, QuantSpec(bits=8, group_size=64)))
    assert float(rel_mse(w, w8, dim=1).max()) < 1e-4
    w4 = dequantize(quantize(w, QuantSpec(bits=4, group_size=64)))
    assert float(rel_mse(w, w4)) < 1e-2
    w6 = dequantize(quantize(w, QuantSpec(bits=6, group_size=64)))
    assert float(rel_mse(w, w8)) < float(rel_mse(w, w6)) < float(rel_mse(w, w4))


def test_smoothing_folds_back_to_the_original_weight():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 64, generator=g)
    act = torch.rand(64, generator=g) + 0.1
    act[[3, 17]] = 40.0
    s = smoothing_scale(act, w, alpha=0.5)
    spec = QuantSpec(bits=8, group_size=16, smooth=True)
    qw = quantize(w, spec, s)
    assert torch.allclose(qw.tensors["inv_smooth"], 1 / s)
    assert float(rel_mse(w, dequantize(qw))) < 3e-4


def test_smoothing_lowers_output_error_for_outlier_activations():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=g)
    x = torch.randn(512, 256, generator=g)
    x[:, :4] *= 50.0  # a few outlier input channels, as in trained diffusion transformers
    h = x.pow(2).mean(0)
    spec = QuantSpec(bits=4, group_size=64)
    plain = weighted_sq_error(w, fake_quantize(w, spec), h)
    s = smoothing_scale(x.abs().amax(0), w, alpha=0.5)
    smoothed = weighted_sq_error(w, fake_quantize(w, QuantSpec(bits=4, group_size=64, smooth=True), s), h)
    assert smoothed < 0.5 * plain


def test_smoothing_needs_a_scale():
    with pytest.raises(SpecError):
        quantize(torch.randn(4, 16), QuantSpec(group_size=16, smooth=True))
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 16), QuantSpec(group_size=16, smooth=True), -torch.ones(16))


def test_metrics():
    a = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    assert float(rel_mse(a, a)) == 0 and sqnr_db(a, a) == math.inf
    b = a.clone()
    b[0, 0] += 1.0
    assert math.isclose(float(rel_mse(a, b)), 1 / 26)
    assert math.isclose(sqnr_db(a, b), 10 * math.log10(26))
    assert torch.allclose(rel_mse(a, b, dim=1), torch.tensor([1 / 25, 0.0], dtype=torch.float64))
    assert weighted_sq_error(a, b, torch.tensor([2.0, 1.0])) == 2.0
