"""The fused quantized matmuls on CUDA against the torch reference (the CPU twin runs them interpreted)."""
import pytest
import torch

from .test_fused import check_against_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric,smooth", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_kernels_match_the_reference_on_cuda(bits, symmetric, smooth, with_bias):
    check_against_reference(bits, symmetric, smooth, with_bias, device="cuda")
