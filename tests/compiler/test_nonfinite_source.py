"""Issue 63: a source transformer with NaN/Inf weights is refused before anything is encoded or calibrated, and the
refusal leaves no state folder that blocks the rerun once the source is fixed; a state that finished no block is
started over by a compile with other inputs, one that finished blocks is still refused (the negative control)."""
import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from squareq.cli import main
from squareq.compiler.state import REFUSED, CompileState, StateError
from squareq.models import ModelError, write_tiny_flux_pipeline
from squareq.models.flux_bfl import diffusers_to_bfl
from squareq.sources import open_source
from squareq.sources.model import Source
from squareq.sources.tensors import _check_finite

from .test_vram import error_lines

pytestmark = pytest.mark.usefixtures("torch_kernels")

LATE = "single_transformer_blocks.1.proj_mlp.weight"  # in the last block: found late, before the early check


@pytest.fixture
def damaged(tmp_path):
    """A tiny FLUX.1 pipeline folder whose transformer's last block holds a NaN: the folder, its transformer file,
    the finite tensors and the compile's arguments."""
    folder = write_tiny_flux_pipeline(tmp_path / "flux", seed=0)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    finite = load_file(str(weights))
    bad = {k: v.clone() for k, v in finite.items()}
    bad[LATE][1, 2] = float("nan")
    save_file(bad, str(weights))
    args = ["compile", str(folder), "-o", str(tmp_path / "s.slab"), "--budget", "8MB", "--calib-samples", "8",
            "--calib-resolution", "64", "--rounding", "nearest", "--effect-probes", "1"]
    return folder, weights, finite, args


def test_a_nan_source_is_refused_before_calibration_and_the_fixed_source_then_compiles(damaged, tmp_path):
    folder, weights, finite, args = damaged
    refused = CliRunner().invoke(main, args)
    errors = error_lines(refused)
    assert refused.exit_code == 1 and len(errors) == 1, refused.output
    assert f"tensor {LATE} in {weights} contains NaN values" in errors[0] and "re-export it" in errors[0]
    # before the encoders and the calibration pass: no block was calibrated, nothing stored
    assert "encoding" not in refused.output and "calibrating" not in refused.output
    assert not (tmp_path / "s.slab.state").exists() and not (tmp_path / "s.slab").exists()
    save_file(finite, str(weights))  # the user fixes the source; the same command, no --force, --resume or rm
    fixed = CliRunner().invoke(main, args)
    assert fixed.exit_code == 0, fixed.output[-2000:]
    assert "wrote" in fixed.output and "different inputs" not in fixed.output
    assert (tmp_path / "s.slab/manifest.json").is_file() and not (tmp_path / "s.slab.state").exists()


def test_a_changed_source_is_still_refused_where_the_state_holds_finished_blocks(damaged, tmp_path, monkeypatch):
    """The negative control: without the early check (as before the fix) the NaN is found in the last block, after
    the blocks before it were calibrated and stored; those measurements are kept, so the rerun with the fixed source
    is refused as different inputs, as before."""
    folder, weights, finite, args = damaged
    with monkeypatch.context() as patch:
        patch.setattr(Source, "check_finite", lambda self, say=None: None)
        late = CliRunner().invoke(main, args)
    assert late.exit_code == 1 and f"tensor {LATE}" in error_lines(late)[0], late.output
    assert "block 3/4 single_transformer_blocks.0: done" in late.output
    state = tmp_path / "s.slab.state"
    assert sorted(p.name for p in state.glob("block.*.json")) == ["block.0.json", "block.1.json", "block.2.json"]
    save_file(finite, str(weights))
    rerun = CliRunner().invoke(main, args)
    assert rerun.exit_code == 1 and len(error_lines(rerun)) == 1, rerun.output
    assert "was made by a compile with different inputs (measurement_key)" in error_lines(rerun)[0]
    assert "starting over" not in rerun.output and len(list(state.glob("block.*.json"))) == 3


def _state(folder, key, **kw):
    return CompileState(folder, {"measurement_key": key, "rebuild_of": None}, resume=False, **kw)


def test_a_state_that_finished_no_block_is_started_over_by_other_inputs_saying_so(tmp_path):
    folder = tmp_path / "s.slab.state"
    _state(folder, "old")
    (folder / "block.0.safetensors").write_bytes(b"half a block")  # no record: not finished
    lines = []
    _state(folder, "new", echo=lines.append)
    assert len(lines) == 1 and lines[0].startswith(f"starting over in {folder}: ") and "finished no block" in lines[0]
    assert sorted(p.name for p in folder.iterdir()) == ["state.json"]
    assert json.loads((folder / "state.json").read_text())["measurement_key"] == "new"
    # the same inputs without --resume: an unfinished compile, refused as before
    with pytest.raises(StateError, match="holds an earlier, unfinished compile; pass --resume"):
        _state(folder, "new")


@pytest.mark.parametrize("finished", ["block.0.json", "effects.json", REFUSED])
def test_a_state_with_finished_work_is_refused_for_other_inputs(tmp_path, finished):
    folder = tmp_path / "s.slab.state"
    _state(folder, "old")
    (folder / finished).write_text("{}")
    lines = []
    with pytest.raises(StateError, match="was made by a compile with different inputs"):
        _state(folder, "new", echo=lines.append)
    assert not lines and (folder / finished).is_file()


def test_the_check_reads_every_bound_tensor_of_a_bfl_file_and_passes_a_finite_one(tmp_path, tiny_flux):
    model, _ = tiny_flux
    bfl = {k: v.clone().contiguous() for k, v in diffusers_to_bfl(model.state_dict()).items()}
    save_file(bfl, str(tmp_path / "ok.safetensors"))
    open_source(str(tmp_path / "ok.safetensors")).check_finite()
    bfl["double_blocks.1.img_mlp.2.bias"][0] = float("-inf")
    save_file(bfl, str(tmp_path / "inf.safetensors"))
    lines = []
    with pytest.raises(ModelError, match=r"tensor double_blocks.1.img_mlp.2.bias in .*inf.safetensors contains Inf"):
        open_source(str(tmp_path / "inf.safetensors")).check_finite(lines.append)
    assert len(lines) == 1 and "for NaN and Inf values" in lines[0]
    empty = torch.empty(0, 4)  # aminmax has no empty reduction: an empty tensor is finite
    assert _check_finite(empty, "e", "f") is empty
