"""LoRA files: diffusers' own loaders reproduce the SquareQ model's output from our file; kohya export is exact."""
import json
import pickle
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from squareq import runtime
from squareq.models import TINY_FLUX_CONFIG, tiny_flux_inputs
from squareq.slab import open_slab
from squareq.train.lora_factors import LoraFileError
from squareq.train.lora_files import ADAPTER_METADATA_KEY, PREFIX, WEIGHT_NAME, save_diffusers_lora, save_kohya_lora
from squareq.train.layouts.flux import from_kohya, to_kohya
from squareq.train.lora_reader import load_lora

RANK, ALPHA = 4, 8  # scale 2: a loader that ignored alpha (scale 1) would not match
HIDDEN = TINY_FLUX_CONFIG["num_attention_heads"] * TINY_FLUX_CONFIG["attention_head_dim"]
# every QuantLinear of tiny-flux (both block kinds)
ALL_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
               "ff_context.net.2", "norm1.linear", "norm1_context.linear", "norm.linear", "proj_mlp", "proj_out")
# double blocks only: diffusers' own kohya parser hard-codes FLUX.1-dev's 3072 rows when it splits a single
# block's linear1, so it cannot read the tiny model's single blocks
DOUBLE_ONLY = tuple(f"transformer_blocks.{i}.{n}" for i in range(TINY_FLUX_CONFIG["num_layers"])
                    for n in ALL_LINEARS if n not in ("norm.linear", "proj_mlp", "proj_out"))


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def inputs():
    return tiny_flux_inputs(dtype=torch.bfloat16)


def squareq_lora(tiny_slab, targets, rank=RANK, alpha=ALPHA, seed=1, b_std=0.1):
    """A trained-looking LoRA (B clearly nonzero) on the resident SquareQ model; its factors and output."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SQUAREQ_KERNELS", "torch")
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
        runtime.add_lora(model, rank=rank, alpha=alpha, targets=targets, seed=seed)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in runtime.lora_parameters(model).items():
                if ".lora_B." in name:
                    p.copy_(b_std * torch.randn(p.shape, generator=g))
            out = model(**inputs(), return_dict=False)[0].float()
    return runtime.lora_state_dict(model), out


@pytest.fixture(scope="module")
def trained(tiny_slab):
    return squareq_lora(tiny_slab, ALL_LINEARS)


def plain_flux(tiny_slab):
    """A plain diffusers FluxTransformer2DModel in bf16 holding the slab's dequantized weights."""
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(**TINY_FLUX_CONFIG).to(torch.bfloat16)
    model.load_state_dict(open_slab(tiny_slab).dequantized_state_dict())
    return model.eval()


def forward(model):
    with torch.no_grad():
        return model(**inputs(), return_dict=False)[0].float()


def rel_mse(a, b):
    return ((a - b).pow(2).mean() / b.pow(2).mean()).item()


def bf16(t):
    return t.to(torch.bfloat16).float()


def deltas(lora, alpha):
    """{layer: scale·B·A} in fp32, scale = alpha / the layer's rank."""
    out = {}
    for key, a in lora.items():
        if key.endswith(".lora_A.weight"):
            layer = key[: -len(".lora_A.weight")]
            b = lora[layer + ".lora_B.weight"]
            out[layer] = (alpha / a.shape[0]) * (b.float() @ a.float())
    return out


def kohya_delta(k, module):
    down, up, alpha = k[module + ".lora_down.weight"], k[module + ".lora_up.weight"], k[module + ".alpha"]
    return (alpha.item() / down.shape[0]) * (up.float() @ down.float())


# ------------------------------------------------------------------------------------------ diffusers


