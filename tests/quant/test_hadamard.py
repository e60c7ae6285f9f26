"""The grouped Hadamard transform (squareq/quant/hadamard.py); rotated specs through quantize, dequantize and GPTQ."""
import dataclasses

import pytest
import torch

from squareq import quant
from squareq.quant import QuantSpec, dequantize, fake_quantize, gptq_quantize, hadamard, quantize
from squareq.quant.hadamard import rotated_diagonal, scale_factor


def sylvester(g: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order g by Kronecker products, normalized, in float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < g:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / g**0.5


@pytest.mark.parametrize("g", [8, 16, 32, 64, 128])
def test_the_transform_is_the_normalized_sylvester_matrix_orthonormal_and_its_own_inverse(g):
    eye = torch.eye(g, dtype=torch.float64)
    h = hadamard(eye, g)
    torch.testing.assert_close(h, sylvester(g), rtol=0, atol=1e-15)
    torch.testing.assert_close(h @ h, eye, rtol=0, atol=1e-14)
    x = torch.randn(5, 3 * g, dtype=torch.float64, generator=torch.Generator().manual_seed(g))
    torch.testing.assert_close(hadamard(hadamard(x, g), g), x, rtol=0, atol=1e-13)
    torch.testing.assert_close(hadamard(x, g).norm(dim=1), x.norm(dim=1), rtol=1e-14, atol=0)
    # each group is transformed alone: the second group of a row never sees the first
    y = x.clone()
    y[:, :g] = 0
    assert torch.equal(hadamard(y, g)[:, g:], hadamard(x, g)[:, g:]) and not hadamard(y, g)[:, :g].any()


def test_at_group_64_the_scaling_is_exact_and_small_integers_come_back_exactly():
    assert scale_factor(64) == 0.125 and scale_factor(16) == 0.25
    assert scale_factor(128) == float(torch.tensor(2**-3.5, dtype=torch.float32))  # odd log2: nearest float32
    x = torch.randint(-8, 8, (4, 256), generator=torch.Generator().manual_seed(0)).float()
    assert torch.equal(hadamard(hadamard(x, 64), 64), x)


def test_bad_groups_and_widths_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.zeros(2, 96), 48)
    with pytest.raises(ValueError, match="whole number of Hadamard groups"):
        hadamard(torch.zeros(2, 100), 64)
    with pytest.raises(ValueError, match="floating"):
        hadamard(torch.zeros(2, 64, dtype=torch.int32), 64)


def test_rotated_diagonal_is_the_diagonal_of_the_rotated_matrix():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 128, generator=g, dtype=torch.float64)
    m = x.T @ x
    full = hadamard(hadamard(m, 32).T, 32).T
    torch.testing.assert_close(rotated_diagonal(m, 32), full.diagonal(), rtol=1e-12, atol=0)
    assert not torch.allclose(rotated_diagonal(m, 32), m.diagonal())  # it is not the unrotated diagonal


def _grid_weight(n=16, k=128, group=64):
    """A weight exactly on the asymmetric W4 grid of every group (each group holds the codes -8 and 7, scale 2^-4):
    plain rounding stores it without error."""
    q = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(2))
    q[:, ::group], q[:, 1::group] = -8, 7
    return q.float() / 16


