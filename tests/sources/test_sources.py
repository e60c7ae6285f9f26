import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from squareq.models import FLUX, ModelError, tiny_flux_inputs
from squareq.models.calibration_set import tokenizer_folder
from squareq.models.flux_bfl import bfl_name, bfl_to_diffusers, diffusers_to_bfl, infer_bfl_config
from squareq.slab.signature import jsonable_config, model_signature
from squareq.sources import open_source, tensors

from ..text_models import save_text_model


def assert_block_equal(source, path, state):
    block = source.load_block(path)
    got = block.state_dict()
    want = {k[len(path) + 1:]: v for k, v in state.items() if k.startswith(path + ".")}
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), f"{path}.{k}"
    assert not any(t.is_meta for t in block.state_dict().values())


def assert_source_equal(source, state):
    for path in source.block_paths:
        assert_block_equal(source, path, state)
    resident = source.resident_state()
    blocks = tuple(p + "." for p in source.block_paths)
    assert resident.keys() == {k for k in state if not k.startswith(blocks)}
    for k, v in resident.items():
        assert torch.equal(v, state[k]), k


@pytest.fixture(scope="module")
def tiny_state(tiny_flux):
    return tiny_flux[0].state_dict()


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_flux):
    """tiny-flux saved as a diffusers model folder, sharded, and inside a pipeline-like folder."""
    model, _ = tiny_flux
    root = tmp_path_factory.mktemp("diffusers")
    model.save_pretrained(root / "single", safe_serialization=True)
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="60KB")
    model.save_pretrained(root / "pipe" / "transformer", safe_serialization=True)
    (root / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                                "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    return root


@pytest.fixture(scope="module")
def bfl_file(tmp_path_factory, tiny_state):
    path = tmp_path_factory.mktemp("bfl") / "tiny-flux1.safetensors"
    save_file({k: v.contiguous() for k, v in diffusers_to_bfl(tiny_state).items()}, str(path))
    return path


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    model = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    folder = tmp_path_factory.mktemp("t5") / "text_encoder"
    model.save_pretrained(folder)
    return model, folder


def test_tiny_flux_source(tiny_flux, tiny_state):
    model, adapter = tiny_flux
    source = open_source("tiny-flux")
    assert source.description == "tiny-flux" and source.family == "flux" and source.adapter is FLUX
    assert source.block_paths == adapter.blocks(model)
    skeleton = source.skeleton()
    assert type(skeleton) is type(model) and all(p.is_meta for p in skeleton.parameters())
    assert model_signature(skeleton) == model_signature(model)
    skeleton.transformer_blocks[0] = torch.nn.Identity()  # each call is a fresh copy: edits do not leak
    assert model_signature(source.skeleton()) == model_signature(model)
    assert_source_equal(source, tiny_state)
    partial = open_source("tiny-flux", blocks=["transformer_blocks"])  # generic mode on a known class
    assert partial.family == "generic" and partial.block_paths == ["transformer_blocks.0", "transformer_blocks.1"]
    assert partial.adapter.calibration_inputs is FLUX.calibration_inputs
    assert "single_transformer_blocks.1.proj_out.weight" in partial.resident_state()
    block = source.load_block("single_transformer_blocks.0", dtype=torch.bfloat16)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}
    with torch.no_grad():  # a loaded block is a copy: writing to it leaves the built-in model alone
        block.proj_out.weight.zero_()
    assert source.load_block("single_transformer_blocks.0").proj_out.weight.abs().sum() > 0


@pytest.mark.parametrize("kind", ["single", "sharded", "pipe"])
def test_diffusers_folder(folders, kind, tiny_flux, tiny_state):
    model, adapter = tiny_flux
    if kind == "sharded":
        assert len(list((folders / kind).glob("*.safetensors"))) > 2
    source = open_source(str(folders / kind))
    expected = folders / kind / ("transformer" if kind == "pipe" else "")
    assert source.description == str(expected.resolve()).rstrip("/")
    assert source.family == "flux" and source.block_paths == adapter.blocks(model)
    skeleton = source.skeleton()
    assert type(skeleton) is type(model) and all(p.is_meta for p in skeleton.parameters())
    assert jsonable_config(skeleton.config) == jsonable_config(model.config)
    assert model_signature(skeleton) == model_signature(model)
    assert_source_equal(source, tiny_state)


