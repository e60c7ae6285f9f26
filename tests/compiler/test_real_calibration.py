"""`squareq compile` calibrates on real images through the model's own pipeline: the built-in photographs (or the
user's --calib-data) encoded by the pipeline folder's VAE and text encoders, noised as the family trains."""
import json

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from squareq.cli import main
from squareq.compiler import CompileOptions, compile_slab
from squareq.models import write_tiny_flux_pipeline
from squareq.models.builtin_data import PHOTOGRAPHS, builtin_photos
from squareq.models.calibration_set import image_batch
from squareq.sources import open_source
from squareq.compiler.calibration_images import calibration_images
from squareq.train.data import load_image

from ..models.tiny_folders import write_pipeline

pytestmark = pytest.mark.usefixtures("torch_kernels")

FOLDERS = {"flux": lambda root: write_tiny_flux_pipeline(root / "flux", seed=0),
           "flux2": lambda root: write_pipeline("tiny-flux2", root / "flux2"),
           "sd3": lambda root: write_pipeline("tiny-sd3", root / "sd3"),
           "qwen-image": lambda root: write_pipeline("tiny-qwen-image", root / "qwen-image"),
           "wan": lambda root: write_pipeline("tiny-wan", root / "wan")}


def _compile(model, out, *extra):
    result = CliRunner().invoke(main, ["compile", str(model), "-o", str(out), "--budget", "8MB", "--calib-samples", "8",
                                       "--calib-resolution", "64", "--rounding", "nearest", "--effect-probes", "4",
                                       *extra])
    assert result.exit_code == 0, result.output
    return json.loads((out / "manifest.json").read_text())


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_a_pipeline_folder_calibrates_on_real_photographs_through_its_own_encoders(family, tmp_path):
    folder = FOLDERS[family](tmp_path)
    m = _compile(folder, tmp_path / "s.slab")
    cal = m["calibration"]
    assert m["model"]["family"] == family
    assert cal["kind"] == "images" and cal["source"].startswith("built-in: 16 photographs from scikit-image")
    assert cal["encoders"] == str(folder) and cal["images"] == len(PHOTOGRAPHS) == 16
    assert [c.split("/")[-1] for c in cal["files"]][:2] == ["astronaut.png", "chelsea.png"]
    assert cal["captions"][1] == "Chelsea the cat." and cal["resolution"] == 64
    assert cal["samples"] == 8 and cal["heldout_samples"] >= 1 and len(cal["heldout_images"]) >= 1
    # times from the family's training distribution, none at pure noise
    assert cal["noise_schedule"] == "flow" and len(set(cal["timesteps"])) == 8 and max(cal["timesteps"]) < 1.0
    for layer in m["layers"]:
        assert layer["metrics"]["heldout_rel_mse"] <= layer["metrics"]["heldout_rtn_rel_mse"]


def test_the_calibration_inputs_are_the_pipelines_own_encodings_noised_as_training_noises(tmp_path):
    from diffusers import FluxPipeline

    folder = write_tiny_flux_pipeline(tmp_path / "flux", seed=0)
    source = open_source(str(folder))
    images = calibration_images(source, resolution=64, max_sequence_length=32)
    pipe = FluxPipeline.from_pretrained(str(folder), local_files_only=True)
    photo = builtin_photos()[1]
    with torch.no_grad():
        z = pipe.vae.encode(load_image(photo.path, (64, 64))[None]).latent_dist.mode()
        prompt, pooled, _ = pipe.encode_prompt([photo.caption], prompt_2=None, max_sequence_length=32)
    cfg = pipe.vae.config
    torch.testing.assert_close(images.latents[1]["latents"], ((z - cfg.shift_factor) * cfg.scaling_factor)[0])
    torch.testing.assert_close(images.texts[1]["prompt_embeds"], prompt[0])
    torch.testing.assert_close(images.texts[1]["pooled_prompt_embeds"], pooled[0])

    batch = image_batch(source.family_adapter.recipe, source.skeleton().config, images, 16, seed=3)
    t = torch.tensor(batch.description["timesteps"])
    x0 = images.latents[1]["latents"]
    noise = torch.randn((16, *x0.shape), generator=torch.Generator().manual_seed(3))[1]
    from squareq.models.flux_latents import pack_latents

    expected = pack_latents(((1 - t[1]) * x0 + t[1] * noise)[None])[0]
    torch.testing.assert_close(batch.kwargs["hidden_states"][1], expected, atol=2e-4, rtol=0)
    assert 0 < float(t.min()) and float(t.max()) < 1  # a real latent at every sample, never pure noise


def test_user_images_with_captions_calibrate_and_are_recorded(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for i, photo in enumerate(builtin_photos()[:5]):
        Image.open(photo.path).convert("RGB").save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"my photo number {i}")
    m = _compile("tiny-flux", tmp_path / "s.slab", "--calib-data", str(data))
    cal = m["calibration"]
    assert cal["source"] == f"user data {data}" and cal["data"] == str(data.resolve()) and cal["images"] == 5
    assert cal["captions"] == [f"my photo number {i}" for i in range(5)] and cal["encoders"] == "tiny-flux"


def test_a_transformer_without_its_pipeline_needs_encoders_and_says_so(tmp_path):
    folder = write_tiny_flux_pipeline(tmp_path / "flux", seed=0)
    bare = tmp_path / "bare"
    (folder / "transformer").rename(bare)
    result = CliRunner().invoke(main, ["compile", str(bare), "-o", str(tmp_path / "s.slab"), "--budget", "8MB"])
    assert result.exit_code == 1 and "--calib-synthetic" not in result.output
    assert "pass them as files with --clip-l, --t5 and --vae, or their pipeline's folder or Hub ID with --encoders" \
        in result.output
    m = _compile(bare, tmp_path / "s.slab", "--encoders", str(folder))
    assert m["calibration"]["kind"] == "images" and m["calibration"]["encoders"] == str(folder)


def test_synthetic_calibration_happens_only_when_asked_for_and_is_recorded(tmp_path):
    m = _compile("tiny-flux", tmp_path / "s.slab", "--calib-synthetic")
    assert m["calibration"]["kind"] == "synthetic" and m["calibration"]["why"].startswith("--calib-synthetic")
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(tmp_path / "t.slab"), "--budget", "8MB",
                                       "--calib-synthetic", "--calib-data", str(tmp_path)])
    assert result.exit_code == 2 and "give one of them" in result.output


def test_an_api_compile_of_a_diffusion_model_without_data_says_what_to_pass(tmp_path):
    with pytest.raises(Exception, match="needs real calibration images.*calibration_images"):
        compile_slab(open_source("tiny-flux"), tmp_path / "s.slab", CompileOptions(budget=2_000_000))
