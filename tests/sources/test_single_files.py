"""Encoders from ComfyUI's single files: which component each flag replaces, each file loaded by the library that
knows its layout (exactly the pipeline's weights, the fp8 T5 upcast), and one sentence for a wrong file."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from squareq.sources.encoder_source import (
    EncoderError,
    EncoderSource,
    encoder_source_for,
    file_components,
    recorded_encoders,
)
from squareq.sources.encoders import check_encoder_source
from squareq.sources.hub import read_index
from squareq.sources.single_files import load_single_files

from ..train.test_lora_files import one_sentence_naming
from ..user_files import stand_in_pipeline, write_comfyui_files
from .test_hub import write_cached_repo

SD3_INDEX = {"_class_name": "StableDiffusion3Pipeline", "vae": ["diffusers", "AutoencoderKL"],
             "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "text_encoder_3": ["transformers", "T5EncoderModel"], "transformer": ["diffusers", "SD3Transformer2DModel"]}
FLUX_INDEX = {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"],
              "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"]}
WAN_INDEX = {"_class_name": "WanPipeline", "vae": ["diffusers", "AutoencoderKLWan"],
             "text_encoder": ["transformers", "UMT5EncoderModel"]}


def test_each_flag_replaces_its_component():
    assert file_components(FLUX_INDEX, ["clip_l", "t5", "vae"]) == {"clip_l": "text_encoder", "t5": "text_encoder_2",
                                                                    "vae": "vae"}
    assert file_components(SD3_INDEX, ["clip_l", "clip_g", "t5"]) == {"clip_l": "text_encoder",
                                                                      "clip_g": "text_encoder_2", "t5": "text_encoder_3"}
    assert file_components(WAN_INDEX, ["t5"]) == {"t5": "text_encoder"}
    with pytest.raises(EncoderError) as err:
        file_components(FLUX_INDEX, ["clip_g"])
    one_sentence_naming(err, "--clip-g")
    assert "text_encoder (CLIPTextModel)" in str(err.value)


@pytest.fixture(scope="module")
def pipeline_and_files(tmp_path_factory):
    pipe = stand_in_pipeline()
    folder = tmp_path_factory.mktemp("pipeline") / "flux"
    pipe.save_pretrained(folder, safe_serialization=True)
    files = write_comfyui_files(pipe, tmp_path_factory.mktemp("comfyui"))
    fp8 = write_comfyui_files(pipe, tmp_path_factory.mktemp("comfyui-fp8"), torch.float8_e4m3fn)["t5"]
    return pipe, folder, files, fp8


def load(folder, dtype=torch.float32, **files):
    return load_single_files(EncoderSource(str(folder), tuple((k, str(v)) for k, v in files.items())), folder,
                             read_index(folder), dtype)


def assert_same_weights(got, want, cast=lambda t: t):
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], cast(b[k])), k


def test_comfyui_files_load_exactly_as_the_pipeline_holds_them(pipeline_and_files):
    pipe, folder, files, _ = pipeline_and_files
    loaded = load(folder, clip_l=files["clip_l"], t5=files["t5"], vae=files["vae"])
    assert set(loaded) == {"text_encoder", "text_encoder_2", "vae"}
    assert type(loaded["text_encoder"]).__name__ == "CLIPTextModel"
    assert_same_weights(loaded["text_encoder"], pipe.text_encoder)  # text_model. names and a projection, read
    assert_same_weights(loaded["text_encoder_2"], pipe.text_encoder_2)  # fp16 file, fp16-exact weights
    assert_same_weights(loaded["vae"], pipe.vae)  # BFL's ae.safetensors layout through from_single_file
    assert loaded["vae"].config.latent_channels == pipe.vae.config.latent_channels


def test_the_fp8_t5_is_upcast_on_load(pipeline_and_files):
    pipe, folder, _, fp8 = pipeline_and_files
    assert {t.dtype for t in load_file(str(fp8)).values()} == {torch.float8_e4m3fn}
    t5 = load(folder, torch.bfloat16, t5=fp8)["text_encoder_2"]
    assert {p.dtype for p in t5.parameters()} == {torch.bfloat16}
    assert_same_weights(t5, pipe.text_encoder_2, cast=lambda t: t.to(torch.float8_e4m3fn).to(torch.bfloat16))
    # control: fp8 rounding changed the weights, so the comparison above can tell the two apart
    assert not torch.equal(t5.shared.weight.float(), pipe.text_encoder_2.shared.weight)


def test_a_wrong_or_damaged_file_is_refused_in_one_sentence(pipeline_and_files, tmp_path):
    _, folder, files, _ = pipeline_and_files
    for flag, name in (("t5", "clip_l"), ("clip_l", "t5"), ("vae", "clip_l")):  # a file given to the wrong flag
        with pytest.raises(EncoderError) as err:
            load(folder, **{flag: files[name]})
        one_sentence_naming(err, f"--{flag.replace('_', '-')} {files[name]}")
        assert "does not hold the" in str(err.value)
    partial = load_file(str(files["t5"]))
    partial.pop("encoder.block.1.layer.1.DenseReluDense.wo.weight")
    save_file(partial, str(tmp_path / "t5-partial.safetensors"))
    with pytest.raises(EncoderError, match="1 weights missing or misshapen, e.g. encoder.block.1.layer.1"):
        load(folder, t5=tmp_path / "t5-partial.safetensors")
    scaled = {**load_file(str(files["t5"])), "scaled_fp8": torch.zeros(0)}
    save_file(scaled, str(tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors"))
    with pytest.raises(EncoderError, match="ComfyUI's scaled fp8 files"):
        load(folder, t5=tmp_path / "t5xxl_fp8_e4m3fn_scaled.safetensors")
    with pytest.raises(EncoderError, match="does not exist"):
        load(folder, vae=tmp_path / "ae.safetensors")
    with pytest.raises(EncoderError) as err:  # a built-in model's encoders are built in
        check_encoder_source(EncoderSource("tiny-flux", (("t5", str(files["t5"])),)), "flux")
    one_sentence_naming(err, "tiny-flux has built-in encoders; leave out --t5")
    (tmp_path / "not.safetensors").write_text("not a tensor file")
    with pytest.raises(EncoderError, match="is not a readable safetensors file"):
        load(folder, vae=tmp_path / "not.safetensors")


class Record:
    def __init__(self, source, encoders=None, family="flux", config=None):
        self.source, self.encoders, self.family = source, encoders or {}, family
        self.config = config if config is not None else {"guidance_embeds": True}


def test_which_encoders_a_command_uses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "hub"  # what a Hub ID names is looked up: a pipeline, or one model (the cache, offline)
    write_cached_repo(cache, "black-forest-labs/FLUX.1-dev", {"model_index.json": json.dumps(FLUX_INDEX)})
    write_cached_repo(cache, "org/one-model", {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    files = {"clip_l": "/x/clip_l.safetensors", "t5": "/x/t5.safetensors", "vae": "/x/ae.safetensors"}
    bfl = Record("/x/flux1-dev.safetensors (BFL single file)")
    # ComfyUI's three files with a BFL model file: configs from the pipeline diffusers' from_single_file would read
    got = encoder_source_for(recorded_encoders(bfl), "flux", bfl.config, files=files)
    assert got == EncoderSource("black-forest-labs/FLUX.1-dev", (("clip_l", "/x/clip_l.safetensors"),
                                                                 ("t5", "/x/t5.safetensors"),
                                                                 ("vae", "/x/ae.safetensors")))
    # one file short: the T5 would silently come from the Hub (9.5 GB, gated) instead of the user's own files
    with pytest.raises(EncoderError) as err:
        encoder_source_for(recorded_encoders(bfl), "flux", bfl.config, files={**files, "t5": None})
    one_sentence_naming(err, "give --clip-l, --t5, --vae together")
    schnell = encoder_source_for("/x/f.safetensors", "flux", {"guidance_embeds": False}, files=files)
    assert schnell.where == "black-forest-labs/FLUX.1-schnell"
    # what a slab records comes back, and flags replace it
    slab = Record("/x/flux1-dev.safetensors (BFL single file)", encoders=got.record())
    assert recorded_encoders(slab) == got
    assert encoder_source_for(recorded_encoders(slab), "flux", files={"t5": "/y/t5.safetensors"}).file_map == {
        "clip_l": "/x/clip_l.safetensors", "t5": "/y/t5.safetensors", "vae": "/x/ae.safetensors"}
    assert encoder_source_for(recorded_encoders(slab), "flux", model="org/pipe", revision="v2") == \
        EncoderSource("org/pipe@v2")
    pinned = Record(f"org/pipe@{'c' * 40}")  # the slab's commit, unless --model names another revision
    assert encoder_source_for(recorded_encoders(pinned), "flux", model="org/pipe").where == f"org/pipe@{'c' * 40}"
    assert encoder_source_for(recorded_encoders(pinned), "flux", model="org/other").where == "org/other"
    assert encoder_source_for(recorded_encoders(pinned), "flux", model="org/pipe", revision="v3").where == \
        "org/pipe@v3"
    assert encoder_source_for(recorded_encoders(Record("tiny-flux")), "flux") == EncoderSource("tiny-flux")
    with pytest.raises(EncoderError, match="--revision v2 names a revision of --model"):
        encoder_source_for(recorded_encoders(slab), "flux", revision="v2")
    with pytest.raises(EncoderError, match="--revision v2 is for a Hugging Face Hub ID, and .* is a local path"):
        encoder_source_for(recorded_encoders(slab), "flux", model=str(tmp_path), revision="v2")
    with pytest.raises(EncoderError) as err:  # no pipeline, and a family with no reference pipeline
        encoder_source_for("/x/model.safetensors", "wan", {}, files={"t5": "/x/umt5.safetensors"})
    one_sentence_naming(err, "--t5")
    pipeline = tmp_path / "pipe"
    pipeline.mkdir()
    (pipeline / "model_index.json").write_text(json.dumps(FLUX_INDEX))
    mine = encoder_source_for(str(pipeline), "flux", files={"t5": "/x/t5.safetensors"})
    assert mine.where == str(pipeline)  # the pipeline at hand gives the configs, and the other encoders
    relative = encoder_source_for("tiny-flux", "flux", model=os.path.relpath(pipeline))
    assert relative.where == str(pipeline)  # recorded absolute: later commands run from other folders
    # a Hub repository of one model (a transformer alone) with the three files: configs from the reference pipeline
    one = encoder_source_for(f"org/one-model@{'a' * 40}", "flux", {"guidance_embeds": True}, files=files)
    assert one.where == "black-forest-labs/FLUX.1-dev" and len(one.files) == 3
    with pytest.raises(EncoderError, match="names no pipeline"):
        recorded_encoders(Record("/x/f.safetensors", encoders={"t5": "/x/t5.safetensors"}))
