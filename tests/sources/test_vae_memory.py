"""A video VAE's memory while it fills the cache (issue 62): how many frames it keeps alive at once (Wan's chunks of
4 with a cache, HunyuanVideo's windows), and tiles where a whole frame does not fit the budget. Negative controls: a
budget that holds the whole VAE does not tile, and one that not even tiles fit is refused naming the budget."""
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLHunyuanVideo

from squareq.sources.encoder_placement import EncoderRun, PlacementError, placed, plan_placement
from squareq.sources.vae_memory import VAE_BYTES_PER_PIXEL, WAN_FRAMES_AT_ONCE, frames_at_once, vae_workspace
from tests.models.tiny_folders import _wan_vae

CPU = torch.device("cpu")
SIZE = 480 * 832  # the frame of Wan 2.1's 480p clips


def _hunyuan_vae():
    return AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
                                     norm_num_groups=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                     up_block_types=("HunyuanVideoUpBlock3D",) * 4).eval()


def test_frames_alive_at_once_follow_how_each_vae_encodes():
    wan, hunyuan = _wan_vae(), _hunyuan_vae()
    assert frames_at_once(wan, 81) == WAN_FRAMES_AT_ONCE and frames_at_once(wan, 5) == 5
    assert frames_at_once(hunyuan, 45) == hunyuan.tile_sample_min_num_frames + 1
    hunyuan.use_framewise_encoding = False  # the negative control: encoded whole, every frame alive
    assert frames_at_once(hunyuan, 45) == 45
    image = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4)
    assert frames_at_once(image, 1) == 1 and not hasattr(image, "tile_sample_min_num_frames")
    whole, tiled = vae_workspace(wan, SIZE, 81), vae_workspace(wan, SIZE, 81, tiled=True)
    assert whole == VAE_BYTES_PER_PIXEL * SIZE * WAN_FRAMES_AT_ONCE and tiled == whole * 256 * 256 // SIZE


def test_the_vae_tiles_only_where_whole_frames_do_not_fit():
    parts = {"vae": _hunyuan_vae()}
    whole = plan_placement(parts, None, CPU, torch.bfloat16, 16, SIZE, frames=45)
    assert not whole.vae_tiled
    tiled = plan_placement(parts, whole.expected - 1, CPU, torch.bfloat16, 16, SIZE, frames=45)
    assert tiled.vae_tiled and tiled.expected < whole.expected and "encodes in tiles" in tiled.describe()
    assert tiled.record()["vae_tiled"] is True
    assert not plan_placement(parts, whole.expected, CPU, torch.bfloat16, 16, SIZE, frames=45).vae_tiled
    with pytest.raises(PlacementError, match="give vram_budget at least"):
        plan_placement(parts, tiled.expected - 1, CPU, torch.bfloat16, 16, SIZE, frames=45)


def test_a_tiled_placement_encodes_in_tiles():
    """Applied, the plan turns the VAE's tiling on, and a frame wider than a tile encodes through it to the latent an
    untiled encode gives, in shape (tiles are blended where they overlap, so values differ slightly)."""
    class Owner:
        vae = _wan_vae()

    # tiles of 64 x 128 pixels, 96 apart (diffusers' default is 256 x 256): a 320-wide frame is 3 of them
    Owner.vae.tile_sample_min_height, Owner.vae.tile_sample_min_width, Owner.vae.tile_sample_stride_width = 64, 128, 96
    frames = torch.rand(1, 3, 5, 64, 320) * 2 - 1
    whole = Owner.vae.encode(frames).latent_dist.mode()
    need = plan_placement({"vae": Owner.vae}, None, CPU, torch.float32, 16, 64 * 320, frames=5).expected
    with placed(Owner, ["vae"], CPU, torch.float32, EncoderRun(need - 1, 16, 64 * 320, frames=5)) as placement:
        assert placement.vae_tiled and Owner.vae.use_tiling
        tiled = Owner.vae.encode(frames).latent_dist.mode()
    assert tiled.shape == whole.shape and torch.isfinite(tiled).all()
