"""Checks every stored format passes (a format's own test file calls them with its specs)."""
import torch

from squareq.quant import QuantSpec, dequantize, fake_quantize, quantize


def check_round_trip_and_kernel(spec: QuantSpec, monkeypatch, shape=(40, 300), seed=0) -> torch.Tensor:
    """quantize -> the torch reference == fake_quantize, and the dispatcher's Triton kernel (the interpreter on a
    CPU) == the reference bit for bit; returns the reference's bf16 weight."""
    import pytest

    pytest.importorskip("triton")
    from squareq.kernels import backend_for
    from squareq.kernels import dequantize as kernel_dequantize

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    smooth = torch.rand(shape[1], generator=g) + 0.5 if spec.smooth else None
    qw = quantize(w, spec, smooth)
    reference = dequantize(qw)
    assert torch.equal(fake_quantize(w, spec, smooth).to(torch.bfloat16), reference)
    monkeypatch.delenv("SQUAREQ_KERNELS", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend_for("cpu") == "triton-interpret"
    assert torch.equal(kernel_dequantize(qw).view(torch.int16), reference.view(torch.int16))
    return reference


def check_slab_streams_like_resident(spec: QuantSpec, tmp_path, layers=("transformer_blocks.0.attn.to_q",
                                                                        "single_transformer_blocks.0.proj_mlp")):
    """A tiny-flux slab with ``layers`` in ``spec`` (the rest W8) records the format, reads it back, and computes
    the same output streamed as resident; the layers' weights are the format's dequantization."""
    from squareq import runtime
    from squareq.models import load_builtin, tiny_flux_inputs
    from squareq.compiler.plain import PlainOptions, write_rtn_slab
    from squareq.slab import open_slab

    model, adapter = load_builtin("tiny-flux")
    path = tmp_path / "fmt.slab"
    write_rtn_slab(model, adapter.blocks(model), dict.fromkeys(layers, spec), path,
               PlainOptions(default_spec=QuantSpec(bits=8), family="flux", source="tiny-flux"))
    slab = open_slab(path)
    recorded = {layer.name: layer.spec for layer in slab.manifest.layers}
    # the writer may search the clip ratio; everything else is the spec as given
    assert all(recorded[name].with_clip(spec.clip_ratio) == spec for name in layers), [recorded[n] for n in layers]
    outputs = []
    for stream in (False, True):
        loaded = runtime.load(path, "cpu", options=runtime.LoadOptions(stream=stream, prefetch=2))
        with torch.no_grad():
            outputs.append(loaded(**tiny_flux_inputs(dtype=torch.bfloat16), return_dict=False)[0])
        runtime.runtime_of(loaded).close()
    assert torch.equal(outputs[0], outputs[1])
    return slab
