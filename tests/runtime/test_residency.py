"""Ring sizing and resident blocks from measured times: the pure plan, and applying it to a streamed model."""
import pytest
import torch

from squareq import runtime
from squareq.runtime.residency import MAX_SLOTS, BlockTimes, StreamTuner, forward_step_seconds, plan_stream

from .harness import assert_same, inputs, step, with_lora

pytestmark = pytest.mark.usefixtures("torch_kernels")

MB = 1 << 20


def _times(copy_ms, compute_ms, mb=None):
    n = len(copy_ms)
    mb = mb or [100] * n
    return BlockTimes({b: mb[b] * MB for b in range(n)}, {b: copy_ms[b] / 1e3 for b in range(n)},
                      {b: compute_ms[b] / 1e3 for b in range(n)})


def test_copy_bound_blocks_go_resident_heaviest_first_until_copies_hide():
    # copies 40 ms against 24 ms of compute: keeping blocks 3 and 1 (the copies least covered by their own
    # compute) leaves 18 ms of copies <= 0.85 * 24 ms
    times = _times([10, 11, 8, 12], [6, 6, 6, 6])
    plan = plan_stream(times, slots=2, slot_bytes=100 * MB, budget_bytes=10_000 * MB, resident="auto", prefetch=2)
    assert plan.resident == (1, 3) and plan.slots == 2
    assert plan.copy_s == pytest.approx(0.018) and plan.compute_s == pytest.approx(0.024)


def test_hidden_copies_keep_nothing_resident_and_the_budget_is_never_exceeded():
    hidden = _times([4, 4, 4], [6, 6, 6])
    assert plan_stream(hidden, 3, 100 * MB, 10_000 * MB, resident="auto", prefetch=3).resident == ()
    heavy = _times([10, 11, 8, 12], [6, 6, 6, 6], mb=[100, 300, 100, 300])
    plan = plan_stream(heavy, 2, 300 * MB, 350 * MB, resident="auto", prefetch=2)
    assert plan.resident == (3,)  # block 1 (300 MB) no longer fits once block 3 is kept; blocks 0/2 do not help
    assert plan_stream(heavy, 2, 300 * MB, 10_000 * MB, resident=1, prefetch=2).resident == (3,)


def test_auto_prefetch_covers_the_longest_streamed_copy_within_the_budget():
    times = _times([20, 5, 5, 5], [5, 5, 5, 5])  # a 20 ms copy needs 4 blocks of 5 ms ahead of it: 5 slots
    assert plan_stream(times, 2, 100 * MB, 10_000 * MB, prefetch="auto").slots == 5
    assert plan_stream(times, 2, 100 * MB, 150 * MB, prefetch="auto").slots == 3  # room for one more slot only
    assert plan_stream(times, 6, 100 * MB, 10_000 * MB, prefetch="auto").slots == 6  # never shrinks
    assert plan_stream(_times([500, 5], [1, 1]), 2, MB, 10_000 * MB, prefetch="auto").slots == MAX_SLOTS
    assert plan_stream(times, 2, 100 * MB, 10_000 * MB, prefetch=2).slots == 2


def test_a_simulated_forward_step_is_its_compute_when_copies_hide_and_its_copies_when_they_do_not():
    order = list(range(6))
    hidden = {b: 0.004 for b in order}, {b: 0.006 for b in order}
    assert forward_step_seconds(order, *hidden, slots=2) == pytest.approx(0.036)
    bound = {b: 0.010 for b in order}, {b: 0.006 for b in order}
    assert forward_step_seconds(order, *bound, slots=2) == pytest.approx(0.060)
    assert forward_step_seconds(order, *bound, slots=8) == pytest.approx(0.060)  # more slots cannot help
    kept = {b: 0.010 for b in order[:3]}, {b: 0.006 for b in order}  # blocks 3-5 kept: no copies, still compute
    assert forward_step_seconds(order, *kept, slots=2) < forward_step_seconds(order, *bound, slots=2)


