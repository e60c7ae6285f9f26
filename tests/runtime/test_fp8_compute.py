"""FP8 compute (LoadOptions(compute=...)): streamed equals resident within the mode, the forward really runs
through torch._scaled_mm, it stays close to bf16, and the mode is settled and refused where it cannot run."""
import pytest
import torch

from squareq import runtime
from squareq.runtime import compute as compute_mode
from squareq.runtime.compute import ComputeError, resolve_compute

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def _run(slab, compute, stream, k=2):
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=stream, prefetch=k, compute=compute))
    with_lora(model)
    return step(model, inputs("cpu"), checkpointing=stream)


@pytest.fixture(scope="module")
def fp8_resident(tiny_slab):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SQUAREQ_KERNELS", "torch")
        return _run(tiny_slab, "fp8", stream=False)


@pytest.mark.parametrize("k", [1, 2])
def test_fp8_streamed_step_equals_fp8_resident(tiny_slab, fp8_resident, k):
    assert_same(_run(tiny_slab, "fp8", stream=True, k=k), fp8_resident)


def test_fp8_forward_goes_through_scaled_mm_and_bf16_does_not(tiny_slab, monkeypatch):
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compute="bf16"))
    with torch.no_grad():
        model(**inputs("cpu"), return_dict=False)
    assert calls == []  # negative control: bf16 compute never quantizes an input
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compute="fp8"))
    assert runtime.runtime_of(model).compute == "fp8"
    with torch.no_grad():
        model(**inputs("cpu"), return_dict=False)
    layers = sum(isinstance(m, runtime.QuantLinear) for m in model.modules())
    assert len(calls) >= layers // 2  # the modulation layers (one row per image) may take the fused path


def test_calls_of_few_rows_stay_bf16(tiny_slab, monkeypatch):
    """FLUX's modulation layers take one row per sample: under FP8 compute they run in bf16 (kernels/fp8.py
    FP8_MIN_ROWS), so no _scaled_mm sees fewer rows than that. Negative control: with the limit at 1 the modulation's
    calls go through _scaled_mm."""
    from squareq.kernels import fp8 as fp8_kernels

    def scaled_mm_rows() -> list[int]:
        rows, real = [], torch._scaled_mm

        def counting(*args, **kwargs):
            rows.append(args[0].shape[0])
            return real(*args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "_scaled_mm", counting)
            model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compute="fp8"))
            with torch.no_grad():
                model(**inputs("cpu"), return_dict=False)
        return rows

    rows = scaled_mm_rows()
    assert rows and min(rows) >= fp8_kernels.FP8_MIN_ROWS
    monkeypatch.setattr(fp8_kernels, "FP8_MIN_ROWS", 1)
    assert min(scaled_mm_rows()) == inputs("cpu")["hidden_states"].shape[0]  # the modulation: a row per sample


def test_fp8_stays_close_to_bf16_and_is_not_bf16(tiny_slab, fp8_resident):
    bf16 = _run(tiny_slab, "bf16", stream=False)
    out8, grads8 = fp8_resident
    out, grads = bf16
    rel = ((out8.float() - out.float()).pow(2).mean() / out.float().pow(2).mean()).item()
    assert 0 < rel < 1e-2
    flat8 = torch.cat([g.flatten() for g in grads8.values()])
    flat = torch.cat([grads[n].flatten() for n in grads8])
    assert torch.nn.functional.cosine_similarity(flat8, flat, dim=0) > 0.99


def test_auto_is_bf16_on_the_cpu(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compute="auto"))
    rt = runtime.runtime_of(model)
    assert rt.compute == "bf16" and "no FP8 tensor cores" in rt.compute_reason
    assert not rt.scratch.fp8


