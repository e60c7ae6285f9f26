"""One GPTQ factor shared by several runs (squareq/quant/gptq.py ``gptq_factor``): the same bits as factoring at each
run, in every stored space, and refused for a space it was not made for; learned rounding's matrix likewise."""
import pytest
import torch

from squareq import quant
from squareq.quant import QuantSpec

from .test_refine import _sigma

K, N = 128, 24
W = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
SCALE = torch.rand(K, generator=torch.Generator().manual_seed(4)) + 0.5


@pytest.mark.parametrize("space,smooth", [(QuantSpec(bits=4), False), (QuantSpec(bits=4, rotate=True), False),
                                          (QuantSpec(bits=4, smooth=True), True)])
def test_a_shared_factor_gives_the_bits_of_factoring_at_each_run(space, smooth):
    sigma, scale = _sigma(), (SCALE if smooth else None)
    factor = quant.gptq_factor(sigma, space, scale, damp=0.1)
    for bits, clip in ((4, 1.0), (6, 0.9), (8, 1.0)):  # other widths and clips in the same space
        spec = QuantSpec(bits=bits, clip_ratio=clip, rotate=space.rotate, smooth=space.smooth)
        alone = quant.gptq_quantize(W, spec, sigma, scale, damp=0.1)
        shared = quant.gptq_quantize(W, spec, sigma, scale, damp=0.1, factor=factor)
        assert all(torch.equal(alone.tensors[r], shared.tensors[r]) for r in alone.tensors)


def test_a_factor_of_another_space_is_refused_in_a_sentence():
    sigma = _sigma()
    plain = quant.gptq_factor(sigma, QuantSpec(bits=4), damp=0.1)
    with pytest.raises(ValueError, match="made for another space"):
        quant.gptq_quantize(W, QuantSpec(bits=4, rotate=True), sigma, damp=0.1, factor=plain)
    smoothed = quant.gptq_factor(sigma, QuantSpec(bits=4, smooth=True), SCALE, damp=0.1)
    with pytest.raises(ValueError, match="made for another space"):  # the same values, another scale tensor
        quant.gptq_quantize(W, QuantSpec(bits=4, smooth=True), sigma, SCALE.clone(), damp=0.1, factor=smoothed)
    with pytest.raises(ValueError, match="another layer"):
        quant.gptq_quantize(W[:, :64], QuantSpec(bits=4), sigma[:64, :64], damp=0.1, factor=plain)
    with pytest.raises(ValueError, match="made with damping 0.1, not 0.01"):
        quant.gptq_quantize(W, QuantSpec(bits=4), sigma, damp=0.01, factor=plain)


def test_a_rotated_factor_needs_whole_groups_and_says_so():
    sigma = _sigma()[:96, :96]
    with pytest.raises(ValueError, match="whole number of groups"):
        quant.gptq_factor(sigma, QuantSpec(bits=4, rotate=True), damp=0.1)


def test_a_shared_refinement_matrix_gives_the_same_codes():
    sigma = _sigma()
    qw = quant.gptq_quantize(W, QuantSpec(bits=4, rotate=True), sigma, damp=0.1)
    alone, rounds = quant.refine_rounding(qw, W, sigma, damp=0.1)
    stored = quant.stored_hessian(sigma, qw.spec, None, W.device, damp=0.1)
    shared, shared_rounds = quant.refine_rounding(qw, W, sigma, sigma=stored)
    assert rounds > 0 and rounds == shared_rounds and torch.equal(alone.tensors["qweight"], shared.tensors["qweight"])
