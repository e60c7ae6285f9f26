"""`squareq compile --from`: the ladder moves both ways across builds, by measured effect, and converges."""
import json
import math

import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.compiler import CompileOptions, Thresholds, compile_slab, layer_search
from squareq.slab import SlabError
from squareq.sources import open_source

pytestmark = pytest.mark.usefixtures("torch_kernels")

ARGS = ["--budget", "2MB", "--calib-samples", "8", "--calib-resolution", "64", "--rounding", "nearest"]


def manifest(slab):
    return json.loads((slab / "manifest.json").read_text())


def size(slab):
    return sum(p.stat().st_size for p in slab.iterdir())


def compile_cli(*args):
    result = CliRunner().invoke(main, ["compile", "tiny-flux", *args, *ARGS])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    d = tmp_path_factory.mktemp("rebuild")
    strict = d / "strict.toml"
    strict.write_text("[thresholds]\nout = 0.002\n")
    compile_cli("-o", str(d / "1.slab"), "--thresholds", str(strict))
    second = compile_cli("-o", str(d / "2.slab"), "--from", str(d / "1.slab"))
    return d, second


def test_a_rebuild_with_default_thresholds_moves_layers_down_and_says_why(builds):
    d, output = builds
    first, second = manifest(d / "1.slab"), manifest(d / "2.slab")
    assert "reusing the measurements" in output
    assert size(d / "2.slab") < size(d / "1.slab")
    down = [layer for layer in second["layers"] if any(m.startswith("down W") for m in layer["history"][-1]["moves"])]
    assert down
    before = {layer["name"]: layer for layer in first["layers"]}
    for layer in down:
        was = before[layer["name"]]
        assert layer["rungs"][layer["rung"]]["bytes"] < was["rungs"][was["rung"]]["bytes"]
        assert [h["build"] for h in layer["history"]] == [1, 2]
        assert [h["rung"] for h in layer["history"]] == [was["rung"], layer["rung"]]
        assert "the floor 0.8·τ_OUT" in layer["history"][-1]["moves"][0]
    cal = second["calibration"]
    assert cal["build"] == 2 and cal["measurements"].startswith("reused from") and cal["from"].endswith("1.slab")
    assert cal["predicted_output_rel_mse"] <= 0.8 * Thresholds().out
    assert first["calibration"]["measured_output_rel_mse"] < cal["measured_output_rel_mse"]
    shown = CliRunner().invoke(main, ["inspect", str(d / "2.slab")]).output
    assert "history (the rung at each build" in shown and "build 2 W4 (down W" in shown


def test_a_third_build_changes_nothing_and_searches_nothing(builds, monkeypatch):
    d, _ = builds
    searched = []
    original = layer_search.search_rungs
    monkeypatch.setattr("squareq.compiler.ladder.search_rungs", lambda *a, **k: searched.append(a) or original(*a, **k))
    compile_cli("-o", str(d / "3.slab"), "--from", str(d / "2.slab"))
    assert searched == []
    second, third = manifest(d / "2.slab"), manifest(d / "3.slab")
    assert (d / "3.slab/slab.safetensors").read_bytes() == (d / "2.slab/slab.safetensors").read_bytes()
    assert [(x["name"], x["rung"]) for x in third["layers"]] == [(x["name"], x["rung"]) for x in second["layers"]]
    assert all(x["history"][-1] == {"build": 3, "rung": x["rung"], "moves": [],
                                    **{k: v for k, v in x["history"][-1].items() if k in ("notes", "diagnostics")}}
               for x in third["layers"])


def test_from_a_slab_of_another_model_is_refused_in_one_sentence(builds, tmp_path, tiny_flux_images):
    from diffusers import FluxTransformer2DModel

    d, _ = builds
    other = FluxTransformer2DModel(**{**dict(open_source("tiny-flux").skeleton().config), "num_single_layers": 1})
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SlabError, match=r"--from .*1\.slab was compiled from another model"):
        compile_slab(open_source(str(tmp_path / "other")), tmp_path / "x.slab",
                     CompileOptions(budget=2_000_000, previous=str(d / "1.slab"), calib_images=tiny_flux_images,
                                    rounding="nearest", calib_samples=4))
    assert not (tmp_path / "x.slab").exists()


