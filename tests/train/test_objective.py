"""The FLUX rectified-flow objective: packing matches diffusers, timesteps, noising and loss."""
import pytest
import torch
from diffusers import FluxPipeline

from squareq.train.objective import (
    flow_loss,
    flow_match,
    image_ids,
    pack_latents,
    sample_timesteps,
    text_ids,
    unpack_latents,
)


@pytest.mark.parametrize("shape", [(2, 16, 8, 12), (1, 4, 2, 2), (3, 16, 64, 32)])
def test_pack_unpack_round_trip_and_match_diffusers(shape):
    b, c, h, w = shape
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    tokens = pack_latents(latents)
    assert tokens.shape == (b, (h // 2) * (w // 2), 4 * c)
    assert torch.equal(tokens, FluxPipeline._pack_latents(latents, b, c, h, w))
    back = unpack_latents(tokens, h, w)
    assert torch.equal(back, latents)
    # diffusers' unpack takes pixel sizes and the VAE scale factor (8 for FLUX).
    assert torch.equal(back, FluxPipeline._unpack_latents(tokens, h * 8, w * 8, 8))


def test_pack_refuses_odd_sizes():
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.zeros(1, 4, 3, 4))
    with pytest.raises(ValueError, match="do not pack"):
        unpack_latents(torch.zeros(1, 6, 16), 4, 4)


def test_ids_match_diffusers():
    h, w = 6, 10
    ours = image_ids(h, w)
    theirs = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, torch.device("cpu"), torch.float32)
    assert ours.shape == ((h // 2) * (w // 2), 3)
    assert torch.equal(ours, theirs)
    assert torch.equal(text_ids(7), torch.zeros(7, 3))


@pytest.mark.parametrize("mode", ["uniform", "logit_normal", "shift"])
def test_timesteps_in_open_interval_and_seeded(mode):
    t1 = sample_timesteps(10_000, torch.Generator().manual_seed(3), mode=mode)
    t2 = sample_timesteps(10_000, torch.Generator().manual_seed(3), mode=mode)
    t3 = sample_timesteps(10_000, torch.Generator().manual_seed(4), mode=mode)
    assert t1.shape == (10_000,) and t1.dtype == torch.float32
    assert bool(((t1 > 0) & (t1 < 1)).all())
    assert torch.equal(t1, t2)
    assert not torch.equal(t1, t3)


def test_shift_moves_mass_toward_noise():
    means = [sample_timesteps(20_000, torch.Generator().manual_seed(0), mode="shift", shift=s).mean().item()
             for s in (1.0, 2.0, 3.0, 6.0)]
    assert means == sorted(means) and means[-1] > means[0] + 0.2
    assert means[0] == pytest.approx(0.5, abs=0.01)  # shift 1 is uniform
    # Same u, shifted by hand.
    u = torch.rand(5, generator=torch.Generator().manual_seed(1))
    t = sample_timesteps(5, torch.Generator().manual_seed(1), mode="shift", shift=3.0)
    assert torch.allclose(t, 3 * u / (1 + 2 * u))


def test_logit_normal_median_and_mean_shift():
    t = sample_timesteps(50_000, torch.Generator().manual_seed(0), mode="logit_normal")
    assert t.median().item() == pytest.approx(0.5, abs=0.01)
    t_hi = sample_timesteps(50_000, torch.Generator().manual_seed(0), mode="logit_normal", logit_mean=1.0)
    assert t_hi.median().item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item(), abs=0.01)


def test_unknown_mode_refused():
    with pytest.raises(ValueError, match="unknown timestep mode"):
        sample_timesteps(2, None, mode="cosine")


def test_flow_match_endpoints_and_target():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 2, 2, generator=g), torch.randn(3, 4, 2, 2, generator=g)
    x_t, target = flow_match(x0, noise, torch.tensor([0.0, 1.0, 0.25]))
    assert torch.equal(x_t[0], x0[0])
    assert torch.equal(x_t[1], noise[1])
    assert torch.allclose(x_t[2], 0.75 * x0[2] + 0.25 * noise[2])
    assert torch.equal(target, noise - x0)


def test_flow_match_keeps_model_dtype_and_fp32_target():
    x0 = torch.randn(2, 4, 2, 2).bfloat16()
    noise = torch.randn(2, 4, 2, 2).bfloat16()
    x_t, target = flow_match(x0, noise, torch.tensor([0.5, 0.5]))
    assert x_t.dtype == torch.bfloat16 and target.dtype == torch.float32
    assert torch.equal(target, noise.float() - x0.float())


def test_flow_loss_known_values():
    pred = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    target = torch.tensor([[0.0, 0.0], [3.0, 2.0]])
    # squared errors: [1, 4] and [0, 4]; mean 9/4
    assert flow_loss(pred, target).item() == pytest.approx(2.25)
    # per-sample MSEs 2.5 and 2.0; weighted mean (2*2.5 + 0*2)/2
    assert flow_loss(pred, target, torch.tensor([2.0, 0.0])).item() == pytest.approx(2.5)
    bf = flow_loss(pred.bfloat16(), target.bfloat16())
    assert bf.dtype == torch.float32 and bf.ndim == 0 and bf.item() == pytest.approx(2.25)


def test_flux_shift_follows_the_image_size():
    """FLUX.1's resolution-dependent shift: e^0.5 at 256 tokens (512²), e^1.15 at 4096 (1024²); a larger image
    draws noisier times; the quantile draw puts its median at the shifted 0.5; no token count, no draw."""
    import math

    from squareq.models.noising import calibration_times, flux_shift, sample_timesteps

    assert flux_shift(256) == pytest.approx(math.exp(0.5)) and flux_shift(4096) == pytest.approx(math.exp(1.15))
    small = sample_timesteps(4000, torch.Generator().manual_seed(0), mode="flux_shift", image_tokens=256)
    large = sample_timesteps(4000, torch.Generator().manual_seed(0), mode="flux_shift", image_tokens=4096)
    assert float(large.median()) > float(small.median()) + 0.1
    s = flux_shift(1024)
    median = float(calibration_times("flow", 101, 0, mode="flux_shift", image_tokens=1024).median())
    assert median == pytest.approx(s / (1 + s), abs=1e-4)
    with pytest.raises(ValueError, match="token count"):
        sample_timesteps(2, None, mode="flux_shift")


def test_loss_weighting_schemes_are_diffusers():
    import math

    from squareq.train.objective import flow_loss, loss_weights

    t = torch.tensor([0.1, 0.5, 0.9])
    assert loss_weights("none", t) is None
    torch.testing.assert_close(loss_weights("sigma_sqrt", t), t ** -2)
    torch.testing.assert_close(loss_weights("cosmap", t), 2 / (math.pi * (1 - 2 * t + 2 * t ** 2)))
    pred, target = torch.zeros(3, 4), torch.tensor([[1.0] * 4, [2.0] * 4, [3.0] * 4])
    weighted = flow_loss(pred, target, loss_weights("sigma_sqrt", t))
    assert float(weighted) == pytest.approx(float(((t ** -2) * torch.tensor([1.0, 4.0, 9.0])).mean()))
    assert float(weighted) != pytest.approx(float(flow_loss(pred, target)))
    with pytest.raises(ValueError, match="unknown loss weighting"):
        loss_weights("snr", t)