def test_names_agree_with_diffusers():
    from diffusers import FluxPipeline
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE

    assert (WEIGHT_NAME, ADAPTER_METADATA_KEY, PREFIX) == (LORA_WEIGHT_NAME_SAFE, LORA_ADAPTER_METADATA_KEY,
                                                           FluxPipeline.transformer_name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_diffusers_round_trip(trained, tmp_path, dtype):
    lora, _ = trained
    path = save_diffusers_lora(lora, tmp_path, RANK, ALPHA, ["to_q", "proj_out"],
                               extra_metadata={"base_model_signature": "abc123", "steps": 10}, dtype=dtype)
    assert path == tmp_path / WEIGHT_NAME and sorted(p.name for p in tmp_path.iterdir()) == [WEIGHT_NAME]
    with safe_open(str(path), "pt") as f:
        keys, header = set(f.keys()), f.metadata()
        assert {f.get_tensor(k).dtype for k in keys} == {dtype}
    assert keys == {f"transformer.{k}" for k in lora}
    adapter = json.loads(header["lora_adapter_metadata"])
    assert (adapter["transformer.r"], adapter["transformer.lora_alpha"]) == (RANK, ALPHA)
    assert header["squareq.base_model_signature"] == "abc123"

    back, info = load_lora(tmp_path)  # the folder, as diffusers takes it
    assert back.keys() == lora.keys()
    for k, v in lora.items():
        expected = bf16(v) if dtype == torch.bfloat16 else v
        assert back[k].dtype == torch.float32 and torch.equal(back[k], expected), k
    assert (info["layout"], info["rank"], info["alpha"], info["targets"]) == ("diffusers", RANK, ALPHA,
                                                                              ["to_q", "proj_out"])
    assert info["metadata"]["format"] == "squareq-lora" and info["metadata"]["steps"] == 10
    # saving again replaces the file through a temporary name and leaves nothing else behind
    save_diffusers_lora({k: 2 * v for k, v in lora.items()}, tmp_path, RANK, ALPHA, ["to_q"], dtype=dtype)
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHT_NAME]
    assert load_lora(path)[1]["targets"] == ["to_q"]


def test_diffusers_load_lora_adapter_reproduces_the_squareq_output(tiny_slab, trained, tmp_path):
    lora, expected = trained
    save_diffusers_lora(lora, tmp_path, RANK, ALPHA, ALL_LINEARS)
    model = plain_flux(tiny_slab)
    # without the adapter the outputs differ clearly: the LoRA matters
    assert rel_mse(forward(model), expected) > 1e-2
    model.load_lora_adapter(str(tmp_path), weight_name=WEIGHT_NAME, prefix="transformer", adapter_name="sq")
    layer = model.transformer_blocks[0].attn.to_q
    assert model.peft_config["sq"].r == RANK and layer.scaling["sq"] == ALPHA / RANK
    assert rel_mse(forward(model), expected) < 1e-4


def test_the_header_metadata_is_what_carries_alpha(tiny_slab, trained, tmp_path):
    """The same tensors without the adapter metadata load with diffusers' default alpha = rank and miss."""
    lora, expected = trained
    path = save_diffusers_lora(lora, tmp_path / "ours", RANK, ALPHA, ALL_LINEARS)
    with safe_open(str(path), "pt") as f:
        bare = {k: f.get_tensor(k) for k in f.keys()}
    save_file(bare, str(tmp_path / "bare.safetensors"))
    model = plain_flux(tiny_slab)
    model.load_lora_adapter(str(tmp_path / "bare.safetensors"), prefix="transformer")
    assert rel_mse(forward(model), expected) > 1e-3
    # and load_lora reads such a file the way diffusers does: scale 1
    _, info = load_lora(tmp_path / "bare.safetensors")
    assert info["alpha"] == RANK and info["targets"] == sorted({k.rsplit(".lora_", 1)[0] for k in lora})


def test_pipeline_loader_accepts_the_folder(tiny_slab, trained, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    lora, expected = trained
    save_diffusers_lora(lora, tmp_path, RANK, ALPHA, ALL_LINEARS)
    state, metadata = FluxPipeline.lora_state_dict(str(tmp_path), return_lora_metadata=True)
    assert set(state) == {f"transformer.{k}" for k in lora}
    assert (metadata["transformer.r"], metadata["transformer.lora_alpha"]) == (RANK, ALPHA)
    # a pipeline needs no VAE or text encoders to load a transformer LoRA
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=plain_flux(tiny_slab))
    pipe.load_lora_weights(str(tmp_path))
    assert rel_mse(forward(pipe.transformer), expected) < 1e-4


