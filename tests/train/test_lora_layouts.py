"""Issue 64: each family's kohya/ComfyUI file (train/layouts/) read back by diffusers' own reader for that family
gives the per-layer deltas our diffusers file gives; LoKr and LoHa in LyCORIS's layout; the refusals."""
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from squareq.models import chroma, flux2, hunyuan_video, ltx_video, qwen_image, sd3, wan, z_image
from squareq.models.tiny import build_tiny_flux
from squareq.train.layouts import LAYOUTS
from squareq.train.layouts.wan import WAN
from squareq.train.lora_factors import LoraFileError
from squareq.train.lora_files import ADAPTER_METADATA_KEY, save_diffusers_lora, save_kohya_lora, save_peft_adapter
from squareq.train.lora_reader import load_lora

RANK, ALPHA = 4, 6  # scale 1.5: a reader that dropped alpha, or applied it twice, would not match
BUILD = {"wan": wan.build_tiny_wan, "hunyuan-video": hunyuan_video.build_tiny_hunyuan_video,
         "qwen-image": qwen_image.build_tiny_qwen_image, "flux2": flux2.build_tiny_flux2,
         "ltx-video": ltx_video.build_tiny_ltx_video, "sd3": sd3.build_tiny_sd3, "chroma": chroma.build_tiny_chroma,
         "z-image": z_image.build_tiny_z_image, "flux": build_tiny_flux}
# diffusers' HunyuanVideo and FLUX.1 (Chroma) readers split a single block's linear1 at the real models' hidden size
# 3072, which the tiny models do not have: those four layers are checked by the stacking tests of test_lora_files.py.
# diffusers' FLUX.1 reader (also Chroma's) leaves the modules outside the blocks without their transformer prefix, so
# they never load there; the file holds them for ComfyUI, as sd-scripts' files do (docs/train.md)
LINEAR1 = r"single_transformer_blocks\.\d+\.(attn\.to_[qkv]|proj_mlp)$"
FLUX1_READER = re.compile(LINEAR1 + r"|^(x_embedder|context_embedder|proj_out|norm_out\.linear|time_text_embed\..*)$")
NOT_IN_DIFFUSERS = {"hunyuan-video": re.compile(LINEAR1), "chroma": FLUX1_READER, "flux": FLUX1_READER}


def linears(family):
    return {n: m for n, m in BUILD[family]().named_modules() if isinstance(m, torch.nn.Linear)}


def held(family):
    """The tiny model's linears the family's layout holds (refused ones left out), less those diffusers cannot read."""
    out = []
    for name in linears(family):
        try:
            LAYOUTS[family].module_of(name)
        except LoraFileError:
            continue
        if family not in NOT_IN_DIFFUSERS or not NOT_IN_DIFFUSERS[family].search(name):
            out.append(name)
    return out


def make_lora(family, layers, seed=0):
    g = torch.Generator().manual_seed(seed)
    mods = linears(family)
    out = {}
    for name in layers:
        out[name + ".lora_A.weight"] = torch.randn(RANK, mods[name].in_features, generator=g)
        out[name + ".lora_B.weight"] = 0.5 * torch.randn(mods[name].out_features, RANK, generator=g)
    return out


def kohya_file(tmp_path, family, lora, alpha=ALPHA, **kw):
    config = dict(BUILD[family]().config)
    return save_kohya_lora(lora, tmp_path / f"{family}.safetensors", RANK, alpha, ["to_q"], dtype=torch.float32,
                           extra_metadata={"family": family}, config=config, **kw)


def diffusers_file(tmp_path, family, lora):
    save_diffusers_lora(lora, tmp_path / "diffusers", RANK, ALPHA, ["to_q"], dtype=torch.float32)
    return tmp_path / "diffusers"


def loaded_deltas(family, source):
    """Every layer's delta after the family's pipeline reads ``source`` (``lora_state_dict``, the converter its layout
    is routed to) and loads it into a fresh tiny model (``load_lora_into_transformer``), as ``load_lora_weights``."""
    import diffusers

    pipeline = getattr(diffusers, LAYOUTS[family].pipeline)
    state, metadata = pipeline.lora_state_dict(str(source), return_lora_metadata=True)
    assert all("lora" in k or "lokr" in k for k in state)  # load_lora_weights refuses a file otherwise
    model = BUILD[family]()
    extra = {"network_alphas": None} if family in ("chroma", "flux") else {}
    pipeline.load_lora_into_transformer(state, transformer=model, metadata=metadata, **extra)
    with torch.no_grad():
        return {name: m.get_delta_weight(m.active_adapters[0]).float() for name, m in model.named_modules()
                if hasattr(m, "get_delta_weight") and getattr(m, "active_adapters", None)}


