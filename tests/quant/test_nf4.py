"""NF4: QLoRA's 16 levels with group absmax scales; its lookup kernel equals the torch reference bit for bit, and a
slab with NF4 layers streams as it computes resident."""
import pytest
import torch

from squareq.quant import QuantSpec, dequantize, quantize
from squareq.quant.formats.nf4 import LEVELS

from .format_checks import check_round_trip_and_kernel, check_slab_streams_like_resident


def nf4(group_size=64, **kw) -> QuantSpec:
    return QuantSpec(format="nf4", bits=4, group_size=group_size, symmetric=True, **kw)


def test_the_levels_are_qloras():
    assert len(LEVELS) == 16 and list(LEVELS) == sorted(LEVELS)
    assert (LEVELS[0], LEVELS[7], LEVELS[15]) == (-1.0, 0.0, 1.0)
    assert nf4().packing == "nf4x2" and nf4(128).label() == "NF4 g128"
    with pytest.raises(ValueError, match="format 'nf4' has no zero points: set symmetric=True"):
        QuantSpec(format="nf4", bits=4)
    with pytest.raises(ValueError, match="format 'nf4' stores 4-bit codes, not bits=8"):
        QuantSpec(format="nf4", bits=8, symmetric=True)


def test_each_weight_takes_the_nearest_level():
    levels = torch.tensor(LEVELS)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(1, 15, (8, 64), generator=g)  # inner levels: noise cannot raise a group's largest magnitude
    codes[:, 0] = 15  # every group's largest magnitude is exactly its scale, 3.0
    w = 3.0 * levels[codes] + 0.004 * (torch.rand(8, 64, generator=g) - 0.5)  # far less than half a level's gap
    w[:, 0] = 3.0
    assert torch.equal(dequantize(quantize(w, nf4())).float(), (3.0 * levels[codes]).to(torch.bfloat16).float())


@pytest.mark.parametrize("spec", [nf4(), nf4(16), nf4(128, scale_dtype="bfloat16"), nf4(32, smooth=True),
                                  nf4(64, scale_dtype="float32", clip_ratio=0.9)],
                         ids=["g64", "g16", "g128-bf16", "g32-smooth", "g64-f32-clip"])
@pytest.mark.parametrize("shape", [(40, 300), (7, 257)], ids=["k300", "k257-odd"])
def test_the_kernel_equals_the_reference(spec, shape, monkeypatch):
    check_round_trip_and_kernel(spec, monkeypatch, shape)


def test_nf4_beats_symmetric_int4_at_the_same_bytes_on_normal_weights_and_not_on_uniform_ones():
    """Its levels are a normal distribution's quantiles: better than the uniform grid where weights are normal (as
    trained weights roughly are), worse where they are uniform (negative control)."""
    g = torch.Generator().manual_seed(1)

    def err(w, spec):
        return float((dequantize(quantize(w, spec)).float() - w).pow(2).mean() / w.pow(2).mean())

    int4 = QuantSpec(bits=4, group_size=64, symmetric=True)
    normal = torch.randn(256, 1024, generator=g)
    uniform = torch.rand(256, 1024, generator=g) * 2 - 1
    assert quantize(normal, nf4()).nbytes == quantize(normal, int4).nbytes
    assert err(normal, nf4()) < 0.8 * err(normal, int4)
    assert err(uniform, nf4()) > err(uniform, int4)


def test_a_slab_with_nf4_layers_streams_like_resident(tmp_path):
    slab = check_slab_streams_like_resident(nf4(), tmp_path)
    assert {layer.spec.packing for layer in slab.manifest.layers} == {"nf4x2", "i8"}


@pytest.mark.gpu
def test_the_kernel_equals_the_reference_on_cuda():
    from squareq.kernels import dequantize as kernel_dequantize

    for spec in (nf4(), nf4(16, smooth=True)):
        w = torch.randn(3072, 3072, generator=torch.Generator().manual_seed(2))
        smooth = torch.rand(3072) + 0.5 if spec.smooth else None
        qw = quantize(w, spec, smooth)
        on_gpu = kernel_dequantize(qw.to("cuda"))
        assert torch.equal(on_gpu.cpu().view(torch.int16), dequantize(qw).view(torch.int16))
