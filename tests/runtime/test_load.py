"""runtime.load builds the family's own class; generic-mode slabs come back as their transformers class; plans;
LoadOptions, and the old keywords' deprecation."""
import dataclasses
import warnings

import pytest
import torch

from squareq import runtime
from squareq.runtime import load_options
from squareq.runtime.attention_choice import AttentionModeError
from squareq.runtime.compute import ComputeError
from squareq.quant import QuantSpec
from squareq.compiler.plain import PlainOptions, write_rtn_slab


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")


def test_load_returns_the_diffusers_class_with_quant_linears(tiny_slab):
    from diffusers import FluxTransformer2DModel

    model = runtime.load(tiny_slab, "cpu")
    assert type(model) is FluxTransformer2DModel
    quant = [n for n, m in model.named_modules() if isinstance(m, runtime.QuantLinear)]
    assert "transformer_blocks.0.attn.to_q" in quant and "proj_out" not in quant
    assert not any(p.requires_grad for p in model.parameters())


def test_load_fuses_flux_attention_unless_told_not_to(tiny_slab):
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from squareq.runtime.flux_attention import FusedFluxAttnProcessor

    fused = runtime.load(tiny_slab, "cpu")
    stock = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(fused_attention=False))
    assert all(type(b.attn.processor) is FusedFluxAttnProcessor for b in fused.transformer_blocks)
    assert all(type(b.attn.processor) is FluxAttnProcessor for b in stock.single_transformer_blocks)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() and "ids" not in k else v
              for k, v in _tiny_inputs().items()}
    with torch.no_grad():
        assert torch.equal(fused(**inputs, return_dict=False)[0], stock(**inputs, return_dict=False)[0])


def _tiny_inputs():
    from squareq.models.tiny import tiny_flux_inputs

    return tiny_flux_inputs(side=4, text_tokens=8)


def test_lora_names_follow_peft_and_targets_are_configurable(tiny_slab):
    model = runtime.load(tiny_slab, "cpu")
    params = runtime.add_lora(model, rank=4, targets=["to_q", "ff.net.2"])
    names = set(runtime.lora_parameters(model))
    assert "transformer_blocks.0.attn.to_q.lora_A.weight" in names
    assert "transformer_blocks.1.ff.net.2.lora_B.weight" in names
    assert not any(".to_k." in n for n in names)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    with pytest.raises(ValueError, match="matches the LoRA targets"):
        runtime.add_lora(model, targets=["no_such_layer"])


def test_generic_mode_slab_loads_as_its_transformers_class(tmp_path):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    source = T5EncoderModel(cfg).eval()
    out = tmp_path / "t5.slab"
    write_rtn_slab(source, ["encoder.block.0", "encoder.block.1"], {}, out,
               PlainOptions(default_spec=QuantSpec(bits=8), family="generic"))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    resident = runtime.load(out, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(out, "cpu", options=runtime.LoadOptions(prefetch=1))
    assert type(streamed) is T5EncoderModel
    with torch.no_grad():
        expected = resident(input_ids=ids).last_hidden_state
        got = streamed(input_ids=ids).last_hidden_state
        assert torch.equal(got, expected)
        # the quantized encoder stays close to the source
        ref = source.to(torch.bfloat16)(input_ids=ids).last_hidden_state.float()
    assert ((got.float() - ref).pow(2).mean() / ref.pow(2).mean()) < 0.02


def test_plan_counts_what_load_allocates(tiny_slab):
    plan = runtime.plan(tiny_slab, resolution=128, batch=2, text_tokens=16, prefetch=3, lora_rank=4)
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=3))
    rt = runtime.runtime_of(model)
    params = runtime.add_lora(model, rank=4)
    assert plan.tokens == (128 // 16) ** 2 + 16 and plan.hidden == 64
    assert plan.ring == sum(s.buffer.numel() for s in rt.streamer.slots)
    assert plan.scratch == rt.scratch.buffer.numel() * 2
    assert plan.lora == 16 * sum(p.numel() for p in params)
    assert plan.checkpoints == len(rt.manifest.blocks) * 2 * plan.batch * plan.tokens * plan.hidden
    assert plan.peak_reserved >= plan.peak_allocated
    assert "expected peak reserved" in str(plan)


def test_plan_refuses_a_budget_it_exceeds(tiny_slab):
    plan = runtime.plan(tiny_slab, resolution=128, text_tokens=16)
    plan.check(plan.peak_reserved)
    with pytest.raises(runtime.PlanError, match="--vram-budget") as refused:
        plan.check(plan.peak_reserved - 1)
    # the smallest budget it names is enough
    from squareq.sizes import parse_size

    named = str(refused.value).split("at least ")[1].split(" (the smallest")[0]
    plan.check(parse_size(named.replace(" ", "")))


def test_load_records_where_the_blocks_wait_and_streams_like_resident(tiny_slab):
    """Issue 40, item 9 split ``load`` into pieces: what it builds is unchanged. Streamed blocks run through the ring
    from the host asked for (or auto's choice, with its reason); resident ones are bound once on the device; both
    compute the same output."""
    from squareq.runtime.blocks import BlockRunner

    from .harness import inputs

    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="pinned", fused_attention=False))
    rt = runtime.runtime_of(streamed)
    assert (rt.host, rt.host_reason, rt.device_blobs) == ("pinned", "asked for", []) and rt.streamer is not None
    assert all(isinstance(streamed.get_submodule(b.name).forward, BlockRunner) for b in rt.manifest.blocks)
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, fused_attention=False))
    rr = runtime.runtime_of(resident)
    assert rr.streamer is None and rr.host == "device" and len(rr.device_blobs) == len(rr.manifest.blocks)
    auto = runtime.runtime_of(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(host="auto")))
    assert auto.host in ("pinned", "disk") and auto.host_reason and auto.host_reason != "asked for"
    batch = inputs("cpu")
    with torch.no_grad():
        assert torch.equal(streamed(**batch, return_dict=False)[0], resident(**batch, return_dict=False)[0])


