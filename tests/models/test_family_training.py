"""`squareq train` on every family's built-in tiny model: the cache holds latents and captions in the family's
layout, training with the family's objective lowers that objective's loss on the training images, and the LoRA it
writes loads back onto the slab."""
import math

import numpy as np
import pytest
import torch

from squareq import runtime
from squareq.compiler.plain import PlainOptions, write_rtn_slab
from squareq.models import ADAPTERS, BUILTIN_MODELS, load_builtin
from squareq.quant import QuantSpec
from squareq.train.cache import EmbeddingCache
from squareq.train.config import load_config
from squareq.train.errors import TrainError
from squareq.train.layouts import LAYOUTS
from squareq.train.loop import train
from squareq.train.lora_attach import attach_lora
from squareq.train.lora_reader import load_lora
from squareq.train.objective import noised
from squareq.train.tiny_dataset import write_tiny_dataset

from ..train.tiny_run import w8_tiny_slab

FAMILIES = sorted(n for n in BUILTIN_MODELS if n != "tiny-flux")  # tiny-flux: tests/train/test_loop.py

# the torch reference dequantizer (conftest.py), for the module fixtures too
pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("data") / "images", count=4, size=64)


def _slab(name, folder):
    return w8_tiny_slab(folder / f"{name}.slab", name)


def _config(slab, data, out, **kw):
    values = {"slab": str(slab), "data": str(data), "output": str(out), "resolution": 64, "max_sequence_length": 16,
              "steps": 24, "lr": 2e-2, "rank": 4, "save_every": 0, "batch_size": 2, "cache_dir": str(out / "cache"),
              "caption_dropout": 0.0}
    values.update(kw)
    return load_config(None, values)


def _eval_loss(slab, cache_dir, family, lora_file=None) -> float:
    """The family objective's loss over every cached latent/caption pair at fixed noise and times, resident model."""
    recipe = ADAPTERS[family].recipe
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))
    if lora_file is not None:
        attach_lora(model, *load_lora(lora_file))
    cache = EmbeddingCache(cache_dir)
    images = [cache.load("latents", p.stem) for p in sorted((cache_dir / "latents").iterdir())]
    latents = torch.stack([e["latents"] for e in images])
    extra = {k: torch.stack([e[k] for e in images]) for k in images[0] if k != "latents"}  # Würstchen's effnet
    texts = [cache.load("text", p.stem) for p in sorted((cache_dir / "text").iterdir())]
    g = torch.Generator().manual_seed(123)
    total = 0.0
    with torch.no_grad():
        for i, text in enumerate(texts):
            batch = {**extra, **{k: v[None].expand(len(latents), *v.shape) for k, v in text.items()}}
            noise = torch.randn(latents.shape, generator=g)
            t = (torch.tensor([100, 400, 700, 900])[: len(latents)] if recipe.objective in ("epsilon", "v_prediction")
                 else torch.tensor([0.3, 0.5, 0.7, 0.9])[: len(latents)])
            x_t, target = noised(recipe.objective, latents, noise, t)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pred = recipe.prediction(model(**recipe.forward(model.config, x_t, t, batch, 1.0)), x_t)
            total += float((pred.float() - target).square().mean())
    runtime.runtime_of(model).close()
    return total / len(texts)


