"""LoRA variants through PEFT's layers on the runtime's QuantLinear: streamed == resident bit for bit, PEFT's plain
LoRA == SquareQ's fast path bit for bit, DoRA starts from the real base weight."""
import pytest
import torch

from squareq import runtime
from squareq.models import tiny_flux_inputs
from squareq.runtime import LoraVariant

TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out")


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch, request):
    if "gpu" not in request.keywords:  # the GPU test runs the device's own kernels
        monkeypatch.setenv("SQUAREQ_KERNELS", "torch")


def step(slab, stream: bool, variant: LoraVariant | None, peft: bool = False, b_std: float = 0.05,
         device: str = "cpu"):
    """One training forward and backward (bf16 autocast, checkpointed): output and every LoRA gradient by name."""
    model = runtime.load(slab, device, options=runtime.LoadOptions(stream=stream, prefetch=2))
    runtime.add_lora(model, rank=4, alpha=2.0, targets=TARGETS, seed=1, variant=variant, peft=peft)
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(runtime.lora_parameters(model).items())):
            if name.endswith("lora_B.weight"):
                p.copy_(b_std * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    model.enable_gradient_checkpointing()
    model.train()
    torch.manual_seed(5)  # dropout's masks
    with torch.autocast(device, dtype=torch.bfloat16):
        inputs = {k: v.to(device) for k, v in tiny_flux_inputs(dtype=torch.float32).items()}
        out = model(**inputs, return_dict=False)[0]
    out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in runtime.lora_parameters(model).items()}
    runtime.runtime_of(model).close()
    return out.detach(), grads


@pytest.mark.parametrize("variant", [LoraVariant(dora=True), LoraVariant(rslora=True, dropout=0.2),
                                     LoraVariant(dora=True, dropout=0.2)], ids=["dora", "rslora+dropout", "dora+dropout"])
def test_streamed_equals_resident_bit_for_bit(tiny_slab, variant):
    resident, streamed = step(tiny_slab, False, variant), step(tiny_slab, True, variant)
    assert torch.equal(resident[0], streamed[0])
    assert resident[1].keys() == streamed[1].keys()
    assert all(torch.equal(resident[1][n], streamed[1][n]) for n in resident[1])
    assert all(g.abs().max() > 0 for g in streamed[1].values())
    if variant.dora:
        assert sum(n.endswith(".lora_magnitude_vector") for n in streamed[1]) == len(streamed[1]) // 3


def test_peft_plain_lora_equals_the_fast_path_bit_for_bit(tiny_slab):
    ours, peft = step(tiny_slab, True, None), step(tiny_slab, True, None, peft=True)
    assert torch.equal(ours[0], peft[0])
    assert ours[1].keys() == peft[1].keys() and all(torch.equal(ours[1][n], peft[1][n]) for n in ours[1])
    # negative control: a variant changes the numbers
    assert not torch.equal(ours[0], step(tiny_slab, True, LoraVariant(rslora=True))[0])


def test_dora_starts_from_the_real_weight_and_leaves_the_output_unchanged(tiny_slab):
    """Each magnitude is its layer's row norms, read from a streamed block brought into a slot (the QuantLinear's
    stand-in weight would give other numbers), so the untrained DoRA model computes what the base model does."""
    base = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    with torch.no_grad():
        expected = base(**tiny_flux_inputs(dtype=torch.bfloat16), return_dict=False)[0]
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=True, prefetch=1))
    runtime.add_lora(model, rank=4, targets=TARGETS, variant=LoraVariant(dora=True))
    layer = base.get_submodule("transformer_blocks.1.attn.to_q")
    magnitude = runtime.lora_parameters(model)["transformer_blocks.1.attn.to_q.lora_magnitude_vector"]
    assert torch.equal(magnitude, layer.dequantized_weight().float().norm(dim=1))
    stand_in = layer.weight.float().norm(dim=1)  # what PEFT would have read without exact_weight
    assert not torch.allclose(stand_in, magnitude)
    with torch.no_grad():
        got = model(**tiny_flux_inputs(dtype=torch.bfloat16), return_dict=False)[0]
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)


def test_rslora_scale_and_dropout_are_peft_s(tiny_slab):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    runtime.add_lora(model, rank=4, alpha=8.0, targets=["to_q"], variant=LoraVariant(rslora=True, dropout=0.25))
    wrapper = model.get_submodule("transformer_blocks.0.attn.to_q")
    assert wrapper.scaling["default"] == 8.0 / 2.0  # alpha / sqrt(rank), not alpha / rank
    assert wrapper.lora_dropout["default"].p == 0.25
    assert all(p.dtype == torch.float32 and p.requires_grad for p in runtime.lora_parameters(model).values())


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, LoraVariant(dora=True, dropout=0.2), LoraVariant(rslora=True)],
                         ids=["peft-plain", "dora+dropout", "rslora"])
def test_streamed_equals_resident_bit_for_bit_on_cuda(tiny_slab, variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.backends.cuda.enable_cudnn_sdp(False)
    with sdpa_kernel(SDPBackend.MATH):  # flash/efficient backwards accumulate with atomics
        resident = step(tiny_slab, False, variant, peft=variant is None, device="cuda")
        streamed = step(tiny_slab, True, variant, peft=variant is None, device="cuda")
    assert torch.equal(resident[0], streamed[0])
    assert all(torch.equal(resident[1][n], streamed[1][n]) for n in resident[1])