def test_the_default_plan_buys_output_error_as_cheaply_as_the_budget_solver(tmp_path):
    """Every byte the default plan spends above all-W4 is justified by the measured output error: per byte it lowers
    that error at least as much as the quality objective spending the same bytes from all-W4."""
    loose = tmp_path / "loose.toml"
    loose.write_text("[thresholds]\nout = 1.0\n")
    compile_cli("-o", str(tmp_path / "w4.slab"), "--thresholds", str(loose))
    compile_cli("-o", str(tmp_path / "default.slab"))
    w4, plan = manifest(tmp_path / "w4.slab"), manifest(tmp_path / "default.slab")
    assert {x["rung"] for x in w4["layers"]} == {"W4"}
    extra = size(tmp_path / "default.slab") - size(tmp_path / "w4.slab")
    assert extra > 0, "the default thresholds should spend some bytes on tiny-flux at this calibration"
    budget = size(tmp_path / "w4.slab") + extra + 512 * len(w4["layers"])  # the compiler's manifest reserve
    compile_cli("-o", str(tmp_path / "solver.slab"), "--thresholds", str(loose), "--objective", "quality",
                "--budget", str(budget))
    solver = manifest(tmp_path / "solver.slab")
    solver_extra = size(tmp_path / "solver.slab") - size(tmp_path / "w4.slab")
    err = lambda m: m["calibration"]["measured_output_rel_mse"]  # noqa: E731
    plan_rate = (err(w4) - err(plan)) / extra
    solver_rate = (err(w4) - err(solver)) / solver_extra
    assert plan_rate > 0 and solver_rate > 0
    assert plan_rate >= 0.9 * solver_rate, (plan_rate, solver_rate)


def test_a_slab_written_before_rungs_had_names_reads_with_names_and_rebuilds(builds, tmp_path):
    """Slabs before the format registry recorded a rung as its bit width (4, 6, 8; 16 for bf16): they read with
    names, show them in inspect, and serve as --from like any other."""
    import shutil

    d, _ = builds
    legacy = tmp_path / "legacy.slab"
    shutil.copytree(d / "2.slab", legacy)
    m = manifest(legacy)
    bits = {"W4": 4, "W6": 6, "W8": 8, "bf16": 16}
    for layer in m["layers"]:
        layer["rung"] = bits[layer["rung"]]
        for h in layer["history"]:
            h["rung"] = bits[h["rung"]]
        layer["rungs"] = {str(bits[r]): v for r, v in layer["rungs"].items()}
    (legacy / "manifest.json").write_text(json.dumps(m))
    shown = CliRunner().invoke(main, ["inspect", str(legacy)]).output
    assert "build 2 W4 (down W" in shown and "build 2 4" not in shown
    compile_cli("-o", str(tmp_path / "3.slab"), "--from", str(legacy))
    third, second = manifest(tmp_path / "3.slab"), manifest(d / "2.slab")
    assert [(x["name"], x["rung"]) for x in third["layers"]] == [(x["name"], x["rung"]) for x in second["layers"]]
    assert [list(x["rungs"]) for x in third["layers"]] == [list(x["rungs"]) for x in second["layers"]]


def _edited_copy(builds, tmp_path, edit):
    import shutil

    d, _ = builds
    copy = tmp_path / "edited.slab"
    shutil.copytree(d / "2.slab", copy)
    m = manifest(copy)
    edit(m)
    (copy / "manifest.json").write_text(json.dumps(m))
    return copy


@pytest.mark.parametrize("build", ["2", 2.5, True, 0])
def test_a_from_slab_whose_build_is_not_a_count_is_one_sentence_before_the_encoders_run(builds, tmp_path, build):
    """Issue 40: calibration.build "abc" was a ValueError traceback after calibration, and "2" or 2.5 passed for a
    count; the sentence names the manifest and the key. The control: the slab it was edited from is taken."""
    from squareq.compiler.previous import check_previous

    edited = _edited_copy(builds, tmp_path, lambda m: m["calibration"].update(build=build))
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "-o", str(tmp_path / "x.slab"), "--from", str(edited),
                                       *ARGS])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"error: --from {edited}: {edited / 'manifest.json'}'s calibration.build is {str(build)!r}, not a whole " \
           "number of at least 1" in result.output
    assert "encoding" not in result.output and not (tmp_path / "x.slab").exists()
    check_previous(builds[0] / "2.slab", open_source("tiny-flux"))


def test_a_from_slab_with_a_nan_effect_is_measured_again_and_no_nan_is_copied(builds, tmp_path, caplog):
    """Issue 40: a NaN effect in PREV's manifest was reused, planned on and copied into the new manifest; now the
    effects are measured again, with a line naming the layer. (The control, a sound PREV reused, is the first test.)"""
    layer = manifest(builds[0] / "2.slab")["layers"][3]["name"]

    def poison(m):
        m["layers"][3]["rungs"]["W4"]["metrics"]["effect"] = float("nan")

    edited = _edited_copy(builds, tmp_path, poison)
    output = compile_cli("-o", str(tmp_path / "3.slab"), "--from", str(edited))
    assert "reusing the measurements" not in output
    assert f"layer {layer} at W4 records effect nan, not a finite number" in caplog.text
    third = manifest(tmp_path / "3.slab")
    assert third["calibration"]["measurements"] == "measured" and third["calibration"]["build"] == 3
    effects = [r["metrics"]["effect"] for x in third["layers"] for r in x["rungs"].values()]
    assert all(math.isfinite(e) for e in effects)
