"""Rows to E4M3 with one scale per row: the reference the FP8 kernels must equal."""
import pytest
import torch

from squareq.quant.fp8_rows import dequantize_rows, quantize_rows, row_scales

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE = E4M3[~E4M3.isnan()]


def test_every_e4m3_value_comes_back_exactly():
    values = FINITE.unique()  # -448 ... 448, subnormals included
    x = (values * 0.125)[None, :]  # the row's largest magnitude is 56, so its scale is 56 / 448 = 0.125
    codes, scales = quantize_rows(x)
    assert scales.item() == 0.125
    assert torch.equal(dequantize_rows(codes, scales), x)


def test_rounding_is_to_nearest_and_ties_go_to_the_even_code():
    # 448 fixes the scale at 1; 168 lies halfway between 160 (mantissa 010) and 176 (011)
    x = torch.tensor([[448.0, 168.0, 168.01, 184.0, -168.0, 0.0029296875]])
    codes, scales = quantize_rows(x)
    assert scales.item() == 1.0
    # 184 is halfway between 176 (011) and 192 (100): the even one is 192; 3·2^-10 is halfway between the
    # subnormals 2^-9 (001) and 2^-8 (010): the even one is 2^-8
    assert codes.float().tolist() == [[448.0, 160.0, 176.0, 192.0, -160.0, 0.00390625]]


def test_a_row_of_zeros_gets_scale_zero_and_zero_codes():
    x = torch.zeros(2, 32)
    x[1, 3] = -2.0
    codes, scales = quantize_rows(x)
    assert scales.tolist() == [0.0, torch.tensor(2.0 / 448.0).item()]
    assert torch.equal(codes[0].float(), torch.zeros(32))
    assert codes[1, 3].float().item() == -448.0


def test_error_is_within_half_a_step_of_e4m3():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    codes, scales = quantize_rows(x)
    back = dequantize_rows(codes, scales)
    normal = x.abs() >= scales[:, None] * 2.0 ** -6  # above E4M3's subnormals: 3 mantissa bits
    assert ((back - x).abs()[normal] <= x.abs()[normal] * 2.0 ** -4 + 1e-12).all()
    assert row_scales(x)[1].mul(row_scales(x)[0]).sub(1).abs().max() < 1e-6


def test_only_2d_inputs():
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.zeros(2, 3, 4))
