"""`squareq compile --calib-cache`: the compiler calibrates on the trainer's cache of real latents and captions."""
import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from squareq.compiler import CompileOptions, compile_slab, open_source
from squareq.models import TINY_FLUX_CONFIG, ModelError
from squareq.slab import open_slab
from squareq.train.config import load_config
from squareq.train.loop import prepare_data


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
                            CompileOptions(budget=2_000_000, calib_cache=str(cache), calib_samples=3))
    cal = manifest.calibration
    assert cal["kind"] == "training-cache" and cal["samples"] == 3 and cal["latent_shape"] == [4, 8, 8]
    assert cal["text_tokens"] == 16 and len(cal["entries"]) == 3
    with open_slab(out, verify=True):
        pass
    assert json.loads((out / "manifest.json").read_text())["calibration"]["cache"] == str(cache)


def test_an_empty_cache_is_refused_with_the_command_to_fill_it(tmp_path):
    (tmp_path / "empty" / "latents").mkdir(parents=True)
    with pytest.raises(ModelError, match="squareq cache"):
        compile_slab(open_source("tiny-flux"), tmp_path / "x.slab",
                     CompileOptions(budget=2_000_000, calib_cache=str(tmp_path / "empty")))
