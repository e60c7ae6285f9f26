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


def test_per_group_clip_never_loses_to_one_ratio_per_layer():
    from squareq.quant import quantize, dequantize, search_group_clip

    g = torch.Generator().manual_seed(4)
    w = torch.randn(48, 200, generator=g)
    w[:24] = torch.distributions.StudentT(torch.tensor(2.5)).sample((24, 200))  # heavy-tailed rows
    h = torch.rand(200, generator=g) + 0.1
    spec = QuantSpec(bits=4, group_size=64)
    per_group = search_group_clip(w, spec, h)
    per_layer = search_clip_ratio(w, spec, h)
    assert per_group.clip.shape == (48, 4) and per_group.clip.unique().numel() > 1
    assert per_group.error < per_layer.error
    assert per_group.error_unclipped == per_layer.error_unclipped
    # the chosen ratios reproduce the searched error exactly, through the real quantizer
    qw = quantize(w, spec, clip=per_group.clip)
    assert abs(weighted_sq_error(w, fake_quantize(w, spec, clip=per_group.clip), h) - per_group.error) < 1e-6 * per_group.error
    assert torch.equal(dequantize(qw), fake_quantize(w, spec, clip=per_group.clip).to(torch.bfloat16))