def test_diffusers_folder_reads_one_block_lazily(folders, monkeypatch):
    source = open_source(str(folders / "sharded"))
    read = []
    real = tensors._safe_open

    class Recorder:
        def __init__(self, handle):
            self.handle = handle

        def get_tensor(self, name):
            read.append(name)
            return self.handle.get_tensor(name)

    def recording(path):
        class Ctx:
            def __enter__(self):
                self.cm = real(path)
                return Recorder(self.cm.__enter__())

            def __exit__(self, *exc):
                return self.cm.__exit__(*exc)

        return Ctx()

    monkeypatch.setattr(tensors, "_safe_open", recording)
    source.load_block("transformer_blocks.1")
    assert read and all(n.startswith("transformer_blocks.1.") for n in read)


def test_bfl_single_file(bfl_file, tiny_flux, tiny_state, monkeypatch):
    model, adapter = tiny_flux
    source = open_source(bfl_file)
    assert source.description == f"{bfl_file.resolve()} (BFL single file)"
    assert source.family == "flux" and source.block_paths == adapter.blocks(model)
    skeleton = source.skeleton()
    assert all(p.is_meta for p in skeleton.parameters())
    assert jsonable_config(skeleton.config) == jsonable_config(model.config)
    assert model_signature(skeleton) == model_signature(model)
    assert_source_equal(source, tiny_state)
    with torch.no_grad():
        assert torch.equal(source.load_model()(**tiny_flux_inputs()).sample, model(**tiny_flux_inputs()).sample)

    # a block's BFL tensors only: the loader never reads other blocks
    read = []
    real = tensors.BFLFile.read

    def spy(self, names):
        out = real(self, names)
        read.extend(self._origin[n] for n in names)
        return out

    monkeypatch.setattr(tensors.BFLFile, "read", spy)
    source.load_block("single_transformer_blocks.1")
    assert read and all(n.startswith("single_blocks.1.") for n in read)


def test_bfl_mapping_round_trip(bfl_file, tiny_flux, tiny_state):
    bfl = load_file(str(bfl_file))
    assert "double_blocks.0.img_attn.qkv.weight" in bfl and "single_blocks.1.linear1.weight" in bfl
    config = infer_bfl_config({k: v.shape for k, v in bfl.items()})
    assert config == {k: v for k, v in jsonable_config(tiny_flux[0].config).items() if k in config} | {
        "axes_dims_rope": (8, 12, 12)}
    back = bfl_to_diffusers(bfl, config)
    assert back.keys() == tiny_state.keys()
    assert all(torch.equal(back[k], tiny_state[k]) for k in back)
    again = diffusers_to_bfl(back, config)
    assert again.keys() == bfl.keys() and all(torch.equal(again[k], bfl[k]) for k in bfl)
    # the final adaLN halves are swapped: BFL stores (shift, scale), diffusers (scale, shift)
    shift, scale = bfl["final_layer.adaLN_modulation.1.weight"].chunk(2)
    assert torch.equal(tiny_state["norm_out.linear.weight"], torch.cat([scale, shift]))
    assert bfl_name("transformer_blocks.1.attn.add_v_proj.bias") == "double_blocks.1.txt_attn.qkv.bias"
    assert bfl_name("single_transformer_blocks.0.attn.norm_k.weight") == "single_blocks.0.norm.key_norm.scale"
    # without qk norms the head dim defaults to FLUX.1's 128
    shapes = {k: v.shape for k, v in bfl.items() if "norm.query_norm" not in k}
    shapes["img_in.weight"] = (256, 16)
    assert infer_bfl_config(shapes)["attention_head_dim"] == 128
    assert infer_bfl_config(shapes)["axes_dims_rope"] == (16, 56, 56)
    with pytest.raises(ModelError, match="not BFL FLUX.1 names: vae.decoder.weight"):
        bfl_to_diffusers({"vae.decoder.weight": torch.zeros(1)}, config)