def test_load_rejects_bad_arguments(tiny_slab):
    with pytest.raises(ValueError, match="host="):
        runtime.LoadOptions(host="ram")
    with pytest.raises(ValueError, match="prefetch="):
        runtime.LoadOptions(prefetch=0)
    with pytest.raises(ValueError, match="cuda_graphs=True needs streamed blocks on a CUDA device"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(cuda_graphs=True))


@pytest.mark.parametrize("field, bad, error, sentence", [
    ("compute", "fp4", ComputeError, r"compute='fp4': choose one of bf16, fp8, auto\."),
    ("attention", "flash", AttentionModeError, r"attention='flash': choose one of auto, cudnn, default\."),
    ("dtype", "fp32", ComputeError, r"dtype='fp32': choose one of bf16, fp16, auto\."),
    ("verify", "sometimes", ValueError, r"verify='sometimes' must be one of \('eager', 'lazy', 'off'\) or a bool\."),
])
def test_load_options_refuse_a_value_that_does_not_exist_when_made(tiny_slab, field, bad, error, sentence):
    """Issue 59: each field with a fixed set of values is refused when the LoadOptions is made, with the error and
    sentence load gave for it before (the check moved, it is not a second one)."""
    with pytest.raises(error, match=sentence):
        runtime.LoadOptions(**{field: bad})
    with pytest.raises(error, match=sentence):  # the old keyword reaches the same refusal
        runtime.load(tiny_slab, "cpu", **{field: bad})
    good = {"compute": "auto", "attention": "default", "dtype": "auto", "verify": False}[field]
    assert getattr(runtime.LoadOptions(**{field: good}), field) == good  # negative control: a real value is kept


def _old_argument_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)
            and "LoadOptions" in str(w.message)]


