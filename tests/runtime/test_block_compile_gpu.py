"""The streamed blocks under torch.compile with inductor on a GPU, with and without CUDA graphs: training steps and a
sampling forward agree with the eager streamed model (inductor fuses elementwise work, which rounds differently in
the last bits), every block is captured and replayed, and nothing compiles once the run's shapes are seen."""
import pytest
import torch

from squareq import runtime
from squareq.runtime import block_compile
from squareq.runtime.block_graphs import WARMUP

from .harness import inputs, step, train_steps

pytestmark = pytest.mark.gpu
STEPS = WARMUP + 4


@pytest.fixture(autouse=True)
def deterministic():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _distance(got, want) -> tuple[float, float]:
    """(the output's relative error, the least cosine of a LoRA gradient) of one step against another."""
    (out_g, grads_g), (out_w, grads_w) = got, want
    rel = ((out_g.float() - out_w.float()).norm() / out_w.float().norm()).item()
    cos = min(torch.nn.functional.cosine_similarity(grads_g[n].flatten().float(), grads_w[n].flatten().float(),
                                                     dim=0).item() for n in grads_w)
    return rel, cos


TOL = 2e-2  # inductor's fused elementwise work rounds differently in the last bits; six SGD steps at lr 0.5 add up


@pytest.mark.parametrize("graphs", [False, True], ids=["eager-launch", "cuda-graphs"])
@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_compiled_blocks_train_like_eager(tiny_slab, graphs, compute):
    if compute == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 compute needs FP8 tensor cores")
    torch._dynamo.reset()
    load = dict(prefetch=2, compute=compute, cuda_graphs=graphs)
    eager, _ = train_steps(runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(**load)), "cuda", STEPS,
                           autocast=True)
    # In FP8 a last-bit difference before a per-token quantization can move a value by a whole E4M3 step, so there the
    # bound is FP8's own distance from bf16 in the same steps, where that is wider
    bounds = [(TOL, 1 - TOL)] * STEPS
    if compute == "fp8":
        as_bf16 = runtime.LoadOptions(**{**load, "compute": "bf16"})
        bf16, _ = train_steps(runtime.load(tiny_slab, "cuda", options=as_bf16), "cuda", STEPS, autocast=True)
        bounds = [(max(TOL, rel), min(1 - TOL, cos)) for rel, cos in map(_distance, eager, bf16)]
    model = runtime.load(tiny_slab, "cuda", options=runtime.LoadOptions(compile_blocks=True, **load))
    try:
        compiled_before = block_compile.compile_seconds()
        got, stats = train_steps(model, "cuda", STEPS, autocast=True)
        assert block_compile.compile_seconds() > compiled_before
        for i, (g, e, (most_rel, least_cos)) in enumerate(zip(got, eager, bounds, strict=True)):
            rel, cos = _distance(g, e)
            assert rel <= most_rel and cos >= least_cos, (f"step {i}: output rel. error {rel:.2e} (at most "
                                                          f"{most_rel:.2e}), LoRA gradient cosine {cos:.5f} (at least "
                                                          f"{least_cos:.5f})")
        if graphs:
            blocks = len(runtime.runtime_of(model).manifest.blocks)
            assert all(s.failures == 0 for s in stats), [vars(s) for s in stats]
            last = stats[-1]
            assert (last.replays, last.eager, last.captures, last.ungraphed) == (2 * blocks, 0, 0, 0)
    finally:
        runtime.runtime_of(model).close()


def test_a_further_step_compiles_nothing(tiny_slab):
    """Once a run's shapes and grad modes are seen (training steps, then no-grad forwards), a further training step
    and a further forward compile nothing."""
    torch._dynamo.reset()
    model = runtime.load(tiny_slab, "cuda",
                         options=runtime.LoadOptions(prefetch=2, compile_blocks=True, cuda_graphs=True))
    train_steps(model, "cuda", STEPS, autocast=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**inputs("cuda"), return_dict=False)  # the no-grad forward of sampling, compiled here if not before
    seen = block_compile.compile_seconds()
    step(model, inputs("cuda", seed=STEPS), checkpointing=True, autocast=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**inputs("cuda"), return_dict=False)
    assert seen > 0 and block_compile.compile_seconds() == seen
