"""Activation offloading on a GPU (issue 62): the checkpointed inputs copied out and back on a stream of their own
give the same output and LoRA gradients, bit for bit, as kept on the device, over several steps (the copies are
ordered against the compute that writes and reads them), and nothing is left in the stash."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from squareq import runtime
from squareq.runtime.activation_offload import ActivationOffload

from .harness import assert_same, train_steps

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture
def deterministic():
    """The GPU's fused attention backward adds with atomics: two runs of the same kept steps differ in the last bits
    (measured on an H200, 2026-11-29), so bit-for-bit needs the math attention and deterministic kernels."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.use_deterministic_algorithms(False)


def test_offloaded_steps_match_kept_ones_on_a_gpu(tiny_slab, cuda, deterministic):
    kept, _ = train_steps(runtime.load(tiny_slab, cuda), cuda, 3, autocast=True)
    model = runtime.load(tiny_slab, cuda)
    offload = runtime.runtime_of(model).activation_offload = ActivationOffload(cuda, min_bytes=0)
    moved, _ = train_steps(model, cuda, 3, autocast=True)
    for a, b in zip(kept, moved, strict=True):
        assert_same(a, b)
    assert offload.bytes_out > 0 and not offload.stashed
