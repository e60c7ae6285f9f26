"""The streamed model equals the resident quantized model bit for bit: outputs, LoRA gradients, any ring size."""
import json
import os

import pytest
import torch

from squareq import runtime
from squareq.slab import SlabError

from .harness import assert_same, inputs, step, with_lora


@pytest.fixture(autouse=True)
def torch_kernels(request, monkeypatch):
    """The torch reference dequantizer (bit-identical to the Triton kernel, which tests/kernels checks), because
    the Triton interpreter makes a training step 30x slower; tests marked `triton` keep the kernel."""
    if "triton" not in request.keywords:
        monkeypatch.setenv("SQUAREQ_KERNELS", "torch")


@pytest.fixture(scope="module")
def reference(tiny_slab):
    """Output and LoRA gradients of the resident quantized model (no streaming, no checkpointing), computed with
    the torch reference dequantizer."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SQUAREQ_KERNELS", "torch")
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
        with_lora(model)
        return step(model, inputs("cpu"), checkpointing=False)


@pytest.mark.triton
def test_streamed_step_through_the_triton_kernel_equals_resident(tiny_slab, reference):
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    with_lora(model)
    assert_same(step(model, inputs("cpu"), checkpointing=True), reference)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_streamed_training_step_equals_resident(tiny_slab, reference, k):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=k))
    with_lora(model)
    assert_same(step(model, inputs("cpu"), checkpointing=True), reference)
    # a second step runs on the recorded order and prefetches; it must still be identical
    assert_same(step(model, inputs("cpu"), checkpointing=True), reference)


def test_resident_model_with_torch_checkpointing_equals_without(tiny_slab, reference):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    with_lora(model)
    assert_same(step(model, inputs("cpu"), checkpointing=True), reference)


def test_streamed_step_under_autocast_equals_resident(tiny_slab):
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    for m in (resident, streamed):
        with_lora(m)
    batch = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs("cpu").items()}
    assert_same(step(streamed, batch, checkpointing=True, autocast=True),
                step(resident, batch, checkpointing=False, autocast=True))


@pytest.mark.parametrize("k", [1, 3])
def test_no_grad_forward_streams_and_equals_resident(tiny_slab, k):
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=k))
    batch = inputs("cpu")
    with torch.no_grad():
        expected = resident(**batch, return_dict=False)[0]
        for _ in range(2):
            assert torch.equal(streamed(**batch, return_dict=False)[0], expected)
    stats = runtime.runtime_of(streamed).step_stats()
    blocks = len(runtime.runtime_of(streamed).manifest.blocks)
    # each pass copies every block once, and the second pass already prefetches k-1 blocks of a third
    assert stats.copies == 2 * blocks + k - 1 and stats.demand_loads == (1 if k > 1 else 2 * blocks)


def test_disk_host_equals_pinned(tiny_slab, reference):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, host="disk"))
    with_lora(model)
    try:
        assert_same(step(model, inputs("cpu"), checkpointing=True), reference)
    finally:
        runtime.runtime_of(model).close()


def _permute_blocks(model, order):
    blocks = model.transformer_blocks
    moved = [blocks[i] for i in order]
    for i, b in enumerate(moved):
        blocks[i] = b


def test_execution_order_differing_from_definition_order_is_learned(tiny_slab):
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    for m in (resident, streamed):
        _permute_blocks(m, [1, 0])  # the forward now runs slab block 1 before block 0
        with_lora(m)
    expected = step(resident, inputs("cpu"), checkpointing=True)
    rt = runtime.runtime_of(streamed)
    assert_same(step(streamed, inputs("cpu"), checkpointing=True), expected)
    assert rt.streamer.order == [1, 0, 2, 3]
    rt.step_stats()
    assert_same(step(streamed, inputs("cpu"), checkpointing=True), expected)
    stats = rt.step_stats()
    # every block but the first of the step is prefetched once the order is known
    assert stats.demand_loads <= 1, stats


@pytest.mark.parametrize("k", [2, 3])
def test_prefetch_hits_after_the_first_pass(tiny_slab, k):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=k))
    with_lora(model)
    rt = runtime.runtime_of(model)
    step(model, inputs("cpu"), checkpointing=True)
    rt.step_stats()
    step(model, inputs("cpu"), checkpointing=True)
    stats = rt.step_stats()
    n = len(rt.manifest.blocks)
    # Every block is needed forward and backward; at each turn (forward->backward, backward->next
    # forward) the ring still holds the k blocks needed first, so a step copies 2(n-k) blocks, all prefetched.
    assert stats.demand_loads == 0
    assert stats.copies == 2 * (n - k)


def test_streamed_training_without_checkpointing_is_refused(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    with_lora(model)
    with pytest.raises(RuntimeError, match="enable_gradient_checkpointing"):
        step(model, inputs("cpu"), checkpointing=False)


def test_corrupted_block_stops_before_the_first_step(tiny_slab, tmp_path):
    import shutil

    bad = tmp_path / "bad.slab"
    shutil.copytree(tiny_slab, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    data = bad / "slab.safetensors"
    with open(data, "r+b") as fh:
        fh.seek(0)
        header_len = int.from_bytes(fh.read(8), "little")
        offset = 8 + header_len + manifest["blocks"][1]["nbytes"] // 2 + manifest["blocks"][0]["nbytes"]
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SlabError, match=r"block 1 .*sha256"):
        runtime.load(bad, "cpu")


def test_memory_is_flat_over_twenty_steps(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    params = with_lora(model)
    opt = torch.optim.AdamW(params, lr=1e-3)
    rt = runtime.runtime_of(model)
    slot_ptrs = [s.buffer.data_ptr() for s in rt.streamer.slots]
    scratch_ptr = rt.scratch.buffer.data_ptr()
    batch = inputs("cpu")
    model.enable_gradient_checkpointing()
    rss = []
    for _ in range(20):
        out = model(**batch, return_dict=False)[0]
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rss.append(_rss_bytes())
    assert [s.buffer.data_ptr() for s in rt.streamer.slots] == slot_ptrs
    assert rt.scratch.buffer.data_ptr() == scratch_ptr
    assert len(rt.streamer.slots) == 2
    assert len(rt_binder_cache(model)) <= 2 * len(rt.manifest.blocks)
    assert max(rss[5:]) - rss[5] < 8 << 20, [r >> 20 for r in rss]


def rt_binder_cache(model):
    return runtime.runtime_of(model).streamer.bind.__self__._cache


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_trace_records_copies_and_blocks(tiny_slab, tmp_path):
    path = tmp_path / "trace.json"
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, trace=path))
    with_lora(model)
    step(model, inputs("cpu"), checkpointing=True)
    runtime.runtime_of(model).step_stats()
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert "copy block 0" in names and "forward block 0" in names and "backward block 0" in names
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")


def _no_grad_output(model):
    with torch.no_grad():
        return model(**inputs("cpu"), return_dict=False)[0]


def test_a_failed_disk_read_is_reported_and_the_ring_recovers(tiny_slab, tmp_path):
    import shutil

    slab = tmp_path / "copy.slab"
    shutil.copytree(tiny_slab, slab)
    data = slab / "slab.safetensors"
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(prefetch=1, host="disk"))
    expected = _no_grad_output(model)
    original = data.read_bytes()
    os.truncate(data, len(original) // 3)
    with pytest.raises(OSError, match="truncated"):
        _no_grad_output(model)
    with open(data, "r+b") as fh:
        fh.write(original)
    assert torch.equal(_no_grad_output(model), expected)
    runtime.runtime_of(model).close()


def test_an_interrupt_while_binding_does_not_wedge_the_ring(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=1))
    expected = _no_grad_output(model)
    streamer = runtime.runtime_of(model).streamer
    bind = streamer.bind

    def interrupted(*args):
        streamer.bind = bind
        raise KeyboardInterrupt

    streamer.bind = interrupted
    with pytest.raises(KeyboardInterrupt):
        _no_grad_output(model)
    assert torch.equal(_no_grad_output(model), expected)


def test_a_first_forward_under_inference_mode_does_not_break_training(tiny_slab, reference):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    with_lora(model)
    with torch.inference_mode():
        model(**inputs("cpu"), return_dict=False)
    assert_same(step(model, inputs("cpu"), checkpointing=True), reference)


def test_a_closed_runtime_refuses_to_stream(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, host="disk"))
    rt = runtime.runtime_of(model)
    rt.close()
    rt.close()  # a second close is harmless
    with pytest.raises(runtime.StreamError, match="load the slab again"):
        _no_grad_output(model)


def test_a_layer_whose_block_left_its_slot_refuses_to_run(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=1))
    _no_grad_output(model)  # with one slot, block 0 was evicted by the blocks after it
    layer = model.get_submodule("transformer_blocks.0.attn.to_q")
    with pytest.raises(RuntimeError, match="no weight bound"):
        layer.dequantized_weight()
