"""Every refusal of the reader, each from a crafted file; nothing is returned from a refused slab."""
import json
import pickle

import pytest
import torch

from squareq.slab import SlabError, open_slab

from .helpers import copy_slab, edit_manifest, flip_byte, read_safetensors, write_safetensors


@pytest.fixture
def slab(tiny_slab, tmp_path):
    return copy_slab(tiny_slab, tmp_path / "copy.slab")


def refused(path, match, **kw):
    with pytest.raises(SlabError, match=match) as info:
        open_slab(path, **kw)
    message = str(info.value)
    assert str(path) in message and message.count("\n") == 0
    return message


def test_truncated_file(slab):
    data = slab / "slab.safetensors"
    data.write_bytes(data.read_bytes()[:-1000])
    refused(slab, "truncated")


def test_flipped_byte_fails_the_hash(slab):
    flip_byte(slab / "slab.safetensors", offset_from_end=150_000)
    refused(slab, "sha256", verify=True)
    lazy = open_slab(slab, verify="lazy")
    bad = [b.index for b in lazy.manifest.blocks if _fails(lazy, b.index)]
    assert len(bad) == 1
    lazy.close()


def _fails(slab, index):
    try:
        slab.block_bytes(index)
        return False
    except SlabError as exc:
        assert "sha256" in str(exc)
        return True


def test_flipped_byte_in_resident_tensors(slab):
    flip_byte(slab / "slab.safetensors", offset_from_end=3)
    refused(slab, "resident tensor .* sha256", verify=True)


def test_layer_offset_past_block_end(slab):
    def edit(m):
        m["layers"][0]["tensors"]["scales"]["offset"] = m["blocks"][0]["nbytes"]

    edit_manifest(slab, edit)
    refused(slab, "fails its layout check")
    edit_manifest(slab, lambda m: None, reseal=True)
    refused(slab, "past its block")


def test_an_edited_offset_is_refused_by_the_layout_check_and_by_overlap(slab):
    """The audit's case: qweight.offset set to 0 made inspect --verify pass and train run on a wrong weight."""
    from click.testing import CliRunner

    from squareq.cli import main

    def edit(m):
        m["layers"][1]["tensors"]["qweight"]["offset"] = 0

    edit_manifest(slab, edit)
    refused(slab, "block 0 .* fails its layout check")
    result = CliRunner().invoke(main, ["inspect", str(slab), "--verify"])
    assert result.exit_code == 1 and "fails its layout check" in result.output and "Traceback" not in result.output
    edit_manifest(slab, lambda m: None, reseal=True)  # even with a matching digest, two tensors cannot share bytes
    refused(slab, "overlaps")


@pytest.mark.parametrize("edit, refusal", [
    (lambda m: m.update(alignment=0), "alignment 0 is not a power of two"),
    (lambda m: m.update(alignment=48), "alignment 48 is not a power of two"),
    (lambda m: m.update(alignment="256"), "field 'alignment'"),
    (lambda m: m["layers"][0]["tensors"]["scales"].update(offset="0"), "field 'offset'"),
    (lambda m: m["layers"][0]["tensors"]["scales"].update(offset=1.5), "field 'offset'"),
    (lambda m: m["layers"][0].update(shape="32x32"), "field 'shape'"),
    (lambda m: m["blocks"][0].update(nbytes=True), "field 'nbytes'"),
    (lambda m: m["blocks"][0].update(layers={"a": 1}), "field 'layers'"),
    (lambda m: m["model"].update(block_lists=None), "field 'block_lists'"),
    (lambda m: m["layers"][0]["spec"].update(bits="4"), "malformed fields"),
    (lambda m: m["layers"][0]["spec"].update(clip_ratio="x"), "malformed fields"),
    (lambda m: m["layers"][0]["spec"].update(symmetric="no"), "malformed fields"),
    (lambda m: m["layers"][0].update(tensors=[1]), "malformed fields"),
    (lambda m: m.update(blocks="none"), "malformed fields"),
    (lambda m: m.update(model=[]), "malformed fields"),
])
def test_fields_of_the_wrong_type_or_range_are_refused_in_one_sentence(slab, edit, refusal):
    edit_manifest(slab, edit)
    refused(slab, refusal)


