"""The FP8 operand kernels on CUDA equal the torch reference bit for bit, and feed torch._scaled_mm."""
import pytest
import torch

from squareq.kernels import fp8 as kfp8
from squareq.quant import QuantSpec, dequantize, quantize
from squareq.quant.fp8_rows import dequantize_rows, quantize_rows

from .fp8_cases import edge_rows, int_weights

pytestmark = pytest.mark.gpu


def test_activation_rows_on_cuda():
    x = edge_rows().cuda()
    codes, scales = kfp8.quantize_activations(x)
    ref_codes, ref_scales = quantize_rows(x)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scales, ref_scales)


def test_direct_launches_equal_the_dispatchers_for_every_specialization():
    """The second call of a shape goes past Triton's dispatcher (kernels/triton_launch.py's DirectLaunch)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for rows in (1, 5, 16, 33, 1536):
        for k in (48, 3072, 15360):
            base = torch.randn(rows * k + 8, generator=g, device="cuda").to(torch.bfloat16)
            for x in (base[: rows * k].view(rows, k), base[8:].view(rows, k)):  # 16-byte aligned, then not
                ref_codes, ref_scales = quantize_rows(x)
                for _ in range(2):
                    codes, scales = kfp8.quantize_activations(x)
                    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (rows, k)
                    assert torch.equal(scales, ref_scales), (rows, k)


NF4 = QuantSpec(bits=4, group_size=64, symmetric=True, format="nf4")


@pytest.mark.parametrize("spec", [None, QuantSpec(bits=16), NF4])
def test_weights_on_cuda(spec):
    cases = int_weights() if spec is None else [(str(spec), quantize(torch.randn(32, 128), spec))]
    for label, qw in cases:
        qw = type(qw)(qw.spec, qw.shape, {k: v.cuda() for k, v in qw.tensors.items()})
        n, k = qw.shape
        codes, scales = torch.empty(n, k, dtype=kfp8.FP8, device="cuda"), torch.empty(n, device="cuda")
        bf16 = None if qw.spec.is_passthrough else torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        run = kfp8.prepare_weight_fp8(codes, scales, qw, bf16)
        ref_codes, ref_scales = quantize_rows(dequantize(qw))
        for _ in range(2):  # the second launch goes past Triton's dispatcher
            codes.view(torch.uint8).fill_(0x7F)
            run()
            assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), label
            assert torch.equal(scales, ref_scales), label


@pytest.mark.parametrize("m", [16, 1536, 4])
def test_fp8_linear_matches_the_dequantized_product(m):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 512, generator=g, device="cuda") * 0.02
    x = torch.randn(m, 512, generator=g, device="cuda").to(torch.bfloat16)
    bias = torch.randn(256, generator=g, device="cuda").to(torch.bfloat16)
    codes, scales = quantize_rows(w)
    y = kfp8.fp8_linear(x, (codes, scales), bias)
    xq, xs = quantize_rows(x)
    expected = dequantize_rows(xq, xs) @ dequantize_rows(codes, scales).t() + bias.float()
    assert y.dtype == torch.bfloat16 and y.shape == (m, 256)
    assert ((y.float() - expected).pow(2).mean() / expected.pow(2).mean()).item() < 1e-4
