"""Which attention kernel the blocks prefer (runtime/attention_choice.py): the rules of ``auto``, and that a streamed
or resident block's forward (its first pass and its checkpointed recompute) runs with cuDNN first in torch's priority
exactly while the runtime prefers it and cuDNN attention has not failed."""
import contextlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from squareq import runtime
from squareq.runtime import attention_choice
from squareq.runtime.attention_choice import AttentionModeError, head_dim, resolve_attention

from .harness import inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")

CUDNN = int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION)


@pytest.fixture
def cudnn_on(monkeypatch):
    """cuDNN attention switched on (a user's default) and not failed; both restored after the test."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(attention_choice, "_cudnn_failed", False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.fixture
def first_backends(monkeypatch):
    """The first backend in torch's priority at each attention call of the model."""
    seen: list[int] = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(int(torch._C._get_sdp_priority_order()[0]))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return seen


def test_modes():
    with pytest.raises(AttentionModeError, match="choose one of auto, cudnn, default"):
        resolve_attention("fast", "cpu", 128)
    assert resolve_attention("default", "cpu", 128)[0] is False
    assert resolve_attention("cudnn", "cpu", 128) == (False, "cuDNN attention runs on CUDA GPUs only, not on cpu")


def test_auto_is_cudnn_only_on_the_gpus_and_head_width_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_attention("auto", "cuda", 128)[0] is True
    assert resolve_attention("cudnn", "cuda", 16)[0] is True  # asked for: any width
    off, why = resolve_attention("auto", "cuda", 16)  # tiny models' narrow heads: cuDNN's backward gave NaN there
    assert off is False and "16" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    off, why = resolve_attention("auto", "cuda", 128)
    assert off is False and "8.0" in why


def test_head_dim_from_diffusers_and_transformers_configs():
    class Model(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    assert head_dim(Model({"attention_head_dim": 128, "num_attention_heads": 24})) == 128
    assert head_dim(Model(type("Config", (), {"hidden_size": 384, "num_attention_heads": 12})())) == 32
    assert head_dim(Model({})) is None
    assert head_dim(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("stream", [True, False])
def test_blocks_run_with_cudnn_first_while_preferred(tiny_slab, cudnn_on, first_backends, stream):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, stream=stream, attention="cudnn"))
    rt = runtime.runtime_of(model)
    assert rt.prefer_cudnn is False  # on a CPU even "cudnn" stays torch's order
    with_lora(model)
    step(model, inputs("cpu"), checkpointing=stream)
    assert first_backends and CUDNN not in first_backends
    before = list(torch._C._get_sdp_priority_order())

    first_backends.clear()
    rt.prefer_cudnn = True  # as on a GPU where it was chosen
    step(model, inputs("cpu"), checkpointing=stream)
    # every call: the streamed forward, its recompute in the backward (streamed), and the resident forward
    assert first_backends and set(first_backends) == {CUDNN}
    assert list(torch._C._get_sdp_priority_order()) == before  # restored after each block

    first_backends.clear()
    attention_choice.mark_cudnn_failed()  # what the fallback after a failed cuDNN backward calls
    step(model, inputs("cpu"), checkpointing=stream)
    assert first_backends and CUDNN not in first_backends


def test_a_user_who_turned_cudnn_attention_off_keeps_it_off(tiny_slab, cudnn_on, first_backends):
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    runtime.runtime_of(model).prefer_cudnn = True
    torch.backends.cuda.enable_cudnn_sdp(False)
    with_lora(model)
    step(model, inputs("cpu"), checkpointing=True)
    assert first_backends and CUDNN not in first_backends


def test_the_fallback_drops_the_preference_and_the_compile_caches(monkeypatch, cudnn_on):
    """After cuDNN attention failed, the next compile must trace anew: the on-disk caches do not key on the attention
    switches, so a cached graph would bring cuDNN's kernel back."""
    import torch._functorch.config
    import torch._inductor.config

    from squareq.runtime.blocks import disable_cudnn_attention

    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", True)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", True)
    assert disable_cudnn_attention("failed (a test)") is True
    assert not torch.backends.cuda.cudnn_sdp_enabled() and attention_choice._cudnn_failed
    assert not torch._inductor.config.fx_graph_cache and not torch._functorch.config.enable_autograd_cache
    # negative control: already off, nothing to redo
    torch._inductor.config.fx_graph_cache = True
    assert disable_cudnn_attention("failed again") is False and torch._inductor.config.fx_graph_cache