def test_load_options_and_the_old_keywords_build_the_same_model(tiny_slab, monkeypatch):
    """Issue 59: LoadOptions replaced load's keywords, which still work for one release. Both build the same model:
    the ring, the host, the attention processor and the output."""
    from .harness import inputs

    monkeypatch.setattr(load_options, "_old_arguments_warned", False)
    options = runtime.LoadOptions(prefetch=3, host="pinned", fused_attention=False, verify="lazy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = runtime.load(tiny_slab, "cpu", options=options)
        assert not _old_argument_warnings(caught)  # the new way warns of nothing
        old = runtime.load(tiny_slab, "cpu", prefetch=3, host="pinned", fused_attention=False, verify="lazy")
    assert len(_old_argument_warnings(caught)) == 1
    rn, ro = runtime.runtime_of(new), runtime.runtime_of(old)
    assert len(rn.streamer.slots) == len(ro.streamer.slots) == 3 and rn.host == ro.host == "pinned"
    assert type(new.transformer_blocks[0].attn.processor) is type(old.transformer_blocks[0].attn.processor)
    batch = inputs("cpu")
    with torch.no_grad():
        assert torch.equal(new(**batch, return_dict=False)[0], old(**batch, return_dict=False)[0])
    default = runtime.runtime_of(runtime.load(tiny_slab, "cpu"))  # no options: LoadOptions()'s defaults
    assert len(default.streamer.slots) == runtime.LoadOptions().prefetch == 2


def test_the_old_keywords_warn_once_per_process_and_still_work(tiny_slab, monkeypatch):
    """A FutureWarning, which Python shows users by default (a DeprecationWarning is hidden unless raised from
    __main__). pyproject ignores FutureWarning in the suite, so the warnings are recorded here with "always": what
    keeps the second call quiet is load's own once-flag (reset first, since an earlier test may have used them)."""
    monkeypatch.setattr(load_options, "_old_arguments_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resident = runtime.load(tiny_slab, "cpu", stream=False)
        streamed = runtime.load(tiny_slab, "cpu", prefetch=1)
    said = _old_argument_warnings(caught)
    assert len(said) == 1 and "options=LoadOptions(...)" in said[0] and "stream" in said[0], said
    assert [w.filename for w in caught if "LoadOptions" in str(w.message)] == [__file__]  # points at the caller
    assert not any(issubclass(w.category, DeprecationWarning) for w in caught)  # not the hidden kind any more
    assert not runtime.runtime_of(resident).streamed and len(runtime.runtime_of(streamed).streamer.slots) == 1
    # negative control: with the flag reset, the next call with the old keywords warns again
    monkeypatch.setattr(load_options, "_old_arguments_warned", False)
    with pytest.warns(FutureWarning, match="LoadOptions"):
        runtime.load(tiny_slab, "cpu", stream=False)


def test_old_positional_options_are_mapped_in_load_s_old_order(tiny_slab, monkeypatch):
    """At 43312c4 load's options could be passed by position after the device (load(slab, dev, 3)); for one release
    they map to the old order, with the same warning."""
    monkeypatch.setattr(load_options, "_old_arguments_warned", False)
    with pytest.warns(FutureWarning, match=r"positional options \(prefetch, host, stream\).*LoadOptions") as caught:
        streamed = runtime.runtime_of(runtime.load(tiny_slab, "cpu", 3, "pinned", True))
    assert [w.filename for w in caught if "LoadOptions" in str(w.message)] == [__file__]
    assert streamed.streamed and len(streamed.streamer.slots) == 3 and streamed.host == "pinned"
    # all eleven, attention and dtype last (each a non-default whose reason shows it arrived)
    every = runtime.runtime_of(runtime.load(tiny_slab, "cpu", 1, "pinned", False, "lazy", None, "bf16", False, True,
                                            False, "default", "auto"))
    assert not every.streamed and every.dtype_reason == "cpu computes bf16" and "as asked" in every.attention_reason
    # positional and keywords mix as they did
    mixed = runtime.load(tiny_slab, "cpu", 2, "pinned", fused_attention=False)
    assert len(runtime.runtime_of(mixed).streamer.slots) == 2
    assert type(mixed.transformer_blocks[0].attn.processor).__name__ != "FusedFluxAttnProcessor"
    # negative controls: a twelfth, an option given twice, and a LoadOptions by position are refused
    with pytest.raises(TypeError, match="from 1 to 13 positional arguments but 14 were given"):
        runtime.load(tiny_slab, "cpu", 1, "pinned", True, "lazy", None, "bf16", False, True, False, "auto", "bf16", 0)
    with pytest.raises(TypeError, match="multiple values for argument 'prefetch'"):
        runtime.load(tiny_slab, "cpu", 3, prefetch=3)


def test_old_keywords_beside_options_and_unknown_keywords_are_refused(tiny_slab):
    with pytest.raises(TypeError, match=r"options=LoadOptions\(...\) or the old keywords \(prefetch\), not both"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(), prefetch=3)
    with pytest.raises(TypeError, match=r"options=LoadOptions\(...\) or the old keywords \(prefetch\), not both"):
        runtime.load(tiny_slab, "cpu", 3, options=runtime.LoadOptions())
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefech'"):
        runtime.load(tiny_slab, "cpu", prefech=3)
    with pytest.raises(TypeError, match="positional"):
        runtime.load(tiny_slab, "cpu", runtime.LoadOptions())  # options are passed by name


def test_load_options_are_frozen_with_load_s_old_defaults():
    options = runtime.LoadOptions(prefetch=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.prefetch = 4
    assert dataclasses.replace(options, host="disk") == runtime.LoadOptions(prefetch=3, host="disk")
    assert {f.name: f.default for f in dataclasses.fields(runtime.LoadOptions)} == {
        "prefetch": 2, "host": "pinned", "stream": True, "verify": "eager", "trace": None, "compute": "bf16",
        "cuda_graphs": False, "fused_attention": True, "compile_blocks": False, "attention": "auto", "dtype": "bf16"}


def test_generic_mode_transformers_model_trains_streamed_like_resident(tmp_path):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_heads=4, dropout_rate=0.0)
    out = tmp_path / "t5.slab"
    write_rtn_slab(T5EncoderModel(cfg).eval(), [f"encoder.block.{i}" for i in range(3)], {}, out,
               PlainOptions(default_spec=QuantSpec(bits=8), family="generic"))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    grads = []
    for stream in (False, True):
        model = runtime.load(out, "cpu", options=runtime.LoadOptions(stream=stream, prefetch=1))
        params = runtime.add_lora(model, rank=2, targets=["q", "v"])
        with torch.no_grad():
            for p in params:
                p.add_(0.05)
        model.train()
        model.gradient_checkpointing_enable()  # transformers' own switch, routed to the streamed blocks
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
        grads.append({n: p.grad for n, p in runtime.lora_parameters(model).items()})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 12
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("config, refusal", [
    ({"num_layers": 200_000}, "builds far more than the 112 tensors"),
    ({"attention_head_dim": "wide"}, "cannot be built from the recorded config"),
])
def test_a_hostile_config_is_refused_before_it_can_fill_memory(tiny_slab, tmp_path, config, refusal):
    """The audit's case: num_layers 200000 in the manifest made `squareq train` build for 300 s past 5.4 GB."""
    import json
    import shutil

    from squareq.models import ModelError
    from squareq.slab.signature import signature_from_shapes

    slab = shutil.copytree(tiny_slab, tmp_path / "hostile.slab")
    m = json.loads((slab / "manifest.json").read_text())
    m["model"]["config"].update(config)
    shapes = [(f"{l['name']}.weight", l["shape"]) for l in m["layers"]]
    shapes += [(f"{b['name']}.{p['name']}", p["shape"]) for b in m["blocks"] for p in b["params"]]
    shapes += [(r["name"], r["shape"]) for r in m["resident"]]
    # a consistent edit: the signature recomputed, so only the build itself can notice
    m["model"]["signature"] = signature_from_shapes(m["model"]["class_name"], m["model"]["config"], shapes)
    (slab / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ModelError, match=refusal) as info:
        runtime.load(slab, "cpu")
    assert str(slab / "manifest.json") in str(info.value)


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-hunyuan-video"])
def test_a_video_plan_counts_the_windows_frames(tmp_path, name):
    """A video family's plan is made for the run's longest window: its tokens grow with its latent frames (1 + (F - 1)
    / 4), and without frames it keeps the family's default length; the negative control: an image slab ignores
    frames."""
    from tests.train.tiny_run import w8_tiny_slab

    slab = w8_tiny_slab(tmp_path / f"{name}.slab", name)
    text = 16 if name == "tiny-hunyuan-video" else 0  # HunyuanVideo's text tokens ride in the block stream
    one, nine, default = (runtime.plan(slab, resolution=64, text_tokens=16, frames=f) for f in (1, 33, None))
    assert one.tokens - text == (64 // 16) ** 2 and nine.tokens - text == 9 * (64 // 16) ** 2
    assert default.tokens - text == (21 if name == "tiny-wan" else 9) * (64 // 16) ** 2
    assert nine.checkpoints > 4 * one.checkpoints and nine.peak_reserved > one.peak_reserved
    flux = w8_tiny_slab(tmp_path / "flux.slab")
    assert runtime.plan(flux, resolution=64, text_tokens=16, frames=33).tokens == (64 // 16) ** 2 + 16