def worst(theirs, ours):
    """The largest per-layer error relative to our delta's size; a layer only one side has counts as its own size
    (a zero module the layout's reader needs is zero)."""
    err = 0.0
    for layer in theirs.keys() | ours.keys():
        a, b = theirs.get(layer), ours.get(layer)
        if a is None or b is None:
            err = max(err, float((a if b is None else b).abs().max()) and 1.0)
            continue
        err = max(err, float((a - b).abs().max() / b.abs().max()))
    return err


@pytest.mark.parametrize("family", sorted(BUILD))
def test_each_family_s_file_reads_back_in_its_diffusers_reader_to_our_deltas(tmp_path, family):
    lora = make_lora(family, held(family))
    path = kohya_file(tmp_path, family, lora)
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
    layout = LAYOUTS[family]
    assert ADAPTER_METADATA_KEY not in header  # diffusers would apply alpha from it a second time
    assert (header["ss_network_module"], header["ss_network_dim"], header["ss_network_alpha"]) == (
        layout.network_module, str(RANK), str(ALPHA))
    assert header["modelspec.implementation"] == layout.implementation and "modelspec.architecture" in header
    ours = loaded_deltas(family, diffusers_file(tmp_path, family, lora))
    assert len(ours) == len(held(family))
    theirs = loaded_deltas(family, path)
    assert theirs.keys() == ours.keys() and worst(theirs, ours) < 1e-6
    # SquareQ reads its own file back too (squareq sample --lora, export-lora), at the trained alpha
    back, info = load_lora(path)
    assert (info["layout"], info["alpha"]) == ("kohya", ALPHA)
    mine = {k.rsplit(".lora_", 1)[0] for k in back}
    assert mine == {k.rsplit(".lora_", 1)[0] for k in lora}
    for layer in mine:
        got = ALPHA / back[layer + ".lora_A.weight"].shape[0] * back[layer + ".lora_B.weight"] @ back[
            layer + ".lora_A.weight"]
        torch.testing.assert_close(got, ours[layer], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,module", [
    ("z-image", "lora_unet_layers_0_attention_qkv.lora_up.weight"),
    ("flux2", "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"),
    ("hunyuan-video", "diffusion_model.double_blocks.0.img_attn_qkv.lora_B.weight")])
def test_negative_controls_a_wrong_alpha_or_swapped_fused_parts_fail_the_comparison(tmp_path, family, module):
    lora = make_lora(family, held(family))
    ours = loaded_deltas(family, diffusers_file(tmp_path, family, lora))
    assert worst(loaded_deltas(family, kohya_file(tmp_path, family, lora, alpha=ALPHA / 2)), ours) > 0.3
    path = kohya_file(tmp_path, family, lora)
    tensors = load_file(str(path))
    up = tensors[module]
    q, k, v = up.chunk(3)
    save_file({**tensors, module: torch.cat([k, q, v])}, str(path))  # q's rows where k's belong
    assert worst(loaded_deltas(family, path), ours) > 0.3


