"""The format registry: specs name a registered format, old manifests read unchanged, a toy format registered by a
test runs through quantize, dequantize, the slab layout and the kernels' dispatcher without any other change."""
import pytest
import torch

from squareq.quant import FORMATS, Format, QuantSpec, SpecError, dequantize, fake_quantize, quantize, tensor_layout
from squareq.quant.registry import register


def test_an_unknown_format_is_refused_naming_the_known_ones():
    with pytest.raises(SpecError, match="format='w3' is not a SquareQ format; use one of .*int"):
        QuantSpec(format="w3")
    with pytest.raises(SpecError, match="stores 4 or 6 or 8-bit codes, not bits=5|bits=5 is not supported"):
        QuantSpec(bits=5)


def test_int_specs_keep_their_manifest_form():
    d = QuantSpec(bits=6, group_size=32).to_dict()
    assert "format" not in d and d["packing"] == "u6x4"  # as written before formats had names
    assert QuantSpec.from_dict(d) == QuantSpec(bits=6, group_size=32)


class _Halves(Format):
    """A toy 8-bit lookup format: code u means (u - 128) / 2 times the group's scale."""

    name = "toy_halves"
    bits = (8,)
    zero_points = False
    table = tuple((u - 128) / 2 for u in range(256))

    def packing(self, spec):
        return "toy8"

    def label(self, spec):
        return f"TOY g{spec.group_size}"

    def layout(self, spec, shape):
        n, k = shape
        return {"qweight": (torch.uint8, (n, k)), "scales": (spec.torch_scale_dtype, (n, -(-k // spec.group_size)))}

    def encode(self, w, spec):
        n, k = w.shape
        g = spec.group_size
        wg = torch.nn.functional.pad(w, (0, -k % g)).reshape(n, -1, g)
        scales = (wg.abs().amax(-1) / 63).clamp_min(1e-8).to(spec.torch_scale_dtype)
        u = torch.round(wg / scales.float()[..., None] * 2).clamp(-128, 127) + 128
        return {"qweight": u.reshape(n, -1)[:, :k].to(torch.uint8), "scales": scales}

    def decode(self, tensors, spec, k):
        table = torch.tensor(self.table, dtype=torch.float32)
        s = tensors["scales"].float().repeat_interleave(spec.group_size, dim=1)[:, :k]
        return table[tensors["qweight"].long()] * s


@pytest.fixture
def toy_format():
    register(_Halves())
    yield FORMATS["toy_halves"]
    del FORMATS["toy_halves"]


@pytest.mark.parametrize("kernels", ["torch", "triton-interpret"])
def test_a_registered_format_runs_through_quantize_layout_and_dequantize(toy_format, monkeypatch, kernels):
    """Without a kernel of its own, the dispatcher serves the format from its torch reference on every backend."""
    if kernels == "torch":
        monkeypatch.setenv("SQUAREQ_KERNELS", "torch")
    else:
        pytest.importorskip("triton")
        monkeypatch.delenv("SQUAREQ_KERNELS", raising=False)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from squareq.kernels import dequantize as kernel_dequantize

    spec = QuantSpec(format="toy_halves", bits=8, group_size=32, symmetric=True)
    assert (spec.label(), spec.packing, spec.to_dict()["format"]) == ("TOY g32", "toy8", "toy_halves")
    w = torch.randn(16, 100)
    qw = quantize(w, spec)
    assert {r: (t.dtype, tuple(t.shape)) for r, t in qw.tensors.items()} == tensor_layout(spec, (16, 100))
    d = dequantize(qw)
    assert torch.equal(d, fake_quantize(w, spec).to(torch.bfloat16))
    assert torch.equal(kernel_dequantize(qw), d)
    assert (d.float() - w).pow(2).mean() < 1e-3 * w.pow(2).mean()
    with pytest.raises(SpecError, match="format 'toy_halves' has no zero points: set symmetric=True"):
        QuantSpec(format="toy_halves", bits=8)


def test_gptq_refuses_a_format_it_cannot_round_onto(toy_format):
    from squareq.quant import gptq_quantize

    with pytest.raises(SpecError, match="GPTQ rounds onto the int format's grid"):
        gptq_quantize(torch.randn(8, 32), QuantSpec(format="toy_halves", bits=8, symmetric=True), torch.eye(32))
