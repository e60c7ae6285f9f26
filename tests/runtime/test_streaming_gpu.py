"""The streaming equalities on CUDA, where the copy stream and events are real, plus flat reserved memory."""
import contextlib

import pytest
import torch

from squareq import runtime

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def deterministic():
    """Math attention: the flash/efficient backwards accumulate with atomics, so two identical runs may differ
    in the last bit, which would hide what these tests look for. cuDNN attention is off (it fails on the device
    image)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.fixture(scope="module")
def cuda_reference(tiny_slab):
    with contextlib.ExitStack() as stack:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
        model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(stream=False))
        with_lora(model)
        return step(model, inputs("cuda"), checkpointing=False, autocast=True)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("host", ["pinned", "shared", "disk"])
def test_streamed_equals_resident_on_cuda(tiny_slab, cuda_reference, k, host):
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=k, host=host))
    with_lora(model)
    try:
        for _ in range(3):
            assert_same(step(model, inputs("cuda"), checkpointing=True, autocast=True), cuda_reference)
        rt = runtime.runtime_of(model)
        stats = rt.step_stats()
        assert rt.streamer.copy_stream is not None and stats.copies > 0
        source = rt.streamer.host
        assert (source.staging[0] if host == "disk" else source.buffer).is_pinned()  # else copies are synchronous
    finally:
        runtime.runtime_of(model).close()


def test_no_grad_on_cuda_equals_resident(tiny_slab):
    resident = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2))
    batch = inputs("cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = resident(**batch, return_dict=False)[0]
        for _ in range(3):
            assert torch.equal(streamed(**batch, return_dict=False)[0], expected)


def test_permuted_execution_order_on_cuda(tiny_slab):
    models = [runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(stream=False)),
              runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2))]
    for m in models:
        blocks = m.single_transformer_blocks
        blocks[0], blocks[1] = blocks[1], blocks[0]
        with_lora(m)
    expected = step(models[0], inputs("cuda"), checkpointing=True, autocast=True)
    for _ in range(2):
        assert_same(step(models[1], inputs("cuda"), checkpointing=True, autocast=True), expected)
    assert runtime.runtime_of(models[1]).streamer.order == [0, 1, 3, 2]


def test_reserved_memory_is_flat_over_twenty_steps(tiny_slab):
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2))
    params = with_lora(model)
    opt = torch.optim.AdamW(params, lr=1e-4)
    model.enable_gradient_checkpointing()
    rt = runtime.runtime_of(model)
    batch = inputs("cuda")
    reserved, allocated = [], []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch, return_dict=False)[0]
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = rt.step_stats()
        reserved.append(stats.reserved)
        allocated.append(torch.cuda.memory_allocated())
    assert len(set(reserved[2:])) == 1, reserved
    assert len(set(allocated[2:])) == 1, allocated


def test_step_stats_measure_copy_wait_on_cuda(tiny_slab):
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=1))
    with_lora(model)
    rt = runtime.runtime_of(model)
    step(model, inputs("cuda"), checkpointing=True, autocast=True)
    stats = rt.step_stats()
    assert stats.copy_wait_s > 0 and stats.peak_allocated > 0 and stats.peak_reserved >= stats.peak_allocated


@pytest.mark.parametrize("host", ["pinned", "disk"])
def test_a_tuned_ring_with_resident_blocks_equals_resident_on_cuda(tiny_slab, cuda_reference, host):
    """StreamTuner on CUDA (event-timed blocks, timed copies): after it adds slots and keeps blocks on the GPU,
    a training step still equals the resident model's, and the kept blocks are no longer copied."""
    from squareq.runtime.residency import StreamTuner

    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, host=host))
    with_lora(model)
    rt = runtime.runtime_of(model)
    tuner = StreamTuner(model, prefetch=4, resident=2, budget_bytes=1 << 34)
    batch = inputs("cuda")
    with torch.no_grad():
        for i in range(2):
            tuner.before_step(i)
            model(**batch, return_dict=False)
            tuner.after_step(i)
    assert len(rt.resident_blocks) == 2 and tuner.plan.compute_s > 0
    rt.apply_stream_plan(type(tuner.plan)(slots=4, resident=(), copy_s=0.0, compute_s=0.0))
    rt.step_stats()
    assert_same(step(model, batch, checkpointing=True, autocast=True), cuda_reference)
    copied = rt.step_stats().bytes_copied
    assert 0 < copied <= 2 * sum(rt.streamer.block_sizes[b] for b in rt.streamer.order)
    rt.close()