def test_deeply_nested_json_is_refused(slab):
    text = (slab / "manifest.json").read_text()
    (slab / "manifest.json").write_text(text[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    refused(slab, "nests JSON too deeply")


def test_header_offset_past_end_of_file(slab):
    path = slab / "slab.safetensors"
    header, data = read_safetensors(path)
    header["block.0"]["data_offsets"] = [len(data), len(data) + header["block.0"]["shape"][0]]
    write_safetensors(path, header, data)
    refused(slab, "truncated or damaged")


def test_wrong_format_version(slab):
    edit_manifest(slab, lambda m: m.update(format_version=99))
    msg = refused(slab, "version 99")
    assert "recompile" in msg


def test_extra_tensor(slab):
    path = slab / "slab.safetensors"
    header, data = read_safetensors(path)
    header["sneaky"] = {"dtype": "U8", "shape": [4], "data_offsets": [len(data), len(data) + 4]}
    write_safetensors(path, header, data + b"\x00" * 4)
    refused(slab, "does not name .*sneaky")


def test_missing_tensor(slab):
    path = slab / "slab.safetensors"
    header, data = read_safetensors(path)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin = header.pop(last)["data_offsets"][0]
    write_safetensors(path, header, data[:begin])
    refused(slab, "missing tensors")


@pytest.mark.parametrize("payload", ["pickle", "torch.save"])
def test_pickle_renamed_to_safetensors(slab, payload):
    path = slab / "slab.safetensors"
    if payload == "pickle":
        path.write_bytes(pickle.dumps({"block.0": [1, 2, 3]}))
        refused(slab, "pickle")
    else:
        torch.save({"block.0": torch.zeros(4)}, path)
        refused(slab, "zip archive")


def test_nan_scale_is_refused_even_with_a_matching_hash(slab):
    import hashlib

    m = json.loads((slab / "manifest.json").read_text())
    layer = m["layers"][0]
    scales = layer["tensors"]["scales"]
    path = slab / "slab.safetensors"
    header, data = read_safetensors(path)
    block = m["blocks"][layer["block"]]
    start = header[block["tensor"]]["data_offsets"][0] + scales["offset"]
    data = bytearray(data)
    data[start : start + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    blob = bytes(data[header[block["tensor"]]["data_offsets"][0] : header[block["tensor"]]["data_offsets"][1]])
    block["sha256"] = hashlib.sha256(blob).hexdigest()
    write_safetensors(path, header, bytes(data))
    (slab / "manifest.json").write_text(json.dumps(m))
    refused(slab, "NaN or Inf scales", verify=True)


def test_signature_mismatch(slab):
    refused(slab, "different model", expected_signature="0" * 64)

    def edit(m):
        m["layers"][0]["shape"] = [m["layers"][0]["shape"][0] + 1, m["layers"][0]["shape"][1]]

    edit_manifest(slab, edit)
    refused(slab, "signature does not match")


def test_not_a_slab_directory(tmp_path):
    refused(tmp_path / "nowhere", "not a slab directory")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "manifest.json").write_text("{}")
    refused(tmp_path / "half", "no slab.safetensors")


def test_damaged_manifest(slab):
    (slab / "manifest.json").write_text("{ not json")
    refused(slab, "not valid JSON")
    (slab / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    refused(slab, "not a SquareQ slab manifest")


def test_a_failed_atomic_write_leaves_no_temporary_and_the_old_file_intact(tmp_path, monkeypatch):
    import errno
    import os

    import pytest as _pytest

    from squareq.slab.atomic import atomic_write_bytes

    target = tmp_path / "state.json"
    target.write_bytes(b"old")

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with _pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_data_file_linked_from_outside_the_slab_folder_is_named(slab, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere.safetensors"
    (slab / "slab.safetensors").rename(elsewhere)
    (slab / "slab.safetensors").symlink_to(elsewhere)
    with caplog.at_level("WARNING", logger="squareq.slab.reader"):
        open_slab(slab, verify=True).close()
    assert f"is a link to {elsewhere}, outside the slab folder" in caplog.text
    caplog.clear()
    (slab / "slab.safetensors").unlink()
    elsewhere.rename(slab / "slab.safetensors")
    with caplog.at_level("WARNING", logger="squareq.slab.reader"):
        open_slab(slab, verify=True).close()
    assert "outside the slab folder" not in caplog.text  # negative control: a plain slab says nothing


def test_a_rotated_layer_whose_inputs_are_not_whole_groups_is_refused(slab, tmp_path, tiny_slab):
    def rotate(name):
        def edit(m):
            next(layer for layer in m["layers"] if layer["name"] == name)["spec"]["rotate"] = True
        return edit

    edit_manifest(slab, rotate("single_transformer_blocks.0.proj_out"))  # 320 inputs in groups of 128
    refused(slab, "fails its layout check")  # the spec is part of the layout digest
    edit_manifest(slab, lambda m: None, reseal=True)
    refused(slab, "layer single_transformer_blocks.0.proj_out is rotated in groups of 128 input channels, which its "
                  "320 are not")
    # the same consistent edit on a layer of whole groups opens (the reader cannot tell it from a rotated layer)
    other = copy_slab(tiny_slab, tmp_path / "other.slab")
    edit_manifest(other, rotate("transformer_blocks.0.attn.to_v"), reseal=True)
    assert open_slab(other).manifest.layers