def test_a_forward_only_ring_grows_only_where_the_simulated_step_gets_faster():
    """With the step's block order (sampling), the ring grows only while the simulated step gains: copy-bound
    blocks everywhere keep the ring (the average rule would add a slot, the negative control); one long copy,
    which more blocks' compute ahead of it hides, grows it."""
    order = list(range(6))
    bound = _times([10] * 6, [6] * 6)
    assert plan_stream(bound, 2, 100 * MB, 10_000 * MB, prefetch="auto", order=order).slots == 2
    assert plan_stream(bound, 2, 100 * MB, 10_000 * MB, prefetch="auto").slots == 3  # the average rule's ring
    spike = _times([20, 1, 1, 1, 1, 1], [5] * 6)
    grown = plan_stream(spike, 2, 100 * MB, 10_000 * MB, prefetch="auto", order=order).slots
    assert grown > 2
    seconds = [forward_step_seconds(order, spike.copy_s, spike.compute_s, k) for k in (2, grown, MAX_SLOTS)]
    assert seconds[1] < seconds[0] and seconds[1] <= seconds[2] * 1.01
    assert plan_stream(spike, 2, 100 * MB, 150 * MB, prefetch="auto", order=order).slots == 3  # the budget's one


def test_with_cuda_graphs_a_forward_only_ring_divides_the_streamed_blocks():
    """``whole_turns``: a ring that does not divide the streamed blocks puts each block in another slot every step
    (another capture each), so the ring grows only to a divisor, and blocks kept by "auto" are streamed again, the
    least helpful first, until the ring divides what streams. Negative control: without it, the 7-block ring takes 5."""
    order = list(range(7))
    spike = _times([20, 1, 1, 1, 1, 1, 1], [5] * 7)
    assert plan_stream(spike, 2, 100 * MB, 10_000 * MB, prefetch="auto", order=order).slots == 5
    assert plan_stream(spike, 2, 100 * MB, 10_000 * MB, prefetch="auto", order=order, whole_turns=True).slots == 7
    bound = _times([10, 11, 8, 12, 10, 10, 10], [6] * 7)
    free = plan_stream(bound, 3, 100 * MB, 350 * MB, resident="auto", prefetch=3, order=order)
    turns = plan_stream(bound, 3, 100 * MB, 350 * MB, resident="auto", prefetch=3, order=order, whole_turns=True)
    assert free.resident == (0, 1, 3) and turns.resident == (3,)  # 6 streamed blocks for 3 slots, not 4
    asked = plan_stream(bound, 3, 100 * MB, 10_000 * MB, resident=2, prefetch=3, order=order, whole_turns=True)
    assert asked.resident == (1, 3)  # a count is kept as asked


def test_a_tuned_streamed_model_computes_the_same_and_copies_only_what_streams(tiny_slab):
    """Two resident blocks and a larger ring, applied after the probe step: the same outputs and LoRA gradients
    bit for bit, forward-only and training, and the resident blocks are not copied any more."""
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    for m in (resident, streamed):
        with_lora(m)
    rt = runtime.runtime_of(streamed)
    n = len(rt.manifest.blocks)
    tuner = StreamTuner(streamed, prefetch=4, resident=2, budget_bytes=1 << 40)
    batch = inputs("cpu")
    with torch.no_grad():
        expected = resident(**batch, return_dict=False)[0]
        for i in range(3):
            tuner.before_step(i)
            assert torch.equal(streamed(**batch, return_dict=False)[0], expected)
            tuner.after_step(i)
            if i == 1:
                assert len(tuner.plan.resident) == 2 and sorted(rt.resident_blocks) == list(tuner.plan.resident)
                assert len(rt.streamer.slots) == 4  # an integer prefetch grows the ring to it
                rt.step_stats()
    stats = rt.step_stats()
    assert stats.bytes_copied <= sum(rt.streamer.block_sizes[b] for b in range(n) if b not in rt.resident_blocks)
    assert_same(step(streamed, batch, checkpointing=True), step(resident, batch, checkpointing=True))
    rt.apply_stream_plan(type(tuner.plan)(slots=4, resident=tuner.plan.resident, copy_s=0.0, compute_s=0.0))
    assert len(rt.streamer.slots) == 4 and len(rt.resident_blocks) == 2  # applying again changes nothing
    assert_same(step(streamed, batch, checkpointing=True), step(resident, batch, checkpointing=True))