@pytest.mark.parametrize("asked, used", [("auto", "default"), ("cudnn", "cudnn"), ("default", "default")])
def test_a_sampling_run_keeps_torchs_order_unless_cudnn_is_asked_for(asked, used, tiny_slab, monkeypatch):
    """squareq sample's auto: cuDNN's first calls cost more than a 28-step run earns back (docs/benchmarks.md)."""
    from squareq.train import sample

    seen = {}

    class Stop(Exception):
        pass

    def load(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(sample.runtime, "load", load)
    with pytest.raises(Stop):
        sample.sample_images(tiny_slab, ["a cat"], resolution=64, steps=2, max_sequence_length=32, attention=asked)
    assert seen["options"].attention == used


class AttentionBackwards(TorchDispatchMode):
    """The strides of the output gradient each attention backward kernel receives."""

    def __init__(self):
        super().__init__()
        self.grad_strides = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.__name__ and "backward" in func.__name__:
            self.grad_strides.append(args[0].stride())
        return func(*args, **(kwargs or {}))


def _single_block_attention(guarded: bool):
    """FLUX.1's single block in small: attention on [B, S, H, D] tensors seen as [B, H, S, D] (diffusers' layout), its
    output concatenated with an MLP's before the projection, so its gradient arrives as a slice of a wider one.
    Returns (the output's strides, the strides each backward kernel got)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 16, generator=g).requires_grad_() for _ in range(3))
    with attention_choice.GradientInOutputLayout() if guarded else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    joined = torch.cat([out.transpose(1, 2).flatten(2), torch.randn(1, 64, 96, generator=g)], dim=2)
    with AttentionBackwards() as seen:
        (joined * torch.randn(joined.shape, generator=g)).sum().backward()
    return out.stride(), seen.grad_strides


def test_attention_gradients_reach_the_kernel_in_the_outputs_layout():
    """torch's cuDNN backward graph is cached by query/key/value alone: a gradient of other strides than the one the
    graph was built with is read wrongly (module docstring). Guarded, every backward gets its output's strides; the
    negative control: unguarded, the single block's gradient arrives with the MLP's wider rows."""
    shape = (1, 2, 64, 16)
    strides, seen = _single_block_attention(guarded=True)
    assert len(seen) == 1 and attention_choice.same_layout(shape, seen[0], strides), (seen, strides)
    strides, seen = _single_block_attention(guarded=False)
    assert len(seen) == 1 and not attention_choice.same_layout(shape, seen[0], strides)
    assert seen[0][2] == 2 * 16 + 96  # a row of the concatenation


@pytest.mark.parametrize("device, compiled, grad, prefer, guarded", [
    ("cuda", False, True, False, True),  # torch's own order may put cuDNN first (module docstring)
    ("cuda", False, True, True, True),
    ("cuda", True, True, True, True),  # traced into a compiled block
    ("cuda", False, False, True, False),  # a pass without a backward has no gradient to lay out
    ("cpu", False, True, True, False),  # no cuDNN
])
def test_the_guard_runs_on_gpu_blocks_that_record_a_backward(cudnn_on, device, compiled, grad, prefer, guarded):
    rt = types.SimpleNamespace(prefer_cudnn=prefer, compiled=compiled, device=torch.device(device))
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    forward = attention_choice.preferring_cudnn(lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x), rt)
    with torch.set_grad_enabled(grad):
        out = forward(q)
    kind = type(out.grad_fn).__name__ if out.grad_fn is not None else None
    assert (kind == "_GradientAsOutputBackward") is guarded, kind
    assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_no_guard_once_cudnn_attention_is_off(cudnn_on):
    torch.backends.cuda.enable_cudnn_sdp(False)
    rt = types.SimpleNamespace(prefer_cudnn=True, compiled=False, device=torch.device("cuda"))
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    out = attention_choice.preferring_cudnn(lambda x: torch.nn.functional.scaled_dot_product_attention(x, x, x), rt)(q)
    assert type(out.grad_fn).__name__ != "_GradientAsOutputBackward"