@pytest.mark.parametrize("name", FAMILIES)
def test_training_with_the_family_objective_lowers_its_loss_and_the_lora_loads_back(name, data, tmp_path):
    family = BUILTIN_MODELS[name][0]
    recipe = ADAPTERS[family].recipe
    slab = _slab(name, tmp_path)
    out = tmp_path / "out"
    result = train(_config(slab, data, out), echo=lambda s: None)
    assert result.steps == 24 and result.skipped_steps == 0 and all(math.isfinite(v) for v in result.losses)

    cache = out / "cache"
    latent = EmbeddingCache(cache).load("latents", next((cache / "latents").iterdir()).stem)["latents"]
    cfg = load_builtin(name)[0].config
    assert latent.shape == ((recipe.latent_channels(cfg), 1, 8, 8) if recipe.frames else (recipe.latent_channels(cfg), 8, 8))
    text = EmbeddingCache(cache).load("text", next((cache / "text").iterdir()).stem)
    fields = recipe.text_fields(cfg)
    assert text["prompt_embeds"].shape[-1] == fields.width and ("prompt_mask" in text) == fields.mask
    assert ("pooled_prompt_embeds" in text) == bool(fields.pooled)

    before = _eval_loss(slab, cache, family)
    after = _eval_loss(slab, cache, family, result.lora_file)
    assert after < 0.95 * before, f"{name}: loss {before:.4f} -> {after:.4f} after training"
    # issue 64: beside it, the family's kohya/ComfyUI file, which reads back (through the family's diffusers reader)
    # to the same deltas; diffusers splits HunyuanVideo's single-block linear1 at the real model's 3072 rows
    assert (result.kohya_file is not None) == (family in LAYOUTS)
    if result.kohya_file is not None and family != "hunyuan-video":
        ours, kohya = (_deltas(*load_lora(f)) for f in (result.lora_file, result.kohya_file))
        assert ours.keys() == kohya.keys()
        for layer, d in ours.items():  # diffusers' converters scale the bf16 factors in bf16
            assert float((kohya[layer] - d).abs().max()) <= 1e-2 * float(d.abs().max()), layer


def _deltas(lora, info):
    return {k[: -len(".lora_A.weight")]: info["alpha"] / a.shape[0] * lora[k.replace("_A.", "_B.")] @ a
            for k, a in lora.items() if k.endswith(".lora_A.weight")}


def test_sample_images_need_the_family_pipeline(data, tmp_path):
    """squareq sample and the trainer's sample images draw another family through its diffusers pipeline: without one
    (a built-in tiny model's source) each says to pass it with --model. A Würstchen stage needs the other stage's
    pipeline too: squareq sample asks for it with --decoder, the trainer for both stages' with sample_prior and
    sample_decoder."""
    from squareq.train.sample import SampleError, sample_images

    slab = _slab("tiny-wan", tmp_path)
    with pytest.raises(TrainError, match="sample_every = 2: .* holds a wan model, which squareq sample draws through "
                                         "its diffusers pipeline .* so pass the pipeline folder or Hub ID with --model"):
        train(_config(slab, data, tmp_path / "out", sample_every=2, sample_prompts=["a cat"]), echo=lambda s: None)
    prior = _slab("tiny-wuerstchen-prior", tmp_path)
    with pytest.raises(TrainError, match="sample_every = 2: .* holds Würstchen's prior, whose sample images are "
                                         "drawn through its pipeline .* give its folder or Hub ID with sample_prior, "
                                         "and the decoder's with sample_decoder"):
        train(_config(prior, data, tmp_path / "p", sample_every=2, sample_prompts=["a cat"]), echo=lambda s: None)
    with pytest.raises(SampleError, match="holds a wan model, which squareq sample draws through its diffusers pipeline "
                                          r"\(WanPipeline\); the built-in tiny model has none, so pass the pipeline "
                                          "folder or Hub ID with --model"):
        sample_images(slab, ["a cat"], resolution=64, steps=2)
    with pytest.raises(SampleError, match="holds Würstchen's prior, and an image needs its decoder too: give the "
                                          "decoder's pipeline folder or Hub ID with --decoder"):
        sample_images(prior, ["a cat"], resolution=128, steps=2)


@pytest.mark.parametrize("name", ["tiny-sd15", "tiny-sdxl", "tiny-sd3", "tiny-chroma", "tiny-wan", "tiny-qwen-image",
                                  "tiny-flux2", "tiny-z-image", "tiny-ltx-video", "tiny-hunyuan-video"])
