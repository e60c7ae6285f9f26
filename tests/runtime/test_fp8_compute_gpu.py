"""FP8 compute on CUDA (Triton operand kernels, torch._scaled_mm): streamed equals resident bit for bit, and the
result stays close to bf16 compute."""
import pytest
import torch

from squareq import runtime

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def deterministic():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):
        yield


def _run(slab, compute, stream, k=2):
    model = runtime.load(slab, "cuda", options=runtime.LoadOptions(stream=stream, prefetch=k, compute=compute))
    with_lora(model)
    try:
        return [step(model, inputs("cuda"), checkpointing=stream, autocast=True) for _ in range(2)]
    finally:
        if stream:
            runtime.runtime_of(model).close()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores")
def test_fp8_on_cuda_streamed_equals_resident_and_stays_close_to_bf16(tiny_slab):
    resident = _run(tiny_slab, "fp8", stream=False)
    for k in (1, 3):
        for got in _run(tiny_slab, "fp8", stream=True, k=k):
            assert_same(got, resident[0])
    out8 = resident[0][0].float()
    out = _run(tiny_slab, "bf16", stream=False)[0][0].float()
    rel = ((out8 - out).pow(2).mean() / out.pow(2).mean()).item()
    assert 0 < rel < 1e-2
    fp8_cores = torch.cuda.get_device_capability() >= (8, 9)
    auto = runtime.runtime_of(runtime.load(tiny_slab, "cuda",
                                           options=runtime.LoadOptions(stream=False, compute="auto"))).compute
    assert auto == ("fp8" if fp8_cores else "bf16")  # auto: FP8 where there are FP8 tensor cores