def test_slots_lent_and_taken_back_leave_no_stale_views(tiny_slab):
    """The trainer lends its ring extra slots for sample images and takes them back at every sampling interval:
    a removed slot's cached views go with it (they would keep its memory and could be bound again), and the
    model computes as before after each round."""
    resident = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    streamed = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
    for m in (resident, streamed):
        with_lora(m)
    rt = runtime.runtime_of(streamed)
    batch = inputs("cpu")
    expected = step(resident, batch, checkpointing=True)
    for _ in range(2):
        rt.streamer.add_slots(2)
        with torch.no_grad():
            streamed(**batch, return_dict=False)  # every block in a slot: all four slots bound
        assert {key[1] for key in rt.binder._cache} >= {s.index for s in rt.streamer.slots[2:]}
        assert_same(step(streamed, batch, checkpointing=True), expected)
        removed = [s.index for s in rt.streamer.slots[2:]]
        rt.streamer.remove_slots(2)
        assert len(rt.streamer.slots) == 2 and not {key[1] for key in rt.binder._cache} & set(removed)
        assert_same(step(streamed, batch, checkpointing=True), expected)


def test_a_probe_step_that_compiled_is_not_measured(tiny_slab, monkeypatch):
    """A step in which torch.compile compiled (the GPU waited on the host) would make the blocks look slower than
    they are: the tuner probes the next step that compiled nothing instead. Negative control: without compiling,
    the probe step (step 1) is measured."""
    from squareq.runtime import residency

    compiled = [0.0]
    monkeypatch.setattr(residency, "compile_seconds", lambda: compiled[0])
    batch = inputs("cpu")

    def planned_after(steps_compiling: tuple[bool, ...]) -> list[bool]:
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
        tuner = StreamTuner(model, prefetch=4, budget_bytes=1 << 40)
        planned = []
        with torch.no_grad():
            for i, compiles in enumerate(steps_compiling):
                tuner.before_step(i)
                model(**batch, return_dict=False)
                compiled[0] += 10.0 if compiles else 0.0
                tuner.after_step(i)
                planned.append(tuner.plan is not None)
        return planned

    assert planned_after((True, True, False)) == [False, False, True]
    assert planned_after((False, False, False)) == [False, True, True]



def test_a_sampling_tuner_probes_the_first_step_that_replays_its_graphs(tiny_slab):
    """``forward_only`` (squareq sample): a step that ran blocks eagerly before their CUDA-graph capture, or captured
    them, is no replaying step, so the tuner probes the first step after the graphs settled. The CPU's stand-in
    capture runs the body and replays by running it again (tests/runtime/test_block_graphs.py), so the graphs warm up
    and settle as on a GPU. Negative controls: without ``forward_only`` (training), and with graphs that never say
    they are settling, the probe is step 1."""
    from squareq.runtime.block_graphs import WARMUP, BlockGraphs

    class NeverSettling(BlockGraphs):
        settling = property(lambda self: False)

    def rerun(body, pool, stream):
        body()
        return body

    batch = inputs("cpu")

    def probed_at(graphs_class, wait: bool) -> int:
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
        rt = runtime.runtime_of(model)
        rt.graphs = graphs_class(rt.device, capture=rerun)
        tuner = StreamTuner(model, prefetch=4, budget_bytes=1 << 40, forward_only=wait)
        with torch.no_grad():
            for i in range(8):
                tuner.before_step(i)
                model(**batch, return_dict=False)
                tuner.after_step(i)
                rt.graphs.end_step()
                if tuner.plan is not None:
                    return i
        return -1

    assert probed_at(BlockGraphs, wait=True) == WARMUP + 1  # the warm-up runs, then the capture, then a replay
    assert probed_at(BlockGraphs, wait=False) == 1
    assert probed_at(NeverSettling, wait=True) == 1