def test_sample_draws_each_family_through_its_pipeline_with_the_streamed_denoiser(name, tmp_path):
    """An image (a video family's first frame) of the asked size from the family's own pipeline folder, the same
    for the same seed, with the slab as the denoiser: a slab of other weights draws another image (the negative
    control: were the folder's own denoiser or none used, the two would match)."""
    import numpy as np

    from squareq.train.sample import sample_images

    from .tiny_folders import build_pipeline, write_pipeline

    folder = write_pipeline(name, tmp_path / "pipeline")
    # FLUX.2's toy pipeline has a transformer of its own (a text width that fits its Mistral encoder)
    denoiser = build_pipeline(name).transformer if name == "tiny-flux2" else load_builtin(name)[0]
    adapter = ADAPTERS[BUILTIN_MODELS[name][0]]

    def slab_of(model, path):
        write_rtn_slab(model, adapter.blocks(model), {}, path,
                       PlainOptions(default_spec=QuantSpec(bits=8), family=adapter.family, source=name))
        return path

    def draw(slab):
        (image,) = sample_images(slab, ["a cat"], model=str(folder), resolution=64, steps=2, max_sequence_length=16,
                                 device="cpu")
        return np.asarray(image).astype(np.float64)

    slab = slab_of(denoiser, tmp_path / "m.slab")
    first = draw(slab)
    assert first.shape == (64, 64, 3) and first.std() > 1.0
    assert np.array_equal(draw(slab), first)
    with torch.no_grad():
        for p in denoiser.parameters():
            p.mul_(0.5)
    assert np.abs(draw(slab_of(denoiser, tmp_path / "halved.slab")) - first).mean() > 0.5


@pytest.mark.parametrize("name,objective", [("tiny-sd15", "v_prediction"), ("tiny-sdxl", "epsilon"),
                                            ("tiny-sd3", "flow"), ("tiny-chroma", "flow"), ("tiny-wan", "flow")])
def test_training_from_the_family_pipeline_folder(name, objective, data, tmp_path):
    from .tiny_folders import build_pipeline, write_pipeline

    folder = write_pipeline(name, tmp_path / "pipeline", prediction_type=objective)
    pipe = build_pipeline(name, prediction_type=objective)
    family = BUILTIN_MODELS[name][0]
    lines = []
    result = train(_config(_slab(name, tmp_path), data, tmp_path / "out", model=str(folder), steps=2, sample_every=2,
                           sample_prompts=["a cat --w 64 --h 48"], sample_steps=2), echo=lines.append)
    assert result.steps == 2 and f"training a {family} LoRA with the {objective} objective" in lines
    # sample images through the family's pipeline (a video family's first frame) at step 0 and at step 2
    from PIL import Image

    for step in (0, 2):
        image = np.asarray(Image.open(tmp_path / "out" / "samples" / f"step-{step:08d}-0.png")).astype(float)
        assert image.shape == (48, 64, 3) and image.std() > 1.0

    cache = tmp_path / "out" / "cache"
    entries = [EmbeddingCache(cache).load("text", p.stem) for p in sorted((cache / "text").iterdir())]
    latents = [EmbeddingCache(cache).load("latents", p.stem)["latents"] for p in (cache / "latents").iterdir()]
    recipe = ADAPTERS[family].recipe
    cfg = load_builtin(name)[0].config
    fields = recipe.text_fields(cfg)
    assert all(e["prompt_embeds"].shape[-1] == fields.width and ("pooled_prompt_embeds" in e) == bool(fields.pooled)
               and ("prompt_mask" in e) == fields.mask for e in entries)
    assert all(x.shape == ((recipe.latent_channels(cfg), 1, 8, 8) if recipe.frames else (recipe.latent_channels(cfg), 8, 8))
               for x in latents)
    # the entries are what the pipeline's own encode_prompt returns for the caption (its first output: the sequence)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where and how the trainer encoded
    pipe.to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    tol = 3e-2 if device.type == "cuda" else 1e-5
    caption = [min(data.glob("*.txt")).read_text().strip()]
    calls = {"tiny-sd15": lambda: pipe.encode_prompt(caption, device, 1, False),
             "tiny-sdxl": lambda: pipe.encode_prompt(caption, device=device, do_classifier_free_guidance=False),
             "tiny-sd3": lambda: pipe.encode_prompt(caption, None, None, device=device, do_classifier_free_guidance=False,
                                                    max_sequence_length=16),
             "tiny-chroma": lambda: pipe.encode_prompt(caption, device=device, do_classifier_free_guidance=False,
                                                       max_sequence_length=16),
             "tiny-wan": lambda: pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=16,
                                                    device=device)}
    with torch.no_grad():
        want = calls[name]()[0][0].float().cpu()
    assert any(torch.allclose(e["prompt_embeds"], want, rtol=tol, atol=tol) for e in entries)


