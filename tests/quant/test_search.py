import torch

from squareq.quant import QuantSpec, fake_quantize, search_clip_ratio, weighted_sq_error



def test_clip_search_beats_no_clipping_on_heavy_tails():
    torch.manual_seed(0)
    w = torch.distributions.StudentT(torch.tensor(3.0)).sample((64, 256))
    spec = QuantSpec(bits=4, group_size=64)
    found = search_clip_ratio(w, spec)
    assert found.clip_ratio < 1.0
    assert found.error < found.error_unclipped
    assert found.error == weighted_sq_error(w, fake_quantize(w, spec.with_clip(found.clip_ratio)))


def test_weighted_search_minimises_the_weighted_error():
    torch.manual_seed(1)
    w = torch.distributions.StudentT(torch.tensor(3.0)).sample((64, 256))
    h = torch.rand(256) + 0.01
    h[:8] = 500.0
    spec = QuantSpec(bits=4, group_size=64)
    weighted = search_clip_ratio(w, spec, act_second_moment=h)
    for r in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5):
        assert weighted.error <= weighted_sq_error(w, fake_quantize(w, spec.with_clip(r)), h) + 1e-9


def test_passthrough_needs_no_search():
    assert search_clip_ratio(torch.randn(4, 8), QuantSpec(bits=16)).clip_ratio == 1.0
