"""The FP8 operand kernels (kernels/triton_fp8.py) equal the torch reference (quant/fp8_rows.py) bit for bit."""
import os

import pytest
import torch

from squareq.kernels import fp8 as kfp8
from squareq.quant import QuantSpec, dequantize, quantize
from squareq.quant.fp8_rows import quantize_rows

from .fp8_cases import edge_rows, int_weights

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter; test_fp8_gpu.py covers CUDA")


def _same(codes, scales, expected):
    ref_codes, ref_scales = expected
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales, ref_scales)


def _weight(qw):
    n, k = qw.shape
    codes = torch.empty(n, k, dtype=kfp8.FP8)
    scales = torch.empty(n)
    bf16 = torch.empty(n, k, dtype=torch.bfloat16)
    return kfp8.prepare_weight_fp8(codes, scales, qw, None if qw.spec.is_passthrough else bf16)()


def test_activation_rows_edge_values():
    x = edge_rows()
    _same(*kfp8.quantize_activations(x), quantize_rows(x))


def test_activation_rows_wider_than_one_tile_take_two_passes():
    from squareq.kernels.triton_fp8 import MAX_ONE_PASS

    x = torch.randn(2, MAX_ONE_PASS + 300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x[1, -1] = 300.0  # the row's largest magnitude sits in the last tile
    _same(*kfp8.quantize_activations(x), quantize_rows(x))


@pytest.mark.parametrize("k", [96, None], ids=["one pass", "two passes"])
def test_activation_rows_with_column_scales_fold_them_in_fp32(k):
    """The input gradient's rows: each column times the weight's channel scale, in the quantizing pass."""
    from squareq.kernels.triton_fp8 import MAX_ONE_PASS

    k = k or MAX_ONE_PASS + 300
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    col = torch.rand(k, generator=g) * 1e-2
    col[-1] = 10.0  # the last column decides the rows' scales
    _same(*kfp8.quantize_activations(x, col), quantize_rows(x.float() * col[None, :]))
    assert not torch.equal(kfp8.quantize_activations(x, col)[1], kfp8.quantize_activations(x)[1])


def test_int_weights_straight_to_e4m3_rows():
    for label, qw in int_weights():
        codes, scales = _weight(qw)
        ref = quantize_rows(dequantize(qw))
        assert torch.equal(codes.view(torch.uint8), ref[0].view(torch.uint8)), label
        assert torch.equal(scales, ref[1]), label


def test_int_weights_to_e4m3_rows_in_the_transposed_layout():
    """The FP8 input gradient's operand: the same codes, written column-major (a transposed view of a [K, N] buffer)."""
    for label, qw in int_weights():
        n, k = qw.shape
        scales = torch.empty(n)
        codes, got_scales = kfp8.prepare_weight_fp8(torch.empty(k, n, dtype=kfp8.FP8).t(), scales, qw, None)()
        ref = quantize_rows(dequantize(qw))
        assert codes.stride() == (1, n), label
        _same(codes.contiguous(), got_scales, ref)


@pytest.mark.parametrize("spec", [QuantSpec(bits=16), QuantSpec(bits=4, group_size=64, symmetric=True, format="nf4"),
                                  QuantSpec(bits=8, group_size=64, symmetric=True, format="fp8_e4m3")])
def test_other_formats_through_bf16(spec):
    qw = quantize(torch.randn(32, 128, generator=torch.Generator().manual_seed(3)), spec)
    _same(*_weight(qw), quantize_rows(dequantize(qw)))


def test_row_maxima_are_found_once_per_layer_and_kept():
    qw = quantize(torch.randn(16, 128, generator=torch.Generator().manual_seed(4)), QuantSpec(bits=4, group_size=64))
    row_max = kfp8.RowMax(torch.empty(16))
    out = [(torch.empty(16, 128, dtype=kfp8.FP8), torch.empty(16)) for _ in range(2)]
    first = kfp8.prepare_weight_fp8(*out[0], qw, None, row_max)  # two slots of one layer share its maxima
    second = kfp8.prepare_weight_fp8(*out[1], qw, None, row_max)
    _same(*first(), quantize_rows(dequantize(qw)))
    assert row_max.ready
    row_max.values.mul_(2)  # kept, not found again: doubled maxima halve the codes' scale
    codes, scales = second()
    assert torch.equal(scales, 2 * out[0][1])
