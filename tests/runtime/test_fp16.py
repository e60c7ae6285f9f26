"""fp16 runs (LoadOptions(dtype="fp16"), for GPUs without bf16): streamed equals resident bit for bit, the base layers
really compute in fp16, a step stays close to the bf16 one, and the type is settled and refused where it cannot run."""
import pytest
import torch
import torch.nn.functional as F

from squareq import runtime
from squareq.runtime import compute as compute_mode
from squareq.runtime.compute import ComputeError, resolve_dtype

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def _run(slab, dtype, stream, k=2):
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=stream, prefetch=k, dtype=dtype))
    with_lora(model)
    activations = torch.float16 if dtype == "fp16" else torch.bfloat16
    return step(model, inputs("cpu", dtype=activations), checkpointing=stream, autocast=activations)


@pytest.mark.parametrize("k", [1, 2])
def test_fp16_streamed_step_equals_fp16_resident(tiny_slab, k):
    assert_same(_run(tiny_slab, "fp16", stream=True, k=k), _run(tiny_slab, "fp16", stream=False))


def test_fp16_base_products_are_fp16_and_bf16_ones_are_not(tiny_slab, monkeypatch):
    """Every quantized layer's matmul reads fp16 weights in an fp16 run; in a bf16 run (the negative control) none
    does."""
    seen = []
    real = F.linear

    def recording(x, weight, bias=None):
        seen.append(weight.dtype)
        return real(x, weight, bias)

    monkeypatch.setattr(F, "linear", recording)
    for dtype, want in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        seen.clear()
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=True, dtype=dtype))
        assert runtime.runtime_of(model).dtype == dtype
        with torch.no_grad(), torch.autocast("cpu", dtype=want):
            model(**inputs("cpu", dtype=want), return_dict=False)
        base = [d for d in seen if d in (torch.bfloat16, torch.float16)]
        assert base and all(d == want for d in base), (dtype, set(base))


def test_fp16_step_is_far_closer_to_fp32_than_bf16_is(tiny_slab, monkeypatch):
    """The same step in fp16, in bf16 and in fp32 (the reference; the same effective weights): fp16's output and LoRA
    gradients sit far closer to fp32's than bf16's do, its 10-bit mantissa against bf16's 7. The bf16 step is the
    negative control that must not pass the fp16 bound."""
    monkeypatch.setitem(compute_mode.DTYPES, "fp32", torch.float32)
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=True, dtype="fp32"))
    with_lora(model)
    ref_out, ref_grads = step(model, inputs("cpu", dtype=torch.float32), checkpointing=True)

    def errors(result):
        out, grads = result
        rel = float((out.float() - ref_out).pow(2).mean() / ref_out.pow(2).mean())
        a = torch.cat([grads[n].flatten() for n in sorted(grads)])
        b = torch.cat([ref_grads[n].flatten() for n in sorted(grads)])
        return rel, float(F.cosine_similarity(a, b, dim=0))

    rel16, cos16 = errors(_run(tiny_slab, "fp16", stream=True))
    relb, cosb = errors(_run(tiny_slab, "bf16", stream=True))
    assert rel16 < 1e-4 and cos16 > 0.9999, (rel16, cos16)
    assert rel16 < relb / 100 and not (relb < 1e-4 and cosb > 0.9999), (rel16, relb, cosb)


def test_dtype_auto_is_fp16_only_before_ampere(monkeypatch):
    assert resolve_dtype("auto", "cpu")[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(compute_mode, "_capability", lambda device: (7, 5))
    dtype, why = resolve_dtype("auto", "cuda:0")
    assert dtype == "fp16" and "Tesla T4 (compute capability 7.5) has no bf16" in why
    monkeypatch.setattr(compute_mode, "_capability", lambda device: (8, 0))
    assert resolve_dtype("auto", "cuda:0")[0] == "bf16"  # negative control: Ampere has bf16
    assert resolve_dtype("fp16", "cuda:0") == ("fp16", "asked for")
    with pytest.raises(ComputeError, match="dtype='fp32': choose one of bf16, fp16, auto"):
        resolve_dtype("fp32", "cpu")


def test_fp8_compute_in_an_fp16_run_is_refused(tiny_slab):
    with pytest.raises(ComputeError, match="fp8 compute runs in bf16 runs only"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(compute="fp8", dtype="fp16"))
