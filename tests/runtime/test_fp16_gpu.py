"""fp16 runs on a GPU (the Triton dequantization converted to fp16, CUDA graphs, torch.compile): streamed equals
resident bit for bit, graph replays equal eager steps bit for bit, the compiled blocks stay within inductor's
rounding of eager, and every step stays within fp16's reach of an fp32 step."""
import pytest
import torch

from squareq import runtime
from squareq.runtime import compute as compute_mode
from squareq.runtime.block_graphs import WARMUP

from .harness import assert_same, inputs, step, train_steps, with_lora

pytestmark = pytest.mark.gpu
STEPS = WARMUP + 3
FP16 = torch.float16


@pytest.fixture(autouse=True)
def deterministic():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _train(model):
    return train_steps(model, "cuda", STEPS, autocast=FP16, dtype=FP16)


def test_fp16_streamed_equals_resident_and_graphs_equal_eager(tiny_slab):
    resident = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(stream=False, dtype="fp16"))
    with_lora(resident)
    streamed = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, dtype="fp16"))
    with_lora(streamed)
    batch = inputs("cuda", dtype=FP16)
    assert_same(step(streamed, batch, checkpointing=True, autocast=FP16),
                step(resident, batch, checkpointing=False, autocast=FP16))
    eager, _ = _train(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, dtype="fp16")))
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, dtype="fp16", cuda_graphs=True))
    try:
        got, stats = _train(model)
        for g, e in zip(got, eager, strict=True):
            assert_same(g, e)
        assert stats[-1].replays > 0 and stats[-1].eager == 0 and all(s.failures == 0 for s in stats)
    finally:
        runtime.runtime_of(model).close()


def test_fp16_compiled_blocks_train_like_eager_and_near_fp32(tiny_slab, monkeypatch):
    torch._dynamo.reset()
    eager, _ = _train(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, dtype="fp16")))
    compiled, _ = _train(runtime.load(tiny_slab, "cuda",
                                      options=runtime.LoadOptions(prefetch=2, dtype="fp16", compile_blocks=True)))
    monkeypatch.setitem(compute_mode.DTYPES, "fp32", torch.float32)
    reference, _ = train_steps(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2, dtype="fp32")),
                               "cuda", STEPS, dtype=torch.float32)
    bf16, _ = train_steps(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(prefetch=2)), "cuda", STEPS,
                          autocast=True)

    def rel(a, b):
        return ((a[0].float() - b[0].float()).norm() / b[0].float().norm()).item()

    for i in range(STEPS):
        assert rel(compiled[i], eager[i]) < 2e-2, i
        # fp16 keeps three more mantissa bits than bf16: its step is far nearer the fp32 one (negative control: bf16)
        assert rel(eager[i], reference[i]) < rel(bf16[i], reference[i]) / 4, (i, rel(eager[i], reference[i]),
                                                                               rel(bf16[i], reference[i]))
