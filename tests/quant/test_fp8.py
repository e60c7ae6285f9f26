"""FP8 E4M3: one byte per weight with group (or row) absmax scales; the lookup kernel equals the torch reference bit
for bit, and a slab with FP8 layers streams as it computes resident."""
import pytest
import torch

from squareq.quant import QuantSpec, dequantize, quantize
from squareq.quant.formats.fp8 import E4M3_MAX, VALUES

from .format_checks import check_round_trip_and_kernel, check_slab_streams_like_resident


def fp8(group_size=64, **kw) -> QuantSpec:
    return QuantSpec(format="fp8_e4m3", bits=8, group_size=group_size, symmetric=True, **kw)


def test_the_table_is_e4m3():
    finite = [v for v in VALUES if v == v]
    assert len(VALUES) == 256 and len(finite) == 254 and max(finite) == E4M3_MAX == 448.0
    assert VALUES[0x38] == 1.0 and VALUES[0x01] == 2.0 ** -9  # exponent bias 7; the smallest subnormal
    assert fp8().packing == "e4m3" and fp8(128).label() == "FP8 g128"
    with pytest.raises(ValueError, match="format 'fp8_e4m3' stores 8-bit codes, not bits=4"):
        QuantSpec(format="fp8_e4m3", bits=4, symmetric=True)


def test_values_on_the_e4m3_grid_survive_and_the_largest_maps_to_448():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor([v for v in VALUES if v == v and abs(v) <= 448.0])
    w = grid[torch.randint(0, len(grid), (16, 64), generator=g)]
    w[:, 0] = 448.0  # every group's scale is then exactly 1
    qw = quantize(w, fp8(scale_dtype="float32"))
    assert torch.equal(qw.tensors["scales"], torch.ones(16, 1))
    assert torch.equal(dequantize(qw).float(), w.to(torch.bfloat16).float())


@pytest.mark.parametrize("spec", [fp8(), fp8(16), fp8(32768, scale_dtype="float32"), fp8(32, smooth=True),
                                  fp8(64, scale_dtype="bfloat16", clip_ratio=0.9)],
                         ids=["g64", "g16", "per-row", "g32-smooth", "g64-bf16-clip"])
@pytest.mark.parametrize("shape", [(40, 300), (7, 257)], ids=["k300", "k257-odd"])
def test_the_kernel_equals_the_reference(spec, shape, monkeypatch):
    check_round_trip_and_kernel(spec, monkeypatch, shape)


def test_per_row_scales_store_one_scale_a_row():
    qw = quantize(torch.randn(8, 300), fp8(32768))
    assert qw.tensors["scales"].shape == (8, 1) and qw.tensors["qweight"].shape == (8, 300)


def test_a_slab_with_fp8_layers_streams_like_resident(tmp_path):
    slab = check_slab_streams_like_resident(fp8(), tmp_path)
    assert {layer.spec.packing for layer in slab.manifest.layers} == {"e4m3", "i8"}


@pytest.mark.gpu
def test_the_kernel_equals_the_reference_on_cuda():
    from squareq.kernels import dequantize as kernel_dequantize

    for spec in (fp8(), fp8(32768), fp8(16, smooth=True)):
        w = torch.randn(3072, 3072, generator=torch.Generator().manual_seed(2))
        smooth = torch.rand(3072) + 0.5 if spec.smooth else None
        qw = quantize(w, spec, smooth)
        on_gpu = kernel_dequantize(qw.to("cuda"))
        assert torch.equal(on_gpu.cpu().view(torch.int16), dequantize(qw).view(torch.int16))
