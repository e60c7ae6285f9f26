"""Compiling within a host memory budget: the spill file, the host plan, its refusal, and identical slabs."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.compiler import CompileOptions, chunks, compile_setup, compile_slab, host_plan, prefetch, spill
from squareq.compiler.budget import BudgetError
from squareq.compiler.host_plan import HostNeeds, plan_host
from squareq.compiler.spill import KeepThenSpill, SpillError, SpillFile
from squareq.compiler.state import CompileState, spill_path
from squareq.compiler.vram import VramPlan
from squareq.runtime.host import budget as host_budget
from squareq.runtime.host.budget import default_host_budget, pinned_bytes
from squareq.sizes import format_size_up
from squareq.sources import open_source

from .test_vram import _minimum_from, error_lines, tiny_compile_args

pytestmark = pytest.mark.usefixtures("torch_kernels")

# two rungs, one quantized: the effects pass dequantizes each candidate per replayed chunk (Triton's interpreter on CI)
OPTS = dict(budget=2_000_000, rounding="nearest", calib_samples=8, max_rows=128, effect_probes=2, formats="W4,bf16")


# --- the spill file -------------------------------------------------------------------------------------------------


def _tensors():
    g = torch.Generator().manual_seed(0)
    dense_t = torch.randn(5, 7, 3, generator=g).transpose(0, 2)  # dense, not contiguous: clone() keeps its strides
    return {
        "float32": torch.randn(6, 4, 5, generator=g),
        "bfloat16": torch.randn(9, 33, generator=g).to(torch.bfloat16),
        "int64": torch.randint(-10**12, 10**12, (4, 3), generator=g),
        "bool": torch.rand(7, 2, generator=g) > 0.5,
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "transposed": dense_t,
        "sliced": torch.randn(4, 10, generator=g)[:, 2:7],  # not dense: clone() makes it contiguous
    }


def test_spilled_tensors_come_back_bit_for_bit_with_clones_strides_and_in_row_slices(tmp_path, monkeypatch):
    """Every dtype (bf16 included), shape and layout round-trips exactly, with the strides ``clone()`` gives; rows of
    the first axis come back alone, also across checksum segments (a small SEGMENT here); nothing stays mapped."""
    monkeypatch.setattr(spill, "SEGMENT", 40)  # a tensor spans several segments, a slice starts and ends inside one
    f = SpillFile(tmp_path / "spill.test.scratch")
    ts = _tensors()
    handles = {name: f.put(t) for name, t in ts.items()}
    assert f.bytes_written == sum(t.numel() * t.element_size() for t in ts.values())
    for name, t in ts.items():
        got = handles[name].load()
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.clone().stride(), name
        assert torch.equal(got, t), name
    for name in ("float32", "bfloat16", "int64", "transposed"):
        t = ts[name]
        for start, stop in ((0, 1), (1, 4), (2, t.shape[0]), (3, 3)):
            part = handles[name].load(start, stop)
            assert torch.equal(part, t[start:stop]) and part.stride() == t.clone()[start:stop].stride(), (name, start)
    assert f.bytes_read > 0
    if sys.platform.startswith("linux"):  # read with readinto, never mapped (a map's touched pages count in RSS)
        assert str(f.path) not in Path("/proc/self/maps").read_text()
    f.remove()
    assert not f.path.exists()


def test_a_damaged_or_cut_spill_file_is_an_error_not_other_numbers(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "SEGMENT", 400)  # a checksum per 100 float32s
    f = SpillFile(tmp_path / "spill.test.scratch")
    a = f.put(torch.arange(1000, dtype=torch.float32))
    b = f.put(torch.ones(10, dtype=torch.bfloat16))
    with open(f.path, "r+b") as raw:  # one flipped byte inside the first tensor
        raw.seek(123)
        byte = raw.read(1)
        raw.seek(123)
        raw.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SpillError, match=r"spill\.test\.scratch is damaged.*--resume"):
        a.load()
    assert torch.equal(a.load(500, 510), torch.arange(500, 510, dtype=torch.float32))  # other segments still read
    with open(f.path, "r+b") as raw:  # the disk filled: the second tensor was cut
        raw.truncate(4000 + 7)
    with pytest.raises(SpillError, match=r"ends at byte 4,007, before the 20 bytes"):
        b.load()
    f.reset()  # the space back: the handles can no longer be read (their bytes would be the next writes')
    assert f.path.stat().st_size == 0
    with pytest.raises(SpillError, match="no longer holds"):
        a.load()
    f.remove()


def test_spilled_rows_are_read_one_item_ahead_in_order_and_a_failed_read_fails_its_item():
    started = []

    def read(item):
        started.append(item)
        if item == "bad":
            raise SpillError("bad bytes")
        return item.upper()

    seen = []
    with prefetch.read_ahead(read, ["a", "b", "c"]) as items:
        for item, got in items:
            # the next item's read runs while this one is worked on; its result waits for its turn
            assert _eventually(lambda: len(started) == min(len(seen) + 2, 3)), (item, started)
            seen.append((item, got))
    assert seen == [("a", "A"), ("b", "B"), ("c", "C")]
    started.clear()  # negative control: without ``ahead`` nothing is read before its turn
    with prefetch.read_ahead(read, ["a", "b"], ahead=False) as items:
        for i, _ in enumerate(items):
            time.sleep(0.05)
            assert started == ["a", "b"][:i + 1]
    with prefetch.read_ahead(read, ["a", "bad", "c"]) as items, pytest.raises(SpillError, match="bad bytes"):
        assert next(items) == ("a", "A")
        next(items)


def _eventually(ok, seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while not ok() and time.monotonic() < end:
        time.sleep(0.005)
    return ok()


def test_leftover_spill_files_are_deleted_when_the_state_folder_opens(tmp_path):
    folder = tmp_path / "t.slab.state"
    CompileState(folder, {"measurement_key": "k"}, resume=False)
    leftover = spill_path(folder, "effect-inputs")
    leftover.write_bytes(b"x" * 1000)  # a killed compile's
    CompileState(folder, {"measurement_key": "k"}, resume=True)
    assert not leftover.exists() and (folder / "state.json").is_file()


# --- the host plan --------------------------------------------------------------------------------------------------


def _needs(**kw) -> HostNeeds:
    parts = dict(process=1000, kept=100, block=200, rungs=50, hessian=0, calibrate=0, effects=0, tape=400,
                 saved=900)
    return HostNeeds(**{**parts, **kw})


def test_the_host_plan_spills_each_part_only_when_its_pass_would_pass_the_budget(tmp_path):
    n = _needs()
    gpu = VramPlan(None, None, host_tape=True, host_saved=True, device="cuda")
    plan = lambda b: plan_host(n, b, gpu, tmp_path)  # noqa: E731
    assert (plan(n.peak(False, False)).tape_where, plan(n.peak(False, False)).saved_where) == ("pinned", "pinned")
    # the effect inputs first: their pass is the larger
    assert (plan(n.peak(False, False) - 1).tape_where, plan(n.peak(False, False) - 1).saved_where) == \
        ("pinned", "spilled")
    assert plan(n.peak(True, True)).spill_tape and plan(n.peak(True, True)).spill_saved
    # the tape alone, when only the calibration pass is over
    tape_heavy = _needs(tape=2000, saved=10)
    p = plan_host(tape_heavy, tape_heavy.peak(False, False) - 1, gpu, tmp_path)
    assert p.spill_tape and not p.spill_saved
    # on the GPU nothing waits on the host, so nothing is spilled
    on_gpu = plan_host(_needs(tape=0, saved=0), 10**6, VramPlan(None, None, device="cuda"), tmp_path)
    assert (on_gpu.tape_where, on_gpu.saved_where) == ("gpu", "gpu")
    assert "spilled to " + str(spill_path(tmp_path, "effect-inputs")) in plan(n.peak(True, True)).describe()
    with pytest.raises(BudgetError) as refused:  # negative control: below the least
        plan(n.peak(True, True) - 1)
    message = str(refused.value)
    assert message.startswith("--host-budget ") and message.count(". ") == 0 and message.endswith(".")
    assert f"give it at least {format_size_up(n.peak(True, True))}." in message
    # parts smaller than the spill's staging buffer are cheaper kept: the least budget then spills nothing
    small = _needs(tape=10, saved=20, staging=1000)
    assert small.least == small.peak(False, False) < small.peak(True, True)
    assert not plan_host(small, small.least, gpu, tmp_path).spill_saved


def test_a_spilled_tape_keeps_in_memory_what_the_budget_has_room_for_and_no_more(tmp_path):
    n = _needs()  # tape 400: spilled, the calibration pass holds 100 beside the 1300 fixed; the effects pass 50
    gpu = VramPlan(None, None, host_tape=True, host_saved=True, device="cuda")
    between = plan_host(n, 1600, gpu, tmp_path)
    assert between.spill_tape and between.tape_kept == 200 and between.expected_peak == 1600
    assert "beyond the first 200 B of each block, kept in pinned host memory" in between.describe()
    assert between.record(final=True)["recorded_inputs_kept_bytes"] == 200
    # negative control: at the least budget there is no room, so the whole tape is spilled
    least = plan_host(n, n.peak(True, True), gpu, tmp_path)
    assert least.spill_tape and least.tape_kept == 0 and least.expected_peak == n.peak(True, True)
    assert "beyond the first" not in least.describe()
    # never more than the tape itself (the effects pass can leave more room than the tape takes)
    assert _needs(tape=400, saved=5000, rungs=0).room_for_tape(10**6, True) == 400


def test_keep_then_spill_keeps_the_first_tensors_within_its_quota_and_spills_the_rest(tmp_path):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, generator=g) for _ in range(4)]  # 256 bytes each
    with SpillFile(tmp_path / "tape") as f:
        store = KeepThenSpill(f, torch.clone, 600, lambda t: t.numel() * t.element_size())
        out = [store(x) for x in xs]
        assert [torch.is_tensor(o) for o in out] == [True, True, False, False] and store.kept == 512
        assert f.bytes_written == 512
        assert all(torch.equal(o if torch.is_tensor(o) else o.load(), x) for o, x in zip(out, xs))
        # the outputs of a chunked block, some kept and some spilled, join as one tensor read back when consumed
        joined = spill.join(out)
        assert torch.equal(joined.to("cpu"), torch.cat(xs))
        # negative control: no quota, nothing kept
        none = KeepThenSpill(f, torch.clone, 0, lambda t: t.numel() * t.element_size())
        assert not any(torch.is_tensor(none(x)) for x in xs)


def test_the_default_host_budget_is_what_is_available_less_10_percent_or_2_gb(monkeypatch):
    monkeypatch.setattr(host_budget, "anonymous_memory", lambda: 1 << 30)
    monkeypatch.setattr(host_budget, "available_memory", lambda: 64 << 30)
    assert default_host_budget()[0] == (1 << 30) + (64 << 30) - int(0.1 * (64 << 30))
    monkeypatch.setattr(host_budget, "available_memory", lambda: 8 << 30)
    budget, how = default_host_budget()
    assert budget == (1 << 30) + (8 << 30) - (2 << 30) and "margin" in how
    monkeypatch.setattr(host_budget, "available_memory", lambda: None)
    assert default_host_budget()[0] is None
    monkeypatch.undo()  # the real readers answer on this machine
    assert host_budget.available_memory() > 0 and host_budget.resident_memory() > 0


def test_the_gpu_estimate_counts_each_pinned_copy_rounded_up_to_a_power_of_two():
    """Pinned copies are counted one by one as torch's caching host allocator makes them (the next power of two):
    never less than the plain bytes, and each copy's size is a power of two."""
    from squareq.compiler.chunks import batched_kwargs, probe_batch_axes
    from squareq.compiler.host_plan import estimate_host
    from squareq.compiler.ladder import DEFAULT_FORMATS, rung_specs
    from squareq.compiler.vram import estimate_needs

    source = open_source("tiny-flux")
    skeleton = source.skeleton()
    batch = source.family_adapter.calibration_inputs(skeleton, 8, 0)
    axes = probe_batch_axes(source, batch.kwargs, batched_kwargs(batch.kwargs, batch.heldout_kwargs, 8), 8, 1)
    needs = estimate_needs(source, skeleton, batch, axes, gptq=True, max_rows=128, probes=4,
                           specs=rung_specs(DEFAULT_FORMATS))
    est = lambda device, on_host: estimate_host(  # noqa: E731
        needs, VramPlan(None, needs, on_host, on_host, device), skeleton, source.block_paths, batch, axes,
        rung_specs(DEFAULT_FORMATS), 4, gptq=True)
    gpu, cpu, kept = est("cuda", True), est("cpu", False), est("cuda", False)
    held = len(batch.heldout) or 8
    copies = axes.probes_per_pass(held, 4) * held
    assert gpu.saved == sum(pinned_bytes(copies * n if b else n) for _, c in axes.calls
                            for n, b in zip(c.input_bytes, c.inputs))
    assert gpu.saved >= cpu.saved >= needs.saved > 0 and gpu.tape >= needs.tape > 0
    assert gpu.hessian > 0 and cpu.hessian == 0 and cpu.calibrate > 0  # on the CPU the work is the host's
    assert kept.tape == kept.saved == 0  # on the GPU: not the host's
    assert all(pinned_bytes(n) & (pinned_bytes(n) - 1) == 0 and pinned_bytes(n) >= n for n in (1, 3, 4096, 4097))


