"""`squareq compile --calib-cache`: the compiler calibrates on the trainer's cache of real latents and captions, each
image with its own caption, noised as the family trains."""
import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from squareq.compiler import CompileOptions, compile_slab
from squareq.models import TINY_FLUX_CONFIG, ModelError
from squareq.slab import open_slab
from squareq.sources import open_source
from squareq.train.config import load_config
from squareq.train.prepare import prepare_data

pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    data = root / "data"
    data.mkdir()
    for i, (color, caption) in enumerate([((200, 40, 40), "a red square"), ((40, 40, 200), "a blue square"),
                                          ((40, 200, 40), "a green square")]):
        Image.new("RGB", (64, 64), color).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(caption)
    cfg = load_config(None, {"data": str(data), "cache_dir": str(root / "cache"), "resolution": 64,
                             "max_sequence_length": 16})
    record = SimpleNamespace(source="tiny-flux", family="flux", config=TINY_FLUX_CONFIG)
    prepare_data(cfg, record, torch.device("cpu"), echo=lambda s: None)
    return root / "cache"


def test_compile_calibrates_on_a_training_cache(cache, tmp_path):
    out = tmp_path / "cached.slab"
    manifest = compile_slab(open_source("tiny-flux"), out,
                            CompileOptions(budget=2_000_000, calib_cache=str(cache), calib_samples=6))
    cal = manifest.calibration
    assert cal["kind"] == "images" and cal["source"] == f"training cache {cache}" and cal["images"] == 3
    assert cal["samples"] == 6 and cal["latent_shape"] == [4, 8, 8] and cal["text_tokens"] == 16
    assert cal["pairing"] == "each image with its caption" and len(cal["entries"]) == 3
    assert cal["heldout_samples"] == 2 and len(cal["heldout_images"]) == 1  # both noisy copies of one image
    assert cal["noise_schedule"] == "flow" and len(set(cal["timesteps"])) == 6
    with open_slab(out, verify=True):
        pass
    assert json.loads((out / "manifest.json").read_text())["calibration"]["cache"] == str(cache)


def test_each_image_is_calibrated_with_its_own_caption(cache):
    from squareq.models import FLUX
    from squareq.models.calibration_set import read_training_cache

    source = open_source("tiny-flux")
    images = read_training_cache(cache, FLUX.recipe, source.skeleton().config, "flux")
    pairs = json.loads((cache / "pairs.json").read_text())
    assert [e for e in images.description["entries"]] == [a for a, _ in pairs]
    from safetensors.torch import load_file
    for (_, text_key), text in zip(pairs, images.texts):
        assert torch.equal(text["prompt_embeds"], load_file(str(cache / "text" / f"{text_key}.safetensors"))["prompt_embeds"])


def test_an_empty_cache_is_refused_with_the_command_to_fill_it(tmp_path):
    (tmp_path / "empty" / "latents").mkdir(parents=True)
    with pytest.raises(ModelError, match="squareq cache"):
        compile_slab(open_source("tiny-flux"), tmp_path / "x.slab",
                     CompileOptions(budget=2_000_000, calib_cache=str(tmp_path / "empty")))


def test_a_cache_trained_with_masks_for_some_images_calibrates_too(tmp_path):
    """masked_loss caches a loss mask beside the latents of the images that have one: the compiler reads the latents
    and captions only (the masks are no input of the model)."""
    data, masks = tmp_path / "data", tmp_path / "masks"
    data.mkdir()
    masks.mkdir()
    for i, color in enumerate([(200, 40, 40), (40, 40, 200), (40, 200, 40)]):
        Image.new("RGB", (64, 64), color).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(f"square {i}")
    Image.new("L", (64, 64), 255).save(masks / "0.png")  # images 1 and 2 have none
    cfg = load_config(None, {"data": str(data), "cache_dir": str(tmp_path / "cache"), "resolution": 64,
                             "max_sequence_length": 16, "masked_loss": True, "mask_dir": str(masks)})
    prepare_data(cfg, SimpleNamespace(source="tiny-flux", family="flux", config=TINY_FLUX_CONFIG),
                 torch.device("cpu"), echo=lambda s: None)
    manifest = compile_slab(open_source("tiny-flux"), tmp_path / "m.slab",
                            CompileOptions(budget=2_000_000, calib_cache=str(tmp_path / "cache"), calib_samples=6,
                                           rounding="nearest", effect_probes=1))
    assert manifest.calibration["images"] == 3
