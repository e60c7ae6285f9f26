import dataclasses
import logging
import os

import pytest
import torch

from squareq.kernels import backend_for, dequantize_into
from squareq.kernels import backend as dispatch
from squareq.quant import QuantSpec, dequantize, quantize

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernel in the Triton interpreter; test_dequant_gpu.py covers CUDA",
)

SHAPES = [(7, 5, 8), (33, 200, 64), (16, 256, 128), (3, 129, 16), (4, 1, 16)]


def _bits(t):
    return t.view(torch.int16)


@interpreted
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("smooth", [False, True])
def test_kernel_matches_reference_bit_for_bit(bits, symmetric, smooth):
    assert backend_for("cpu") == "triton-interpret"
    g = torch.Generator().manual_seed(bits * 10 + symmetric * 2 + smooth)
    for n, k, group in SHAPES:
        spec = QuantSpec(bits=bits, group_size=group, symmetric=symmetric, smooth=smooth)
        w = torch.randn(n, k, generator=g) * 3
        s = torch.rand(k, generator=g) + 0.5 if smooth else None
        qw = quantize(w, spec, s)
        out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
        dequantize_into(out, qw)
        assert torch.equal(_bits(out), _bits(dequantize(qw))), (n, k, group)


@interpreted
def test_kernel_writes_into_a_view_of_a_larger_buffer():
    qw = quantize(torch.randn(10, 70), QuantSpec(bits=4, group_size=16))
    scratch = torch.full((12, 96), float("nan"), dtype=torch.bfloat16)
    dequantize_into(scratch[1:11, :70], qw)
    assert torch.equal(_bits(scratch[1:11, :70]), _bits(dequantize(qw)))
    assert scratch[0].isnan().all() and scratch[11].isnan().all() and scratch[:, 70:].isnan().all()


def test_bad_output_buffer_is_refused():
    qw = quantize(torch.randn(4, 16), QuantSpec(group_size=16))
    with pytest.raises(ValueError, match="bfloat16"):
        dequantize_into(torch.empty(4, 16), qw)
    with pytest.raises(ValueError, match="bfloat16"):
        dequantize_into(torch.empty(4, 15, dtype=torch.bfloat16), qw)


def test_torch_fallback_is_chosen_and_logged_once(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "_announced", set())
    qw = quantize(torch.randn(8, 40), QuantSpec(bits=6, group_size=8))
    with caplog.at_level(logging.INFO, logger="squareq.kernels"):
        for _ in range(3):
            out = torch.empty(8, 40, dtype=torch.bfloat16)
            dequantize_into(out, qw)
            assert torch.equal(_bits(out), _bits(dequantize(qw)))
    messages = [r.getMessage() for r in caplog.records if r.name == "squareq.kernels"]
    assert len(messages) == 1 and "torch backend" in messages[0] and "TRITON_INTERPRET" in messages[0]


def test_forcing_the_reference(monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")
    assert backend_for("cpu") == "torch"


@interpreted
def test_prepared_launcher_matches_the_reference():
    from squareq.kernels import prepare_dequantize

    for bits in (4, 6, 8, 16):
        spec = QuantSpec(bits=bits, group_size=32) if bits != 16 else QuantSpec(bits=16)
        w = torch.randn(24, 96, generator=torch.Generator().manual_seed(bits))
        qw = quantize(w, spec)
        out = torch.empty(24, 96, dtype=torch.bfloat16)
        launch = prepare_dequantize(out, qw)
        for _ in range(2):
            assert torch.equal(launch().view(torch.int16), dequantize(qw).view(torch.int16)), bits


@interpreted
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_rotated_layers_match_the_reference_bit_for_bit(bits):
    """The kernel's butterfly (HAS_ROTATE) gives the reference's bits, with and without zero points and smoothing, at
    group sizes whose 1/sqrt(g) is exact (16, 64) and rounded (8, 32, 128); the prepared launcher too."""
    from squareq.kernels import prepare_dequantize

    g = torch.Generator().manual_seed(40 + bits)
    for i, (n, k, group) in enumerate([(7, 64, 8), (33, 256, 64), (16, 256, 128), (3, 512, 16), (5, 96, 32)]):
        spec = QuantSpec(bits=bits, group_size=group, symmetric=i % 2 == 0, smooth=i % 3 == 1, rotate=True)
        w = torch.randn(n, k, generator=g) * 3
        qw = quantize(w, spec, torch.rand(k, generator=g) + 0.5 if spec.smooth else None)
        out = torch.full((n, k), float("nan"), dtype=torch.bfloat16)
        dequantize_into(out, qw)
        assert torch.equal(_bits(out), _bits(dequantize(qw))), (n, k, group)
        assert torch.equal(_bits(prepare_dequantize(torch.empty_like(out), qw)()), _bits(dequantize(qw)))
        # negative control: the same codes read as unrotated are not the rotated weight
        unrotated = type(qw)(dataclasses.replace(spec, rotate=False), qw.shape, qw.tensors)
        assert not torch.equal(_bits(dequantize_into(out, unrotated)), _bits(dequantize(qw)))