def _outlier_weight(n=32, k=128):
    """Gaussian rows with one 30x input column per group of 64: plain W4 rounding spends its range on it."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    w[:, 5::64] *= 30
    return w


def test_a_rotated_spec_stores_w_times_h_and_dequantizes_back():
    spec = QuantSpec(bits=4, group_size=64)
    rot = dataclasses.replace(spec, rotate=True)
    w = _outlier_weight()
    qw = quantize(w, rot)
    assert qw.spec == rot and set(qw.tensors) == set(quantize(w, spec).tensors)  # the same roles and bytes
    stored = quantize(hadamard(w, 64), spec)
    assert all(torch.equal(qw.tensors[r], stored.tensors[r]) for r in qw.tensors)
    decoded = quant.FORMATS["int"].decode(stored.tensors, spec, w.shape[1])
    assert torch.equal(dequantize(qw), hadamard(decoded, 64).to(torch.bfloat16))
    assert torch.equal(fake_quantize(w, rot).to(torch.bfloat16), dequantize(qw))
    # rotation spreads the outlier columns over their groups: far less error than plain rounding
    assert quant.rel_mse(w, dequantize(qw).float()) < 0.3 * quant.rel_mse(w, dequantize(quantize(w, spec)).float())
    # negative control: a weight on the W4 grid is exact unrotated and loses that when rotated
    grid = _grid_weight()
    assert torch.equal(dequantize(quantize(grid, spec)).float(), grid)
    assert quant.rel_mse(grid, dequantize(quantize(grid, rot)).float()) > 1e-4


def test_rotation_with_smoothing_rotates_last():
    rot = QuantSpec(bits=6, group_size=32, smooth=True, rotate=True)
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    s = torch.rand(64, generator=torch.Generator().manual_seed(5)) + 0.5
    qw = quantize(w, rot, s)
    plain = dataclasses.replace(rot, rotate=False)
    inner = quant.FORMATS["int"].decode(qw.tensors, plain, 64) * qw.tensors["inv_smooth"]
    assert torch.equal(dequantize(qw), hadamard(inner, 32).to(torch.bfloat16))
    assert torch.equal(qw.tensors["qweight"], quantize(hadamard(w, 32), plain, s).tensors["qweight"])


def test_a_rotated_spec_needs_whole_groups():
    with pytest.raises(ValueError, match="K=100 is not a multiple of group_size=64"):
        quantize(torch.randn(4, 100), QuantSpec(rotate=True))


def test_rotated_gptq_rounds_the_rotated_weight_against_the_rotated_hessian():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4096, 128, generator=g) @ (torch.eye(128) + 0.2 * torch.randn(128, 128, generator=g))
    h = quant.input_hessian(x)
    w = torch.randn(24, 128, generator=g)
    spec = QuantSpec(bits=4, group_size=64)
    rot = dataclasses.replace(spec, rotate=True, clip_ratio=0.95)
    got = gptq_quantize(w, rot, h, damp=0.1)
    h_rot = hadamard(hadamard(h.double(), 64).T, 64).T.float()
    want = gptq_quantize(hadamard(w, 64), dataclasses.replace(rot, rotate=False), h_rot, damp=0.1)
    assert got.spec == rot and all(torch.equal(got.tensors[r], want.tensors[r]) for r in want.tensors)
    # negative control: against the unrotated Hessian the rotated weight rounds otherwise
    other = gptq_quantize(hadamard(w, 64), dataclasses.replace(rot, rotate=False), h, damp=0.1)
    assert not torch.equal(other.tensors["qweight"], got.tensors["qweight"])
    assert quant.output_rel_mse(w, dequantize(got), x) < quant.output_rel_mse(w, dequantize(quantize(w, rot)), x)
    with pytest.raises(ValueError, match="act_order"):
        gptq_quantize(w, rot, h, act_order=True)


def test_rotated_gptq_decouples_the_channels_of_a_group_no_input_reaches():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2048, 128, generator=g)
    x[:, 64:] = 0  # the second group never sees an input: so do its 64 rotated channels
    w = torch.randn(16, 128, generator=g)
    qw, info = quant.gptq_quantize_with_info(w, QuantSpec(rotate=True), quant.input_hessian(x), damp=0.1)
    assert info.dead_channels == 64 and not info.fell_back_to_rtn
    x[:, 64:] = 1e-3 * torch.randn(2048, 64, generator=g)  # the same group barely reached: nothing is dead
    assert quant.gptq_quantize_with_info(w, QuantSpec(rotate=True), quant.input_hessian(x))[1].dead_channels == 0
