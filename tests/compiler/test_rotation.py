"""Hadamard rotation as a per-layer candidate: kept where it beats the other candidates on held-out rows, not where
it loses, and a compiled slab with rotated layers runs through the runtime like its dequantized weights."""
import copy

import pytest
import torch
from torch import nn

from squareq import quant, runtime
from squareq.compiler import CompileOptions, compile_slab, layer_search
from squareq.compiler.layer_search import search_layer
from squareq.compiler.layer_statistics import StatsCollector
from squareq.quant import QuantSpec
from squareq.slab import open_slab
from squareq.sources import open_source

from ..runtime.harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")

K, N, TOKENS, SAMPLES, HELD = 128, 32, 64, 8, (1, 4)


def layer_stats(w: torch.Tensor, tokens: int = TOKENS):
    """Statistics of one linear with weight ``w`` over correlated Gaussian inputs, ``tokens`` a sample, two samples
    held out."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, tokens, K, generator=g) @ (torch.eye(K) + 0.3 * torch.randn(K, K, generator=g) / K**0.5)
    layer = nn.Linear(K, N, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    block = nn.Sequential(layer)
    with StatsCollector("b", block, max_rows=4096, samples=SAMPLES, heldout_samples=HELD) as col:
        block(x)
    return col.stats["b.0"]


def test_rotation_is_kept_where_it_wins_on_the_held_out_rows():
    g = torch.Generator().manual_seed(1)
    # scattered outliers (1% of the weights 31x): a group's range goes to them, in no column smoothing could shrink
    # and no ratio clipping could drop; rotation spreads each over its group
    w = torch.randn(N, K, generator=g) * (1 + 30 * (torch.rand(N, K, generator=g) < 0.01))
    st = layer_stats(w)
    c = search_layer(w, st, QuantSpec(bits=4))
    assert c.qweight.spec.rotate and c.metrics["rotate"] == 1.0
    assert c.metrics["heldout_rel_mse"] < 0.25 * c.metrics["heldout_rtn_rel_mse"]
    unrotated = search_layer(w, st, QuantSpec(bits=4), rotate=False)  # the best the search has without it
    assert not unrotated.qweight.spec.rotate
    assert c.metrics["heldout_rel_mse"] < 0.6 * unrotated.metrics["heldout_rel_mse"]


def test_rotation_is_not_kept_where_it_loses_on_the_held_out_rows(monkeypatch):
    """A weight exactly on the W4 grid: plain rounding stores it without error, every rotated option errs."""
    q = torch.randint(-8, 8, (N, K), generator=torch.Generator().manual_seed(2))
    q[:, ::64], q[:, 1::64] = -8, 7  # each group spans the whole asymmetric code range, scale 1/16
    w = q.float() / 16
    st = layer_stats(w)
    offered = []
    original = layer_search._Rung.offer
    monkeypatch.setattr(layer_search._Rung, "offer", lambda self, i, o: offered.append(o) or original(self, i, o))
    c = search_layer(w, st, QuantSpec(bits=4))
    tried = [o for o in offered if o[0].spec.rotate]
    assert len(tried) >= 2 and any(o[3] for o in tried)  # rotated rounding and rotated GPTQ were there to judge
    assert all(quant.output_rel_mse(w, quant.dequantize(o[0]), st.heldout_rows) > 1e-6 for o in tried)
    assert not c.qweight.spec.rotate and c.metrics["rotate"] == 0.0
    assert c.metrics["heldout_rel_mse"] == 0.0 and torch.equal(quant.dequantize(c.qweight).float(), w)


def test_a_layer_whose_k_is_not_whole_groups_is_searched_without_rotation(monkeypatch):
    w = torch.randn(8, 96)
    st = _stats_of_width(w)
    monkeypatch.setattr(layer_search, "rotated_specs", lambda *a: pytest.fail("rotation tried on K=96, g64"))
    assert not search_layer(w, st, QuantSpec(bits=4)).qweight.spec.rotate


def _stats_of_width(w):
    x = torch.randn(2, 32, w.shape[1], generator=torch.Generator().manual_seed(3))
    block = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    with StatsCollector("b", block, max_rows=256, samples=2, heldout_samples=(1,)) as col:
        block(x)
    return col.stats["b.0"]


@pytest.mark.triton
def test_a_compiled_slab_with_rotated_layers_runs_like_its_dequantized_weights(tmp_path, tiny_flux, tiny_flux_images,
                                                                               monkeypatch):
    """tiny-flux compiled end to end: the search keeps rotation for some layers, the manifest and inspect say so, and
    the runtime's output (streamed, through the Triton interpreter's kernels when set, LoRA attached) is the source
    model's with every quantized weight replaced by its dequantization."""
    from squareq.slab.summary import format_summary, summarize

    monkeypatch.delenv("SQUAREQ_KERNELS", raising=False)  # the kernels themselves, rotation's butterfly included

    out = tmp_path / "rot.slab"
    compile_slab(open_source("tiny-flux"), out, CompileOptions(
        budget=10**9, formats=("W4", "bf16"), calib_samples=4, max_rows=128, effect_probes=4,
        calib_images=tiny_flux_images))
    slab = open_slab(out, verify=True)
    rotated = [r.name for r in slab.manifest.layers if r.spec.rotate]
    assert rotated and all(r.metrics["rotate"] == 1.0 for r in slab.manifest.layers if r.spec.rotate)
    summary = summarize(slab)
    assert any(row["format"].endswith(" H") and row["rotate"] for row in summary["layers"])
    assert "rot=1" in format_summary(summary)

    model = copy.deepcopy(tiny_flux[0]).to(torch.bfloat16)
    with torch.no_grad():
        for rec in slab.manifest.layers:
            model.get_submodule(rec.name).weight.copy_(slab.dequantized_weight(rec.name))
        want = model(**inputs("cpu"), return_dict=False)[0]
    streamed = runtime.load(out, "cpu", options=runtime.LoadOptions(prefetch=2, fused_attention=False))
    with torch.no_grad():
        assert torch.equal(streamed(**inputs("cpu"), return_dict=False)[0], want)
    # LoRA sees the layer's own input (the rotation lives inside the dequantized weight): it trains streamed as
    # resident, bit for bit
    resident = runtime.load(out, "cpu", options=runtime.LoadOptions(stream=False, fused_attention=False))
    results = []
    for m in (streamed, resident):
        with_lora(m)
        results.append(step(m, inputs("cpu"), checkpointing=m is streamed))
    assert_same(*results)
    assert all(g.abs().sum() > 0 for g in results[0][1].values())
    runtime.runtime_of(streamed).close()


def test_no_rotation_compiles_without_rotated_layers(tmp_path):
    """`squareq compile --no-rotation` reaches the search: no layer is rotated and the manifest records it (the
    compile above, with the default, rotates some layers of the same model: the control)."""
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "plain.slab"
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(out), "--budget", "1GB", "--formats",
                                       "W4,bf16", "--calib-samples", "4", "--calib-resolution", "64",
                                       "--effect-probes", "1", "--no-rotation"])
    assert result.exit_code == 0, result.output
    manifest = open_slab(out).manifest
    assert manifest.calibration["rotation"] is False
    quantized = [r for r in manifest.layers if not r.spec.is_passthrough]
    assert quantized and not any(r.spec.rotate or r.metrics["rotate"] for r in quantized)
