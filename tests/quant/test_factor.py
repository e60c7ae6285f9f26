"""GPTQ's factor computed in place, block by block, equals the library's Cholesky-of-the-inverse."""
import pytest
import torch

from squareq.quant.factor import cholesky_inplace_, inverse_factor, invert_lower_inplace_


def _spd(k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(k, k, generator=g, dtype=torch.float64)
    return a @ a.T / k + 0.05 * torch.eye(k, dtype=torch.float64)


@pytest.mark.parametrize("k,block", [(300, 64), (257, 100), (64, 1024), (129, 1)])
def test_blocked_cholesky_and_inverse_match_the_library(k, block):
    h = _spd(k)
    a = h.clone()
    a.triu_(1).add_(h.tril())  # the upper triangle is never read: leave the original there
    assert cholesky_inplace_(a, block)
    torch.testing.assert_close(a, torch.linalg.cholesky(h), rtol=1e-10, atol=1e-12)
    assert torch.equal(a.triu(1), torch.zeros_like(a))
    invert_lower_inplace_(a, block)
    torch.testing.assert_close(a, torch.linalg.inv(torch.linalg.cholesky(h)), rtol=1e-9, atol=1e-10)


def test_the_factor_is_the_upper_cholesky_factor_of_the_inverse_and_rows_come_in_blocks():
    k = 300
    h = _spd(k, 1)
    factor, used = inverse_factor(lambda: h.flip(0, 1).clone(), damp=0.0, base=1.0)
    assert used == 0.0
    expected = torch.linalg.cholesky(torch.linalg.inv(h), upper=True)
    torch.testing.assert_close(factor.full().double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(factor.rows(128, 256), factor.full()[128:256])


def test_a_matrix_that_is_not_positive_definite_raises_the_damping_then_gives_up():
    h = -torch.eye(8, dtype=torch.float64)
    factor, used = inverse_factor(lambda: h.clone(), damp=0.1, base=1.0, retries=2)
    assert factor is None and used == pytest.approx(1.0)
    factor, used = inverse_factor(lambda: h.clone(), damp=0.1, base=1.0, retries=3)  # 10·1 - 1 > 0: it works
    assert factor is not None and used == pytest.approx(10.0)
