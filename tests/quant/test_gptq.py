import functools
import logging

import pytest
import torch

from squareq.quant import (
    QuantSpec,
    dequantize,
    fake_quantize,
    gptq_quantize,
    gptq_quantize_with_info,
    input_hessian,
    output_rel_mse,
    quantize,
    rel_mse,
    smoothing_scale,
    tensor_layout,
)
from squareq.quant.rtn import group_params, round_to_grid

OUTLIERS = [7, 70, 150, 201]


@functools.cache
def correlated_layer(seed, n=128, k=256, rows=2048):
    """Weights and inputs with correlated channels: a random rotation of a power-law spectrum (the
    i-th eigenvalue of E[x xᵀ] ∝ 1/i, a stand-in for real activations' decaying spectra), plus a few 20×
    outlier channels. Returns (w, calibration rows, held-out rows); cached, so never modify them."""
    g = torch.Generator().manual_seed(seed)
    left, _ = torch.linalg.qr(torch.randn(k, k, generator=g))
    right, _ = torch.linalg.qr(torch.randn(k, k, generator=g))
    mix = (left * (torch.arange(k) + 1.0) ** -0.5) @ right.T
    x = torch.randn(2 * rows, k, generator=g) @ mix
    x = x / x.std(dim=0).mean()
    x[:, [c for c in OUTLIERS if c < k]] *= 20.0
    w = torch.randn(n, k, generator=g) * 0.05
    return w, x[:rows], x[rows:]


def out_err(w, qw, x):
    return output_rel_mse(w, dequantize(qw).float(), x)


def ratio(w, spec, x_cal, x_eval, smooth_scale=None, **kw):
    h = input_hessian(x_cal)
    gptq = out_err(w, gptq_quantize(w, spec, h, smooth_scale=smooth_scale, **kw), x_eval)
    rtn = out_err(w, quantize(w, spec, smooth_scale), x_eval)
    return gptq / rtn


@pytest.fixture(scope="module")
def layer():
    return correlated_layer(0)


# GPTQ/RTN output rel-MSE ratios measured on this layer (seed 0, W4 g64), on the calibration rows /
# on held-out rows: asym 0.44/0.48, sym 0.45/0.49, act_order asym 0.35/0.41, sym 0.34/0.41 (seeds 1-4:
# 0.37-0.45 / 0.41-0.51 without act_order, 0.29-0.34 / 0.35-0.40 with). The claim is
# "roughly half"; the bound leaves a margin.
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4_output_error_is_well_below_round_to_nearest(layer, symmetric, act_order):
    w, x_cal, x_held = layer
    spec = QuantSpec(bits=4, group_size=64, symmetric=symmetric)
    assert ratio(w, spec, x_cal, x_cal, act_order=act_order) < 0.6
    assert ratio(w, spec, x_cal, x_held, act_order=act_order) < 0.6  # not just fitted to the calibration rows


# Measured (calibration / held-out rows): W6 0.45/0.50, W8 0.50/0.54.
@pytest.mark.parametrize("bits", [6, 8])
def test_w6_w8_improve_too(layer, bits):
    w, x_cal, x_held = layer
    assert ratio(w, QuantSpec(bits=bits, group_size=64), x_cal, x_held) < 0.65


# Uncorrelated unit-variance inputs: H is the identity up to sampling noise, so there is little to
# compensate. On the calibration rows GPTQ is still a little better (0.94 at 2048 rows); on held-out
# rows, compensating the sampling noise of H costs about K/(2·rows): measured 1.15 with 1024 rows,
# 1.07 with 2048, 1.017 with 8192, 1.005 with 32768 (K = 256; here 1.011 / 1.006 with 16384).
# Calibrate on many more rows than K.
@pytest.mark.parametrize("symmetric", [False, True])
def test_uncorrelated_inputs_are_not_made_worse(symmetric):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.05
    x = torch.randn(16384 + 4096, 256, generator=g)
    spec = QuantSpec(bits=4, group_size=64, symmetric=symmetric)
    assert ratio(w, spec, x[:2048], x[:2048]) < 1.0
    assert ratio(w, spec, x[:16384], x[16384:]) < 1.03


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec(bits=4, group_size=64),
        QuantSpec(bits=4, group_size=16, symmetric=True, clip_ratio=0.9),
        QuantSpec(bits=6, group_size=32, scale_dtype="bfloat16"),
        QuantSpec(bits=8, group_size=64, symmetric=True, scale_dtype="float32"),
    ],
    ids=lambda s: s.label() + (f" clip{s.clip_ratio}" if s.clip_ratio < 1 else ""),
)
@pytest.mark.parametrize("k", [256, 200])
@pytest.mark.parametrize("act_order", [False, True])
def test_stored_format_is_the_round_to_nearest_format(spec, k, act_order):
    w, x, _ = correlated_layer(1, n=48, k=k, rows=1024)
    qw = gptq_quantize(w, spec, input_hessian(x), act_order=act_order)
    layout = tensor_layout(spec, (48, k))
    assert set(qw.tensors) == set(layout)
    for role, (dtype, shape) in layout.items():
        assert qw.tensors[role].dtype == dtype and tuple(qw.tensors[role].shape) == shape, role
    assert qw.shape == (48, k) and qw.spec == spec
    out = dequantize(qw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert out_err(w, qw, x) < out_err(w, quantize(w, spec), x)


def test_act_order_stores_codes_in_original_column_order():
    # With a diagonal H no error is passed on, so whatever the processing order the codes must be
    # exactly the round-to-nearest codes in their original columns.
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 200, generator=g)
    h = torch.diag(torch.rand(200, generator=g) * 10 + 0.1)
    for spec in (QuantSpec(bits=4, group_size=64), QuantSpec(bits=6, group_size=16, symmetric=True, clip_ratio=0.85)):
        ref = quantize(w, spec)
        for act_order in (False, True):
            got = gptq_quantize(w, spec, h, act_order=act_order)
            for role in ref.tensors:
                assert torch.equal(got.tensors[role], ref.tensors[role]), (spec, act_order, role)


