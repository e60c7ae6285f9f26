import json

import pytest
from click.testing import CliRunner

from squareq.cli import main

from .slab.helpers import copy_slab, flip_byte


@pytest.fixture
def runner():
    return CliRunner()


def test_help_lists_every_command(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for name in ("compile", "train", "accept", "inspect", "demo"):
        assert f"  {name} " in result.output


def test_inspect_table_and_totals(runner, tiny_slab):
    result = runner.invoke(main, ["inspect", str(tiny_slab)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "transformer_blocks.0.attn.to_q" in out and "W8" in out and "W6" in out and "bf16" in out
    assert "bits per weight" in out and "streamed blocks" in out and "largest" in out


def test_inspect_json_matches_the_manifest(runner, tiny_slab):
    result = runner.invoke(main, ["inspect", str(tiny_slab), "--json"])
    assert result.exit_code == 0
    report = json.loads(result.output)
    manifest = json.loads((tiny_slab / "manifest.json").read_text())
    assert [row["layer"] for row in report["layers"]] == [layer["name"] for layer in manifest["layers"]]
    layer_bytes = sum(t["nbytes"] for layer in manifest["layers"] for t in layer["tensors"].values())
    weights = sum(layer["shape"][0] * layer["shape"][1] for layer in manifest["layers"])
    assert report["totals"]["bits_per_weight"] == pytest.approx(8 * layer_bytes / weights)
    assert report["totals"]["streamed_bytes"] == sum(b["nbytes"] for b in manifest["blocks"])


def test_inspect_verify_passes_on_a_good_slab(runner, tiny_slab):
    result = runner.invoke(main, ["inspect", str(tiny_slab), "--verify"])
    assert result.exit_code == 0 and "matches its sha256" in result.output


def test_inspect_verify_fails_clearly_on_one_flipped_byte(runner, tiny_slab, tmp_path):
    slab = copy_slab(tiny_slab, tmp_path / "bad.slab")
    flip_byte(slab / "slab.safetensors", offset_from_end=150_000)
    assert runner.invoke(main, ["inspect", str(slab)]).exit_code == 0  # without --verify nothing is hashed
    result = runner.invoke(main, ["inspect", str(slab), "--verify"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "sha256" in lines[0] and str(slab) in lines[0]


def test_inspect_of_a_missing_path(runner, tmp_path):
    result = runner.invoke(main, ["inspect", str(tmp_path / "nope.slab")])
    assert result.exit_code == 1 and "not a slab directory" in result.output


def test_demo_runs_compile_train_sample_accept(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")  # the Triton kernel has its own tests; the interpreter is slow
    out = tmp_path / "demo"
    result = runner.invoke(main, ["demo", "-o", str(out), "--steps", "12"])
    assert result.exit_code == 0, result.output
    for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
        assert step in result.output
    assert (out / "tiny-flux.slab" / "manifest.json").is_file() and (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "sample.png").stat().st_size > 0 and "all gates passed" in result.output
    report = json.loads((out / "accept.json").read_text())
    assert [g["name"] for g in report["gates"]] == ["layer MSE", "block drift", "image drift", "gradient agreement",
                                                    "convergence", "peak VRAM and size"]
    for gate in report["gates"]:  # the printed gate lines are the report's
        assert f"{gate['name']}: {gate['status']} ({gate['measured']};" in result.output
    assert (out / "accept" / "image-drift.png").stat().st_size > 0 and "images: " in result.output
    assert "trained a rank-8 LoRA for 12 steps" in result.output
    # the training's status line: not a terminal here, so every quarter of the steps as a line of its own
    assert [f"training: step {k}/12" in result.output for k in (3, 6, 9, 12)] == [True] * 4
    again = runner.invoke(main, ["demo", "-o", str(out)])
    assert again.exit_code == 1 and "already holds a demo" in again.output and "--force" in again.output


def test_python_dash_m_squareq_runs_the_cli():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "squareq", "--version"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "squareq" in done.stdout


@pytest.mark.parametrize("verbose", [False, True])
def test_third_party_warnings_are_quiet_unless_verbose(verbose, caplog, monkeypatch):
    """diffusers' routine warnings (through logging) and torchvision's (through ``warnings``) are hidden without
    --verbose and shown with it; SquareQ's own warnings are always shown."""
    import logging
    import warnings

    from squareq.third_party import THIRD_PARTIES, quiet_third_parties

    for var in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY"):
        monkeypatch.delenv(var, raising=False)
    levels = {name: logging.getLogger(name).level for name in THIRD_PARTIES}
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            quiet_third_parties(verbose)
            # diffusers' own handler does not propagate to pytest's, so ask the logger whether it would emit
            diffusers_warns = logging.getLogger("diffusers.models.modeling_utils").isEnabledFor(logging.WARNING)
            warnings.warn_explicit("torchvision.io is deprecated", UserWarning, "image.py", 1, module="torchvision.io")
            logging.getLogger("squareq.train").warning("skipped: a.png has no caption")
        messages = [r.getMessage() for r in caplog.records]
        assert "skipped: a.png has no caption" in messages
        assert diffusers_warns == verbose
        assert any("torchvision.io" in str(w.message) for w in caught) == verbose
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


HUGE = "1" + "0" * 400


@pytest.mark.parametrize("args, flag", [
    (["compile", "tiny-flux", "-o", "OUT", "--budget", HUGE + "GB"], "--budget"),
    (["compile", "tiny-flux", "-o", "OUT", "--budget", "2MB", "--vram-budget", HUGE], "--vram-budget"),
    (["compile", "tiny-flux", "-o", "OUT", "--budget", "2MB", "--host-budget", HUGE], "--host-budget"),
    (["compile", "tiny-flux", "-o", "OUT", "--budget", "2MB", "--max-block-bytes", HUGE], "--max-block-bytes"),
    (["compile", "tiny-flux", "-o", "OUT", "--budget", "2MB", "--vram-cap", "1e999"], "--vram-cap"),
])
def test_an_enormous_or_unreadable_size_is_one_sentence_naming_its_flag(tmp_path, args, flag):
    """Issue 40, items 5 and 9: a 400-digit size was an OverflowError traceback, and size errors named the value
    only; the control is a readable size, which passes this check."""
    args = [str(tmp_path / "t.slab") if a == "OUT" else a for a in args]
    result = CliRunner().invoke(main, args)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # not a traceback
    assert len(errors) == 1 and errors[0].startswith(f"error: {flag}: "), result.output
    from squareq.sizes import parse_size

    assert parse_size("12GB", flag) == 12 * 10**9  # the control: a size it can read


def test_accept_samples_below_two_is_refused_naming_samples(tmp_path):
    """Issue 40, item 9: `accept --samples 1`, which the help allowed, was refused as "--calib-samples 1"; the
    control: --samples 2 passes the option check (the run then stops at the next missing thing)."""
    result = CliRunner().invoke(main, ["accept", str(tmp_path / "none.slab"), "--samples", "1"])
    assert result.exit_code == 2 and "'--samples': 1 is not in the range" in result.output
    assert "calib-samples" not in result.output
    result = CliRunner().invoke(main, ["accept", str(tmp_path / "none.slab"), "--samples", "2"])
    assert "--samples" not in result.output