# --- end to end -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, tiny_flux_images):
    """tiny-flux compiled twice, chunked (one sample per chunk, one probe per effects pass): with a host budget far
    above its needs, and at the least the plan accepts (recorded and effect inputs spilled). Records every spill
    file made, and which spill files the state folder held when the plan's error pass started."""
    tmp = tmp_path_factory.mktemp("host")
    plans, files, at_plan_error = [], [], []

    class Recorded(SpillFile):
        def __init__(self, path):
            super().__init__(path)
            files.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunks, "CHUNK_BYTES", 1)
        mp.setattr(chunks, "EFFECT_PASS_BYTES", 1)
        mp.setattr(host_plan, "SpillFile", Recorded)
        real = compile_setup.plan_host
        mp.setattr(compile_setup, "plan_host", lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])

        def progress(line):
            if line.startswith("measuring the plan's model-output error"):
                at_plan_error.append(sorted(p.name for p in (tmp / "tight.slab.state").glob("spill.*")))

        opts = dict(OPTS, calib_images=tiny_flux_images)
        compile_slab(open_source("tiny-flux"), tmp / "roomy.slab", CompileOptions(**opts, host_budget=10**13))
        roomy_files = len(files)
        n = plans[0].needs
        least = n.peak(True, True)
        compile_slab(open_source("tiny-flux"), tmp / "tight.slab", CompileOptions(**opts, host_budget=least),
                     progress=progress)
        tight_files = len(files)
        # room for about half the tape beside the spill, below what keeping either part whole needs
        between = min(n.peak(True, True, n.tape // 2), n.peak(False, True) - 1, n.peak(True, False) - 1)
        compile_slab(open_source("tiny-flux"), tmp / "between.slab", CompileOptions(**opts, host_budget=between))
    return dict(tmp=tmp, plans=plans, files=files, roomy_files=roomy_files, tight_files=tight_files,
                at_plan_error=at_plan_error)


def _vram(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"{name}.slab" / "manifest.json").read_text())["calibration"]["vram"]


def test_a_host_budget_below_what_waits_spills_it_and_writes_the_same_slab(compiled):
    tmp, files = compiled["tmp"], compiled["files"][compiled["roomy_files"]:compiled["tight_files"]]
    a, b = ((tmp / f"{n}.slab" / "slab.safetensors").read_bytes() for n in ("roomy", "tight"))
    assert a == b
    rungs = [[layer["rung"] for layer in json.loads((tmp / f"{n}.slab" / "manifest.json").read_text())["layers"]]
             for n in ("roomy", "tight")]
    assert rungs[0] == rungs[1]
    tight = compiled["plans"][1]
    assert tight.spill_tape and tight.spill_saved and tight.expected_peak <= tight.budget
    vram = _vram(tmp, "tight")
    assert vram["recorded_inputs"] == vram["effect_inputs"] == "spilled"
    assert vram["recorded_inputs_on_host"] is False and vram["effect_inputs_on_host"] is False  # the VRAM plan's
    by_part = {f.path.name: f for f in files}
    assert set(by_part) == {"spill.recorded-inputs.scratch", "spill.effect-inputs.scratch"}
    tape, saved = by_part["spill.recorded-inputs.scratch"], by_part["spill.effect-inputs.scratch"]
    assert vram["recorded_inputs_spilled_bytes"] == tape.bytes_written > 0 and tape.bytes_read > 0
    assert vram["effect_inputs_spilled_bytes"] == saved.bytes_written > 0 and saved.bytes_read > 0
    assert vram["host_budget_bytes"] == tight.budget and vram["host_expected_peak_bytes"] == tight.expected_peak
    # each file gone when its pass ended (before the plan's error is measured), and the state folder with it after
    assert compiled["at_plan_error"] == [[]]
    assert not any(f.path.exists() for f in files) and not (tmp / "tight.slab.state").exists()


def test_room_beside_the_spill_keeps_the_first_recorded_inputs_in_memory_and_writes_the_same_slab(compiled):
    tmp, plans = compiled["tmp"], compiled["plans"]
    tight, between = plans[1], plans[2]
    assert between.spill_tape and 0 < between.tape_kept < between.needs.tape
    assert between.expected_peak <= between.budget
    a, b = ((tmp / f"{n}.slab" / "slab.safetensors").read_bytes() for n in ("tight", "between"))
    assert a == b
    wrote = {n: _vram(tmp, n)["recorded_inputs_spilled_bytes"] for n in ("tight", "between")}
    assert 0 < wrote["between"] < wrote["tight"]  # fewer through the file: the kept ones did not go
    assert _vram(tmp, "between")["recorded_inputs_kept_bytes"] == between.tape_kept
    # at the least budget the effects pass sets the peak, so the calibration pass has some room there too, less
    assert _vram(tmp, "tight")["recorded_inputs_kept_bytes"] == tight.tape_kept < between.tape_kept


def test_a_large_host_budget_spills_nothing(compiled):
    roomy = compiled["plans"][0]
    assert compiled["roomy_files"] == 0 and not roomy.spill_tape and not roomy.spill_saved
    vram = _vram(compiled["tmp"], "roomy")
    assert vram["recorded_inputs"] == vram["effect_inputs"] == "host"  # a CPU compile: its host memory is all it has
    assert vram["recorded_inputs_spilled_bytes"] == vram["effect_inputs_spilled_bytes"] == 0
    assert vram["host_budget_bytes"] == 10**13


def test_a_host_budget_below_the_least_is_refused_before_calibration_with_the_smallest_that_works(tmp_path):
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    # above the process itself (below it is refused before the encoders: tests/compiler/test_budget.py), under the least
    refused = CliRunner().invoke(main, args + ["--host-budget", "1.1GB"])
    errors = error_lines(refused)
    assert refused.exit_code == 1 and len(errors) == 1, refused.output
    assert errors[0].startswith("error: --host-budget 1.10 GB cannot hold the compile's host memory")
    assert "the process itself" in errors[0] and errors[0].count(". ") == 0
    assert "calibrating and searching" not in refused.output  # refused before the calibration pass
    assert not out.exists() and not (tmp_path / "t.slab.state").exists()
    least = _minimum_from(refused.output)
    # negative control: the stated minimum itself is accepted
    ok = CliRunner().invoke(main, args + ["--host-budget", str(least)])
    assert ok.exit_code == 0, ok.output
    vram = json.loads((out / "manifest.json").read_text())["calibration"]["vram"]
    # the cheapest placement was taken (tiny-flux's tape is a few recorded inputs: spilling it would hold two of them
    # in flight, no less than keeping it)
    assert vram["host_expected_peak_bytes"] <= vram["host_budget_bytes"] == least
