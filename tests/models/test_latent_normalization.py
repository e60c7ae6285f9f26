"""The cache's latent normalization per VAE class (squareq/sources/pipeline_encoders.py) is what each family's own
diffusers pipeline does to an encoded image, so a pipeline folder's latents train on the scale its sampler expects."""
import pytest
import torch

from squareq.models.flux_latents import pack_latents
from squareq.sources.pipeline_encoders import PipelineEncoders, normalize_latent


def _image(seed=0, side=32):
    return torch.rand(3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_flux2_latents_are_its_pipeline_s_patchified_batch_norm_latents():
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4,
                                       norm_num_groups=4).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(16))
        vae.bn.running_var.copy_(torch.rand(16) + 0.5)
    pipe = diffusers.Flux2Pipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                   tokenizer=None, transformer=None)
    ours = PipelineEncoders(pipe, "flux2", torch.device("cpu"), torch.float32).encode_image(_image())
    with torch.no_grad():
        theirs = pipe._encode_vae_image(_image()[None], generator=None)  # [1, 4C, h/2, w/2], normalized
    # our [C, h, w] latent packs 2x2 into the pipeline's patchified channels (c, dy, dx)
    torch.testing.assert_close(pack_latents(ours[None]), theirs.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_qwen_image_latents_are_its_edit_pipeline_s():
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                           latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 2.0, 0.5, 1.0]).eval()
    pipe = diffusers.QwenImageEditPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                                           text_encoder=None, tokenizer=None, processor=None, transformer=None)
    ours = PipelineEncoders(pipe, "qwen-image", torch.device("cpu"), torch.float32).encode_image(_image())
    with torch.no_grad():
        theirs = pipe._encode_vae_image(_image()[None, :, None], generator=None)  # [1, C, 1, h, w]
    torch.testing.assert_close(ours, theirs[0, :, 0], rtol=1e-5, atol=1e-5)


def test_ltx_normalization_is_its_pipeline_s():
    from diffusers import LTXPipeline

    class AutoencoderKLLTXVideo:  # the statistics the real class keeps as buffers, and its config
        latents_mean = torch.tensor([0.5, -1.0, 0.25])
        latents_std = torch.tensor([2.0, 0.5, 1.5])
        config = type("Config", (), {"scaling_factor": 0.7})()

    z = torch.randn(2, 3, 1, 4, 4)
    vae = AutoencoderKLLTXVideo()
    want = LTXPipeline._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(normalize_latent(vae, z), want)


@pytest.mark.parametrize("name", ["AutoencoderKLWan", "AutoencoderKLQwenImage"])
def test_wan_and_qwen_statistics_are_per_channel(name):
    vae = type(name, (), {"config": type("Config", (), {"latents_mean": [1.0, 2.0], "latents_std": [2.0, 4.0]})()})()
    z = torch.ones(1, 2, 1, 3, 3)
    out = normalize_latent(vae, z)
    assert torch.allclose(out[0, 0], torch.zeros(1, 3, 3)) and torch.allclose(out[0, 1], torch.full((1, 3, 3), -0.25))
