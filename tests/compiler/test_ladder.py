import pytest
import torch

from squareq.compiler.calibration import StatsCollector
from squareq.compiler.ladder import climb, trips
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


def test_a_plain_layer_stays_at_w4_with_no_reasons():
    w, stats = gaussian_layer()
    d = climb("plain", w, stats, Thresholds(), rounding="nearest")
    assert d.chosen.bits == 4 and d.reasons == [] and [c.bits for c in d.tried] == [4]
    assert 0 < d.chosen.metrics["output_rel_mse"] < Thresholds().mse


def test_a_strict_mse_moves_the_layer_up_and_says_why():
    w, stats = gaussian_layer()
    d = climb("strict", w, stats, Thresholds(mse=2e-3), rounding="nearest")
    assert d.chosen.bits == 6
    assert len(d.reasons) == 1 and d.reasons[0].startswith("W4: output rel-MSE") and "τ_MSE 0.002" in d.reasons[0]
    assert d.tried[0].metrics["output_rel_mse"] > 2e-3 >= d.chosen.metrics["output_rel_mse"]


def test_scale_spread_limit_grows_with_the_bit_width():
    w, stats = gaussian_layer()
    w = w.clone()
    w[:2] *= 3000.0  # two rows dwarf the rest: max/median group scale ~ 3000
    stats = layer_with_stats(w, stats.rows)
    d = climb("spread", w, stats, Thresholds(mse=1.0, scale=30.0), rounding="nearest")
    assert d.chosen.bits == 16
    assert [r.split(":")[0] for r in d.reasons] == ["W4", "W6", "W8"]
    assert all("group-scale ratio" in r for r in d.reasons)


def test_activation_outlier_rule():
    qw = quantize(torch.randn(8, 64), QuantSpec(bits=4))
    base = {"output_rel_mse": 0.0, "scale_ratio": 1.0}
    assert trips(Candidate(qw, 0.0, {**base, "act_outlier_score": 39.0}), Thresholds(act=40.0)) == []
    (reason,) = trips(Candidate(qw, 0.0, {**base, "act_outlier_score": 41.0}), Thresholds(act=40.0))
    assert reason.startswith("W4: activation outlier score 41 > τ_ACT")
    qw6 = quantize(torch.randn(8, 64), QuantSpec(bits=6))
    assert trips(Candidate(qw6, 0.0, {**base, "act_outlier_score": 150.0}), Thresholds(act=40.0)) == []


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


def test_measure_all_keeps_the_choice_and_measures_higher_rungs():
    w, stats = gaussian_layer()
    d = climb("q", w, stats, Thresholds(), rounding="nearest", measure_all=True)
    assert d.chosen.bits == 4 and [c.bits for c in d.tried] == [4, 6, 8, 16]
    errs = [c.metrics["output_rel_mse"] for c in d.tried]
    assert errs[0] > errs[1] > errs[2] > errs[3] >= 0
    assert [c.nbytes for c in d.tried] == sorted(c.nbytes for c in d.tried)


def test_thresholds_toml(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text("[thresholds]\nmse = 0.005\nblock = 0.05\n")
    t = Thresholds.from_toml(p)
    assert t.mse == 0.005 and t.block == 0.05 and t.act == Thresholds().act
    p.write_text("[thresholds]\nmsee = 1\n")
    with pytest.raises(ThresholdsError, match="unknown threshold keys"):
        Thresholds.from_toml(p)
    with pytest.raises(ThresholdsError, match="does not exist"):
        Thresholds.from_toml(tmp_path / "none.toml")
    with pytest.raises(ThresholdsError, match="positive"):
        Thresholds(mse=-1)