# ---------------------------------------------------------------------------------------------- kohya

KOHYA_KEY = re.compile(r"^lora_unet_(double_blocks_\d+_(img|txt)_(attn_(qkv|proj)|mlp_[02]|mod_lin)"
                       r"|single_blocks_\d+_(linear[12]|modulation_lin))\.(lora_down\.weight|lora_up\.weight|alpha)$")


def test_kohya_keys_alphas_and_fused_deltas(trained):
    lora, _ = trained
    k = to_kohya(lora, ALPHA)
    assert all(KOHYA_KEY.match(key) for key in k), [key for key in k if not KOHYA_KEY.match(key)]
    modules = {key.rsplit(".", 2)[0] if key.endswith(".weight") else key.rsplit(".", 1)[0] for key in k}
    assert len(modules) == 2 * 10 + 2 * 3  # every BFL linear of two double and two single blocks
    for m in modules:
        assert k[m + ".alpha"].dim() == 0 and k[m + ".lora_down.weight"].dim() == 2
    d = deltas(lora, ALPHA)
    for i in range(2):
        db, sb = f"transformer_blocks.{i}.", f"single_transformer_blocks.{i}."
        fused = {  # BFL module -> the diffusers layers it stacks, in row order
            f"double_blocks_{i}_img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
            f"double_blocks_{i}_txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
        }
        for m, parts in fused.items():
            key = "lora_unet_" + m
            assert k[key + ".alpha"].item() == 3 * ALPHA and k[key + ".lora_down.weight"].shape[0] == 3 * RANK
            torch.testing.assert_close(kohya_delta(k, key), torch.cat([d[db + p] for p in parts]))
        key = f"lora_unet_single_blocks_{i}_linear1"
        assert k[key + ".alpha"].item() == 4 * ALPHA
        torch.testing.assert_close(kohya_delta(k, key), torch.cat(
            [d[sb + p] for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]))
        plain = {f"double_blocks_{i}_img_attn_proj": db + "attn.to_out.0",
                 f"double_blocks_{i}_txt_attn_proj": db + "attn.to_add_out",
                 f"double_blocks_{i}_img_mlp_0": db + "ff.net.0.proj",
                 f"double_blocks_{i}_txt_mlp_2": db + "ff_context.net.2",
                 f"double_blocks_{i}_img_mod_lin": db + "norm1.linear",
                 f"single_blocks_{i}_linear2": sb + "proj_out",
                 f"single_blocks_{i}_modulation_lin": sb + "norm.linear"}
        for m, layer in plain.items():
            assert k[f"lora_unet_{m}.alpha"].item() == ALPHA
            assert torch.equal(k[f"lora_unet_{m}.lora_up.weight"], lora[layer + ".lora_B.weight"])


@pytest.mark.parametrize("alpha", [ALPHA, 6, 1])
def test_kohya_round_trip_is_exact(trained, alpha):
    lora, _ = trained
    back, got_alpha = from_kohya(to_kohya(lora, alpha))
    assert got_alpha == alpha and back.keys() == lora.keys()
    for key in lora:
        assert torch.equal(back[key], lora[key]), key
    want, have = deltas(lora, alpha), deltas(back, got_alpha)
    assert all(torch.equal(have[n], want[n]) for n in want)


