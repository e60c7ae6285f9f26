import pytest
import torch

from squareq.compiler.budget import BlockLayers, BudgetError, candidate_bytes, parse_size, plan_bytes, solve
from squareq.compiler.ladder import LayerDecision
from squareq.compiler.layer_search import Candidate
from squareq.compiler.thresholds import Thresholds
from squareq.quant import QuantSpec, quantize


@pytest.mark.parametrize("text, n", [("12GB", 12 * 10**9), ("11.5GiB", int(11.5 * 2**30)), ("800MB", 800 * 10**6),
                                     ("123456", 123456), (" 2 kib ", 2048)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "12XB", "", "-5GB"])
def test_unparsable_sizes_are_refused(text):
    with pytest.raises(BudgetError, match="write it like 12GB"):
        parse_size(text)


def decision(name, errors):
    """A layer measured at W4/W6/W8 with the given output errors; the ladder chose W4."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(len(name)))
    tried = [Candidate(quantize(w, QuantSpec(bits=b, group_size=64)), 0.0,
                       {"output_rel_mse": e, "act_outlier_score": 1.0, "scale_ratio": 1.0})
             for b, e in zip((4, 6, 8), errors)]
    return LayerDecision(name, tried[0], tried)


def blocks():
    return [BlockLayers(f"b.{i}", [decision(f"b.{i}.l{j}", (0.01, 0.002 * (j + 1), 0.0001)) for j in range(2)], 512)
            for i in range(3)]


def test_size_objective_keeps_the_ladder_choice_and_states_the_minimum():
    bl = blocks()
    choice = solve(bl, Thresholds(), budget=10**6)
    assert set(choice.values()) == {0}
    minimum = plan_bytes(bl, choice, overhead=100)
    with pytest.raises(BudgetError, match=f"at least {minimum:,} bytes"):
        solve(bl, Thresholds(), budget=minimum - 1, overhead=100)
    assert solve(bl, Thresholds(), budget=minimum, overhead=100) == choice


def test_quality_objective_spends_best_gain_per_byte_within_budget():
    bl = blocks()
    base = plan_bytes(bl, {d.name: 0 for b in bl for d in b.decisions}, 0)
    step = candidate_bytes(bl[0].decisions[0].tried[1]) - candidate_bytes(bl[0].decisions[0].tried[0])
    choice = solve(bl, Thresholds(), budget=base + 2 * step, objective="quality")
    upgraded = [n for n, i in choice.items() if i > 0]
    # l0 gains 0.008 per W6 upgrade, l1 only 0.006: the two affordable upgrades go to l0 layers
    assert len(upgraded) == 2 and all(n.endswith("l0") for n in upgraded)
    assert plan_bytes(bl, choice, 0) <= base + 2 * step


def test_stream_window_caps_consecutive_blocks():
    bl = blocks()
    ladder = {d.name: 0 for b in bl for d in b.decisions}
    block_size = plan_bytes(bl[:1], {d.name: 0 for d in bl[0].decisions}, 0)
    with pytest.raises(BudgetError, match="consecutive blocks exceed"):
        solve(bl, Thresholds(), budget=10**7, window=(2, 2 * block_size - 1))
    assert solve(bl, Thresholds(), budget=10**7, window=(2, 2 * block_size)) == ladder
    # the quality objective may spend the budget only where the window still fits
    choice = solve(bl, Thresholds(), budget=10**7, objective="quality", window=(2, 2 * block_size))
    assert choice == ladder