def test_kept_blocks_leave_the_ring_rule_as_it_was():
    """``resident`` with ``prefetch="auto"``: without ``order`` (training) the ring follows the average rule, as with
    nothing kept; with ``order`` (sampling) the simulated step in that order. (The kept blocks' own ordering once
    leaked into ``order`` and sent training through the simulation: 3 slots here.)"""
    times = _times([12, 12, 1, 1], [5, 5, 5, 5])
    assert plan_stream(times, 2, 100 * MB, 10_000 * MB, resident=1, prefetch="auto").slots == 4
    assert plan_stream(times, 2, 100 * MB, 10_000 * MB, resident=1, prefetch="auto", order=[0, 1, 2, 3]).slots == 3


def test_a_probe_armed_past_the_end_of_an_image_times_one_step_of_the_next(tiny_slab, monkeypatch):
    """A pipeline's callback arms the probe for the step after an image's last; the next image counts its steps from
    0 again, so the tuner times that image's next step instead: one step's blocks, not several added up.
    Negative control, the same with the probe due within the image: planned at once."""
    from squareq.runtime import residency

    counted = []
    seconds = residency.BlockTimer.seconds
    monkeypatch.setattr(residency.BlockTimer, "seconds", lambda self: (counted.append(len(self.marks)),
                                                                       seconds(self))[1])
    batch = inputs("cpu")

    def run(probe_step: int) -> list[int]:
        counted.clear()
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))
        tuner = StreamTuner(model, prefetch=4, budget_bytes=1 << 40, probe_step=probe_step)
        with torch.no_grad():
            for _ in range(2):  # two images of two steps; the callback runs after each step
                for step in range(2):
                    model(**batch, return_dict=False)
                    tuner.pipeline_callback(None, step, None, {})
        assert tuner.plan is not None
        return list(counted)

    n = len(runtime.runtime_of(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2))).manifest.blocks)
    assert run(probe_step=2) == [n]
    assert run(probe_step=1) == [n]


def test_a_vram_budget_counts_the_eager_peak_only_where_blocks_run_eagerly(monkeypatch):
    """``peak_limit``: with CUDA graphs that capture new blocks and slots at once, the budget is the limit less what
    the probe step left reserved, less the capture margin; without graphs (or once a capture at once failed), the
    limit less the peak so far, which the eager steps reach again. At or over the limit, nothing."""
    from types import SimpleNamespace

    from squareq.runtime.residency import CAPTURE_MARGIN

    tuner = StreamTuner.__new__(StreamTuner)
    graphs = SimpleNamespace(enabled=True, at_once=True)
    tuner.rt = SimpleNamespace(device=torch.device("cuda", 0), graphs=graphs)
    limit, now, peak = 3_000_000_000, 1_800_000_000, 2_300_000_000
    tuner.budget_bytes, tuner.peak_limit = 10 * limit, limit
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: now)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak)
    assert tuner._budget() == limit - now - CAPTURE_MARGIN
    graphs.at_once = False
    assert tuner._budget() == limit - peak
    tuner.rt.graphs = None
    assert tuner._budget() == limit - peak
    tuner.peak_limit = peak - 1
    assert tuner._budget() == 0
    tuner.rt.graphs, tuner.peak_limit = SimpleNamespace(enabled=True, at_once=True), now
    assert tuner._budget() == 0


def test_free_memory_is_bounded_by_a_capped_allocator(monkeypatch):
    """With ``torch.cuda.set_per_process_memory_fraction`` set (a benchmark's card on a larger GPU), the tuner plans
    with the room the cap leaves and a margin of the cap's size, not with the device's free memory, which the cap
    does not show; negative control: with no cap, the device's free memory less its margin, as before."""
    from types import SimpleNamespace

    from squareq.runtime.residency import MIN_MARGIN_BYTES

    gb = 10**9
    tuner = StreamTuner.__new__(StreamTuner)
    tuner.rt, tuner.budget_bytes = SimpleNamespace(device=torch.device("cuda", 0)), None
    share = [0.1]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * gb, 150 * gb))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: share[0])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gb)
    assert tuner._free_budget() == 15 * gb - 10 * gb - max(MIN_MARGIN_BYTES, 15 * gb // 20)
    share[0] = 1.0
    assert tuner._free_budget() == 100 * gb - 150 * gb // 20
