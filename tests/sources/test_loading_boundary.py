"""The loading boundary (squareq/sources/boundary.py): a damaged Hub snapshot or model folder ends `squareq compile` in
one sentence naming the file, never a traceback; an intact one opens."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.models import ModelError
from squareq.sources import hub, open_source
from squareq.sources.encoders import open_encoders

from ..compiler.test_vram import error_lines
from ..user_files import STAND_IN_REPO, stand_in_pipeline, write_hub_cache

pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    """The tiny FLUX.1 pipeline as the cached snapshot of FLUX.1-dev: (cache, snapshot)."""
    cache = tmp_path_factory.mktemp("hub") / "cache"
    return cache, write_hub_cache(cache, stand_in_pipeline())


def _cut(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _pickle_in_place(path):
    path.unlink()
    torch.save({"x": torch.zeros(2)}, path)


def _link_to_pickle(path):
    pickled = path.parent / "weights.bin"
    torch.save({"x": torch.zeros(2)}, pickled)
    path.unlink()
    path.symlink_to(pickled)


def _huge_config(path):
    config = json.loads(path.read_text())
    config.update(num_layers=4096, num_single_layers=4096, num_attention_heads=256, attention_head_dim=256)
    path.write_text(json.dumps(config))


# case: (what is done to the snapshot, words the one sentence holds)
CASES = {
    "refs/main not UTF-8": (lambda s: (s.parents[1] / "refs" / "main").write_bytes(b"\xff\xfe\x00"),
                            ["refs/main holds", "models--black-forest-labs--FLUX.1-dev", "download it again"]),
    "text_encoder/config.json missing": (lambda s: (s / "text_encoder" / "config.json").unlink(),
                                         ["text_encoder/config.json is missing", "hf download"]),
    "text_encoder/config.json not JSON": (lambda s: (s / "text_encoder" / "config.json").write_text("{not json"),
                                          ["text_encoder/config.json is not a readable JSON config"]),
    "text_encoder_2 cut": (lambda s: _cut(s / "text_encoder_2" / "model.safetensors"),
                           ["text_encoder_2/model.safetensors is not a readable safetensors file", "hf download"]),
    "vae cut": (lambda s: _cut(s / "vae" / "diffusion_pytorch_model.safetensors"),
                ["vae/diffusion_pytorch_model.safetensors is not a readable safetensors file"]),
    "a pickle named model.safetensors": (lambda s: _pickle_in_place(s / "text_encoder" / "model.safetensors"),
                                         ["text_encoder/model.safetensors is a zip archive (torch.save output), "
                                          "not a safetensors file", "never loads pickles"]),
    "model.safetensors a link to a pickle": (lambda s: _link_to_pickle(s / "text_encoder" / "model.safetensors"),
                                             ["text_encoder/model.safetensors is a zip archive",
                                              "never loads pickles"]),
    "refs/main empty": (lambda s: (s.parents[1] / "refs" / "main").write_bytes(b""),
                        ["refs/main is empty", "names no snapshot", "hf download black-forest-labs/FLUX.1-dev"]),
    "refs/main not a commit": (lambda s: (s.parents[1] / "refs" / "main").write_text("../../../../pipe"),
                               ["refs/main holds", "not a 40-hex commit"]),
    "a transformer config asking for 100 GB": (lambda s: _huge_config(s / "transformer" / "config.json"),
                                               ["transformer/config.json", "check that file"]),
}


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_hub_snapshot_ends_compile_in_one_sentence_naming_what_to_fix(case, intact, tmp_path,
                                                                                 monkeypatch):
    cache = tmp_path / "cache"
    shutil.copytree(intact[0], cache, symlinks=True)
    damage, words = CASES[case]
    damage(cache / intact[1].relative_to(intact[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    hub._fetch.cache_clear()
    out = tmp_path / "s.slab"
    result = CliRunner().invoke(main, ["compile", STAND_IN_REPO, "-o", str(out), "--budget", "2MB",
                                       "--calib-samples", "2", "--calib-resolution", "64"])
    hub._fetch.cache_clear()
    errors = error_lines(result)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert len(errors) == 1 and errors[0].endswith("."), result.output
    for word in words:
        assert word in errors[0], (word, errors[0])
    assert not out.exists()


def test_an_intact_snapshot_opens_with_its_encoders(intact, monkeypatch):
    """Positive control for the cases above: the same snapshot, untouched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(intact[0]))
    hub._fetch.cache_clear()
    try:
        source = open_source(STAND_IN_REPO)
        assert source.hub.revision == intact[1].name
        with open_encoders(STAND_IN_REPO, torch.device("cpu"), "flux", dtype=torch.float32) as encoders:
            assert encoders.encode_prompts(["a cat"], 16)[0]
    finally:
        hub._fetch.cache_clear()


def test_a_folder_whose_config_asks_for_far_more_layers_than_its_weights_hold_is_refused_before_it_builds(intact,
                                                                                                         tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(intact[1] / "transformer", folder)
    assert open_source(folder).skeleton is not None  # positive control: as saved
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": 5000, "num_single_layers": 5000}))
    with pytest.raises(ModelError) as refused:
        open_source(folder)
    message = str(refused.value)
    assert "describes far more layers than the" in message and "tensors of its weights files hold" in message
    assert str(folder / "config.json") in message and "\n" not in message
