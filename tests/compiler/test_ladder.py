import pytest
import torch

from squareq.compiler.calibration import StatsCollector
from squareq.compiler.ladder import diagnostics, measure_rungs
from squareq.compiler.layer_search import Candidate, search_layer
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
    d = measure_rungs("q", w, stats, [4, 6, 8, 16], rounding="nearest")
    assert d.chosen.bits == 4 and [c.bits for c in d.tried] == [4, 6, 8, 16]
    errs = [c.metrics["output_rel_mse"] for c in d.tried]
    assert errs[0] > errs[1] > errs[2] > errs[3] >= 0
    assert [c.nbytes for c in d.tried] == sorted(c.nbytes for c in d.tried)
    with pytest.raises(ValueError, match="rungs"):
        measure_rungs("q", w, stats, [5], rounding="nearest")


def test_diagnostics_name_each_proxy_limit_and_scale_with_bits():
    base = {"output_rel_mse": 0.0, "scale_ratio": 1.0}
    assert diagnostics(4, {**base, "act_outlier_score": 39.0}, Thresholds(act=40.0)) == []
    (reason,) = diagnostics(4, {**base, "act_outlier_score": 41.0}, Thresholds(act=40.0))
    assert reason.startswith("W4: activation outlier score 41 > τ_ACT")
    assert diagnostics(6, {**base, "act_outlier_score": 150.0}, Thresholds(act=40.0)) == []
    (reason,) = diagnostics(4, {**base, "act_outlier_score": 1.0, "scale_ratio": 139.0}, Thresholds())
    assert "group-scale ratio 139 > τ_SCALE" in reason
    assert diagnostics(16, {**base, "act_outlier_score": 1e9}, Thresholds()) == []


def test_smoothing_lowers_error_on_planted_activation_outliers():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(512, 128, generator=g)
    x[:, :3] *= 60.0
    stats = layer_with_stats(w, x)
    plain = search_layer(w, stats, 4, rounding="nearest", alphas=(0.0,))
    smoothed = search_layer(w, stats, 4, rounding="nearest")
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
