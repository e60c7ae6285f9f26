"""CUDA graphs per streamed block on a GPU: replays equal the eager streamed model bit for bit, step by step, in bf16
and FP8 compute, for training and sampling, and reserved memory stays flat once every graph is captured."""
import pytest
import torch

from squareq import runtime
from squareq.runtime.block_graphs import WARMUP
from squareq.runtime.blocks import RESIDENT

from .harness import assert_same, inputs, train_steps, with_lora

pytestmark = pytest.mark.gpu
STEPS = WARMUP + 4  # eager runs, the captures, then steps made of replays only


@pytest.fixture(autouse=True)
def deterministic():
    """Math attention: the flash/efficient backwards accumulate with atomics, so two identical runs may differ in the
    last bit. cuDNN attention is off (it fails on the device image)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _train(model):
    return train_steps(model, "cuda", STEPS, autocast=True)


@pytest.mark.parametrize("k,host,compute", [(1, "pinned", "bf16"), (2, "pinned", "bf16"), (3, "disk", "bf16"),
                                            (2, "pinned", "fp8")])
def test_cuda_graphs_equal_eager_step_by_step(tiny_slab, k, host, compute):
    load = dict(prefetch=k, host=host, compute=compute)
    if compute == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 compute needs FP8 tensor cores")
    eager, _ = _train(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(**load)))
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(cuda_graphs=True, **load))
    try:
        got, stats = _train(model)
        for g, e in zip(got, eager, strict=True):
            assert_same(g, e)
        blocks = len(runtime.runtime_of(model).manifest.blocks)
        assert sum(s.captures for s in stats) > 0 and all(s.failures == 0 for s in stats)
        last = stats[-1]  # every block's forward and backward replayed, nothing run eagerly
        assert (last.replays, last.eager, last.captures, last.ungraphed) == (2 * blocks, 0, 0, 0)
    finally:
        runtime.runtime_of(model).close()


def test_no_grad_sampling_under_cuda_graphs_equals_eager(tiny_slab):
    eager = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2))
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, cuda_graphs=True))
    batch = inputs("cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = eager(**batch, return_dict=False)[0]
        for _ in range(WARMUP + 2):
            assert torch.equal(model(**batch, return_dict=False)[0], expected)
    assert runtime.runtime_of(model).graphs.stats.replays > 0


def _keep_block_at(step: int, block: int = 1):
    """A ``before_step`` that keeps ``block`` on the device from step ``step`` on, as a StreamTuner plan does."""
    from squareq.runtime.residency import StreamPlan

    def before(model, i):
        if i == step:
            rt = runtime.runtime_of(model)
            rt.apply_stream_plan(StreamPlan(len(rt.streamer.slots), (block,), 0.0, 0.0))
    return before


@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_a_block_kept_mid_run_is_captured_at_once_and_trains_like_eager(tiny_slab, compute):
    """A block kept after the warm-up is captured at its first call on the device (no eager runs there), forward and
    recompute, and the graphed steps still equal the eager ones bit for bit."""
    if compute == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 compute needs FP8 tensor cores")
    steps, keep = STEPS + 2, _keep_block_at(WARMUP + 2)
    load = dict(prefetch=2, compute=compute)
    eager, _ = train_steps(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(**load)), "cuda", steps,
                           autocast=True, before_step=keep)
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(cuda_graphs=True, **load))
    try:
        got, stats = train_steps(model, "cuda", steps, autocast=True, before_step=keep)
        for g, e in zip(got, eager, strict=True):
            assert_same(g, e)
        graphs = runtime.runtime_of(model).graphs
        kept = [k for k, e in graphs.entries.items() if k[1] == 1 and k[2] == RESIDENT and e.replay is not None]
        assert len(kept) == 2  # its forward and its recompute + backward
        assert sum(s.at_once for s in stats[WARMUP + 2:]) >= 2 and sum(s.eager for s in stats[WARMUP + 2:]) == 0
        assert all(s.failures == 0 for s in stats)
    finally:
        runtime.runtime_of(model).close()


@pytest.mark.parametrize("compute,compiled", [("bf16", False), ("fp8", False), ("bf16", True)])
def test_sampling_blocks_in_new_slots_and_kept_are_captured_at_once_and_equal_eager(tiny_slab, compute, compiled):
    """Sampling with 3 slots: blocks visit new slots across steps, and a block is kept halfway; every replay's output
    equals the same model without graphs (bit for bit; within inductor's last bits for compiled blocks)."""
    if compute == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 compute needs FP8 tensor cores")
    if compiled:
        torch._dynamo.reset()  # the other tests' compiles count toward Dynamo's recompile limit
    load = dict(prefetch=3, compute=compute, compile_blocks=compiled)
    eager = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(**load))
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(cuda_graphs=True, **load))
    batch, keep = inputs("cuda"), _keep_block_at(2 * (WARMUP + 1))
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for i in range(4 * (WARMUP + 1)):
                keep(eager, i)
                keep(model, i)
                expected, got = eager(**batch, return_dict=False)[0], model(**batch, return_dict=False)[0]
                if compiled:
                    rel = ((got.float() - expected.float()).pow(2).mean() / expected.float().pow(2).mean()).item()
                    assert rel < 1e-4, f"step {i}: rel. error {rel:.2e}"
                else:
                    assert torch.equal(got, expected), f"step {i}"
        graphs = runtime.runtime_of(model).graphs
        assert graphs.stats.at_once > 0 and graphs.stats.failures == 0 and graphs.at_once
        assert any(k[2] == RESIDENT and e.replay is not None for k, e in graphs.entries.items())
    finally:
        runtime.runtime_of(model).close()
        runtime.runtime_of(eager).close()


