"""The fused quantized matmuls on CUDA against the torch reference (the CPU twin runs them interpreted)."""
import pytest
import torch

from .test_fused import VARIANTS, check_against_reference, check_rotated

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric,smooth", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_kernels_match_the_reference_on_cuda(bits, symmetric, smooth, with_bias, variant, monkeypatch):
    check_against_reference(bits, symmetric, smooth, with_bias, variant, monkeypatch, device="cuda")


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_kernels_apply_the_rotation_on_cuda(bits, variant, monkeypatch):
    check_rotated(bits, variant, monkeypatch, device="cuda")


def test_fused_results_repeat_bit_for_bit_on_cuda():
    """The split reduction adds its partial sums in a fixed order: a training step that is redone (resume, cuDNN
    retry) must see the same bits."""
    from squareq.kernels.triton_fused import fused_input_grad, fused_linear

    from .test_fused import _case

    for rows in (1, 8):  # the GEMV and the MMA kernels
        qw, x, dy, bias = _case(4, False, False, (rows, 3072, 3072, 64), seed=5, device="cuda")
        ys = [fused_linear(x, qw, bias) for _ in range(5)]
        dxs = [fused_input_grad(dy, qw) for _ in range(5)]
        assert all(torch.equal(y, ys[0]) for y in ys) and all(torch.equal(d, dxs[0]) for d in dxs)
