"""cuDNN attention in FLUX.1's double and single blocks on a GPU (runtime/attention_choice.py): eager and compiled
blocks run with the gradient-layout guard give the LoRA gradients flash gives. The negative control:
eager blocks without the guard get wrong gradients, or cuDNN refuses the call, because torch caches the backward graph
by query, key and value alone. Each case has its own sequence length, so no case reuses another's cached graph."""
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from squareq.runtime import attention_choice

pytestmark = pytest.mark.gpu
TOL = 2e-2  # two attention kernels in bf16: about 1e-3 apart on the device (docs/train.md, "Edit pairs")


@pytest.fixture(autouse=True)
def cudnn_on(monkeypatch):
    if torch.cuda.get_device_capability() < attention_choice.AUTO_CAPABILITY:
        pytest.skip("cuDNN attention is preferred from compute capability 9.0 (runtime/attention_choice.py)")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(attention_choice, "_cudnn_failed", False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def _flux(compiled: bool):
    """FLUX.1-dev's transformer at its widths, with one double and one single block."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True).to("cuda", torch.bfloat16)
    model.requires_grad_(False)
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    for block in blocks:
        block.attn.to_q.weight.requires_grad_(True)
        if compiled:
            block.compile()
    return model, blocks


def _to_q_grads(model, blocks, forward, image_tokens: int) -> list[torch.Tensor]:
    side = int(image_tokens ** 0.5)
    ids = torch.zeros(side, side, 3, device="cuda")
    ids[..., 1] = torch.arange(side, device="cuda")[:, None]
    ids[..., 2] = torch.arange(side, device="cuda")[None, :]
    g = torch.Generator(device="cuda").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    for block in blocks:
        block.attn.to_q.weight.grad = None
    scalar = lambda value: torch.full((1,), value, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    out = forward(hidden_states=rand(1, side * side, 64), encoder_hidden_states=rand(1, 512, 4096),
                  pooled_projections=rand(1, 768), timestep=scalar(0.5), guidance=scalar(3.5),
                  img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(512, 3, device="cuda")).sample
    (out.float() - 1).pow(2).mean().backward()
    torch.cuda.synchronize()
    return [block.attn.to_q.weight.grad.float() for block in blocks]


def _errors(compiled: bool, guarded: bool, image_tokens: int) -> list[float]:
    """Each block's to_q gradient with cuDNN first through ``preferring_cudnn``, relative to flash's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # the reference: an eager twin (the same seed) with flash alone; torch's order may put cuDNN first on this GPU, and
    # a compiled block keeps the kernel it was traced with whatever the switches say later
    reference, reference_blocks = _flux(compiled=False)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        want = _to_q_grads(reference, reference_blocks, reference.forward, image_tokens)
    del reference, reference_blocks
    model, blocks = _flux(compiled)
    if guarded:
        rt = types.SimpleNamespace(prefer_cudnn=True, compiled=compiled, device=torch.device("cuda"))
        forward = attention_choice.preferring_cudnn(model.forward, rt)
    else:  # cuDNN first as preferring_cudnn puts it, without the guard
        first = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

        def forward(**kwargs):
            with sdpa_kernel(first, set_priority=True):
                return model.forward(**kwargs)
    got = _to_q_grads(model, blocks, forward, image_tokens)
    return [((a - b).norm() / b.norm()).item() for a, b in zip(got, want)]


def test_eager_blocks_with_the_guard_match_flash():
    assert max(_errors(compiled=False, guarded=True, image_tokens=4096)) < TOL


def test_compiled_blocks_with_the_guard_match_flash():
    """Without it a compiled FLUX.1 block stopped on an illegal memory access too (H200, torch 2.11)."""
    assert max(_errors(compiled=True, guarded=True, image_tokens=3600)) < TOL


def test_negative_control_eager_blocks_without_the_guard_go_wrong():
    """In a process of its own: a read outside memory would leave this one's CUDA context unusable."""
    code = ("import json; from tests.runtime.test_attention_layout_gpu import _errors; "
            "print(json.dumps(_errors(compiled=False, guarded=False, image_tokens=3136)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    if proc.returncode:  # cuDNN's execute failed, or the read went outside memory
        assert "mha_graph" in proc.stderr or "illegal memory access" in proc.stderr, proc.stderr[-2000:]
        return
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert errors[0] > 0.5, (f"the double block's gradient is right without the guard ({errors}): torch's cuDNN graph "
                             "cache may now key on the gradient's strides, and the guard in "
                             "runtime/attention_choice.py could go")
