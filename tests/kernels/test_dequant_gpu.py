"""The CUDA Triton dequant kernel equals the torch reference bit for bit (runs only where CUDA is)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from squareq.quant import QuantSpec, dequantize, quantize  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _quantized(n: int, k: int, spec: QuantSpec, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    w[0, : max(1, k // 3)] *= 40.0  # a row with an outlier range
    s = torch.rand(k, device="cuda", generator=gen) * 4 + 0.25 if spec.smooth else None
    return quantize(w, spec, s)


def _check(qw, out: torch.Tensor, tile=None) -> None:
    from squareq.kernels.triton_dequant import triton_dequantize_into

    out.fill_(float("nan"))
    triton_dequantize_into(out, qw, tile=tile)
    torch.cuda.synchronize()
    ref = dequantize(qw)
    assert not torch.isnan(out).any(), "the kernel left elements unwritten"
    assert torch.equal(_bits(out), _bits(ref)), f"{qw.spec.label()} {qw.shape}: differs from the torch reference"


CASES = [  # (n, k, group_size): odd K, K not a multiple of the group, tiny K, K = 1, several tiles
    (64, 256, 64),
    (37, 200, 64),
    (5, 1, 16),
    (3, 7, 16),
    (19, 129, 128),
    (130, 1000, 16),
]


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric,smooth", [(True, False), (False, False), (False, True), (True, True)])
def test_matches_reference(bits, symmetric, smooth):
    for i, (n, k, g) in enumerate(CASES):
        spec = QuantSpec(bits=bits, group_size=g, symmetric=symmetric, smooth=smooth)
        qw = _quantized(n, k, spec, seed=1000 * bits + i)
        _check(qw, torch.empty(n, k, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_scale_dtypes_and_tiles(bits):
    from squareq.kernels.triton_dequant import default_tile

    for j, scale_dtype in enumerate(["bfloat16", "float32"]):
        spec = QuantSpec(bits=bits, group_size=64, scale_dtype=scale_dtype)
        qw = _quantized(96, 704, spec, seed=7 + j)
        out = torch.empty(96, 704, device="cuda", dtype=torch.bfloat16)
        for tile in (None, (1, 64, 1), (16, 128, 4), (64, 512, 8), default_tile(64, 704)):
            _check(qw, out, tile)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_writes_into_view_of_scratch_buffer(bits):
    n, k = 48, 300
    spec = QuantSpec(bits=bits, group_size=64, smooth=True)
    qw = _quantized(n, k, spec, seed=99)
    scratch = torch.full((n + 3, k + 77), 7.0, device="cuda", dtype=torch.bfloat16)
    view = scratch[1 : n + 1, 5 : k + 5]  # row stride k + 77 > k, offset start
    assert view.stride(0) > k
    _check(qw, view)
    untouched = torch.ones_like(scratch, dtype=torch.bool)
    untouched[1 : n + 1, 5 : k + 5] = False
    assert (scratch[untouched] == 7.0).all(), "the kernel wrote outside its view"


def test_unaligned_packed_rows_take_the_byte_path():
    # 6-bit rows of whole 48-byte chunks are read as 16-byte vectors; a qweight that sits at an odd
    # offset inside a larger buffer (as in a slab) must still decode exactly.
    n, k = 24, 512
    for bits in (4, 6, 8):
        qw = _quantized(n, k, QuantSpec(bits=bits, group_size=64), seed=bits)
        q = qw.tensors["qweight"]
        buf = torch.zeros(q.numel() + 3, device="cuda", dtype=torch.uint8)
        moved = buf[3:].view(q.shape)
        moved.copy_(q)
        assert moved.data_ptr() % 16 != 0
        qw.tensors["qweight"] = moved
        _check(qw, torch.empty(n, k, device="cuda", dtype=torch.bfloat16))


def test_dispatch_uses_triton_on_cuda():
    from squareq.kernels import backend_for, dequantize_into

    if backend_for("cuda") != "triton":
        pytest.skip("SQUAREQ_KERNELS=torch or triton missing")
    spec = QuantSpec(bits=4, group_size=128, symmetric=True)
    qw = _quantized(256, 384, spec, seed=5)
    out = torch.full((256, 384), float("nan"), device="cuda", dtype=torch.bfloat16)
    dequantize_into(out, qw)
    assert torch.equal(_bits(out), _bits(dequantize(qw)))


@pytest.mark.parametrize("spec", [QuantSpec(bits=4, group_size=64), QuantSpec(bits=6, group_size=128),
                                  QuantSpec(bits=8, group_size=128, symmetric=True), QuantSpec(bits=4, smooth=True)])
def test_prepared_launcher_matches_reference_on_every_call(spec):
    """The prepared launcher's first call goes through Triton's dispatcher, later ones launch the compiled kernel
    directly; both must write the reference weight, for layers sharing one output buffer."""
    from squareq.kernels import prepare_dequantize

    buffer = torch.empty(512 * 768, dtype=torch.bfloat16, device="cuda")
    layers = [_quantized(n, k, spec, seed) for seed, (n, k) in enumerate([(512, 768), (256, 512), (384, 768)])]
    launchers = [prepare_dequantize(buffer[: qw.shape[0] * qw.shape[1]].view(qw.shape), qw) for qw in layers]
    for _ in range(3):
        for qw, launch in zip(layers, launchers):
            buffer.fill_(float("nan"))
            out = launch()
            torch.cuda.synchronize()
            assert torch.equal(_bits(out), _bits(dequantize(qw))), qw.spec.label()


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("smooth", [False, True])
def test_rotated_layers_match_reference(bits, smooth):
    """The butterfly on CUDA (floating-point fusion off) gives the reference's bits, at group sizes whose 1/sqrt(g)
    is exact (64, 16) and rounded (128, 32), on the default tiles and the largest."""
    for i, (n, k, g) in enumerate([(64, 256, 64), (130, 1024, 16), (19, 384, 128), (7, 3072, 32)]):
        spec = QuantSpec(bits=bits, group_size=g, symmetric=i % 2 == 1, smooth=smooth, rotate=True)
        qw = _quantized(n, k, spec, seed=2000 * bits + i)
        _check(qw, torch.empty(n, k, device="cuda", dtype=torch.bfloat16))