def test_partly_targeted_fused_layers_get_zero_rows(trained):
    lora, _ = trained
    keep = ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v", "single_transformer_blocks.1.attn.to_q",
            "single_transformer_blocks.1.attn.to_k", "single_transformer_blocks.1.attn.to_v")
    part = {k: v for k, v in lora.items() if k.rsplit(".lora_", 1)[0] in keep}
    k = to_kohya(part, ALPHA)
    qkv, linear1 = "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_single_blocks_1_linear1"
    assert set(k) == {m + s for m in (qkv, linear1) for s in (".lora_down.weight", ".lora_up.weight", ".alpha")}
    assert k[qkv + ".lora_down.weight"].shape == (2 * RANK, HIDDEN) and k[qkv + ".alpha"].item() == 2 * ALPHA
    assert k[qkv + ".lora_up.weight"].shape == (3 * HIDDEN, 2 * RANK)
    assert not k[qkv + ".lora_up.weight"][HIDDEN:2 * HIDDEN].any()  # k rows
    # linear1: q, k, v rows, then the MLP input's 4 x hidden rows, all zero
    assert k[linear1 + ".lora_up.weight"].shape == (7 * HIDDEN, 3 * RANK) and k[linear1 + ".alpha"].item() == 3 * ALPHA
    assert not k[linear1 + ".lora_up.weight"][3 * HIDDEN:].any()
    d = deltas(part, ALPHA)
    torch.testing.assert_close(kohya_delta(k, qkv)[2 * HIDDEN:], d["transformer_blocks.0.attn.to_v"])
    back, alpha = from_kohya(k)
    assert alpha == ALPHA and back.keys() == part.keys()
    assert all(torch.equal(back[key], part[key]) for key in part)


def test_kohya_trained_on_the_fused_layer(trained):
    """A dense lora_up: each part keeps the whole lora_down (rank k·r) and its rows; other alphas fold into B."""
    g = torch.Generator().manual_seed(3)
    qkv, proj = "lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_img_attn_proj"
    k = {qkv + ".lora_down.weight": torch.randn(6, HIDDEN, generator=g),
         qkv + ".lora_up.weight": torch.randn(3 * HIDDEN, 6, generator=g), qkv + ".alpha": torch.tensor(3.0),
         proj + ".lora_down.weight": torch.randn(2, HIDDEN, generator=g),
         proj + ".lora_up.weight": torch.randn(HIDDEN, 2, generator=g), proj + ".alpha": torch.tensor(2.0)}
    back, alpha = from_kohya(k)
    assert alpha == 3.0  # q, k and v share it; to_out.0's scale 1 is folded into its B
    got = deltas(back, alpha)
    fused = kohya_delta(k, qkv)
    for j, part in enumerate(("to_q", "to_k", "to_v")):
        layer = f"transformer_blocks.0.attn.{part}"
        assert back[layer + ".lora_A.weight"].shape == (6, HIDDEN)
        torch.testing.assert_close(got[layer], fused[j * HIDDEN:(j + 1) * HIDDEN])
    torch.testing.assert_close(got["transformer_blocks.0.attn.to_out.0"], kohya_delta(k, proj))


def test_kohya_file_round_trip_and_header(trained, tmp_path):
    lora, _ = trained
    path = save_kohya_lora(lora, tmp_path / "lora.safetensors", RANK, ALPHA, targets=["to_q"])
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
        assert f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight").dtype == torch.bfloat16
        assert f.get_tensor("lora_unet_double_blocks_0_img_attn_qkv.alpha").dtype == torch.float32
    assert (header["ss_network_module"], header["ss_network_dim"], header["ss_network_alpha"]) == (
        "networks.lora_flux", str(RANK), str(ALPHA))
    back, info = load_lora(path)
    assert (info["layout"], info["rank"], info["alpha"], info["targets"]) == ("kohya", RANK, ALPHA, ["to_q"])
    assert back.keys() == lora.keys() and all(torch.equal(back[k], bf16(v)) for k, v in lora.items())


