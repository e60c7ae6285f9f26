"""Learned rounding (squareq/quant/refine.py): it lowers the calibration objective it descends, in every stored space
(plain, smoothed, rotated, symmetric), keeps the format's bytes, scales and code range, and moves nothing where no
step helps."""
import pytest
import torch

from squareq import quant
from squareq.quant import QuantSpec, refine_rounding

K, N = 128, 24


def _sigma(seed: int = 0) -> torch.Tensor:
    """E[x xᵀ] of correlated inputs with a few loud channels (the shape of real activations)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2048, K, generator=g) @ (torch.eye(K) + 0.4 * torch.randn(K, K, generator=g) / K**0.5)
    x[:, :4] *= 6
    return x.T @ x / x.shape[0]


def _objective(w, qw, sigma):
    e = (w - quant.dequantize(qw).float()).double()
    return float(torch.einsum("nk,kl,nl->", e, sigma.double(), e))


@pytest.mark.parametrize("spec,smooth", [
    (QuantSpec(bits=4), False),
    (QuantSpec(bits=4, symmetric=True, group_size=32), False),
    (QuantSpec(bits=6, smooth=True), True),
    (QuantSpec(bits=4, rotate=True), False),
    (QuantSpec(bits=8, rotate=True, clip_ratio=0.9), False),
])
def test_it_lowers_the_calibration_objective_and_keeps_the_format(spec, smooth):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(N, K, generator=g)
    sigma = _sigma()
    scale = torch.rand(K, generator=g) + 0.5 if smooth else None
    qw = quant.gptq_quantize(w, spec, sigma, scale, damp=0.1)
    moved, rounds = refine_rounding(qw, w, sigma)
    assert rounds > 0 and _objective(w, moved, sigma) < 0.97 * _objective(w, qw, sigma)
    assert moved.spec == qw.spec and set(moved.tensors) == set(qw.tensors)
    for role in qw.tensors:
        assert moved.tensors[role].dtype == qw.tensors[role].dtype and moved.tensors[role].shape == qw.tensors[role].shape
        if role != "qweight":
            assert torch.equal(moved.tensors[role], qw.tensors[role])  # scales, zero points, 1/s unchanged
    codes = quant.unpack(moved.tensors["qweight"], spec.bits, K)
    assert int(codes.min()) >= (-spec.qmax if spec.symmetric else spec.qmin) and int(codes.max()) <= spec.qmax


def test_rounding_to_nearest_is_already_best_for_the_weight_error_and_nothing_moves():
    """With Σ = I the objective is the weight error, which round-to-nearest minimizes code by code (the control: the
    descent must not move codes that no step improves)."""
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    qw = quant.quantize(w, QuantSpec(bits=4))
    moved, rounds = refine_rounding(qw, w, torch.eye(K))
    assert rounds == 0 and torch.equal(moved.tensors["qweight"], qw.tensors["qweight"])


def test_what_has_no_codes_is_refused_in_a_sentence():
    w = torch.randn(N, K)
    with pytest.raises(ValueError, match="learned rounding moves integer codes; bf16 has none to move"):
        refine_rounding(quant.quantize(w, QuantSpec(bits=16)), w, torch.eye(K))
    with pytest.raises(ValueError, match=r"needs a \[24, 128\] weight and a \[128, 128\] Hessian"):
        refine_rounding(quant.quantize(w, QuantSpec(bits=4)), w, torch.eye(64))