@pytest.mark.parametrize("name", ["tiny-sd15", "tiny-wan"])
def test_diffusers_pipeline_load_lora_weights_reproduces_the_trained_model(name, data, tmp_path):
    from .tiny_folders import lora_in_pipeline

    slab = _slab(name, tmp_path)
    result = train(_config(slab, data, tmp_path / "out", steps=4), echo=lambda s: None)
    without, loaded = lora_in_pipeline(name, slab, tmp_path / "out", result.lora_file)
    assert without > 1e-6 and loaded < 1e-4  # the LoRA changes the output, and diffusers reads it as trained


def test_encoders_of_another_family_are_refused_in_one_sentence(data, tmp_path):
    from squareq.sources.encoders import EncoderError

    slab = _slab("tiny-sd3", tmp_path)
    with pytest.raises(EncoderError, match="tiny-wan is the built-in wan model, so its encoders do not fit a sd3 model"):
        train(_config(slab, data, tmp_path / "out", model="tiny-wan"), echo=lambda s: None)


def test_wuerstchen_from_a_pipeline_folder_is_refused_for_its_missing_image_encoder(data, tmp_path):
    from squareq.sources.encoders import EncoderError

    folder = tmp_path / "wuerstchen-prior"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "WuerstchenPriorPipeline"}')
    slab = _slab("tiny-wuerstchen-prior", tmp_path)
    with pytest.raises(EncoderError, match="needs Würstchen's EfficientNet image encoder"):
        train(_config(slab, data, tmp_path / "out", model=str(folder)), echo=lambda s: None)


def test_only_the_unet_families_read_the_scheduler_s_prediction_type(tmp_path):
    from squareq.train.objective import training_objective

    (tmp_path / "scheduler").mkdir()
    (tmp_path / "model_index.json").write_text("{}")
    (tmp_path / "scheduler" / "scheduler_config.json").write_text('{"prediction_type": "v_prediction"}')
    assert training_objective(tmp_path, "sd-unet") == "v_prediction"
    assert training_objective(tmp_path, "wuerstchen-prior") == "cosine_epsilon"
    assert training_objective(tmp_path, "sd3") == "flow"


def test_a_negative_prompt_acts_through_cfg_without_true_cfg(tmp_path):
    """SD 1.5's guidance is classifier-free: a prompt's --n is taken without --l and given to the pipeline, which
    draws another image with it. Negative control: FLUX.1 (guidance-distilled) refuses --n without --l."""
    from squareq.train.sample import SampleError, sample_images

    from .tiny_folders import write_pipeline

    folder = write_pipeline("tiny-sd15", tmp_path / "pipeline")
    slab = _slab("tiny-sd15", tmp_path)

    def draw(prompt):
        (image,) = sample_images(slab, [prompt], model=str(folder), resolution=64, steps=2, max_sequence_length=16,
                                 device="cpu", guidance=7.0)
        return np.asarray(image).astype(np.float64)

    assert np.abs(draw("a cat --n a dog") - draw("a cat")).mean() > 0.5
    with pytest.raises(SampleError, match="has a negative prompt \\(--n\\) but no --l above 1"):
        sample_images(_slab("tiny-flux", tmp_path), ["a cat --n a dog"], resolution=64, steps=2)
    # what a pipeline would drop is refused: SD 1.5 has no true CFG scale, FLUX.2's pipeline no negative prompt
    with pytest.raises(SampleError, match="--l in the prompt 'a cat': the sd-unet pipeline has no true CFG scale"):
        draw("a cat --n a dog --l 4")
    from squareq.train.prompt_options import parse_prompt
    from squareq.train.sample import check_prompts

    with pytest.raises(SampleError, match="--n in the prompt 'a cat': the flux2 pipeline takes no negative prompt"):
        check_prompts("flux2", [parse_prompt("a cat --n a dog", true_cfg_only=False).settled(64, 2, 3.5, 0)])