def test_diffusers_reads_our_kohya_file(tiny_slab, tmp_path):
    """diffusers' own kohya parser (what ComfyUI-style files go through) gives the SquareQ model's output."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    lora, expected = squareq_lora(tiny_slab, DOUBLE_ONLY, seed=2, b_std=0.15)
    path = save_kohya_lora(lora, tmp_path / "kohya.safetensors", RANK, ALPHA, dtype=torch.float32)
    state = FluxPipeline.lora_state_dict(str(path))
    theirs = deltas({k.removeprefix("transformer."): v for k, v in state.items()}, RANK)  # alpha baked in: scale 1
    ours = deltas(lora, ALPHA)
    assert theirs.keys() == ours.keys()
    for layer in ours:
        torch.testing.assert_close(theirs[layer], ours[layer])
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=plain_flux(tiny_slab))
    assert rel_mse(forward(pipe.transformer), expected) > 1e-2
    pipe.load_lora_weights(str(path))
    assert rel_mse(forward(pipe.transformer), expected) < 1e-4


# --------------------------------------------------------------------------------------------- refusals


def one_sentence_naming(err, name):
    msg = str(err.value)
    assert name in msg and "\n" not in msg and msg.endswith("."), msg


@pytest.mark.parametrize("kind", ["zip", "pickle", "garbage"])
def test_non_safetensors_files_are_refused(tmp_path, kind):
    path = tmp_path / "lora.safetensors"
    if kind == "zip":
        torch.save({"a.lora_A.weight": torch.zeros(2, 2)}, path)  # torch.save writes a zip archive
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    else:
        path.write_bytes(b"this is not a LoRA file at all")
    with pytest.raises(LoraFileError) as err:
        load_lora(path)
    one_sentence_naming(err, str(path))
    assert {"zip": "zip archive", "pickle": "pickle", "garbage": "not a readable safetensors"}[kind] in str(err.value)


def test_bad_contents_are_refused(tmp_path):
    cases = {
        "missing_b": ({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, HIDDEN)},
                      "transformer_blocks.0.attn.to_q"),
        "text_encoder": ({"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8),
                          "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4)},
                         "text-encoder"),
        "unknown_module": ({"lora_unet_double_blocks_0_img_attn_foo.lora_down.weight": torch.zeros(4, 8),
                            "lora_unet_double_blocks_0_img_attn_foo.lora_up.weight": torch.zeros(8, 4)},
                           "lora_unet_double_blocks_0_img_attn_foo"),
        "foreign": ({"model.layer.weight": torch.zeros(2, 2)}, "neither"),
    }
    for name, (tensors, words) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(LoraFileError) as err:
            load_lora(path)
        one_sentence_naming(err, str(path))
        assert words in str(err.value), name
    with pytest.raises(LoraFileError) as err:
        load_lora(tmp_path / "nowhere")
    one_sentence_naming(err, "nowhere")


def _diffusers_file(tmp_path, name, adapter=None, extra=None, tensors=None):
    a, b = torch.randn(4, HIDDEN), torch.randn(HIDDEN, 4)
    tensors = tensors or {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": a,
                          "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": b}
    metadata = dict(extra or {})
    if adapter is not None:
        metadata[ADAPTER_METADATA_KEY] = adapter if isinstance(adapter, str) else json.dumps(adapter)
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("adapter, extra, words", [
    ({"transformer.r": 4, "transformer.lora_alpha": "abc"}, None, "lora_alpha is 'abc', not a positive number"),
    ({"transformer.lora_alpha": float("nan")}, None, "not a positive number"),
    ({"transformer.lora_alpha": -2}, None, "not a positive number"),
    ({"transformer.lora_alpha": 4, "transformer.alpha_pattern": {"to_q": "x"}}, None, "alpha_pattern"),
    ({"transformer.lora_alpha": 4, "transformer.alpha_pattern": {"(to_q": 2}}, None, "not a valid layer pattern"),
    ("[1, 2]", None, "is not a JSON object"),
    ("{not json", None, "is not a JSON object"),
    (None, {"squareq.targets": "7"}, "squareq.targets is not a list"),
])
def test_bad_adapter_metadata_is_refused_in_one_sentence(tmp_path, adapter, extra, words):
    """The audit's case: lora_alpha "abc" in the header raised a ValueError traceback."""
    path = _diffusers_file(tmp_path, "bad", adapter, extra)
    with pytest.raises(LoraFileError) as err:
        load_lora(path)
    one_sentence_naming(err, str(path))
    assert words in str(err.value)
    good = _diffusers_file(tmp_path, "good", {"transformer.lora_alpha": 2})  # negative control
    assert load_lora(good)[1]["alpha"] == 2


