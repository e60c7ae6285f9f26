"""CUDA graphs per streamed block (runtime/block_graphs.py), checked on the CPU.

A CPU has no CUDA graphs, so these tests hand the runtime a capture that replays by running the captured body again on
the same static buffers. That checks everything but the capture itself: the keys, the warm-up, the static inputs and
outputs shared between blocks, the clones that keep one block's outputs from being overwritten by the next, and the
backward's gradients. tests/runtime/test_block_graphs_gpu.py runs the real CUDA graphs.
"""
import logging

import pytest
import torch

from squareq import runtime
from squareq.runtime import block_graphs
from squareq.runtime.block_graphs import WARMUP, BlockGraphs

from .harness import assert_same, inputs, train_steps, with_lora

STEPS = WARMUP + 3  # eager runs, the captures, then a step of replays only


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def rerun(body, pool, stream):
    """A capture that runs ``body`` (as a CUDA capture runs its Python) and replays by running it again."""
    body()
    return body


def graphed(slab, k=2, capture=rerun):
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(prefetch=k))
    rt = runtime.runtime_of(model)
    rt.graphs = BlockGraphs(rt.device, capture=capture)
    return model


@pytest.fixture(scope="module")
def eager_steps(tiny_slab):
    """Training steps of the streamed model without graphs, with an optimizer step between them."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SQUAREQ_KERNELS", "torch")
        return _train(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2)))[0]


def _train(model, autocast=False):
    return train_steps(model, "cpu", STEPS, autocast=autocast)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_graphed_training_equals_eager_step_by_step(tiny_slab, eager_steps, k):
    model = graphed(tiny_slab, k)
    got, counts = _train(model)
    for g, e in zip(got, eager_steps, strict=True):
        assert_same(g, e)
    blocks = len(runtime.runtime_of(model).manifest.blocks)
    assert sum(c.captures for c in counts) > 0 and all(c.failures == c.ungraphed == 0 for c in counts)
    last = counts[-1]  # every block's forward and backward replayed, nothing ran eagerly
    assert (last.replays, last.eager, last.captures) == (2 * blocks, 0, 0)


def test_graphed_step_under_autocast_equals_eager(tiny_slab):
    eager, _ = _train(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2)), autocast=True)
    got, counts = _train(graphed(tiny_slab), autocast=True)
    for g, e in zip(got, eager, strict=True):
        assert_same(g, e)
    assert counts[-1].replays > 0


def test_without_the_clone_after_a_replay_the_blocks_overwrite_each_other(tiny_slab, eager_steps, monkeypatch):
    """Negative control for the equality tests: the static outputs are shared by every block with the same
    signature, so handing them out uncloned lets the next block's replay overwrite what the last one returned."""
    real = BlockGraphs.call

    def uncloned(self, key, tensors, run):
        outs, extra = real(self, key, tensors, run)
        entry = self.entries.get(key)
        if entry is not None and entry.replay is not None and not entry.failed:
            outs = list(entry.static_out)
        return outs, extra

    monkeypatch.setattr(BlockGraphs, "call", uncloned)
    got, _ = _train(graphed(tiny_slab))
    assert not all(_same(g, e) for g, e in zip(got, eager_steps))


def _same(a, b) -> bool:
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


def test_no_grad_forward_replays_and_equals_eager(tiny_slab):
    eager = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    model = graphed(tiny_slab)
    batch = inputs("cpu")
    with torch.no_grad():
        expected = eager(**batch, return_dict=False)[0]
        for _ in range(WARMUP + 2):
            assert torch.equal(model(**batch, return_dict=False)[0], expected)
    graphs = runtime.runtime_of(model).graphs
    assert graphs.stats.replays > 0
    entries, buffers = len(graphs.entries), len(graphs.buffers)
    with torch.no_grad():
        for _ in range(3):
            model(**batch, return_dict=False)
    assert (len(graphs.entries), len(graphs.buffers)) == (entries, buffers)  # captured once, then only replayed
    # the two double blocks read their inputs from the same static buffers, not from a set each
    doubles = [e for key, e in graphs.entries.items() if key[1] in (0, 1) and e.static_in]
    assert {key[1] for key, e in graphs.entries.items() if key[1] in (0, 1) and e.static_in} == {0, 1}
    assert all(a is b for a, b in zip(doubles[0].static_in, doubles[-1].static_in, strict=True))


