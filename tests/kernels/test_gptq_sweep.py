"""The Triton GPTQ sweep equals the torch reference bit for bit: interpreted on a CPU, compiled on a GPU."""
from __future__ import annotations

import os

import pytest
import torch

from squareq.quant import QuantSpec, gptq_quantize, input_hessian
from squareq.quant.gptq import sweep_block
from squareq.quant.spec import SpecError

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernel in the Triton interpreter; the gpu test covers CUDA")
on_gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# rows, block width (partial groups, a width under the tile, one group), spec
CASES = [
    (37, 128, QuantSpec(bits=4)),
    (16, 100, QuantSpec(bits=6, symmetric=True)),
    (20, 64, QuantSpec(bits=8, group_size=32, scale_dtype="bfloat16", clip_ratio=0.85)),
    (33, 96, QuantSpec(bits=4, scale_dtype="float32", clip_ratio=0.9)),
    (8, 40, QuantSpec(bits=4, group_size=16, symmetric=True)),
]


def _block(n: int, width: int, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 3 * width, generator=g) * 0.05
    w[:, width + 5] = 0  # a dead column
    w[3 % n, :] = 0  # an all-zero row: its groups get scale 1
    w[1, width + 9] = 2.0  # an outlier
    a = torch.randn(width, width, generator=g) * 0.1
    u = torch.linalg.cholesky(a @ a.T + torch.eye(width), upper=True)  # column-major, as GPTQ's factor comes
    return w.to(device)[:, width:2 * width], u.to(device)  # a view with the weight's row stride


def _same(got, ref) -> list[bool]:
    return [y is None if x is None else (x.dtype == y.dtype and torch.equal(x, y)) for x, y in zip(got, ref)]


@interpreted
@pytest.mark.parametrize("n,width,spec", CASES, ids=lambda c: getattr(c, "label", lambda: str(c))())
def test_interpreted_sweep_matches_the_reference_bit_for_bit(n, width, spec):
    from squareq.kernels.triton_gptq import triton_sweep_block

    blk, u = _block(n, width, seed=n + width)
    before = blk.clone()
    got = triton_sweep_block(blk, u, spec)
    assert torch.equal(blk, before), "the kernel must not change its input block"
    assert all(_same(got, sweep_block(blk.clone(), u, spec)))


@interpreted
def test_a_scale_that_overflows_its_dtype_is_refused_like_the_reference():
    from squareq.kernels.triton_gptq import triton_sweep_block

    blk, u = _block(8, 64, seed=1)
    blk = blk * 1e8  # the outlier needs a W8 scale of 2e8/127, over float16's 65504
    spec = QuantSpec(bits=8, symmetric=True)
    with pytest.raises(SpecError, match="overflow"):
        sweep_block(blk.clone(), u, spec)
    with pytest.raises(SpecError, match="overflow"):
        triton_sweep_block(blk, u, spec)


@pytest.mark.parametrize("n,width,spec", CASES[:3], ids=lambda c: getattr(c, "label", lambda: str(c))())
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sweep_matches_the_reference_bit_for_bit(n, width, spec):
    from squareq.kernels.triton_gptq import triton_sweep_block

    blk, u = _block(n, width, seed=n + width, device="cuda")
    assert all(_same(triton_sweep_block(blk, u, spec), sweep_block(blk.clone(), u, spec)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", [QuantSpec(bits=4), QuantSpec(bits=6, symmetric=True, smooth=True)], ids=str)
def test_cuda_gptq_with_the_kernel_gives_the_reference_bits(spec):
    from squareq.kernels import gptq_sweep

    g = torch.Generator().manual_seed(0)
    k = 384
    x = (torch.randn(4096, k, generator=g) @ (torch.randn(k, k, generator=g) * 0.2)).cuda()
    w = (torch.randn(96, k, generator=g) * 0.05).cuda()
    smooth = (torch.rand(k, generator=g) + 0.5).cuda() if spec.smooth else None
    h = input_hessian(x)
    assert gptq_sweep("cuda") is not None
    got = gptq_quantize(w, spec, h, smooth, damp=0.1, sweep=gptq_sweep("cuda"))
    ref = gptq_quantize(w, spec, h, smooth, damp=0.1)
    assert all(torch.equal(got.tensors[r], ref.tensors[r]) for r in ref.tensors)