def test_non_finite_factors_and_kohya_alphas_are_refused(tmp_path):
    nan = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.full((4, HIDDEN), float("nan")),
           "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(HIDDEN, 4)}
    path = _diffusers_file(tmp_path, "nan", tensors=nan)
    with pytest.raises(LoraFileError) as err:
        load_lora(path)
    one_sentence_naming(err, str(path))
    assert "holds NaN or Inf values in transformer.transformer_blocks.0.attn.to_q.lora_A.weight" in str(err.value)
    stem = "lora_unet_double_blocks_0_img_attn_proj"
    for alpha, words in ((torch.ones(2), "is not one positive number"), (torch.tensor(0.0), "is not one positive number"),
                         (torch.tensor(float("inf")), None)):
        path = tmp_path / "kohya.safetensors"
        save_file({f"{stem}.lora_down.weight": torch.randn(4, HIDDEN), f"{stem}.lora_up.weight": torch.randn(HIDDEN, 4),
                   f"{stem}.alpha": alpha}, str(path))
        with pytest.raises(LoraFileError) as err:
            load_lora(path)
        one_sentence_naming(err, str(path))
        assert (f"{stem}.alpha {words}" if words else f"NaN or Inf values in {stem}.alpha") in str(err.value)


def test_layers_without_a_kohya_counterpart_are_refused(trained):
    lora, _ = trained
    for layer in ("transformer_blocks.0.attn.norm_q", "foo.bar"):
        bad = dict(lora, **{f"{layer}.lora_A.weight": torch.zeros(RANK, HIDDEN),
                            f"{layer}.lora_B.weight": torch.zeros(HIDDEN, RANK)})
        with pytest.raises(LoraFileError) as err:
            to_kohya(bad, ALPHA)
        one_sentence_naming(err, layer)


def test_resident_layers_map_too():
    """Outside the blocks: x_embedder is BFL's img_in; norm_out.linear's (scale, shift) rows are BFL's (shift, scale)."""
    g = torch.Generator().manual_seed(4)
    lora = {"norm_out.linear.lora_A.weight": torch.randn(RANK, HIDDEN, generator=g),
            "norm_out.linear.lora_B.weight": torch.randn(2 * HIDDEN, RANK, generator=g),
            "x_embedder.lora_A.weight": torch.randn(RANK, 16, generator=g),
            "x_embedder.lora_B.weight": torch.randn(HIDDEN, RANK, generator=g)}
    k = to_kohya(lora, ALPHA)
    b = lora["norm_out.linear.lora_B.weight"]
    assert torch.equal(k["lora_unet_final_layer_adaLN_modulation_1.lora_up.weight"], torch.cat([b[HIDDEN:], b[:HIDDEN]]))
    assert torch.equal(k["lora_unet_img_in.lora_down.weight"], lora["x_embedder.lora_A.weight"])
    back, alpha = from_kohya(k)
    assert alpha == ALPHA and back.keys() == lora.keys() and all(torch.equal(back[n], lora[n]) for n in lora)


# ------------------------------------------------------------------------------------------ DoRA, rsLoRA


def variant_lora(tiny_slab, variant):
    """A trained-looking LoRA of ``variant`` (B and, for DoRA, the magnitudes moved) on the resident model."""
    from squareq.runtime import LoraVariant  # noqa: F401 (the type of variant)

    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    runtime.add_lora(model, rank=RANK, alpha=ALPHA, targets=DOUBLE_ONLY, seed=1, variant=variant)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in runtime.lora_parameters(model).items():
            if ".lora_B." in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".lora_magnitude_vector"):
                p.mul_(1 + 0.2 * torch.rand(p.shape, generator=g))
        model.eval()
        out = model(**inputs(), return_dict=False)[0].float()
    return model, runtime.lora_state_dict(model), out