def test_a_failed_capture_runs_eagerly_from_then_on_and_says_so_once(tiny_slab, eager_steps, caplog):
    def failing(body, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = graphed(tiny_slab, capture=failing)
    with caplog.at_level(logging.WARNING, logger="squareq.runtime"):
        got, counts = _train(model)
    for g, e in zip(got, eager_steps, strict=True):
        assert_same(g, e)
    assert sum(c.failures for c in counts) > 0 and sum(c.replays for c in counts) == 0
    assert counts[-1].ungraphed > 0  # the failed keys (then every call) run eagerly
    said = [r for r in caplog.records if "capturing a streamed block" in r.getMessage()]
    assert len(said) == 1 and "not permitted" in said[0].getMessage()


def _key(graphs, block, slot=1, values=(None,), x=None):
    x = [torch.zeros(2, 3)] if x is None else x
    return graphs.key("forward", 0, slot, "spec", (True, False), values, (), x, block)


def test_the_key_follows_what_the_kernels_read(tiny_slab):
    model = graphed(tiny_slab)
    with_lora(model)
    graphs = runtime.runtime_of(model).graphs
    block = model.transformer_blocks[0]
    first = _key(graphs, block)
    assert first == _key(graphs, block)  # negative control: nothing changed, same key
    assert _key(graphs, block, slot=2) != first  # another slot: other addresses
    assert _key(graphs, block, x=[torch.zeros(2, 4)]) != first
    assert _key(graphs, block, values=(0.5,)) != first
    layer = block.attn.to_q
    layer.lora_A.weight.data = layer.lora_A.weight.data.clone()  # a new storage: a graph would read the old one
    assert _key(graphs, block) != first
    second = _key(graphs, block)
    layer.lora_scale *= 2  # a kernel scalar
    assert _key(graphs, block) != second
    third = _key(graphs, block)
    layer.lora_B.weight.requires_grad_(False)  # the backward's gradient list changes
    assert _key(graphs, block) != third
    fourth = _key(graphs, block)
    block.train()
    assert _key(graphs, block) != fourth


def test_arguments_a_key_cannot_hold_by_value_run_eagerly(tiny_slab, caplog):
    model = graphed(tiny_slab)
    graphs = runtime.runtime_of(model).graphs
    block = model.transformer_blocks[0]

    class Cache:  # hashed by identity, and may hold tensors a graph would read at their old addresses
        pass

    with caplog.at_level(logging.WARNING, logger="squareq.runtime"):
        assert _key(graphs, block, values=(Cache(),)) is None
        assert _key(graphs, block, values=([1],)) is None
    assert "Cache argument" in caplog.text
    assert _key(graphs, block, values=(None, 1, 2.0, "x", torch.bfloat16)) is not None  # negative control


def test_a_block_with_active_dropout_is_never_graphed(tiny_slab, caplog):
    model = graphed(tiny_slab)
    graphs = runtime.runtime_of(model).graphs
    block = model.transformer_blocks[0]
    assert _key(graphs, block) is not None  # negative control
    block.attn.add_module("dropout_probe", torch.nn.Dropout(0.1))
    block.train()
    with caplog.at_level(logging.WARNING, logger="squareq.runtime"):
        assert _key(graphs, block) is None
    assert "dropout" in caplog.text
    block.eval()  # inactive in eval mode: no random numbers
    assert _key(graphs, block) is not None


def test_static_buffers_made_under_inference_mode_take_later_writes(tiny_slab):
    model = graphed(tiny_slab)
    batch = inputs("cpu")
    with torch.inference_mode():
        for _ in range(WARMUP + 1):
            model(**batch, return_dict=False)
    with torch.no_grad():  # the same shapes outside inference mode: the same static buffers, written again
        out = model(**batch, return_dict=False)[0]
    eager = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    with torch.no_grad():
        assert torch.equal(out, eager(**batch, return_dict=False)[0])
    assert runtime.runtime_of(model).graphs.stats.replays > 0


def test_over_the_buffer_cap_the_graphs_used_longest_ago_go(tiny_slab, monkeypatch, caplog):
    model = graphed(tiny_slab)
    graphs = runtime.runtime_of(model).graphs
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="squareq.runtime"):
        for batch in (1, 2):  # two shapes: two sets of graphs and buffers
            for _ in range(WARMUP + 1):
                model(**inputs("cpu", batch=batch), return_dict=False)
                graphs.end_step()
        both = graphs.static_bytes()
        ones = [key[-3][0][0][0] for key in graphs.entries].count(1)  # graphs whose first argument has batch 1
        monkeypatch.setattr(block_graphs, "STATIC_BYTES_CAP", both - 1)
        model(**inputs("cpu", batch=2), return_dict=False)
        graphs.end_step()
    assert graphs.stats.evicted > 0 and graphs.static_bytes() < both
    batches = [key[-3][0][0][0] for key in graphs.entries]
    assert batches.count(2) == len(runtime.runtime_of(model).manifest.blocks)  # used last: all kept
    assert batches.count(1) == ones - graphs.stats.evicted  # the ones that went were those used longest ago
    assert "aspect buckets" in caplog.text