def test_reserved_memory_is_flat_once_every_graph_is_captured(tiny_slab):
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, cuda_graphs=True))
    params = with_lora(model)
    opt = torch.optim.AdamW(params, lr=1e-4)
    model.enable_gradient_checkpointing()
    rt = runtime.runtime_of(model)
    reserved = []
    for i in range(STEPS + 5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**inputs("cuda", seed=i), return_dict=False)[0]
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rt.step_stats()
        reserved.append(torch.cuda.memory_reserved())
    assert rt.graphs.stats.failures == 0
    assert len(set(reserved[STEPS:])) == 1, reserved


def test_other_attention_backends_capture_again(tiny_slab):
    """The trainer turns cuDNN attention off when its backward fails: graphs captured with other backends allowed must
    not replay then, since they hold the attention kernel picked at their capture."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, cuda_graphs=True))
    batch = inputs("cuda")
    rt = runtime.runtime_of(model)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(WARMUP + 1):
            model(**batch, return_dict=False)
        keys = set(rt.graphs.entries)
        model(**batch, return_dict=False)
        assert set(rt.graphs.entries) == keys  # negative control: the same backends, the same graphs
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            model(**batch, return_dict=False)
        assert set(rt.graphs.entries) > keys


def test_a_capture_that_fails_leaves_the_step_correct_and_the_stream_as_it_was(tiny_slab):
    """A host sync inside a block is fine eagerly and illegal inside a capture: the capture fails, the block runs
    eagerly from then on, and the thread's current stream, the allocator and the random generator are as before
    (eager results equal; a random draw outside a graph works, which it did not while torch's capture epilogue was
    skipped)."""
    def sync(module, args, output):
        (output[0] if isinstance(output, tuple) else output).float().sum().item()

    eager, _ = _train(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2)))
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, cuda_graphs=True))
    model.transformer_blocks[0].norm1.register_forward_hook(sync)
    try:
        got, counts = _train(model)
        for g, e in zip(got, eager, strict=True):
            assert_same(g, e)
        assert sum(c.failures for c in counts) > 0
        assert sum(c.replays for c in counts) > 0  # the other blocks still replay
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.rand(8, device="cuda").isfinite().all()
    finally:
        runtime.runtime_of(model).close()