def _gpu(monkeypatch, capability, name="NVIDIA Test GPU"):
    monkeypatch.setattr(compute_mode, "_capability", lambda device: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_auto_is_fp8_only_where_there_are_fp8_tensor_cores_and_bf16_when_the_default_is_turned_off(monkeypatch):
    _gpu(monkeypatch, (9, 0))
    mode, why = resolve_compute("auto", "cuda:0")
    assert mode == "fp8" and "has FP8 tensor cores" in why
    assert resolve_compute("fp8", "cuda:0")[0] == "fp8"
    _gpu(monkeypatch, (8, 9))
    assert resolve_compute("auto", "cuda:0")[0] == "fp8"
    monkeypatch.setattr(compute_mode, "FP8_BY_DEFAULT", False)
    mode, why = resolve_compute("auto", "cuda:0")
    assert mode == "bf16" and "--compute fp8 uses them" in why
    assert resolve_compute("fp8", "cuda:0")[0] == "fp8"
    _gpu(monkeypatch, (8, 0))
    monkeypatch.setattr(compute_mode, "FP8_BY_DEFAULT", True)
    mode, why = resolve_compute("auto", "cuda:0")
    assert mode == "bf16" and "no FP8 tensor cores" in why


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    _gpu(monkeypatch, (8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ComputeError, match="A100.*no FP8 tensor cores.*choose compute bf16 or auto"):
        resolve_compute("fp8", "cuda:0")
    assert resolve_compute("bf16", "cuda:0")[0] == "bf16"  # negative control: bf16 runs anywhere


def test_an_unknown_mode_is_refused(tiny_slab):
    with pytest.raises(ComputeError, match="compute='fp16': choose one of bf16, fp8, auto"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compute="fp16"))


def test_the_memory_plan_counts_the_fp8_scratch(tiny_slab):
    bf16 = runtime.plan(tiny_slab, resolution=128, text_tokens=16, compute="bf16")
    fp8 = runtime.plan(tiny_slab, resolution=128, text_tokens=16, compute="fp8")
    assert fp8.scratch > bf16.scratch and fp8.peak_allocated - bf16.peak_allocated == fp8.scratch - bf16.scratch


def test_fp8_input_gradients_stay_close_to_bf16_s_and_go_through_scaled_mm(tiny_slab, fp8_resident, monkeypatch):
    """With compute.FP8_BACKWARD the frozen layers' input gradients are FP8 products too: the LoRA gradients stay
    close to the bf16 backward's (the same FP8 forward), the streamed step still equals the resident one, and the
    backward's _scaled_mm calls are there (the negative control: without it, only the forward's)."""
    def counted():
        calls = []
        real = torch._scaled_mm
        monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
        return calls

    calls = counted()
    _, grads_bf16_backward = _run(tiny_slab, "fp8", stream=False)
    forward_only = len(calls)
    monkeypatch.setattr(compute_mode, "FP8_BACKWARD", True)
    calls.clear()
    out8, grads8 = resident = _run(tiny_slab, "fp8", stream=False)
    assert len(calls) > forward_only
    flat8 = torch.cat([g.flatten() for g in grads8.values()])
    flat = torch.cat([grads_bf16_backward[n].flatten() for n in grads8])
    assert not torch.equal(flat8, flat)
    assert torch.nn.functional.cosine_similarity(flat8, flat, dim=0) > 0.999
    assert_same(_run(tiny_slab, "fp8", stream=True), resident)


def test_the_fp8_input_gradient_is_the_product_of_its_quantized_operands():
    from squareq.kernels.fp8 import fp8_input_grad
    from squareq.quant.fp8_rows import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(0)
    codes, scales = quantize_rows(torch.randn(32, 64, generator=g) * torch.rand(32, 1, generator=g))
    grad = torch.randn(3, 5, 32, generator=g).to(torch.bfloat16)
    got = fp8_input_grad(grad, (codes, scales))
    assert got.shape == (3, 5, 64) and got.dtype == torch.bfloat16
    gq, gs = quantize_rows(grad.reshape(-1, 32).float() * scales[None, :])
    want = ((gq.float() * gs[:, None]) @ codes.float()).view(3, 5, 64)  # the channel scales folded into the gradient
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-6)
    exact = grad.float() @ dequantize_rows(codes, scales)
    rel = float((got.float() - exact).pow(2).sum() / exact.pow(2).sum())
    assert 0 < rel < 2e-3  # E4M3's 3 mantissa bits on the gradient


def test_the_fp8_gradient_converters_are_prepared_once_per_block_and_slot(tiny_slab, monkeypatch):
    """The runtime binds each streamed block's layers from a plan made once per block and slot: later steps prepare
    nothing again, the FP8 input gradient's converters included (a fresh one per bind would launch through Triton's
    dispatcher every time)."""
    monkeypatch.setattr(compute_mode, "FP8_BACKWARD", True)
    prepared = []
    real = runtime.QuantLinear.prepared

    def counting(self, qw):
        prepared.append(real(self, qw))
        return prepared[-1]

    monkeypatch.setattr(runtime.QuantLinear, "prepared", counting)
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=True, prefetch=2, compute="fp8"))
    with_lora(model)
    step(model, inputs("cpu"), checkpointing=True)
    first = len(prepared)
    assert first > 0 and any(grad is not None for _, _, grad in prepared)  # the int layers' transposed converters
    step(model, inputs("cpu"), checkpointing=True)
    assert len(prepared) == first