@pytest.mark.parametrize("kind", ["dora", "rslora"])
def test_diffusers_applies_our_dora_and_rslora_files_as_trained(tiny_slab, tmp_path, kind):
    """diffusers' own loader builds the PEFT config from our header (use_dora, use_rslora) and reproduces the SquareQ
    model's output; so does SquareQ reading its own file back (sample --lora)."""
    from squareq.runtime import LoraVariant
    from squareq.train.lora_attach import attach_lora

    variant = LoraVariant(dora=kind == "dora", rslora=kind == "rslora")
    _, lora, expected = variant_lora(tiny_slab, variant)
    path = save_diffusers_lora(lora, tmp_path, RANK, ALPHA, DOUBLE_ONLY, dtype=torch.float32, variant=variant)
    with safe_open(str(path), "pt") as f:
        magnitudes = [k for k in f.keys() if k.endswith(".lora_magnitude_vector")]
        adapter = json.loads(f.metadata()[ADAPTER_METADATA_KEY])
    assert (len(magnitudes) > 0) == variant.dora
    assert (adapter["transformer.use_dora"], adapter["transformer.use_rslora"]) == (variant.dora, variant.rslora)
    model = plain_flux(tiny_slab)
    model.load_lora_adapter(str(tmp_path), weight_name=WEIGHT_NAME, prefix="transformer", adapter_name="sq")
    assert rel_mse(forward(model), expected) < 1e-4
    # negative control: the same factors read as a plain LoRA give another output
    plain = plain_flux(tiny_slab)
    save_diffusers_lora({k: v for k, v in lora.items() if "magnitude" not in k}, tmp_path / "plain", RANK, ALPHA,
                        DOUBLE_ONLY, dtype=torch.float32)
    plain.load_lora_adapter(str(tmp_path / "plain"), weight_name=WEIGHT_NAME, prefix="transformer")
    assert rel_mse(forward(plain), expected) > 1e-3

    back, info = load_lora(tmp_path)
    assert info["use_dora"] == variant.dora
    ours = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=True))
    attach_lora(ours, back, info)
    ours.eval()
    # an rsLoRA file applies through the fast path at the same scale; outside autocast that path computes the
    # adapter in bf16 where PEFT's does in fp32, hence a rounding's difference
    assert rel_mse(forward(ours), expected) < 1e-4


def test_rslora_exports_to_kohya_at_its_scale_and_dora_is_refused(tiny_slab, tmp_path):
    from squareq.runtime import LoraVariant

    _, lora, _ = variant_lora(tiny_slab, LoraVariant(rslora=True))
    save_diffusers_lora(lora, tmp_path, RANK, ALPHA, DOUBLE_ONLY, dtype=torch.float32,
                        variant=LoraVariant(rslora=True))
    back, info = load_lora(tmp_path)
    assert info["alpha"] == pytest.approx(ALPHA * RANK ** 0.5)  # alpha/sqrt(r) as a plain scale
    k = to_kohya(back, info["alpha"])
    module = "lora_unet_double_blocks_0_img_attn_proj"
    layer = "transformer_blocks.0.attn.to_out.0"
    expected = (ALPHA / RANK ** 0.5) * (lora[layer + ".lora_B.weight"] @ lora[layer + ".lora_A.weight"])
    torch.testing.assert_close(kohya_delta(k, module), expected, rtol=1e-6, atol=1e-7)

    _, dora, _ = variant_lora(tiny_slab, LoraVariant(dora=True))
    with pytest.raises(LoraFileError, match="DoRA LoRA has no kohya/ComfyUI layout.*use the diffusers file"):
        to_kohya(dora, ALPHA)
    with pytest.raises(LoraFileError, match="has DoRA magnitudes but the variant is not DoRA"):
        save_diffusers_lora(dora, tmp_path / "x", RANK, ALPHA, DOUBLE_ONLY)
    broken = {k: v for k, v in dora.items() if k != "transformer_blocks.0.attn.to_q.lora_magnitude_vector"}
    with pytest.raises(LoraFileError, match="DoRA magnitudes .* and LoRA factors name different layers"):
        save_diffusers_lora(broken, tmp_path / "y", RANK, ALPHA, DOUBLE_ONLY, variant=LoraVariant(dora=True))


