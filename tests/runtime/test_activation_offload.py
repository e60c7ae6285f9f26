"""Activation offloading (issue 62): a streamed training step with its checkpointed block inputs kept in host memory
gives the same output and LoRA gradients, bit for bit, as with them on the device; every offloaded input comes back
and none is left; the negative control: inputs brought back changed change the gradients. On a GPU the copies run
on a stream of their own (tests/runtime/test_activation_offload_gpu.py)."""
import pytest
import torch

from squareq import runtime
from squareq.runtime.activation_offload import ActivationOffload

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


@pytest.fixture
def model(tiny_slab):
    m = runtime.load(tiny_slab, "cpu")
    with_lora(m)
    return m


def test_offloaded_inputs_give_the_same_step(model):
    batch = inputs("cpu")
    kept = step(model, batch, checkpointing=True)
    rt = runtime.runtime_of(model)
    rt.activation_offload = offload = ActivationOffload(torch.device("cpu"), min_bytes=0)
    moved = step(model, batch, checkpointing=True)
    assert_same(kept, moved)
    blocks = len(rt.manifest.blocks)
    # one put per block whose inputs carry a gradient (all but the first: the embedders have no LoRA), all taken back
    assert offload.next_key == blocks - 1 and not offload.stashed
    hidden = batch["hidden_states"]
    assert offload.bytes_out >= (blocks - 1) * hidden.numel() * hidden.element_size()


def test_inputs_that_come_back_changed_change_the_gradients(model, monkeypatch):
    batch = inputs("cpu")
    kept = step(model, batch, checkpointing=True)
    offload = runtime.runtime_of(model).activation_offload = ActivationOffload(torch.device("cpu"), min_bytes=0)
    taken = ActivationOffload.take

    def nudged(self, key):
        return [t + 0.01 for t in taken(self, key)]

    monkeypatch.setattr(ActivationOffload, "take", nudged)
    _, grads = step(model, batch, checkpointing=True)
    assert any(not torch.equal(grads[n], kept[1][n]) for n in grads)
    assert offload.bytes_out > 0


def test_small_or_constant_inputs_stay(model):
    """Inputs without a gradient (timestep and rotary embeddings, shared by every block) and ones under min_bytes
    are kept as saved tensors, not copied."""
    offload = ActivationOffload(torch.device("cpu"))
    assert not offload.wanted(torch.zeros(1 << 20, requires_grad=False))
    assert not offload.wanted(torch.zeros(16, requires_grad=True))
    assert offload.wanted(torch.zeros(1 << 19, requires_grad=True))  # 2 MiB of fp32


def test_the_plan_moves_the_checkpoints_to_the_host(tiny_slab):
    kept = runtime.plan(tiny_slab, resolution=128, text_tokens=16)
    moved = runtime.plan(tiny_slab, resolution=128, text_tokens=16, offload=True)
    per_block = 2 * kept.tokens * kept.hidden
    assert kept.offloaded == 0 and moved.offloaded == kept.checkpoints
    assert moved.checkpoints == 2 * per_block and moved.peak_allocated < kept.peak_allocated
    assert "in host memory" in str(moved) and "in host memory" not in str(kept)


def test_a_run_with_offload_on_trains_the_same_lora(tmp_path, monkeypatch):
    """``offload_activations = "on"`` hands the runtime a stash (every input offloaded here: the threshold lowered)
    and trains the same LoRA as "off"; a value it does not know is refused by name."""
    from squareq.runtime import activation_offload
    from squareq.train.config import ConfigError, load_config
    from squareq.train.loop import train
    from squareq.train.tiny_dataset import write_tiny_dataset
    from tests.train.tiny_run import w8_tiny_slab

    monkeypatch.setattr(activation_offload, "OFFLOAD_MIN_BYTES", 0)
    monkeypatch.setattr(activation_offload.ActivationOffload.__init__, "__defaults__", (0,))
    slab, data = w8_tiny_slab(tmp_path / "t.slab"), write_tiny_dataset(tmp_path / "data")
    values = {"slab": str(slab), "data": str(data), "resolution": 64, "max_sequence_length": 16, "steps": 2,
              "rank": 4, "save_every": 0, "cache_dir": str(tmp_path / "cache")}
    used = []
    put = activation_offload.ActivationOffload.put
    monkeypatch.setattr(activation_offload.ActivationOffload, "put", lambda self, t: used.append(1) or put(self, t))
    on = train(load_config(None, {**values, "output": str(tmp_path / "on"), "offload_activations": "on"}),
               echo=lambda s: None)
    assert used
    used.clear()
    off = train(load_config(None, {**values, "output": str(tmp_path / "off"), "offload_activations": "off"}),
                echo=lambda s: None)
    assert not used and on.losses == off.losses
    with pytest.raises(ConfigError, match="offload_activations = 'maybe' is not one of auto, on, off"):
        load_config(None, {**values, "output": "o", "offload_activations": "maybe"})


def test_host_buffers_are_exact_and_reused(model):
    """The offloaded inputs are held at their exact size (no power-of-two rounding), a second step reuses them, and
    closing the runtime gives them back; the negative control: a longer input than any free buffer releases the
    smaller ones instead of holding both."""
    from squareq.runtime.host.pinned import held_bytes

    before = held_bytes()
    rt = runtime.runtime_of(model)
    rt.activation_offload = offload = ActivationOffload(torch.device("cpu"), min_bytes=0)
    step(model, inputs("cpu"), checkpointing=True)
    held = held_bytes() - before
    assert held == offload.bytes_out  # every put's exact bytes: none rounded up
    step(model, inputs("cpu"), checkpointing=True)
    assert held_bytes() - before == held  # reused, not allocated again
    buffers = offload.buffers
    small = len(buffers.free)
    longer = buffers.take(max(m.nbytes for m in buffers.free) + 1)
    assert not buffers.free and held_bytes() - before == longer.nbytes  # the smaller ones were given back
    buffers.give_back([longer])
    assert buffers.take(1) is longer and small > 1  # the smallest free buffer that holds a request serves it
    buffers.give_back([longer])
    offload.close()
    assert held_bytes() == before and not buffers.free
    buffers.give_back([buffers.take(8)])
    rt.close()  # the end of a run: the runtime closes its offload
    assert not buffers.free
