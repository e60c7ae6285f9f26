"""Each flow family's training recipe speaks its diffusers pipeline's language: Euler steps taken with the recipe's
forward arguments and prediction (time scale and direction, packing, output sign) land where the family's own
pipeline lands from the same latents, text and sigmas. A recipe that trains on the wrong time scale or sign fails."""
import itertools

import pytest
import torch

from squareq.models import ADAPTERS, BUILTIN_MODELS, load_builtin
from squareq.models.flux_latents import pack_latents, unpack_latents
from squareq.models.tiny_pipeline import build_tiny_vae


def _euler(recipe, model, x, sigmas, text, guidance=1.0):
    """The sampler every flow pipeline runs: x += (σ_next - σ)·v, v from the recipe."""
    for s, s_next in itertools.pairwise(sigmas):
        t = torch.full((x.shape[0],), float(s))
        v = recipe.prediction(model(**recipe.forward(model.config, x, t, text, guidance), return_dict=False), x)
        x = x + (float(s_next) - float(s)) * v
    return x


def _scheduler(**kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, **kw)


def _case(name):
    """(pipeline, call kwargs, our latent [1, ...], our text dict, pipeline output -> our layout)."""
    import diffusers

    model, adapter = load_builtin(name)
    model = model.float()
    recipe, cfg = adapter.recipe, model.config
    fields = recipe.text_fields(cfg)
    g = torch.Generator().manual_seed(5)
    channels = recipe.latent_channels(cfg)
    x = torch.randn(1, channels, *((1,) if recipe.frames else ()), 8, 8, generator=g)
    embeds = torch.randn(1, 6, fields.width, generator=g)
    text = {"prompt_embeds": embeds}
    if fields.mask:
        text["prompt_mask"] = torch.ones(1, 6)
    if fields.pooled:
        text["pooled_prompt_embeds"] = torch.randn(1, fields.pooled, generator=g)
    size = dict(height=64, width=64, num_inference_steps=3, output_type="latent")
    family = adapter.family
    if family == "flux":
        pipe = diffusers.FluxPipeline(scheduler=_scheduler(use_dynamic_shifting=True), vae=None, text_encoder=None,
                                      tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=model)
        call = dict(prompt_embeds=embeds, pooled_prompt_embeds=text["pooled_prompt_embeds"], latents=pack_latents(x),
                    guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: unpack_latents(out, 8, 8)
    if family == "z-image":
        pipe = diffusers.ZImagePipeline(scheduler=_scheduler(), vae=build_tiny_vae(latent_channels=channels),
                                        text_encoder=None, tokenizer=None, transformer=model)
        call = dict(prompt_embeds=[embeds[0]], latents=x, guidance_scale=0.0, **size)
        return pipe, call, x, text, lambda out: out
    if family == "sd3":
        pipe = diffusers.StableDiffusion3Pipeline(transformer=model, scheduler=_scheduler(),
                                                  vae=build_tiny_vae(latent_channels=channels), text_encoder=None,
                                                  tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                                                  text_encoder_3=None, tokenizer_3=None)
        call = dict(prompt_embeds=embeds, pooled_prompt_embeds=text["pooled_prompt_embeds"], latents=x,
                    guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: out
    if family == "wan":
        pipe = diffusers.WanPipeline(tokenizer=None, text_encoder=None, transformer=model, vae=None,
                                     scheduler=_scheduler())
        call = dict(prompt_embeds=embeds, latents=x, num_frames=1, guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: out
    if family == "qwen-image":
        pipe = diffusers.QwenImagePipeline(scheduler=_scheduler(use_dynamic_shifting=True), vae=None,
                                           text_encoder=None, tokenizer=None, transformer=model)
        call = dict(prompt_embeds=embeds, prompt_embeds_mask=text["prompt_mask"].long(), latents=pack_latents(x),
                    true_cfg_scale=1.0, **size)
        return pipe, call, x, text, lambda out: unpack_latents(out, 8, 8)
    if family == "chroma":
        pipe = diffusers.ChromaPipeline(scheduler=_scheduler(use_dynamic_shifting=True),
                                        vae=build_tiny_vae(latent_channels=channels), text_encoder=None,
                                        tokenizer=None, transformer=model)
        call = dict(prompt_embeds=embeds, prompt_attention_mask=text["prompt_mask"], latents=pack_latents(x),
                    guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: unpack_latents(out, 8, 8)
    if family == "flux2":
        pipe = diffusers.Flux2Pipeline(scheduler=_scheduler(use_dynamic_shifting=True), vae=None, text_encoder=None,
                                       tokenizer=None, transformer=model)
        patches = pack_latents(x).transpose(1, 2).reshape(1, 4 * channels, 4, 4)  # FLUX.2's patchified layout
        call = dict(prompt_embeds=embeds, latents=patches, guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: unpack_latents(out, 8, 8)
    if family == "hunyuan-video":
        pipe = diffusers.HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=model, vae=None,
                                              scheduler=_scheduler(), text_encoder_2=None, tokenizer_2=None)
        call = dict(prompt_embeds=embeds, pooled_prompt_embeds=text["pooled_prompt_embeds"],
                    prompt_attention_mask=text["prompt_mask"], latents=x, num_frames=1, guidance_scale=1.0, **size)
        return pipe, call, x, text, lambda out: out
    if family == "ltx-video":
        pipe = diffusers.LTXPipeline(scheduler=_scheduler(use_dynamic_shifting=True), vae=None, text_encoder=None,
                                     tokenizer=None, transformer=model)
        call = dict(prompt_embeds=embeds, prompt_attention_mask=text["prompt_mask"], latents=x.flatten(2).transpose(1, 2),
                    num_frames=1, guidance_scale=1.0, **{**size, "height": 256, "width": 256})  # its VAE is 32x
        return pipe, call, x, text, lambda out: out.transpose(1, 2).reshape(x.shape)
    raise KeyError(family)


CASES = ["tiny-flux", "tiny-z-image", "tiny-sd3", "tiny-wan", "tiny-qwen-image", "tiny-chroma", "tiny-flux2", "tiny-hunyuan-video",
         "tiny-ltx-video"]


@pytest.mark.parametrize("name", CASES)
def test_recipe_euler_steps_land_where_the_family_pipeline_lands(name):
    pipe, call, x, text, to_ours = _case(name)
    with torch.no_grad():
        theirs = to_ours(pipe(**call)[0])
        ours = _euler(ADAPTERS[BUILTIN_MODELS[name][0]].recipe, pipe.transformer, x, pipe.scheduler.sigmas, text)
    assert theirs.shape == ours.shape
    err = (theirs.float() - ours).norm() / ours.norm()
    assert err < 1e-4, f"{name}: relative difference {err:.2e} from the pipeline"


@pytest.mark.parametrize("objective", ["epsilon", "v_prediction"])
def test_ddpm_noising_and_targets_are_diffusers_scheduler_s(objective):
    from diffusers import DDPMScheduler

    from squareq.train.objective import noised

    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                              prediction_type=objective)  # SD 1.x / SDXL's scheduler_config.json
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([0, 499, 999])
    x_t, target = noised(objective, x0, noise, t)
    torch.testing.assert_close(x_t, scheduler.add_noise(x0, noise, t), rtol=1e-5, atol=1e-5)
    want = noise if objective == "epsilon" else scheduler.get_velocity(x0, noise, t)
    torch.testing.assert_close(target, want, rtol=1e-5, atol=1e-5)


def test_sdxl_size_conditioning_is_the_pipeline_s_for_an_uncropped_image():
    import diffusers

    model, adapter = load_builtin("tiny-sdxl")
    recipe, cfg = adapter.recipe, model.config
    pooled = recipe.text_fields(cfg).pooled
    x = torch.zeros(2, 4, 12, 8)  # a 96 x 64 image
    kwargs = recipe.forward(cfg, x, torch.tensor([10, 20]), {"prompt_embeds": torch.zeros(2, 5, 32),
                                                             "pooled_prompt_embeds": torch.zeros(2, pooled)}, 1.0)
    pipe = diffusers.StableDiffusionXLPipeline(vae=build_tiny_vae(), text_encoder=None, text_encoder_2=None,
                                               tokenizer=None, tokenizer_2=None, unet=model,
                                               scheduler=diffusers.EulerDiscreteScheduler())
    want = pipe._get_add_time_ids((96, 64), (0, 0), (96, 64), torch.float32, text_encoder_projection_dim=pooled)
    torch.testing.assert_close(kwargs["added_cond_kwargs"]["time_ids"], want.expand(2, 6))


def test_wuerstchen_noising_is_its_scheduler_s():
    from diffusers import DDPMWuerstchenScheduler

    from squareq.train.objective import noised

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    t = torch.tensor([0.02, 0.5, 0.97])
    x_t, target = noised("cosine_epsilon", x0, noise, t)
    torch.testing.assert_close(x_t, DDPMWuerstchenScheduler().add_noise(x0, noise, t), rtol=1e-5, atol=1e-5)
    assert torch.equal(target, noise)