def test_dora_magnitudes_stay_fp32_in_a_bf16_file(tiny_slab, tmp_path):
    """A magnitude is a whole row's norm: rounded to bf16 it would rescale the row's output, so it is kept fp32."""
    from squareq.runtime import LoraVariant

    _, lora, _ = variant_lora(tiny_slab, LoraVariant(dora=True))
    path = save_diffusers_lora(lora, tmp_path, RANK, ALPHA, DOUBLE_ONLY, variant=LoraVariant(dora=True))
    with safe_open(str(path), "pt") as f:
        dtypes = {k.rsplit(".", 1)[-1] if "magnitude" in k else "factor": f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {"lora_magnitude_vector": torch.float32, "factor": torch.bfloat16}
    back, _ = load_lora(tmp_path)
    assert all(torch.equal(back[k], lora[k]) for k in lora if k.endswith(".lora_magnitude_vector"))


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_export_lora_keeps_the_run_s_header_and_never_overwrites_its_input(trained, tmp_path, fmt):
    """Issue 40, item 6: ``export-lora X -o X`` is refused with the input untouched; an export elsewhere carries the
    training run's modelspec.* and ss_* keys (the control: the header is there to carry)."""
    from click.testing import CliRunner

    from squareq.cli import main

    lora, _ = trained
    run_header = {"modelspec.title": "sks dog", "modelspec.date": "2026-11-26", "ss_training_started_at": "1",
                  "ss_num_train_images": "12", "ss_tag_frequency": json.dumps({"sks": 12})}
    if fmt == "kohya":
        src = save_kohya_lora(lora, tmp_path / "in.safetensors", RANK, ALPHA, targets=["to_q"], header=run_header)
        same = src
    else:
        src = save_diffusers_lora(lora, tmp_path / "in", RANK, ALPHA, ["to_q"], header=run_header)
        same = tmp_path / "in"
    before = src.read_bytes()
    refused = CliRunner().invoke(main, ["export-lora", str(same), "-o", str(same), "--format", fmt])
    assert refused.exit_code == 2 and "would overwrite the LoRA being exported" in refused.output
    assert src.read_bytes() == before
    out = tmp_path / ("out.safetensors" if fmt == "kohya" else "out")
    done = CliRunner().invoke(main, ["export-lora", str(same), "-o", str(out), "--format", fmt])
    assert done.exit_code == 0, done.output
    written = out if fmt == "kohya" else out / "pytorch_lora_weights.safetensors"
    with safe_open(str(written), "pt") as f:
        header = f.metadata()
    assert {k: header.get(k) for k in run_header} == run_header


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_export_lora_removes_the_temporary_of_a_killed_export_and_nothing_else(trained, tmp_path, fmt):
    """Issue 40, item 7: the .tmp of an export that was killed mid-write survived every later export; the next export
    to the same path removes it with a line, and leaves every other file (the control) alone."""
    from click.testing import CliRunner

    from squareq.cli import main

    lora, _ = trained
    src = save_diffusers_lora(lora, tmp_path / "in", RANK, ALPHA, ["to_q"])
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder / "x.safetensors" if fmt == "kohya" else folder / "pytorch_lora_weights.safetensors"
    debris = target.with_name(f".{target.name}.0a1b2c3d.tmp")
    kept = [target.with_name(f"{target.name}.0a1b2c3d.tmp"), target.with_name(f".{target.name}.bak"),
            folder / ".other.safetensors.0a1b2c3d.tmp"]
    for path in [debris, *kept]:
        path.write_bytes(b"half a file")
    out = target if fmt == "kohya" else folder
    done = CliRunner().invoke(main, ["export-lora", str(src.parent), "-o", str(out), "--format", fmt])
    assert done.exit_code == 0, done.output
    assert done.output.splitlines()[0] == f"removed {debris}, left by an export that was killed while writing it"
    assert not debris.exists() and all(p.read_bytes() == b"half a file" for p in kept) and target.is_file()
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, *(p.name for p in kept)])
