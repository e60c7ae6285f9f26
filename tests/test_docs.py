"""The format and threshold documentation cannot drift from the code: every field the code serializes is named.

Field lists come from the code (dataclass fields, ``to_dict()`` keys, a real manifest), never from a list
typed here, so adding a field without documenting it fails a test.
"""
import dataclasses
import json
from pathlib import Path

import pytest

from squareq.compiler.thresholds import Thresholds
from squareq.quant import QuantSpec, tensor_layout
from squareq.slab import manifest as slab_manifest
from squareq.slab.manifest import BlockRecord, LayerRecord, Manifest, ModelRecord, ResidentRecord, TensorRecord
from squareq.slab.writer import _totals

pytestmark = pytest.mark.usefixtures("torch_kernels")

DOCS = Path(__file__).resolve().parents[1] / "docs"
SLAB_FORMAT = DOCS / "slab-format.md"
COMPILER = DOCS / "compiler.md"

# Every dataclass serialized into manifest.json, and the heading of the section documenting it.
RECORDS = [Manifest, ModelRecord, BlockRecord, LayerRecord, TensorRecord, ResidentRecord]


def section(text: str, marker: str) -> str:
    """The text under the first markdown heading containing ``marker``, up to the next heading."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("#") and marker in line]
    assert starts, f"docs/slab-format.md has no section whose heading contains {marker}"
    body = []
    for line in lines[starts[0] + 1:]:
        if line.startswith("#"):
            break
        body.append(line)
    return "\n".join(body)


def undocumented(keys, text: str) -> list[str]:
    return sorted(k for k in set(keys) if f"`{k}`" not in text)


@pytest.fixture(scope="module")
def slab_doc() -> str:
    return SLAB_FORMAT.read_text()


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_every_manifest_record_field_is_documented(slab_doc, record):
    fields = [f.name for f in dataclasses.fields(record)]
    missing = undocumented(fields, section(slab_doc, f"`{record.__name__}`"))
    assert not missing, (f"{record.__name__} fields {missing} are serialized to manifest.json but not documented "
                         f"in the {record.__name__} section of docs/slab-format.md")


def test_every_quant_spec_key_is_documented(slab_doc):
    keys = set()
    for spec in (QuantSpec(), QuantSpec(bits=16), QuantSpec(bits=6, symmetric=True, smooth=True), QuantSpec(rotate=True)):
        keys |= set(spec.to_dict())
    missing = undocumented(keys, section(slab_doc, "`QuantSpec`"))
    assert not missing, f"QuantSpec.to_dict() keys {missing} are not documented in docs/slab-format.md"


def test_every_tensor_role_and_dtype_is_documented(slab_doc):
    roles = set()
    for spec in (QuantSpec(), QuantSpec(symmetric=True), QuantSpec(smooth=True), QuantSpec(bits=16)):
        roles |= set(tensor_layout(spec, (8, 64)))
    missing = undocumented(roles, section(slab_doc, "Inside a blob"))
    assert not missing, f"stored tensor roles {missing} are not in docs/slab-format.md's role table"
    missing = undocumented(slab_manifest.DTYPES, section(slab_doc, "`TensorRecord`"))
    assert not missing, f"slab dtypes {missing} are not documented in docs/slab-format.md"


def test_format_constants_match_the_code(slab_doc):
    m = slab_manifest
    assert slab_doc.startswith(f"# Slab format, version {m.FORMAT_VERSION}\n")
    for text in (f'`FORMAT_NAME = "{m.FORMAT_NAME}"`', f"`FORMAT_VERSION = {m.FORMAT_VERSION}`",
                 f"`ALIGNMENT = {m.ALIGNMENT}`", f'`DATA_FILE = "{m.DATA_FILE}"`',
                 f'`MANIFEST_FILE = "{m.MANIFEST_FILE}"`', f"`{m.block_tensor_name('<k>')}`",
                 f"`{m.resident_tensor_name('<name>')}`"):
        assert text in slab_doc, f"docs/slab-format.md does not state {text}"


def test_every_totals_key_is_documented(slab_doc):
    missing = undocumented(_totals([], [], []), section(slab_doc, "### `totals`"))
    assert not missing, f"totals keys {missing} (squareq/slab/writer.py _totals) are not documented"


def test_every_threshold_is_documented_in_slab_format(slab_doc):
    keys = [f.name for f in dataclasses.fields(Thresholds)]
    assert set(keys) == set(Thresholds().to_dict())
    missing = undocumented(keys, section(slab_doc, "### `thresholds`"))
    assert not missing, f"threshold keys {missing} are written to the manifest but not documented there"


def test_every_threshold_is_documented_in_compiler_md():
    keys = [f.name for f in dataclasses.fields(Thresholds)]
    missing = undocumented(keys, COMPILER.read_text())
    assert not missing, f"docs/compiler.md documents the thresholds file but not the keys {missing}"


@pytest.fixture(scope="module")
def compiled_manifest(tmp_path_factory, tiny_flux_images) -> dict:
    """manifest.json of a real (fast) compile of tiny-flux on the built-in photographs."""
    from squareq.compiler import CompileOptions, compile_slab
    from squareq.sources import open_source

    out = tmp_path_factory.mktemp("docs") / "tiny.slab"
    compile_slab(open_source("tiny-flux"), out, CompileOptions(budget=2_000_000, rounding="nearest", calib_samples=4,
                                                                max_rows=128, calib_images=tiny_flux_images))
    return json.loads((out / slab_manifest.MANIFEST_FILE).read_text())


def test_a_compiled_manifest_has_only_documented_keys(slab_doc, compiled_manifest):
    m = compiled_manifest
    checks = {
        "top level": (m, "`Manifest`"),
        "model": (m["model"], "`ModelRecord`"),
        "calibration": (m["calibration"], "### `calibration`"),
        "totals": (m["totals"], "### `totals`"),
        "thresholds": (m["thresholds"], "### `thresholds`"),
    }
    for what, (obj, marker) in checks.items():
        missing = undocumented(obj, section(slab_doc, marker))
        assert not missing, f"a compiled manifest's {what} has keys {missing} that docs/slab-format.md does not name"
    for block in m["blocks"]:
        assert not undocumented(block, section(slab_doc, "`BlockRecord`"))
        for p in block["params"]:
            assert not undocumented(p, section(slab_doc, "`TensorRecord`"))
    metrics = section(slab_doc, "### `layers[].metrics`")
    roles = section(slab_doc, "Inside a blob")
    for layer in m["layers"]:
        assert not undocumented(layer, section(slab_doc, "`LayerRecord`"))
        assert not undocumented(layer["spec"], section(slab_doc, "`QuantSpec`"))
        missing = undocumented(layer["metrics"], metrics)
        assert not missing, f"layer metrics {missing} ({layer['name']}) are not documented in docs/slab-format.md"
        assert not undocumented(layer["tensors"], roles), layer["tensors"].keys()


def test_documented_defaults_of_thresholds_match_the_code(slab_doc):
    """The thresholds table states each default; they are the dataclass's."""
    table = section(slab_doc, "### `thresholds`")
    for key, value in Thresholds().to_dict().items():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{key}` |")), None)
        assert row is not None, key
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[2]) == value, (key, cells[2], value)