def test_a_video_family_draws_a_clip_of_the_asked_frames(tmp_path):
    """Wan with --frames 5 (or a prompt's --f 5): five frames of the asked size, saved by squareq sample as an
    animated WebP of five frames; --f 1 is one image. Negative controls: an image family refuses frames, and Wan a
    count its VAE cannot make (1 + 4k)."""
    from click.testing import CliRunner
    from PIL import Image

    from squareq.cli import main
    from squareq.train.sample import SampleError, sample_images

    from .tiny_folders import write_pipeline

    folder = write_pipeline("tiny-wan", tmp_path / "pipeline")
    slab = _slab("tiny-wan", tmp_path)
    clip, still = sample_images(slab, ["a cat --f 5", "a cat --f 1"], model=str(folder), resolution=64, steps=2,
                                max_sequence_length=16, device="cpu")
    assert isinstance(clip, list) and len(clip) == 5 and all(f.size == (64, 64) for f in clip)
    assert isinstance(still, Image.Image)
    result = CliRunner().invoke(main, ["sample", str(slab), "--prompt", "a cat", "--model", str(folder), "--frames", "5",
                                       "--resolution", "64", "--steps", "2", "--max-sequence-length", "16",
                                       "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    with Image.open(tmp_path / "out" / "sample-000.webp") as webp:
        assert webp.n_frames == 5 and webp.size == (64, 64)
    with pytest.raises(SampleError, match="holds a sd-unet model, which draws images; frames are for the video"):
        sample_images(_slab("tiny-sd15", tmp_path), ["a cat --f 5"], resolution=64, steps=2)
    with pytest.raises(SampleError, match="--f 6: a wan clip has 1 \\+ 4·k frames .* give 5 or 9"):
        sample_images(slab, ["a cat --f 6"], model=str(folder), resolution=64, steps=2)


def test_wuerstchen_draws_with_either_stage_streamed_and_the_other_from_its_folder(tmp_path, monkeypatch):
    """A Würstchen slab is one stage; squareq sample draws through both pipelines (loaded from folders in the Hub's
    layout, which diffusers 0.42 cannot load whole), the slab streamed as its stage. The slab's weights draw the
    image (another seed's slab draws another; the same slab the same), and --g sets the slab's stage. Negative
    controls: the other stage missing, the slab's own stage given again, --prior beside a FLUX slab, a side that is
    not a multiple of 128, no --model for the built-in tiny model."""
    import diffusers
    from click.testing import CliRunner
    from PIL import Image

    from squareq.cli import main
    from squareq.models import build_tiny_wuerstchen_decoder, build_tiny_wuerstchen_prior
    from squareq.train.sample import SampleError, sample_images

    from .tiny_folders import write_wuerstchen_folders

    prior_dir, decoder_dir = write_wuerstchen_folders(tmp_path / "pipes")
    embeddings = []  # what the prior handed the decoder, per drawing
    decode = diffusers.WuerstchenDecoderPipeline.__call__
    monkeypatch.setattr(diffusers.WuerstchenDecoderPipeline, "__call__", lambda pipe, image_embeddings, **kw: (
        embeddings.append(image_embeddings.float().clone()), decode(pipe, image_embeddings, **kw))[1])

    def output(image):  # the prior's stage: its embeddings; the decoder's: the image
        return embeddings[-1] if family == "wuerstchen-prior" else torch.from_numpy(np.asarray(image).astype(float))
    for family, build, own, other in (("wuerstchen-prior", build_tiny_wuerstchen_prior, prior_dir,
                                       {"decoder": str(decoder_dir)}),
                                      ("wuerstchen-decoder", build_tiny_wuerstchen_decoder, decoder_dir,
                                       {"prior": str(prior_dir)})):
        slab = _slab(f"tiny-{family}", tmp_path)
        reseeded = tmp_path / f"{family}-seed5.slab"
        model = build(5)
        write_rtn_slab(model, ADAPTERS[family].blocks(model), {}, reseeded,
                       PlainOptions(default_spec=QuantSpec(bits=8), family=family, source=f"tiny-{family}"))
        draw = lambda path, prompt: sample_images(path, [prompt], model=str(own), resolution=128, steps=3,  # noqa: E731
                                                  device="cpu", stages=other)[0]
        image = draw(slab, "a cat --g 4")
        first = output(image)
        assert image.size == (128, 128) and torch.equal(output(draw(slab, "a cat --g 4")), first)
        scale = first.abs().mean()
        assert (output(draw(reseeded, "a cat --g 4")) - first).abs().mean() > 0.05 * scale, family
        assert (output(draw(slab, "a cat --g 1")) - first).abs().mean() > 0.05 * scale, family
        with pytest.raises(SampleError, match=f"an image needs its {list(other)[0]} too: give"):
            sample_images(slab, ["a cat"], model=str(own), resolution=128, steps=2)
        with pytest.raises(SampleError, match="holds Würstchen's .* itself"):
            sample_images(slab, ["a cat"], model=str(own), resolution=128, steps=2,
                          stages={**other, family.split("-")[1]: str(own)})
        with pytest.raises(SampleError, match="multiples of 128"):
            sample_images(slab, ["a cat"], model=str(own), resolution=96, steps=2, stages=other)
        with pytest.raises(SampleError, match="the built-in tiny model has none, so pass"):
            sample_images(slab, ["a cat"], resolution=128, steps=2, stages=other)
    with pytest.raises(SampleError, match="--prior is for a Würstchen slab"):
        sample_images(_slab("tiny-flux", tmp_path), ["a cat"], resolution=64, steps=2, stages={"prior": str(prior_dir)})
    result = CliRunner().invoke(main, ["sample", str(tmp_path / "tiny-wuerstchen-prior.slab"), "--prompt", "a cat",
                                       "--model", str(prior_dir), "--decoder", str(decoder_dir), "--resolution", "128",
                                       "--steps", "2", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    with Image.open(tmp_path / "out" / "sample-000.png") as png:
        assert png.size == (128, 128)


def test_pipeline_samples_leave_the_training_run_as_it_was(data, tmp_path):
    """Sample images through SD 1.5's pipeline at every step (its own RNG draws, set aside) train the LoRA a run
    without samples trains, bit for bit, with the same losses; the samples are there."""
    from .tiny_folders import write_pipeline

    folder = write_pipeline("tiny-sd15", tmp_path / "pipeline")
    slab = _slab("tiny-sd15", tmp_path)
    plain = train(_config(slab, data, tmp_path / "plain", model=str(folder), steps=3), echo=lambda s: None)
    sampled = train(_config(slab, data, tmp_path / "sampled", model=str(folder), steps=3, sample_every=1,
                            sample_prompts=["a cat"], sample_steps=2), echo=lambda s: None)
    assert sampled.losses == plain.losses
    a, _ = load_lora(plain.lora_file)
    b, _ = load_lora(sampled.lora_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list((tmp_path / "sampled" / "samples").glob("step-*-0.png"))) == 4  # steps 0 to 3


def test_wuerstchen_sample_images_during_training_through_both_stages(data, tmp_path):
    """A Würstchen decoder trained on the built-in model draws its sample images through both stages' pipelines
    (sample_decoder: its own text encoder, scheduler and VQGAN; sample_prior: the whole prior), the model being
    trained as the decoder, with the training RNG set aside: the same losses and LoRA as without samples, and a
    128² image at each sample step. Negative controls: without sample_prior, and sample_prior beside a Wan slab."""
    from PIL import Image

    from .tiny_folders import write_wuerstchen_folders

    prior_dir, decoder_dir = write_wuerstchen_folders(tmp_path / "pipes")
    slab = _slab("tiny-wuerstchen-decoder", tmp_path)
    plain = train(_config(slab, data, tmp_path / "plain", steps=2), echo=lambda s: None)
    sampled = train(_config(slab, data, tmp_path / "sampled", steps=2, sample_every=1, sample_steps=2,
                            sample_prompts=["a cat --w 128 --h 128"], sample_prior=str(prior_dir),
                            sample_decoder=str(decoder_dir)), echo=lambda s: None)
    assert sampled.losses == plain.losses
    a, _ = load_lora(plain.lora_file)
    b, _ = load_lora(sampled.lora_file)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    images = sorted((tmp_path / "sampled" / "samples").glob("step-*-0.png"))
    assert len(images) == 3  # steps 0 to 2
    with Image.open(images[-1]) as png:
        assert png.size == (128, 128)
    with pytest.raises(TrainError, match="sample_every = 1: .* an image needs its prior too: give the prior's "
                                         "pipeline folder or Hub ID with sample_prior"):
        train(_config(slab, data, tmp_path / "no-prior", steps=2, sample_every=1, sample_prompts=["a cat --w 128"],
                      sample_decoder=str(decoder_dir)), echo=lambda s: None)
    with pytest.raises(TrainError, match="sample_prior is for a Würstchen slab's sample images; this slab holds a wan"):
        train(_config(_slab("tiny-wan", tmp_path), data, tmp_path / "wan", steps=2, sample_prior=str(prior_dir)),
              echo=lambda s: None)
