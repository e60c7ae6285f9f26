"""The budget's sizes and the planner (compiler/plan.py) on hand-made measurements."""
import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.compiler.budget import BudgetError, parse_size
from squareq.compiler.plan import HYSTERESIS, LayerOptions, PlanError, make_plan

from .test_vram import tiny_compile_args

# the torch reference dequantizer (conftest.py): the refusals and the compiles they let through are under test here
pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.mark.parametrize("text, n", [("12GB", 12 * 10**9), ("11.5GiB", int(11.5 * 2**30)), ("800MB", 800 * 10**6),
                                     ("123456", 123456), (" 2 kib ", 2048)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["lots", "12XB", "", "-5GB"])
def test_unparsable_sizes_are_refused(text):
    with pytest.raises(BudgetError, match="write it like 12GB"):
        parse_size(text)


BYTES = {"W4": 100, "W6": 150, "W8": 200, "bf16": 400}


def layers(start="W4"):
    """Three blocks of two layers; layer l0 of each block matters 4x more to the output than l1."""
    return [LayerOptions(f"b.{i}.l{j}", i, dict(BYTES),
                         {"W4": 4e-3 / (1 + 3 * j), "W6": 1e-3 / (1 + 3 * j), "W8": 1e-4, "bf16": 0.0}, start)
            for i in range(3) for j in range(2)]


FIXED = {0: 50, 1: 50, 2: 50}


def total(plan, overhead=0):
    return overhead + sum(FIXED.values()) + plan.layer_bytes


def test_nothing_moves_when_the_start_meets_tau_out():
    plan = make_plan(layers(), FIXED, tau=0.02)
    assert set(plan.rungs.values()) == {"W4"} and plan.moves == {}
    assert plan.error == pytest.approx(3 * (4e-3 + 1e-3))


def test_moves_up_where_the_error_falls_most_per_byte_and_says_why():
    plan = make_plan(layers(), FIXED, tau=0.01)
    up = sorted(n for n, r in plan.rungs.items() if r != "W4")
    assert up == ["b.0.l0", "b.1.l0", "b.2.l0"][: len(up)] and up  # the layers that matter most, first
    assert plan.error <= 0.01
    (move,) = plan.moves[up[0]]
    assert move.startswith("up W4→W6: the plan's model-output rel-MSE") and "> τ_OUT 0.01" in move and "+50 bytes" in move


def test_a_rebuild_moves_down_to_the_floor_and_then_stays():
    strict = make_plan(layers(), FIXED, tau=1e-3)
    assert strict.error <= 1e-3
    relaxed = make_plan([LayerOptions(x.name, x.block, x.bytes, x.effect, strict.rungs[x.name]) for x in layers()],
                        FIXED, tau=0.01)
    assert relaxed.layer_bytes < strict.layer_bytes and relaxed.error <= HYSTERESIS * 0.01
    assert all(m.startswith("down W") for moves in relaxed.moves.values() for m in moves) and relaxed.moves
    again = make_plan([LayerOptions(x.name, x.block, x.bytes, x.effect, relaxed.rungs[x.name]) for x in layers()],
                      FIXED, tau=0.01)
    assert again.rungs == relaxed.rungs and again.moves == {}


def test_a_plan_between_the_floor_and_tau_out_does_not_move():
    start = make_plan(layers(), FIXED, tau=0.012)
    assert HYSTERESIS * 0.012 < start.error <= 0.012
    again = make_plan([LayerOptions(x.name, x.block, x.bytes, x.effect, start.rungs[x.name]) for x in layers()],
                      FIXED, tau=0.012)
    assert again.rungs == start.rungs and again.moves == {}


def test_a_budget_below_the_plan_is_refused_with_the_minimum_and_a_tau_that_fits():
    plan = make_plan(layers(), FIXED, tau=0.01)
    need = total(plan, overhead=100)
    with pytest.raises(PlanError, match=f"at least {need:,} bytes") as info:
        make_plan(layers(), FIXED, tau=0.01, budget=need - 1, overhead=100)
    assert isinstance(info.value, BudgetError) and "τ_OUT (out) =" in str(info.value)
    assert make_plan(layers(), FIXED, tau=0.01, budget=need, overhead=100).rungs == plan.rungs


def test_quality_objective_spends_the_rest_where_the_error_falls_most_per_byte():
    base = make_plan(layers(), FIXED, tau=0.02)
    budget = total(base) + 100  # two W4→W6 moves
    plan = make_plan(layers(), FIXED, tau=0.02, budget=budget, objective="quality")
    up = sorted(n for n, r in plan.rungs.items() if r != "W4")
    assert len(up) == 2 and all(n.endswith("l0") for n in up)
    assert total(plan) <= budget and plan.error < base.error
    assert all("--objective quality" in plan.moves[n][-1] for n in up)


def test_the_block_cap_moves_layers_down_inside_the_biggest_blocks():
    big = [LayerOptions(x.name, x.block, x.bytes, x.effect, "W8") for x in layers()]
    cap = 50 + 200 + 100  # one layer per block may stay at W8
    plan = make_plan(big, FIXED, tau=1.0, block_cap=cap)
    per_block = {}
    for x in big:
        per_block[x.block] = per_block.get(x.block, FIXED[x.block]) + x.bytes[plan.rungs[x.name]]
    assert max(per_block.values()) <= cap
    assert any("block cap" in m for moves in plan.moves.values() for m in moves)
    with pytest.raises(PlanError, match="lowest rung, more than the block cap"):
        make_plan(big, FIXED, tau=1.0, block_cap=50 + 199)
    # an error limit the cap does not leave room for is refused, naming both
    with pytest.raises(PlanError, match="block cap allows"):
        make_plan(layers(), FIXED, tau=1e-6, block_cap=50 + 200)


def test_rungs_are_ordered_by_bytes_not_by_name_and_a_cheaper_format_is_taken_first():
    """A format of fewer bytes than W4 (NF4 here) is where a layer starts, and the planner moves by bytes and
    measured effect whatever the rungs are called."""
    nf4 = [LayerOptions(x.name, x.block, {**x.bytes, "NF4": 96}, {**x.effect, "NF4": x.effect["W4"] * 0.9}, "NF4")
           for x in layers()]
    assert nf4[0].rungs == ["NF4", "W4", "W6", "W8", "bf16"]
    plan = make_plan(nf4, FIXED, tau=0.02)
    assert set(plan.rungs.values()) == {"NF4"} and plan.moves == {}  # NF4 is cheaper and better: W4 is never taken
    tight = make_plan(nf4, FIXED, tau=0.01)
    assert "W4" not in tight.rungs.values() and any(m.startswith("up NF4→W6") for ms in tight.moves.values() for m in ms)


def test_a_rung_of_the_same_bytes_and_less_effect_is_a_move_up():
    same = [LayerOptions(x.name, x.block, {**x.bytes, "FP8": 200}, {**x.effect, "FP8": 5e-5}, "W8") for x in layers()]
    plan = make_plan(same, FIXED, tau=4e-4)  # all six at W8 err 6e-4; four at FP8 meet it without a byte more
    assert "bf16" not in plan.rungs.values() and plan.error <= 4e-4 and plan.layer_bytes <= 6 * 200
    assert any(m.startswith("up W8→FP8") and "+0 bytes" in m for ms in plan.moves.values() for m in ms)


def test_a_budget_below_the_smallest_slab_the_shapes_give_is_refused_before_anything_is_measured(tmp_path):
    from click.testing import CliRunner

    from squareq.cli import main

    out = tmp_path / "t.slab"
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(out), "--budget", "300000",
                                       "--calib-samples", "8", "--calib-resolution", "64"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert "--budget 300,000 bytes is below the smallest slab this model can have, 377,856 bytes" in errors[0]
    assert "raise --budget" in errors[0]
    assert "encoding" not in result.output and "calibrating" not in result.output  # refused before the encoders ran
    assert not out.exists() and not (tmp_path / "t.slab.state").exists()


def test_the_smallest_slab_bound_is_below_a_real_slab_with_every_layer_at_the_smallest_rung(tmp_path, tiny_flux):
    from squareq.compiler.budget import least_slab_bytes
    from squareq.compiler.ladder import DEFAULT_FORMATS, rung_specs
    from squareq.compiler.plain import PlainOptions, write_rtn_slab
    from squareq.sources import open_source

    smallest = rung_specs(DEFAULT_FORMATS)[0]
    model, adapter = tiny_flux
    out = tmp_path / "w4.slab"
    write_rtn_slab(model, adapter.blocks(model), {}, out, PlainOptions(default_spec=smallest, family="flux",
                                                                       source="tiny-flux"))
    source = open_source("tiny-flux")
    resident, fixed, layers = least_slab_bytes(source.skeleton(), source.block_paths, rung_specs(DEFAULT_FORMATS))
    size = (out / "slab.safetensors").stat().st_size
    assert resident > 0 and fixed > 0 and layers > 0
    assert resident + fixed + layers <= size < 2 * (resident + fixed + layers), (resident, fixed, layers, size)


def test_a_block_cap_no_block_fits_is_refused_before_anything_is_measured(tmp_path):
    """The third audit: an impossible --max-block-bytes was refused only after the encoders and the whole search ran,
    leaving a state folder. Refused from the shapes now, naming the block; a cap above the bound goes on to the
    encoders (the positive control: it reaches calibration)."""
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    result = CliRunner().invoke(main, [*args, "--max-block-bytes", "1KB"])
    assert result.exit_code == 1 and "--max-block-bytes 1,000 cannot hold block transformer_blocks." in result.output
    assert "encoding" not in result.output and "calibrating" not in result.output
    assert not out.exists() and not (tmp_path / "t.slab.state").exists()
    result = CliRunner().invoke(main, [*args, "--max-block-bytes", "200KB"])
    assert result.exit_code == 0 and "calibrating" in result.output, result.output[-1500:]


def test_a_host_budget_below_the_process_is_refused_before_the_encoders(tmp_path):
    """The third audit: an impossible --host-budget was refused only after the calibration images were encoded. Below
    what the process itself takes, it is refused before; a budget above it reaches calibration (positive control)."""
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    result = CliRunner().invoke(main, [*args, "--host-budget", "1KB"])
    assert result.exit_code == 1 and "--host-budget 1.00 KB cannot hold the compile's host memory" in result.output
    assert "encoding" not in result.output and not out.exists() and not (tmp_path / "t.slab.state").exists()
    result = CliRunner().invoke(main, [*args, "--host-budget", "8GB"])
    assert result.exit_code == 0 and "calibrating" in result.output, result.output[-1500:]


def test_a_vram_cap_no_ring_of_blocks_fits_is_refused_before_the_encoders(tmp_path):
    """The third audit: a --vram-cap above the resident tensors but below two ring slots of a block was refused only
    after the whole search. Refused from the shapes now, naming the least; a cap above it compiles (positive
    control)."""
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    result = CliRunner().invoke(main, [*args, "--vram-cap", "150KB"])
    assert result.exit_code == 1 and "--vram-cap 150,000 cannot hold the resident tensors" in result.output
    assert "2 ring slots of block transformer_blocks." in result.output
    assert "encoding" not in result.output and not (tmp_path / "t.slab.state").exists()
    result = CliRunner().invoke(main, [*args, "--vram-cap", "400KB"])
    assert result.exit_code == 0, result.output[-1500:]


def test_a_compile_refused_by_its_budget_continues_when_rerun_with_another_budget_without_resume(tmp_path):
    """The third audit: the refusal said to rerun with --resume, and the rerun without it was blocked by the state
    folder the refusal kept. The same model and measurement options now continue from it, saying so."""
    from .test_vram import error_lines

    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    at = args.index("--budget") + 1
    refused = CliRunner().invoke(main, args[:at] + ["380KB"] + args[at + 1:])
    assert refused.exit_code == 1 and "the measurements are kept in" in refused.output, refused.output
    assert (tmp_path / "t.slab.state").is_dir() and not out.exists()
    # negative control: other measurement options cannot use those measurements, and say so
    other = CliRunner().invoke(main, args + ["--calib-samples", "4"])
    assert other.exit_code == 1 and len(error_lines(other)) == 1, other.output
    assert "was made by a compile with different inputs" in error_lines(other)[0]
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 0, rerun.output
    assert "continuing the compile in" in rerun.output and "calibrating and searching" not in rerun.output
    assert out.is_dir() and not (tmp_path / "t.slab.state").exists()


def test_a_refused_block_cap_names_the_flag_it_came_from_and_a_value_that_holds_the_block():
    """Issue 63: the planner's refusal of a cap from --vram-cap told the user to raise --max-block-bytes. It names
    the flag given now, and a value of it that holds the block (the control: a cap given as --max-block-bytes)."""
    from squareq.compiler.plan import CapFlag

    big = [LayerOptions(x.name, x.block, x.bytes, x.effect, "W8") for x in layers()]
    with pytest.raises(PlanError) as refused:
        make_plan(big, FIXED, tau=1.0, block_cap=50 + 199)
    assert "more than the block cap of 249; raise --max-block-bytes to 250 or offer" in str(refused.value)
    vram = CapFlag("--vram-cap", given=10_000, slots=2)  # the resident tensors and 2 slots of 249 bytes, and 1 spare
    with pytest.raises(PlanError) as refused:
        make_plan(big, FIXED, tau=1.0, block_cap=50 + 199, cap_flag=vram)
    message = str(refused.value)
    assert "the 249 bytes --vram-cap 10,000 leaves each of its 2 ring slots; raise --vram-cap to 10,002" in message
    assert "--max-block-bytes" not in message
    with pytest.raises(PlanError, match=r"raise --vram-cap or τ_OUT"):
        make_plan(layers(), FIXED, tau=1e-6, block_cap=50 + 200, cap_flag=vram)


def _block_floors():
    """For tiny-flux at the default --formats: (the old early bound, the largest block with its layers at the smallest
    rung; the new, with the smoothing scales the search may add; the resident tensors as --vram-cap counts them)."""
    from squareq.compiler.budget import _stored_bytes, largest_least_block
    from squareq.compiler.ladder import DEFAULT_FORMATS, rung_specs
    from squareq.sources import open_source

    source, specs = open_source("tiny-flux"), rung_specs(DEFAULT_FORMATS)
    skeleton = source.skeleton()
    blocks = tuple(p + "." for p in source.block_paths)
    resident = sum(_stored_bytes(t) for n, t in skeleton.state_dict().items() if not n.startswith(blocks))
    return (largest_least_block(skeleton, source.block_paths, specs)[1],
            largest_least_block(skeleton, source.block_paths, specs, scales=True)[1], resident)


@pytest.mark.parametrize("flag", ["--max-block-bytes", "--vram-cap"])
def test_a_cap_just_above_the_old_bound_is_refused_before_calibration_and_the_floor_it_names_compiles(tmp_path,
                                                                                                       flag):
    """Issue 63: --max-block-bytes 89,601 (the old early bound 89,600 + 1; the search's block took 92,928) and the
    --vram-cap of two such slots were refused only after the whole search, the latter naming --max-block-bytes. The
    early floor counts the smoothing scales the search may add now: a value below it is refused before calibration in
    one sentence naming the flag given and the floor; the floor itself compiles (the negative control)."""
    from .test_vram import error_lines

    old, floor, resident = _block_floors()
    assert (old, floor) == (89_600, 94_720)  # the audit's model: every one of a block's 14 layers smoothed adds 5,120
    slots = 2  # --ring-slots' default
    value = {"--max-block-bytes": lambda block: block, "--vram-cap": lambda block: resident + slots * block}[flag]
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    for given in (value(old + 1), value(floor) - 1):
        result = CliRunner().invoke(main, [*args, flag, str(given)])
        errors = error_lines(result)
        assert result.exit_code == 1 and len(errors) == 1, result.output[-1500:]
        assert errors[0].startswith(f"error: {flag} {given:,} cannot hold ") and errors[0].endswith(".")
        assert f"raise {flag} to at least {value(floor):,} " in errors[0]
        assert "--max-block-bytes" not in errors[0] or flag == "--max-block-bytes"
        assert "calibrating" not in result.output and not (tmp_path / "t.slab.state").exists()
    result = CliRunner().invoke(main, [*args, flag, str(value(floor))])
    assert result.exit_code == 0 and out.is_dir(), result.output[-1500:]


def test_a_vram_cap_the_search_cannot_fit_is_refused_naming_vram_cap(tmp_path, monkeypatch):
    """The late refusal, where it can still happen (the early check is skipped for a rebuild, stood in for here by
    switching it off): it names --vram-cap, the flag given, and a value of it that holds the block."""
    import squareq.compiler.compile_setup as compile_setup

    from .test_vram import error_lines

    old, _, resident = _block_floors()
    monkeypatch.setattr(compile_setup, "check_vram_cap", lambda *args: None)
    out = tmp_path / "t.slab"
    given = resident + 2 * (old + 1)
    result = CliRunner().invoke(main, [*tiny_compile_args(out), "--vram-cap", str(given)])
    errors = error_lines(result)
    assert result.exit_code == 1 and len(errors) == 1 and "calibrating" in result.output, result.output[-1500:]
    assert "leaves each of its 2 ring slots; raise --vram-cap to " in errors[0]
    assert "--max-block-bytes" not in errors[0]
