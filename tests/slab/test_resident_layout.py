"""Resident tensor records are under a layout digest (issue 40, item 3): a manifest edit that would load one resident
tensor in another's place is refused by `inspect --verify` and by every open for use, in one sentence."""
import json

import pytest
import torch
from click.testing import CliRunner

from squareq import runtime
from squareq.cli import main
from squareq.slab import SlabError, open_slab

from .helpers import copy_slab, edit_manifest, reseal_signature

# two resident tensors of tiny-flux with one shape ([64, 64]) and different values
FIRST = "time_text_embed.timestep_embedder.linear_2.weight"
SECOND = "time_text_embed.guidance_embedder.linear_2.weight"


@pytest.fixture
def slab(tiny_slab, tmp_path):
    return copy_slab(tiny_slab, tmp_path / "copy.slab")


def _record(m: dict, name: str) -> dict:
    return next(r for r in m["resident"] if r["name"] == name)


def _swap_names(m: dict) -> None:
    first, second = _record(m, FIRST), _record(m, SECOND)
    first["name"], second["name"] = SECOND, FIRST


def _refused_everywhere(slab, match: str) -> None:
    """Opening (as inspect does), --verify and runtime.load (as train and sample do) all refuse in one sentence."""
    for use in (lambda: open_slab(slab, verify="off"),
                lambda: runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))):
        with pytest.raises(SlabError, match=match) as info:
            use()
        assert str(slab) in str(info.value) and "\n" not in str(info.value)
    result = CliRunner().invoke(main, ["inspect", str(slab), "--verify"])
    lines = [line for line in result.output.splitlines() if line]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "recompile" in lines[0] and "Traceback" not in result.output


def test_the_swap_would_change_the_model(tiny_slab):
    """The two tensors differ, so loading one in the other's place is a different model (what the check prevents)."""
    with open_slab(tiny_slab, verify="eager") as s:
        tensors = s.resident_tensors()
        assert tensors[FIRST].shape == tensors[SECOND].shape and not torch.equal(tensors[FIRST], tensors[SECOND])


def test_swapped_resident_names_are_refused(slab):
    edit_manifest(slab, _swap_names)
    _refused_everywhere(slab, "resident tensors' records fail their layout check")


@pytest.mark.parametrize("field, value", [("dtype", "F16"), ("shape", [4096]), ("shape", [32, 128])])
def test_a_changed_resident_dtype_or_shape_is_refused(slab, field, value):
    def edit(m):
        _record(m, FIRST)[field] = value
        reseal_signature(m)  # the signature covers shapes; resealed, the layout digest alone must catch the edit

    edit_manifest(slab, edit)
    _refused_everywhere(slab, "resident tensors' records fail their layout check")
    edit_manifest(slab, lambda m: None, reseal=True)  # with a matching digest, the data file's header still disagrees
    _refused_everywhere(slab, f"resident tensor {FIRST} does not match the manifest's dtype or shape")


def test_a_resident_record_pointing_at_another_tensor_is_refused_even_with_a_matching_digest(slab):
    edit_manifest(slab, _swap_names, reseal=True)
    _refused_everywhere(slab, f"resident tensor {SECOND} is stored under 'resident.{FIRST}'")


def test_an_untouched_slab_verifies_and_loads(slab):
    edit_manifest(slab, lambda m: None)  # rewritten without a change: the digest does not depend on the JSON's form
    result = CliRunner().invoke(main, ["inspect", str(slab), "--verify"])
    assert result.exit_code == 0 and "matches its sha256" in result.output and "note:" not in result.output
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))
    with open_slab(slab, verify="eager") as s:
        assert torch.equal(dict(model.named_parameters())[FIRST].detach().cpu(), s.resident_tensors()[FIRST])


def test_a_slab_written_before_the_digest_opens_and_verify_says_so_in_one_line(slab):
    edit_manifest(slab, lambda m: m.pop("resident_layout_sha256"))
    runtime.load(slab, "cpu", options=runtime.LoadOptions(stream=False))
    result = CliRunner().invoke(main, ["inspect", str(slab), "--verify"])
    notes = [line for line in result.output.splitlines() if line.startswith("note:")]
    assert result.exit_code == 0 and len(notes) == 1 and "recompile it" in notes[0] and str(slab) in notes[0]
    as_json = CliRunner().invoke(main, ["inspect", str(slab), "--verify", "--json"])
    assert json.loads(as_json.stdout)["verified"] and as_json.stderr.startswith("note:")  # the note beside the JSON
    edit_manifest(slab, _swap_names)  # without a digest, the swap is still caught by the records' data-file keys
    _refused_everywhere(slab, f"resident tensor {SECOND} is stored under 'resident.{FIRST}'")
