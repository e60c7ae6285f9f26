"""The cache's encoders within the run's VRAM budget: a text encoder that does not fit is streamed block by block,
never loaded whole, and gives the entries the whole encoder gives; one that fits stays whole (the negative control);
a budget nothing fits is one sentence naming the smallest that works."""
import pytest
import torch

from squareq.models import BUILTIN_MODELS, load_builtin
from squareq.runtime.module_stream import largest_block_list
from squareq.sizes import format_size_up
from squareq.sources.encoder_placement import (
    FIXED,
    EncoderRun,
    PlacementError,
    module_bytes,
    plan_placement,
    streamed_bytes,
)
from squareq.sources.encoders import open_encoders

from ..models.tiny_folders import write_pipeline

pytestmark = pytest.mark.usefixtures("torch_kernels")

CAPTIONS = ["a red square on a grey floor", "two blue circles", "", "sks, studio portrait"]
TOKENS, PIXELS = 16, 64 * 64
STREAM_HANDLE = "_squareq_module_stream"


def _streamed(module) -> bool:
    return STREAM_HANDLE in module.__dict__


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    # text encoders deeper than the two blocks a streamed encoder keeps on the device
    return {name: write_pipeline(name, root / name, text_layers=4)
            for name in ("tiny-flux", "tiny-flux2", "tiny-qwen-image", "tiny-wan")}


def _family_and_config(name):
    if name == "tiny-flux2":
        from ..models.tiny_folders import build_pipeline

        return "flux2", build_pipeline("tiny-flux2").transformer.config
    return BUILTIN_MODELS[name][0], load_builtin(name)[0].config


def _encode(source, family, config, budget):
    run = EncoderRun(budget=budget, tokens=TOKENS, pixels=PIXELS)
    with open_encoders(source, torch.device("cpu"), family, config, run) as enc:
        pipe = enc.pipeline
        streamed = {n: _streamed(getattr(pipe, n)) for n in ("text_encoder", "text_encoder_2")
                    if getattr(pipe, n, None) is not None}
        return enc.placement, streamed, enc.encode_prompts(CAPTIONS, TOKENS)


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-flux2", "tiny-qwen-image", "tiny-wan"])
def test_an_encoder_over_the_budget_streams_and_gives_the_same_entries(name, folders):
    family, config = ("flux", None) if name == "tiny-flux" else _family_and_config(name)
    source = str(folders[name])
    whole, was_streamed, expected = _encode(source, family, config, None)
    assert whole.streamed == () and not any(was_streamed.values())

    # one byte short of what the encoders need whole: the largest text encoder streams, the rest stays whole
    placement, was_streamed, got = _encode(source, family, config, whole.expected - 1)
    largest = max((n for n in whole.sizes if n != "vae"), key=whole.sizes.get)
    assert placement.streamed == (largest,) and was_streamed[largest]
    assert placement.expected <= whole.expected - 1 < whole.expected
    assert "stream block by block" in placement.describe()
    for a, b in zip(expected, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)

    # the negative control: a budget that holds everything leaves every encoder whole
    placement, was_streamed, _ = _encode(source, family, config, whole.expected)
    assert placement.streamed == () and not any(was_streamed.values())


def _deep_parts(layers=4):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from squareq.models.tiny_pipeline import build_tiny_vae, tiny_clip_config, tiny_t5_config

    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(**{**tiny_clip_config(100, 32), "num_hidden_layers": layers}))
    t5 = T5EncoderModel(T5Config(**{**tiny_t5_config(100, 64), "num_layers": layers}))
    return {"vae": build_tiny_vae(latent_channels=4), "text_encoder": clip, "text_encoder_2": t5}


def test_a_streamed_encoder_needs_its_outer_tensors_and_two_blocks_on_the_device():
    t5 = _deep_parts()["text_encoder_2"]
    blocks = list(t5.get_submodule(largest_block_list(t5)))
    per_block = module_bytes(blocks[0], torch.bfloat16)
    outer = module_bytes(t5, torch.bfloat16) - sum(module_bytes(b, torch.bfloat16) for b in blocks)
    assert len(blocks) == 4 and streamed_bytes(t5, torch.bfloat16) == outer + 2 * per_block
    assert module_bytes(t5, torch.bfloat16) * 2 == module_bytes(t5, torch.float32)


def test_a_two_block_encoder_is_never_streamed():
    """With two device slots, streaming an encoder of two blocks would save nothing."""
    parts = _deep_parts(layers=2)
    cpu = torch.device("cpu")
    whole = plan_placement(parts, None, cpu, torch.bfloat16, TOKENS, PIXELS)
    with pytest.raises(PlacementError, match="even with nothing streamed"):
        plan_placement(parts, whole.expected - 1, cpu, torch.bfloat16, TOKENS, PIXELS)


def test_a_budget_nothing_fits_names_the_smallest_that_works():
    parts = _deep_parts()
    cpu = torch.device("cpu")
    with pytest.raises(PlacementError) as caught:
        plan_placement(parts, FIXED, cpu, torch.bfloat16, TOKENS, PIXELS, flag="--vram-budget")
    message = str(caught.value)
    assert message.count(". ") == 0 and message.startswith("--vram-budget ")
    assert "text_encoder_2 and text_encoder streamed" in message  # the larger first
    least = plan_placement(parts, None, cpu, torch.bfloat16, TOKENS, PIXELS)
    streamed_all = least.expected - sum(least.sizes[n] - least.streamed_sizes[n] for n in least.streamed_sizes)
    assert f"give --vram-budget at least {format_size_up(streamed_all)}" in message
    # the named size is enough: planning within it streams both text encoders and fits; a byte less is refused
    placement = plan_placement(parts, streamed_all, cpu, torch.bfloat16, TOKENS, PIXELS)
    assert set(placement.streamed) == {"text_encoder", "text_encoder_2"} and placement.expected == streamed_all
    with pytest.raises(PlacementError):
        plan_placement(parts, streamed_all - 1, cpu, torch.bfloat16, TOKENS, PIXELS)


def test_streamed_encoders_are_released_on_exit_even_after_an_error():
    from types import SimpleNamespace

    from squareq.sources.encoder_placement import placed

    parts = _deep_parts()
    cpu = torch.device("cpu")
    whole = plan_placement(parts, None, cpu, torch.float32, TOKENS, PIXELS)
    owner = SimpleNamespace(**parts)
    with pytest.raises(RuntimeError, match="the caption batch failed"):
        with placed(owner, list(parts), cpu, torch.float32, EncoderRun(whole.expected - 1, TOKENS, PIXELS)) as p:
            assert p.streamed == ("text_encoder_2",) and _streamed(owner.text_encoder_2)
            raise RuntimeError("the caption batch failed")
    assert not _streamed(owner.text_encoder_2)  # its pinned blobs and slots are gone, not waiting for a collection