@pytest.mark.parametrize("act_order", [False, True])
def test_identity_hessian_reproduces_round_to_nearest_bit_for_bit(act_order):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 72, generator=g)
    s = torch.rand(72, generator=g) + 0.5
    spec = QuantSpec(bits=4, group_size=16, smooth=True)
    got = gptq_quantize(w, spec, torch.eye(72), smooth_scale=s, act_order=act_order)
    ref = quantize(w, spec, s)
    assert all(torch.equal(got.tensors[r], ref.tensors[r]) for r in ref.tensors)


def reference_gptq(w, spec, h, damp, act_order=False):
    """Unblocked float64 GPTQ written with explicit inverse-Hessian downdates (no Cholesky)."""
    n, k = w.shape
    g = spec.group_size
    h = h.double()
    perm = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(k)
    if act_order:  # static groups from the original weight
        padded = torch.nn.functional.pad(w.float(), (0, -k % g)).reshape(n, -1, g)
        static_s, static_z = group_params(padded, spec)
    w = w.double()[:, perm].clone()
    h = h[perm][:, perm]
    hinv = torch.linalg.inv(h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64))
    deq = torch.empty_like(w)
    for j in range(k):
        col = int(perm[j])
        if act_order:
            s, z = static_s[:, col // g].float(), None if static_z is None else static_z[:, col // g]
        elif j % g == 0:
            s, z = group_params(w[:, j : j + g].float(), spec)
            s = s.float()
        q = round_to_grid(w[:, j].float(), s, z, spec)
        d = ((q if z is None else q - z) * s).double()
        deq[:, col] = d
        e = (w[:, j] - d) / hinv[j, j]
        w[:, j + 1 :] -= e[:, None] * hinv[j, j + 1 :][None, :]
        hinv = hinv - hinv[:, j : j + 1] @ hinv[j : j + 1, :] / hinv[j, j]
    return deq


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_size", [7, 32, 1000])
def test_blocked_sweep_matches_an_unblocked_reference(block_size, act_order):
    w, x, _ = correlated_layer(6, n=16, k=72, rows=512)
    h = input_hessian(x)
    spec = QuantSpec(bits=4, group_size=16, scale_dtype="float32")
    ref = reference_gptq(w, spec, h, damp=0.01, act_order=act_order)
    qw = gptq_quantize(w, spec, h, damp=0.01, block_size=block_size, act_order=act_order)
    same = dequantize(qw).double() == ref.to(torch.bfloat16).double()
    assert same.double().mean() > 0.99  # measured 1.0; float32 vs float64 could flip a rare near-tie
    assert out_err(w, qw, x) == pytest.approx(output_rel_mse(w, ref, x), rel=0.05)


def test_smoothing_is_handled_in_the_smoothed_input_space(layer):
    w, x_cal, x_held = layer
    spec = QuantSpec(bits=4, group_size=64, smooth=True)
    s = smoothing_scale(x_cal.abs().amax(dim=0), w, alpha=0.5)
    qw = gptq_quantize(w, spec, input_hessian(x_cal), smooth_scale=s)
    assert torch.allclose(qw.tensors["inv_smooth"], 1.0 / s)
    # 1/s is folded back in: the effective weight is W (GPTQ trades weight error for output error,
    # measured weight rel-MSE 0.024 vs RTN's 0.016), not W·diag(s).
    assert float(rel_mse(w, dequantize(qw).float())) < 0.1
    # Measured: 0.44 / 0.49 of RTN with the same smoothing (calibration / held-out rows); act_order 0.47.
    assert ratio(w, spec, x_cal, x_held, smooth_scale=s) < 0.6
    assert ratio(w, spec, x_cal, x_held, smooth_scale=s, act_order=True) < 0.6


def test_smoothing_with_a_wrong_space_hessian_would_be_worse(layer):
    # Guards the diag(1/s) H diag(1/s) mapping: the right Hessian must do at least as well as
    # pretending the smoothed weight saw the raw inputs.
    w, x_cal, _ = layer
    spec = QuantSpec(bits=4, group_size=64, smooth=True)
    s = smoothing_scale(x_cal.abs().amax(dim=0), w, alpha=0.5)
    h = input_hessian(x_cal)
    right = out_err(w, gptq_quantize(w, spec, h, smooth_scale=s), x_cal)
    wrong = out_err(w, gptq_quantize(w, spec, h * s[:, None] * s[None, :], smooth_scale=s), x_cal)
    assert right < wrong


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dead_channels_and_rank_deficient_hessians(act_order, symmetric):
    g = torch.Generator().manual_seed(7)
    k = 96
    w = torch.randn(24, k, generator=g)
    x = torch.randn(512, 20, generator=g) @ torch.randn(20, k, generator=g)  # rank 20 of 96
    x[:, [5, 40]] = 0.0  # channels that never see a signal
    spec = QuantSpec(bits=4, group_size=32, symmetric=symmetric)
    qw, info = gptq_quantize_with_info(w, spec, input_hessian(x), act_order=act_order)
    out = dequantize(qw).float()
    assert torch.isfinite(out).all() and not info.fell_back_to_rtn and info.dead_channels == 2
    # A dead column is still the nearest grid point of its original values (within half a step).
    step = qw.tensors["scales"].float().repeat_interleave(32, dim=1)[:, :k]
    for c in (5, 40):
        assert ((out[:, c] - w[:, c]).abs() <= step[:, c] * 0.5 + 0.01 * w[:, c].abs()).all()
    assert out_err(w, qw, x) < out_err(w, quantize(w, spec), x)


def test_all_zero_hessian_and_zero_weights():
    spec = QuantSpec(bits=4, group_size=16)
    w = torch.randn(4, 32)
    w[1] = 0
    w[:, 16:] = 0
    qw = gptq_quantize(w, spec, torch.zeros(32, 32))
    assert torch.equal(dequantize(qw), dequantize(quantize(w, spec)))


def test_a_hessian_that_will_not_factor_falls_back_to_rtn_with_a_warning(caplog):
    g = torch.Generator().manual_seed(8)
    w = torch.randn(8, 32, generator=g)
    h = torch.eye(32)
    h[0, 1] = h[1, 0] = 1e5  # indefinite far beyond what damping fixes
    spec = QuantSpec(bits=4, group_size=16)
    with caplog.at_level(logging.WARNING, logger="squareq.quant"):
        qw, info = gptq_quantize_with_info(w, spec, h)
    assert info.fell_back_to_rtn
    assert "round-to-nearest" in caplog.text
    ref = quantize(w, spec)
    assert all(torch.equal(qw.tensors[r], ref.tensors[r]) for r in ref.tensors)


def test_bad_inputs_are_refused_and_passthrough_passes_through():
    w = torch.randn(4, 32)
    with pytest.raises(ValueError, match="Hessian"):
        gptq_quantize(w, QuantSpec(bits=4, group_size=16), torch.eye(16))
    h = torch.eye(32)
    h[3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, QuantSpec(bits=4, group_size=16), h)
    with pytest.raises(ValueError, match="damp"):
        gptq_quantize(w, QuantSpec(bits=4, group_size=16), torch.eye(32), damp=-1.0)
    qw = gptq_quantize(w, QuantSpec(bits=16), torch.eye(32))
    assert torch.equal(qw.tensors["weight"], w.to(torch.bfloat16))


def test_output_rel_mse():
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(6, 10, generator=g), torch.randn(3, 5, 10, generator=g)
    approx = w + 0.1 * torch.randn(6, 10, generator=g)
    y, y_hat = x @ w.T, x @ approx.T
    assert output_rel_mse(w, approx, x) == pytest.approx(float(((y - y_hat) ** 2).sum() / (y**2).sum()), rel=1e-6)
    assert output_rel_mse(w, w, x) == 0.0
    assert output_rel_mse(torch.zeros(6, 10), torch.zeros(6, 10), x) == 0.0
    assert output_rel_mse(w, fake_quantize(w, QuantSpec(bits=8, group_size=8)), x) < 1e-4