def test_after_repeated_failures_the_runtime_stops_graphing(tiny_slab, eager_steps):
    def failing(body, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = graphed(tiny_slab, capture=failing)
    got, counts = _train(model)
    for g, e in zip(got, eager_steps, strict=True):
        assert_same(g, e)
    graphs = runtime.runtime_of(model).graphs
    assert sum(c.failures for c in counts) == block_graphs.MAX_FAILURES and not graphs.enabled
    assert not graphs.entries and counts[-1].eager == 0


def test_removing_a_slot_drops_its_graphs(tiny_slab):
    model = graphed(tiny_slab, k=3)
    batch = inputs("cpu")
    with torch.no_grad():
        for _ in range(WARMUP + 1):
            model(**batch, return_dict=False)
    rt = runtime.runtime_of(model)
    gone = rt.streamer.slots[-1].index
    assert any(key[2] == gone for key in rt.graphs.entries)
    rt.streamer.remove_slots(1)
    assert not any(key[2] == gone for key in rt.graphs.entries)


def test_cuda_graphs_are_refused_without_a_cuda_device(tiny_slab):
    with pytest.raises(ValueError, match="cuda_graphs=True needs streamed blocks on a CUDA device"):
        runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(cuda_graphs=True))
    model = runtime.load(tiny_slab, "cpu")
    assert runtime.runtime_of(model).graphs is None  # off by default


def test_layouts_kept_for_slices_and_made_plain_for_overlaps():
    assert block_graphs.non_overlapping((2, 3), (3, 1)) and block_graphs.non_overlapping((2, 3), (1, 2))
    assert block_graphs.non_overlapping((2, 64, 64), (5120, 64, 1))  # a slice of a [2, 80, 64] tensor
    assert not block_graphs.non_overlapping((2, 3), (0, 1))  # expanded
    assert not block_graphs.non_overlapping((2, 3), (2, 1))
    wide = torch.arange(2 * 80 * 64.0).view(2, 80, 64)
    view = wide[:, 16:]
    copy = block_graphs.copy_in_layout(view)
    assert copy.stride() == view.stride() and torch.equal(copy, view) and copy.data_ptr() != view.data_ptr()
    expanded = torch.arange(3.0).expand(2, 3)
    assert block_graphs.copy_in_layout(expanded).stride() == (3, 1)