def test_qwen_image_with_adapter_metadata_in_its_header_is_applied_twice(tmp_path):
    """Why no layout's header carries lora_adapter_metadata: diffusers takes the config from it, on top of the
    alpha its converter has already baked in."""
    lora = make_lora("qwen-image", ["transformer_blocks.0.attn.to_q"])
    path = kohya_file(tmp_path, "qwen-image", lora)
    ours = loaded_deltas("qwen-image", diffusers_file(tmp_path, "qwen-image", lora))
    with safe_open(str(tmp_path / "diffusers" / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = f.metadata()[ADAPTER_METADATA_KEY]  # our diffusers file's, which carries alpha there
    save_file(load_file(str(path)), str(path), metadata={"format": "pt", ADAPTER_METADATA_KEY: meta})
    theirs = loaded_deltas("qwen-image", path)
    layer = "transformer_blocks.0.attn.to_q"
    torch.testing.assert_close(theirs[layer], ours[layer] * (ALPHA / RANK))


def test_wan_s_musubi_reader_needs_every_block_module_which_the_file_zero_fills(tmp_path):
    """The default targets (attention) only: the other modules of every block are zero rank-1 factors with alpha 1,
    which change nothing; without them diffusers' _convert_musubi_wan_lora_to_diffusers fails (the control)."""
    from dataclasses import replace

    layers = [n for n in held("wan") if re.search(r"attn1\.to_[qkv]$|attn1\.to_out\.0$", n)]
    lora = make_lora("wan", layers)
    path = kohya_file(tmp_path, "wan", lora)
    keys = load_file(str(path))
    assert keys["lora_unet_blocks_1_ffn_0.lora_down.weight"].shape == (1, 32) and keys[
        "lora_unet_blocks_1_ffn_0.alpha"].item() == 1
    ours = loaded_deltas("wan", diffusers_file(tmp_path, "wan", lora))
    theirs = loaded_deltas("wan", path)
    assert set(theirs) > set(ours) and worst(theirs, ours) < 1e-6
    save_file(replace(WAN, finish=None).write(lora, ALPHA), str(path))
    with pytest.raises(KeyError, match="blocks_0_cross_attn_q"):
        loaded_deltas("wan", path)


def test_hunyuan_video_files_always_carry_the_img_attn_qkv_key_diffusers_routes_by(tmp_path):
    """Without any img_attn_qkv key diffusers' HunyuanVideo reader passes the file through and loads nothing (the
    control); the writer adds a zero one where q, k and v are not targeted."""
    from dataclasses import replace

    from squareq.train.layouts.hunyuan_video import HUNYUAN_VIDEO

    lora = make_lora("hunyuan-video", ["transformer_blocks.0.attn.to_out.0", "transformer_blocks.1.ff.net.2"])
    ours = loaded_deltas("hunyuan-video", diffusers_file(tmp_path, "hunyuan-video", lora))
    theirs = loaded_deltas("hunyuan-video", kohya_file(tmp_path, "hunyuan-video", lora))
    assert worst(theirs, ours) < 1e-6
    path = tmp_path / "bare.safetensors"
    save_file(replace(HUNYUAN_VIDEO, finish=None).write(lora, ALPHA), str(path))
    assert loaded_deltas("hunyuan-video", path) == {}  # nothing loaded, with only a log line


def test_hunyuan_video_s_linear1_stacks_q_k_v_and_the_mlp_input_with_alpha_baked(tmp_path):
    """A single block's fused linear1, which diffusers splits at the real model's 3072 rows: ComfyUI's formula on the
    file (no .alpha: scale 1) gives the parts' deltas in order, the MLP input's rows zero where it is untargeted."""
    block = "single_transformer_blocks.1."
    lora = make_lora("hunyuan-video", [block + "attn.to_q", block + "attn.to_v"])
    t = load_file(str(kohya_file(tmp_path, "hunyuan-video", lora)))
    key = "diffusion_model.single_blocks.1.linear1"
    assert key + ".alpha" not in t and t[key + ".lora_A.weight"].shape == (2 * RANK, 32)
    fused = t[key + ".lora_B.weight"] @ t[key + ".lora_A.weight"]
    assert fused.shape == (3 * 32 + 4 * 32, 32) and not fused[32:64].any() and not fused[96:].any()
    for rows, layer in ((slice(0, 32), "attn.to_q"), (slice(64, 96), "attn.to_v")):
        want = ALPHA / RANK * lora[block + layer + ".lora_B.weight"] @ lora[block + layer + ".lora_A.weight"]
        torch.testing.assert_close(fused[rows], want)


@pytest.mark.parametrize("family,layer,words", [
    ("flux2", "double_stream_modulation_img.linear", "drops with only a log line"),
    ("flux2", "time_guidance_embed.guidance_embedder.linear_1", "drops with only a log line"),
    ("hunyuan-video", "context_embedder.token_refiner.refiner_blocks.0.attn.to_q", "fused self_attn_qkv"),
    ("hunyuan-video", "norm_out.linear", "final adaLN_modulation.1"),
    ("wan", "proj_out", "only the blocks' modules"),
    ("ltx-video", "proj_in", "transformer blocks only"),
    ("z-image", "cap_embedder.1", "blocks and refiners only"),
    ("chroma", "distilled_guidance_layer.in_proj", "no linear counterpart")])
def test_a_layer_a_layout_cannot_hold_is_refused_in_one_sentence(tmp_path, family, layer, words):
    lora = make_lora(family, [layer, *held(family)[:2]])
    with pytest.raises(LoraFileError) as err:
        kohya_file(tmp_path, family, lora)
    msg = str(err.value)
    assert layer in msg and words in msg and "drop it from targets" in msg and msg.endswith(".") and "\n" not in msg
    kohya_file(tmp_path, family, make_lora(family, held(family)[:2]))  # the control: without it, written


def test_families_without_a_layout_are_refused_in_one_sentence(tmp_path):
    with pytest.raises(LoraFileError, match=r"is for a sd-unet model, for which SquareQ writes no kohya/ComfyUI "
                                            r"layout .*; keep to the diffusers file\.$"):
        save_kohya_lora({"x.lora_A.weight": torch.zeros(1, 2), "x.lora_B.weight": torch.zeros(2, 1)},
                        tmp_path / "x.safetensors", 1, 1, extra_metadata={"family": "sd-unet"})


# ----------------------------------------------------------------------------------------------- LoKr, LoHa


def lycoris(family, kind, rank, pattern):
    """A tiny model with PEFT's LoKr or LoHa on the linears matching ``pattern``, random factors: their runtime
    names (``<layer>.lokr_w1``) and PEFT's own delta of each layer."""
    from peft import LoHaConfig, LoKrConfig, inject_adapter_in_model

    from squareq.runtime.peft_lora import file_name

    model = BUILD[family]()
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and re.search(pattern, n)]
    config = (LoKrConfig if kind == "lokr" else LoHaConfig)(r=rank, alpha=ALPHA, target_modules=targets)
    model = inject_adapter_in_model(config, model)
    g = torch.Generator().manual_seed(rank)
    factors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("lokr_" if kind == "lokr" else "hada_") in name:  # bf16 values: an export's bf16 file holds them
                p.copy_((0.3 * torch.randn(p.shape, generator=g)).bfloat16().float())
                factors[file_name(name)] = p.detach().clone()
        deltas = {n: m.get_delta_weight("default").float() for n, m in model.named_modules()
                  if hasattr(m, "get_delta_weight") and hasattr(m, "scaling")}
    return factors, deltas


@pytest.mark.parametrize("family,rank,pattern", [
    ("z-image", 2, r"(layers|refiner)\.\d+\."),  # w2 decomposed at the tiny sizes: .alpha kept
    ("z-image", 32, r"(layers|refiner)\.\d+\."),  # both factors full: alpha / r baked into w1, no .alpha
    ("flux2", 2, r"transformer_blocks\.\d+\.")])
def test_lokr_files_read_back_in_diffusers_to_peft_s_deltas(tmp_path, family, rank, pattern):
    factors, deltas = lycoris(family, "lokr", rank, pattern)
    path = save_kohya_lora(factors, tmp_path / "lokr.safetensors", rank, ALPHA, dtype=torch.float32,
                           extra_metadata={"family": family})
    tensors = load_file(str(path))
    full = rank == 32
    assert any(k.endswith(".alpha") for k in tensors) != full
    with safe_open(str(path), "pt") as f:
        header = f.metadata()
    assert header["ss_network_module"] == "lycoris.kohya" and json.loads(header["ss_network_args"]) == {"algo": "lokr"}
    assert ADAPTER_METADATA_KEY not in header and header["squareq.layout"] == "lycoris"
    theirs = loaded_deltas(family, path)
    assert theirs.keys() == deltas.keys() and worst(theirs, deltas) < 1e-6
    if full:  # the control: PEFT's alpha / r left out of w1 (LyCORIS applies none to full factors) is off by it
        save_file({k: v / (ALPHA / rank) if k.endswith("lokr_w1") else v for k, v in tensors.items()}, str(path))
        assert worst(loaded_deltas(family, path), deltas) > 0.3


def comfy_loha_delta(t, key):
    """ComfyUI's (and LyCORIS's) LoHa delta: alpha / rows(hada_w1_b) · (w1_a w1_b) ⊙ (w2_a w2_b)."""
    w1 = t[key + ".hada_w1_a"] @ t[key + ".hada_w1_b"]
    w2 = t[key + ".hada_w2_a"] @ t[key + ".hada_w2_b"]
    return t[key + ".alpha"].item() / t[key + ".hada_w1_b"].shape[0] * w1 * w2


def test_loha_files_stack_fused_layers_exactly_at_peft_s_scale(tmp_path):
    """diffusers 0.42 has no LoHa reader: LyCORIS's formula (ComfyUI's) on the file gives PEFT's deltas, q, k and v
    stacked in FLUX.2's fused qkv with alpha × 3; the control: alpha as written for one part is a third of it."""
    factors, deltas = lycoris("flux2", "loha", 2, r"transformer_blocks\.\d+\.")
    path = save_kohya_lora(factors, tmp_path / "loha.safetensors", 2, ALPHA, dtype=torch.float32,
                           extra_metadata={"family": "flux2"})
    t = load_file(str(path))
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert t[qkv + ".alpha"].item() == 3 * ALPHA and t[qkv + ".hada_w1_b"].shape[0] == 3 * 2
    torch.testing.assert_close(comfy_loha_delta(t, qkv), torch.cat(
        [deltas[f"transformer_blocks.0.attn.{p}"] for p in ("to_q", "to_k", "to_v")]))
    torch.testing.assert_close(comfy_loha_delta(t, "lora_unet_single_blocks_1_linear2"),
                               deltas["single_transformer_blocks.1.attn.to_out"])
    wrong = dict(t, **{qkv + ".alpha": torch.tensor(float(ALPHA))})
    assert not torch.allclose(comfy_loha_delta(wrong, qkv)[:32], deltas["transformer_blocks.0.attn.to_q"])


def test_lokr_on_a_fused_native_layer_is_refused_where_its_keys_are_native(tmp_path):
    factors, _ = lycoris("hunyuan-video", "lokr", 2, r"^transformer_blocks\.0\.attn\.to_[qk]$")
    with pytest.raises(LoraFileError, match=r"LoKr layer transformer_blocks\.0\.attn\.to_[qk] is part of the fused "
                                            r"module diffusion_model\.double_blocks\.0\.img_attn_qkv .*drop it from"):
        save_kohya_lora(factors, tmp_path / "x.safetensors", 2, ALPHA, extra_metadata={"family": "hunyuan-video"})


def test_export_lora_writes_a_peft_folder_in_lycoris_s_layout_and_a_family_s_diffusers_file_in_its_own(tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main
    from squareq.runtime import LoraVariant
    from squareq.runtime.peft_lora import lycoris_config

    factors, deltas = lycoris("z-image", "lokr", 2, r"layers\.\d+\.")
    layers = sorted({k.rsplit(".", 1)[0] for k in factors})
    folder = save_peft_adapter(factors, tmp_path / "run_peft",
                               lycoris_config(LoraVariant(kind="lokr"), 2, ALPHA, layers),
                               header={"modelspec.architecture": "z-image/lokr", "modelspec.title": "t"})
    done = CliRunner().invoke(main, ["export-lora", str(folder), "-o", str(tmp_path / "z.safetensors")])
    assert done.exit_code == 0, done.output
    assert "kohya layout, lokr rank 2" in done.output
    # diffusers bakes alpha into the bf16 file's lokr_w1 in bf16 (_bake_lokr_alpha_): one bf16 rounding
    assert worst(loaded_deltas("z-image", tmp_path / "z.safetensors"), deltas) < 1e-2
    refused = CliRunner().invoke(main, ["export-lora", str(folder), "-o", str(tmp_path / "d"), "--format",
                                        "diffusers"])
    assert refused.exit_code == 1 and "export it with --format kohya" in refused.output, refused.output
    # a Wan LoRA's diffusers file (with the config the run records) to musubi-tuner's layout
    lora = make_lora("wan", ["blocks.0.attn1.to_q", "blocks.1.attn2.to_out.0"])
    save_diffusers_lora(lora, tmp_path / "wan", RANK, ALPHA, ["to_q"],
                        extra_metadata={"family": "wan", "base_config": dict(BUILD["wan"]().config)})
    done = CliRunner().invoke(main, ["export-lora", str(tmp_path / "wan"), "-o", str(tmp_path / "wan.safetensors")])
    assert done.exit_code == 0, done.output
    ours = loaded_deltas("wan", tmp_path / "wan")
    # the converter scales the bf16 file's lora_down by alpha / rank in bf16: one bf16 rounding
    assert worst(loaded_deltas("wan", tmp_path / "wan.safetensors"), ours) < 1e-2


def renamed_one_key(path):
    """The file at ``path`` with one factor's key moved to a block the model does not have (block 0's first)."""
    tensors = load_file(str(path))
    key = next(k for k in sorted(tensors) if re.search(r"[._]0[._]", k) and k.endswith(".weight"))
    tensors[re.sub(r"([._])0([._])", r"\g<1>97\2", key, count=1)] = tensors.pop(key)
    save_file(tensors, str(path), metadata=safe_open(str(path), "pt").metadata())
    return key


@pytest.mark.parametrize("family", sorted(BUILD))
def test_negative_control_a_file_with_one_key_renamed_fails_the_read_back(tmp_path, family):
    """The read-back check of the first test, on the family's file with one key renamed: the family's converter
    refuses it, or the layers it loads are not ours (the renamed factor's layer lost, or left at PEFT's init)."""
    lora = make_lora(family, held(family))
    ours = loaded_deltas(family, diffusers_file(tmp_path, family, lora))
    path = kohya_file(tmp_path, family, lora)
    renamed_one_key(path)
    try:
        theirs = loaded_deltas(family, path)
    except (ValueError, KeyError):  # diffusers' converters refuse keys they do not know
        return
    assert theirs.keys() != ours.keys() or worst(theirs, ours) > 0.3