def test_bfl_prefixed_all_in_one_file(tmp_path, tiny_state):
    state = {"model.diffusion_model." + k: v.contiguous() for k, v in diffusers_to_bfl(tiny_state).items()}
    state["first_stage_model.decoder.weight"] = torch.zeros(3)  # other components of an all-in-one file
    save_file(state, str(tmp_path / "all.safetensors"))
    source = open_source(str(tmp_path / "all.safetensors"))
    assert_block_equal(source, "transformer_blocks.0", tiny_state)


def test_transformers_encoder_generic(t5):
    model, folder = t5
    state = model.state_dict()
    source = open_source(str(folder), blocks=["encoder.block"])
    assert source.family == "generic"
    assert source.block_paths == ["encoder.block.0", "encoder.block.1"]
    assert type(source.skeleton()) is type(model) and all(p.is_meta for p in source.skeleton().parameters())
    assert_source_equal(source, state)  # tied shared/embed_tokens weights come from the one stored copy
    full = source.load_model()
    assert full.shared.weight is full.encoder.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        assert torch.equal(full(ids).last_hidden_state, model(ids).last_hidden_state)


def test_missing_path(tmp_path):
    with pytest.raises(ModelError, match="does not exist; pass a Hugging Face Hub ID, a diffusers folder, a BFL "
                                         ".safetensors file or tiny-flux"):
        open_source(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="has no config.json"):
        open_source(str(tmp_path))


def test_unknown_class_needs_blocks(t5):
    with pytest.raises(ModelError, match=r"T5EncoderModel, which has no SquareQ family adapter; pass --blocks ATTR.*encoder\.block"):
        open_source(str(t5[1]))
    with pytest.raises(ModelError, match="no block list 'encoder.layers'"):
        open_source(str(t5[1]), blocks=["encoder.layers"])