def test_the_graphed_recompute_differentiates_fresh_leaves_and_puts_the_parameters_back():
    """A capture must not feed the gradient accumulators the step's graph keeps alive (made on another stream): the
    graphed recompute swaps in new leaves on the same storage, whose gradients are the parameters'."""
    from torch import nn

    from squareq.runtime.blocks import _parameters_as_fresh_leaves

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).requires_grad_(False)
    trained = [block[1].weight.requires_grad_(), block[1].bias.requires_grad_()]
    x = torch.randn(3, 4)
    expected = torch.autograd.grad(block(x).square().sum(), trained)
    with _parameters_as_fresh_leaves(block, trained) as leaves:
        assert all(a is not p and a.is_leaf and a.data_ptr() == p.data_ptr() for a, p in zip(leaves, trained))
        assert block[1].weight is leaves[0] and block[1].bias is leaves[1]
        got = torch.autograd.grad(block(x).square().sum(), leaves)
    assert block[1].weight is trained[0] and block[1].bias is trained[1]
    assert all(isinstance(p, nn.Parameter) for p in block.parameters())
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    try:  # put back even when the recompute fails
        with _parameters_as_fresh_leaves(block, trained):
            raise RuntimeError("recompute failed")
    except RuntimeError:
        pass
    assert block[1].weight is trained[0]


def _forwards(model, n: int) -> list[torch.Tensor]:
    batch = inputs("cpu")
    with torch.no_grad():
        return [model(**batch, return_dict=False)[0] for _ in range(n)]


def test_a_block_warms_up_once_whichever_slots_it_visits(tiny_slab):
    """Blocks visit every slot of the ring in turn across steps: a block call runs eagerly WARMUP times in all, and
    in every other slot it is captured at its first call; the replays compute what the eager model does. Negative
    control: with ``at_once`` off, every (block, slot) runs eagerly WARMUP times."""
    expected = _forwards(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=3)), 1)[0]
    counts = {}
    for at_once in (True, False):
        model = graphed(tiny_slab, k=3)
        graphs = runtime.runtime_of(model).graphs
        graphs.at_once = at_once
        for out in _forwards(model, 4 * (WARMUP + 1)):
            assert torch.equal(out, expected)
        keys = {k for k, e in graphs.entries.items() if e.replay is not None}
        twins = {block_graphs.twin(k) for k in keys}
        assert len(keys) > len(twins)  # the blocks did visit several slots
        counts[at_once] = (graphs.stats.eager, graphs.stats.at_once, len(keys), len(twins))
    eager, at_once, keys, twins = counts[True]
    assert eager == WARMUP * twins and at_once >= keys - twins
    eager, at_once, keys, twins = counts[False]
    assert eager == WARMUP * keys and at_once == 0


def test_a_failed_capture_at_once_goes_back_to_warming_up_and_says_so(tiny_slab, caplog):
    """A capture at once that fails is not one of the MAX_FAILURES: that key runs eagerly and warms up, as every
    key does from then on, and the run goes on graphed with the eager model's outputs."""
    expected = _forwards(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=3)), 1)[0]
    state = {"captures": 0, "fail_at": None}

    def capture(body, pool, stream):
        state["captures"] += 1
        if state["captures"] == state["fail_at"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        return rerun(body, pool, stream)

    model = graphed(tiny_slab, k=3, capture=capture)
    graphs = runtime.runtime_of(model).graphs
    with caplog.at_level(logging.WARNING, logger="squareq.runtime"):
        _forwards(model, WARMUP + 1)  # every block captured in some slot
        assert graphs.stats.at_once > 0
        state["fail_at"] = state["captures"] + 1  # the next capture (one at once: every block is warm) fails
        at_once, eager = graphs.stats.at_once, graphs.stats.eager
        outs = _forwards(model, 4 * (WARMUP + 1))
    assert all(torch.equal(o, expected) for o in outs)
    assert not graphs.at_once and graphs.enabled and graphs.stats.failures == 0
    assert graphs.stats.at_once == at_once and graphs.stats.eager > eager and graphs.stats.replays > 0
    said = [r for r in caplog.records if "where it had not run eagerly failed" in r.getMessage()]
    assert len(said) == 1 and "not permitted" in said[0].getMessage()
