import pytest
import torch

from squareq.compiler.ladder import DEFAULT_FORMATS, diagnostics, ladder, measure_rungs, rung_specs
from squareq.compiler.layer_search import Candidate, search_layer
from squareq.compiler.layer_statistics import StatsCollector
from squareq.compiler.thresholds import Thresholds, ThresholdsError
from squareq.quant import QuantSpec, quantize


def layer_with_stats(w, x, seed=0):
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    wrapper = torch.nn.Sequential(lin)
    with StatsCollector("blk", wrapper, max_rows=256, seed=seed) as col:
        wrapper(x)
    return col.stats["blk.0"]


def gaussian_layer(n=64, k=128, rows=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    return w, layer_with_stats(w, x)


def test_every_rung_is_measured_and_error_falls_with_bits():
    w, stats = gaussian_layer()
    d = measure_rungs("q", w, stats, rung_specs(["bf16", "W8", "W4", "W6"]), rounding="nearest")
    assert d.chosen.rung == "W4" and [c.rung for c in d.tried] == ["W4", "W6", "W8", "bf16"]
    errs = [c.metrics["output_rel_mse"] for c in d.tried]
    assert errs[0] > errs[1] > errs[2] > errs[3] >= 0
    assert [c.nbytes for c in d.tried] == sorted(c.nbytes for c in d.tried)
    with pytest.raises(ValueError, match="no rungs"):
        measure_rungs("q", w, stats, [], rounding="nearest")


def test_the_ladder_offers_every_registered_format_by_name_ordered_by_bytes():
    offered = ladder(64)
    assert list(offered) == ["NF4", "W4", "W6", "FP8", "W8", "bf16"]  # NF4 has no zero points: fewer bytes than W4
    assert offered["NF4"].format == "nf4" and offered["NF4"].symmetric and not offered["W4"].symmetric
    assert offered["FP8"].format == "fp8_e4m3" and offered["bf16"].is_passthrough
    assert [s.short_label for s in rung_specs(DEFAULT_FORMATS)] == ["W4", "W6", "W8", "bf16"]
    for wrong in (["W5"], [], ["W4", "W4"], ["w4"]):
        with pytest.raises(ValueError, match="--formats .*name each rung once, from NF4, W4, W6, FP8, W8, bf16"):
            rung_specs(wrong)


def test_nf4_and_fp8_rungs_are_searched_by_rounding_without_gptq():
    """GPTQ rounds onto the int grid only: an NF4 or FP8 rung keeps plain rounding or the α/clip proposal, and a W4
    rung of the same layer may take GPTQ."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 128, generator=g), torch.randn(512, 128, generator=g)
    lin = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False))
    with torch.no_grad():
        lin[0].weight.copy_(w)
    with StatsCollector("blk", lin, max_rows=256, seed=0, hessian=True) as col:
        lin(x)
    stats = col.stats["blk.0"]
    d = measure_rungs("q", w, stats, rung_specs(["NF4", "W4", "FP8"]))
    assert [c.rung for c in d.tried] == ["NF4", "W4", "FP8"]
    assert d.candidate("NF4").metrics["gptq"] == 0.0 and d.candidate("FP8").metrics["gptq"] == 0.0
    assert d.candidate("NF4").qweight.spec.format == "nf4"
    for c in d.tried:
        assert c.metrics["output_rel_mse"] <= c.metrics["heldout_rtn_rel_mse"]
    assert d.candidate("FP8").metrics["output_rel_mse"] < d.candidate("W4").metrics["output_rel_mse"]


def test_diagnostics_name_each_proxy_limit_and_scale_with_bits():
    base = {"output_rel_mse": 0.0, "scale_ratio": 1.0}
    w4, w6, nf4, bf16 = (ladder()[r] for r in ("W4", "W6", "NF4", "bf16"))
    assert diagnostics(w4, {**base, "act_outlier_score": 39.0}, Thresholds(act=40.0)) == []
    (reason,) = diagnostics(w4, {**base, "act_outlier_score": 41.0}, Thresholds(act=40.0))
    assert reason.startswith("W4: activation outlier score 41 > τ_ACT")
    assert diagnostics(w6, {**base, "act_outlier_score": 150.0}, Thresholds(act=40.0)) == []
    (reason,) = diagnostics(nf4, {**base, "act_outlier_score": 1.0, "scale_ratio": 139.0}, Thresholds())
    assert reason.startswith("NF4: group-scale ratio 139 > τ_SCALE")
    assert diagnostics(bf16, {**base, "act_outlier_score": 1e9}, Thresholds()) == []


def test_smoothing_lowers_error_on_planted_activation_outliers():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(512, 128, generator=g)
    x[:, :3] *= 60.0
    stats = layer_with_stats(w, x)
    plain = search_layer(w, stats, QuantSpec(bits=4), rounding="nearest", alphas=(0.0,))
    smoothed = search_layer(w, stats, QuantSpec(bits=4), rounding="nearest")
    assert smoothed.alpha > 0 and smoothed.qweight.spec.smooth
    assert smoothed.metrics["output_rel_mse"] < 0.8 * plain.metrics["output_rel_mse"]
    assert smoothed.metrics["act_outlier_score"] < plain.metrics["act_outlier_score"]


def test_thresholds_toml(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[thresholds]\nmse = 0.005\nblock = 0.05\n")
    t = Thresholds.from_toml(p)
    assert t.mse == 0.005 and t.block == 0.05 and t.act == Thresholds().act and t.out == Thresholds().out
    p.write_text("[thresholds]\nmsee = 1\n")
    with pytest.raises(ThresholdsError, match="unknown threshold keys"):
        Thresholds.from_toml(p)
    with pytest.raises(ThresholdsError, match="does not exist"):
        Thresholds.from_toml(tmp_path / "none.toml")
    with pytest.raises(ThresholdsError, match="positive"):
        Thresholds(mse=-1)
