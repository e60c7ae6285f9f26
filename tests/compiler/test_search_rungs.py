"""A layer's rungs searched together (compiler/layer_search.py ``search_rungs``): each rung's result is bit for bit
the one searched alone, while GPTQ factors each stored space once per layer instead of once per candidate."""
import torch

from squareq import quant
from squareq.compiler import layer_search
from squareq.compiler.ladder import DEFAULT_FORMATS, rung_specs
from squareq.compiler.layer_search import search_layer, search_rungs

from .test_rotation import K, N, layer_stats

W = torch.randn(N, K, generator=torch.Generator().manual_seed(7))
W[:, 5] *= 12  # a loud input column: the smoothing search has something to propose


def _counted(monkeypatch, name):
    calls = []
    original = getattr(quant, name)
    monkeypatch.setattr(layer_search.quant, name, lambda *a, **k: calls.append(a[1:3]) or original(*a, **k))
    return calls


def test_each_rung_is_the_one_searched_alone():
    st = layer_stats(W)
    specs = rung_specs(DEFAULT_FORMATS)
    together = search_rungs(W, st, specs)
    for spec, c in zip(specs, together):
        alone = search_layer(W, st, spec)
        assert c.qweight.spec == alone.qweight.spec and c.alpha == alone.alpha and c.metrics == alone.metrics
        assert all(torch.equal(c.qweight.tensors[r], alone.qweight.tensors[r]) for r in alone.qweight.tensors)


def test_gptq_factors_each_space_once_per_layer(monkeypatch):
    st = layer_stats(W)
    specs = rung_specs(DEFAULT_FORMATS)  # W4, W6, W8 and bf16
    factors = _counted(monkeypatch, "gptq_factor")
    runs = _counted(monkeypatch, "gptq_quantize")
    search_rungs(W, st, specs)
    spaces = {(spec.rotate, id(smooth) if spec.smooth else None) for spec, smooth in factors}
    assert len(runs) >= 7  # per int rung: GPTQ at the proposal, rotated GPTQ at clip 1 (and at the rotated clip)
    assert len(factors) == len(spaces) <= 1 + 3  # the rotated space once, the unrotated one once per α chosen
    searched_together = len(factors)
    factors.clear()
    for spec in specs:  # the negative control: searched a rung at a time, each rung factors again
        search_layer(W, st, spec)
    assert len(factors) >= 2 * searched_together  # measured 6 against 3
