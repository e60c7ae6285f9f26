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


@pytest.fixture(scope="module")
def deep_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("deep")
    # eight blocks: a ring of three page-locked buffers holds fewer than the whole encoder
    return {name: write_pipeline(name, root / name, text_layers=8) for name in ("tiny-flux", "tiny-qwen-image")}


def _file_ranges(path) -> list[tuple[int, int]]:
    """Where ``path`` is memory-mapped in this process (/proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _encode_watched(source, family, config, run, file):
    """The placement, the entries, the bytes held page-locked while the streamed encoder ran, and whether its blocks'
    tensors (those out of the device slots) are views of ``file`` between forwards."""
    from squareq.runtime.host.pinned import held_bytes

    seen, before = [], held_bytes()  # other tests' buffers may still wait for a collection
    with open_encoders(source, torch.device("cpu"), family, config, run) as enc:
        name = enc.placement.streamed[0]
        module = getattr(enc.pipeline, name)
        blocks = module.get_submodule(largest_block_list(module))
        blocks[0].register_forward_pre_hook(lambda *_: seen.append(held_bytes() - before))
        entries = enc.encode_prompts(CAPTIONS, TOKENS)
        ranges = _file_ranges(file)
        views = all(any(a <= p.data_ptr() < b for a, b in ranges) for p in blocks[:4].parameters())
        return enc.placement, entries, max(seen), views


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-qwen-image"])
def test_an_encoder_over_both_budgets_streams_from_its_file_with_few_blocks_pinned(name, deep_folders):
    """Over the VRAM budget and the host budget: the encoder's blocks are read from its memory-mapped file into a ring
    of page-locked buffers (at most RING_STAGES blocks pinned), and give the entries the whole encoder gives. The
    negative control: a host budget that holds the encoder keeps its blocks pinned whole."""
    family, config = ("flux", None) if name == "tiny-flux" else _family_and_config(name)
    source = str(deep_folders[name])
    whole, _, expected = _encode(source, family, config, None)
    budget = whole.expected - 1
    largest = max((n for n in whole.sizes if n != "vae"), key=whole.sizes.get)
    file = deep_folders[name] / largest / "model.safetensors"

    pinned, entries, held, _ = _encode_watched(source, family, config, EncoderRun(budget, TOKENS, PIXELS), file)
    assert pinned.streamed == (largest,) and pinned.ring == ()  # no host budget: pinned whole
    assert held >= pinned.pinned_sizes[largest] > pinned.ring_sizes[largest]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, entries, strict=True) for k in a)

    ring_needs = pinned.copies.get("vae", 0) + pinned.ring_sizes[largest]
    run = EncoderRun(budget, TOKENS, PIXELS, host_budget=ring_needs)
    ring, entries, held, views = _encode_watched(source, family, config, run, file)
    assert ring.ring == (largest,) and ring.host_expected <= ring_needs
    assert held <= ring.ring_sizes[largest] < pinned.pinned_sizes[largest]
    assert views, "the streamed encoder's blocks are not the file's pages"
    assert all(torch.equal(a[k], b[k]) for a, b in zip(expected, entries, strict=True) for k in a)
    assert "from its file through" in ring.describe()

    # a host budget below even the ring: one sentence naming the smallest that works
    with pytest.raises(PlacementError, match="give host_budget 1 B more"):
        _encode_watched(source, family, config, EncoderRun(budget, TOKENS, PIXELS, host_budget=ring_needs - 1), file)


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-qwen-image"])
def test_the_plan_from_configs_and_headers_is_what_loading_does(name, deep_folders):
    """A run's host plan is made before any weight loads (sources/encoder_files.py): the same streamed encoders, the
    same ring, pinned and ring sizes and the same copies as the loaded encoders are placed with."""
    from squareq.sources.encoder_files import planned_placement, read_encoder_files

    family, config = ("flux", None) if name == "tiny-flux" else _family_and_config(name)
    source = str(deep_folders[name])
    whole, _, _ = _encode(source, family, config, None)
    for host_budget in (None, 10**12, 1):
        run = EncoderRun(whole.expected - 1, TOKENS, PIXELS, host_budget=host_budget)
        planned = planned_placement(read_encoder_files(source), torch.device("cpu"), torch.float32, run)
        if host_budget == 1:  # refused as it loads, and already over the budget in the plan
            assert planned.host_expected > 1
            with pytest.raises(PlacementError):
                _encode_watched(source, family, config, run, deep_folders[name] / "x")
            continue
        loaded = _encode_watched(source, family, config, run, deep_folders[name] / "x")[0]
        for field in ("streamed", "ring", "pinned_sizes", "ring_sizes", "copies", "sizes"):
            assert getattr(planned, field) == getattr(loaded, field), field


def test_an_encoder_of_few_blocks_stays_pinned_since_a_ring_would_hold_as_much():
    from squareq.runtime.module_stream import RING_STAGES
    from squareq.sources.encoder_placement import check_host, plan_host

    parts = _deep_parts(layers=RING_STAGES)
    cpu = torch.device("cpu")
    whole = plan_placement(parts, None, cpu, torch.float32, TOKENS, PIXELS)
    streamed = plan_placement(parts, whole.expected - 1, cpu, torch.float32, TOKENS, PIXELS)
    assert "text_encoder_2" in streamed.streamed
    least = plan_host(streamed, parts, torch.float32, 0, {})
    assert least.ring == () and least.host_expected == sum(least.pinned_sizes.values())
    with pytest.raises(PlacementError, match="^host_budget leaves 0 B of host memory .* as loaded they hold"):
        check_host(least, 0)
    # the negative control: eight blocks go through the ring at the same budget
    deep = _deep_parts(layers=8)
    whole = plan_placement(deep, None, cpu, torch.float32, TOKENS, PIXELS)
    streamed = plan_placement(deep, whole.expected - 1, cpu, torch.float32, TOKENS, PIXELS)
    assert plan_host(streamed, deep, torch.float32, 0, {}).ring == ("text_encoder_2",)


def test_an_encoder_copied_as_it_loaded_counts_as_a_copy(monkeypatch):
    """A library that copies a file it was expected to map (transformers before 5 may) is noticed from the
    process's growth, and the plan counts the copy; a load that grew by what it should keeps the views."""
    from types import SimpleNamespace

    from squareq.sources import encoder_files
    from squareq.sources.encoder_files import as_loaded

    parts = _deep_parts(layers=8)
    owner, names = SimpleNamespace(**parts), ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    now = 100 << 30
    monkeypatch.setattr(encoder_files, "anonymous_memory", lambda: now)  # the process's memory after the load
    mapped = {"text_encoder_2": torch.float32}
    copies = module_bytes(parts["vae"], torch.float32) + module_bytes(parts["text_encoder"], torch.float32)
    assert as_loaded(mapped, now - copies, owner, names, torch.float32) == mapped
    grown = copies + module_bytes(parts["text_encoder_2"], torch.float32) + (256 << 20)
    assert as_loaded(mapped, now - grown, owner, names, torch.float32) == {}


def test_the_encoders_budget_on_a_gpu_keeps_within_a_capped_allocator(monkeypatch):
    """No budget given, on a GPU: the free memory plus what the allocator holds unused, within the allocator's cap
    (a benchmark's card on a larger GPU); negative control: no cap, the device's free memory counts whole."""
    from squareq.sources.encoder_placement import run_budget

    gb = 10**9
    share = [0.1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (100 * gb, 150 * gb))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index=None: share[0])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 6 * gb)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda index=None: 4 * gb)
    cuda = torch.device("cuda", 0)
    assert run_budget(None, cuda) == 15 * gb - 4 * gb
    assert run_budget(7 * gb, cuda) == 7 * gb  # a budget given is the budget
    share[0] = 1.0
    assert run_budget(None, cuda) == 100 * gb + 6 * gb - 4 * gb