def _copy_folder(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    weights = load_file(str(src / "diffusion_pytorch_model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "diffusion_pytorch_model.safetensors"))
    return dst


def test_wrong_shapes_and_missing_tensors_are_refused(folders, tmp_path):
    name = "transformer_blocks.1.attn.to_k.weight"
    bad = _copy_folder(folders / "single", tmp_path / "shape", lambda w: w.__setitem__(name, w[name][:, :-1].contiguous()))
    with pytest.raises(ModelError, match=rf"{name} in .*diffusion_pytorch_model.safetensors has shape \[64, 63\], "
                                         r"but FluxTransformer2DModel with this config expects \[64, 64\]"):
        open_source(str(bad))
    gone = _copy_folder(folders / "single", tmp_path / "missing", lambda w: w.pop("proj_out.bias"))
    with pytest.raises(ModelError, match=r"has no tensor proj_out.bias, which FluxTransformer2DModel with this config "
                                         r"expects \(1 missing in all, e\.g\. proj_out\.bias; tensors it holds that "
                                         r"FluxTransformer2DModel does not have: none\); the checkpoint does not"):
        open_source(str(gone))


def test_an_extra_tensor_is_left_out_with_a_warning_as_from_pretrained_leaves_it_out(folders, tmp_path, caplog):
    from diffusers import FluxTransformer2DModel

    extra = _copy_folder(folders / "single", tmp_path / "extra", lambda w: w.__setitem__("lora.up", torch.zeros(2)))
    FluxTransformer2DModel.from_pretrained(str(extra))  # diffusers loads it (and warns)
    with caplog.at_level("WARNING", logger="squareq.sources"):
        source = open_source(str(extra))
    assert source.ignored == ["lora.up"]
    assert "1 tensors that FluxTransformer2DModel with this config does not have (lora.up)" in caplog.text
    assert "left out" in caplog.text
    assert torch.equal(source.load_block("transformer_blocks.0", "cpu").attn.to_q.weight,
                       open_source(str(folders / "single")).load_block("transformer_blocks.0", "cpu").attn.to_q.weight)


def test_a_legacy_buffer_in_the_checkpoint_is_skipped_quietly_as_transformers_skips_it(tmp_path, caplog):
    """Older transformers saved BERT's ``embeddings.position_ids`` (now a non-persistent buffer); checkpoints that
    ship in packages still carry it, and ``from_pretrained`` skips it without a word."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    folder = save_text_model(BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                  num_attention_heads=2, intermediate_size=64)), tmp_path / "bert")
    weights = load_file(str(folder / "model.safetensors"))
    weights["embeddings.position_ids"] = torch.arange(512)[None]
    save_file(weights, str(folder / "model.safetensors"))
    BertModel.from_pretrained(str(folder))
    with caplog.at_level("WARNING", logger="squareq.sources"):
        source = open_source(str(folder), ["encoder.layer"])
    assert source.ignored == [] and "left out" not in caplog.text
    assert tokenizer_folder(source.folder) == folder


def test_nan_weight_is_named(folders, tmp_path, tiny_state):
    name = "single_transformer_blocks.0.proj_mlp.weight"

    def plant(w):
        w[name] = w[name].clone()
        w[name][3, 5] = float("nan")

    source = open_source(str(_copy_folder(folders / "single", tmp_path / "nan", plant)))
    assert_block_equal(source, "transformer_blocks.0", tiny_state)  # only tensors actually read are checked
    with pytest.raises(ModelError, match=rf"tensor {name} in .*diffusion_pytorch_model.safetensors contains NaN"):
        source.load_block("single_transformer_blocks.0")


def test_bfl_errors_name_bfl_tensors(tmp_path, tiny_state):
    bfl = {k: v.clone() for k, v in diffusers_to_bfl(tiny_state).items()}
    bfl["double_blocks.1.img_mlp.2.bias"][0] = float("inf")
    save_file(bfl, str(tmp_path / "inf.safetensors"))
    source = open_source(str(tmp_path / "inf.safetensors"))
    with pytest.raises(ModelError, match=r"tensor double_blocks.1.img_mlp.2.bias in .*inf.safetensors contains Inf"):
        source.load_block("transformer_blocks.1")
    bfl = {k: v.clone() for k, v in diffusers_to_bfl(tiny_state).items()}
    bfl["double_blocks.0.txt_attn.qkv.weight"] = bfl["double_blocks.0.txt_attn.qkv.weight"][:, :-2].contiguous()
    save_file(bfl, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ModelError, match=r"double_blocks.0.txt_attn.qkv.weight \(diffusers transformer_blocks.0.attn."
                                         r"add_q_proj.weight\) in .*shape.safetensors has shape \[64, 62\]"):
        open_source(str(tmp_path / "shape.safetensors"))
    save_file({"some.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ModelError, match="is not a BFL FLUX.1 checkpoint"):
        open_source(str(tmp_path / "other.safetensors"))


def test_revision_is_for_hub_ids_and_encoder_files_for_encoding(tmp_path):
    with pytest.raises(ModelError, match="--revision v1: tiny-flux is a built-in model, not a Hugging Face Hub ID"):
        open_source("tiny-flux", revision="v1")
    with pytest.raises(ModelError, match="--revision v1 is for a Hugging Face Hub ID, and .* is a local path"):
        open_source(str(tmp_path), revision="v1")
    from click.testing import CliRunner

    from squareq.cli import main

    result = CliRunner().invoke(main, ["compile", "tiny-flux", "--budget", "2MB", "-o", str(tmp_path / "s.slab"),
                                       "--calib-synthetic", "--t5", str(tmp_path / "t5.safetensors")])
    assert result.exit_code == 2, result.output
    assert "--t5 encode calibration images, and --calib-synthetic encodes none; leave them out" in result.output
    assert not (tmp_path / "s.slab").exists()
