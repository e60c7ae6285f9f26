import pytest
import torch
from safetensors import safe_open

from squareq.kernels import dequantize_into
from squareq.quant import QuantSpec, dequantize, quantize
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.slab import SlabError, model_signature, open_slab


def test_every_layer_reads_back_bit_for_bit(tiny_flux, tiny_slab):
    model, _ = tiny_flux
    modules = dict(model.named_modules())
    with open_slab(tiny_slab, verify=True, expected_signature=model_signature(model)) as slab:
        layers = slab.manifest.layers
        assert len(layers) == sum(
            isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.startswith(("transformer_blocks.", "single_transformer_blocks."))
        )
        assert {layer.spec.bits for layer in layers} == {4, 6, 8, 16}
        for layer in layers:
            reference = quantize(modules[layer.name].weight.detach(), layer.spec)
            stored = slab.quantized_weight(layer.name)
            assert stored.tensors.keys() == reference.tensors.keys()
            for role, t in reference.tensors.items():
                assert torch.equal(stored.tensors[role], t), (layer.name, role)
            assert torch.equal(slab.dequantized_weight(layer.name).view(torch.int16), dequantize(reference).view(torch.int16))
            out = torch.empty(tuple(layer.shape), dtype=torch.bfloat16)
            dequantize_into(out, stored)
            assert torch.equal(out.view(torch.int16), dequantize(reference).view(torch.int16))


def test_non_quantized_tensors_read_back(tiny_flux, tiny_slab):
    model, _ = tiny_flux
    state = model.state_dict()
    with open_slab(tiny_slab) as slab:
        rebuilt = slab.dequantized_state_dict()
        assert rebuilt.keys() == state.keys()
        for block in slab.manifest.blocks:
            for name, t in slab.block_params(block.index).items():
                assert torch.equal(t, state[f"{block.name}.{name}"].to(torch.bfloat16)), name
        for name, t in slab.resident_tensors().items():
            assert torch.equal(t, state[name].to(torch.bfloat16)), name


def test_layout_is_aligned_and_plain_safetensors(tiny_slab):
    with open_slab(tiny_slab) as slab:
        m = slab.manifest
        assert all(t.offset % 256 == 0 for layer in m.layers for t in layer.tensors.values())
        assert all(p.offset % 256 == 0 for b in m.blocks for p in b.params)
        assert all(b.nbytes % 256 == 0 for b in m.blocks)
        keys = {b.tensor for b in m.blocks} | {r.tensor for r in m.resident}
    with safe_open(str(tiny_slab / "slab.safetensors"), "pt") as f:
        assert set(f.keys()) == keys
        with open_slab(tiny_slab) as slab:
            assert torch.equal(f.get_tensor("block.1"), slab.block_bytes(1))


def test_writer_refuses_to_overwrite_and_leaves_nothing_on_failure(tiny_flux, tmp_path, monkeypatch):
    model, adapter = tiny_flux
    blocks = adapter.blocks(model)
    out = tmp_path / "a.slab"
    with pytest.raises(SlabError, match="no QuantSpec"):
        write_rtn_slab(model, blocks, {}, out)
    assert list(tmp_path.iterdir()) == []

    from squareq.slab import writer

    calls = []

    def failing(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise RuntimeError("disk full")
        return original(*args, **kwargs)

    original = writer._layout_block
    monkeypatch.setattr(writer, "_layout_block", failing)
    with pytest.raises(RuntimeError, match="disk full"):
        write_rtn_slab(model, blocks, {}, out, PlainOptions(default_spec=QuantSpec()))
    assert list(tmp_path.iterdir()) == []  # neither the slab nor the builder's blobs
    monkeypatch.setattr(writer, "_layout_block", original)

    write_rtn_slab(model, blocks, {}, out, PlainOptions(default_spec=QuantSpec()))
    with pytest.raises(SlabError, match="already exists"):
        write_rtn_slab(model, blocks, {}, out, PlainOptions(default_spec=QuantSpec()))
    write_rtn_slab(model, blocks, {}, out, PlainOptions(default_spec=QuantSpec(bits=8), overwrite=True))
    with open_slab(out) as slab:
        assert {layer.spec.bits for layer in slab.manifest.layers} == {8}
    assert [p.name for p in tmp_path.iterdir()] == ["a.slab"]


def test_the_builder_writes_block_by_block_and_plans_its_metadata_without_weights(tiny_flux, tmp_path):
    """SlabBuilder: the slab it writes holds exactly the blobs laid out; metadata_bytes, planned from placeholder
    weights on the meta device, bounds the real header + manifest + resident bytes from above, closely; its blobs'
    folder is gone afterwards; and finish refuses a slab over max_bytes before writing anything."""
    from squareq.quant import QuantizedWeight
    from squareq.slab import BlockContent, SlabBuilder, WriteOptions
    from squareq.slab.writer import block_linears

    model, adapter = tiny_flux
    prefixes = adapter.blocks(model)
    residents = {n: t for n, t in model.state_dict().items() if not n.startswith(tuple(f"{p}." for p in prefixes))}
    contents = []
    for i, prefix in enumerate(prefixes):
        block = model.get_submodule(prefix)
        quantized = {n: quantize(m.weight.detach(), QuantSpec(bits=6)) for n, m in block_linears(prefix, block)}
        contents.append(BlockContent(i, prefix, block, quantized))
    options = WriteOptions(family="flux", source="tiny-flux")
    with pytest.raises(SlabError, match="over the 1,000-byte budget; raise --budget"):
        with SlabBuilder(tmp_path / "small.slab", model, options) as slab:
            for c in contents:
                slab.add_block(c)
            slab.finish(residents, max_bytes=1000)
    assert list(tmp_path.iterdir()) == []
    with SlabBuilder(tmp_path / "a.slab", model, options) as slab:
        for c in contents:
            slab.add_block(c)
        manifest = slab.finish(residents)
    assert [p.name for p in tmp_path.iterdir()] == ["a.slab"]
    blobs = sum(b.nbytes for b in manifest.blocks)
    actual = sum(p.stat().st_size for p in (tmp_path / "a.slab").iterdir()) - blobs
    with torch.device("meta"):
        skeleton = type(model).from_config(model.config)
    planned = [BlockContent(c.index, c.prefix, skeleton.get_submodule(c.prefix),
                            {n: QuantizedWeight.placeholder(q.spec, q.shape) for n, q in c.quantized.items()},
                            measure=False) for c in contents]
    bound = SlabBuilder.metadata_bytes(skeleton, planned, residents, options)
    assert actual <= bound <= actual + 64 * len(manifest.layers)
    with open_slab(tmp_path / "a.slab") as read:
        assert [b.nbytes for b in read.manifest.blocks] == [b.nbytes for b in manifest.blocks]
        assert all(layer.spec.bits == 6 and layer.rung == "W6" for layer in read.manifest.layers)
