"""`squareq accept` on tiny-flux: each gate passes on a good slab and fails on a slab broken its way; the table,
JSON and JUnit reports agree; exit codes say pass (0), gate failed (3), cannot run (1)."""
import json
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.models import load_builtin
from squareq.quant import QuantSpec
from squareq.slab import WriteOptions, write_slab
from squareq.slab.writer import block_linears


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")


@pytest.fixture(scope="module")
def good_slab(tmp_path_factory):
    from squareq.compiler import CompileOptions, compile_slab, open_source

    out = tmp_path_factory.mktemp("accept") / "good.slab"
    compile_slab(open_source("tiny-flux"), out, CompileOptions(budget=2_000_000))
    return out


def _write(tmp_path, name, spec, edit=None, **opts):
    """A slab of tiny-flux (weights optionally edited first), recorded as compiled from tiny-flux."""
    model, adapter = load_builtin("tiny-flux")
    if edit:
        with torch.no_grad():
            edit(model, adapter)
    out = tmp_path / name
    write_slab(model, adapter.blocks(model), {}, out,
               WriteOptions(default_spec=spec, family="flux", source="tiny-flux", **opts))
    return out


def _accept(slab, tmp_path, *extra):
    report, junit = tmp_path / f"{slab.name}.json", tmp_path / f"{slab.name}.xml"
    result = CliRunner().invoke(main, ["accept", str(slab), "--model", "tiny-flux", "--steps", "20",
                                       "--workdir", str(tmp_path / f"{slab.name}.accept"), "--report", str(report),
                                       "--junit", str(junit), *extra])
    return result, report, junit


def _table_rows(output):
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = cells
    return rows


def test_a_good_slab_passes_and_the_three_reports_agree(good_slab, tmp_path):
    result, report, junit = _accept(good_slab, tmp_path)
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.output)
    data = json.loads(report.read_text())
    assert data["passed"] is True and [g["name"] for g in data["gates"]] == list(rows)
    assert list(rows) == ["layer MSE", "convergence", "peak VRAM and size"]
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    for gate in data["gates"]:
        assert rows[gate["name"]][1:4] == [gate["status"], gate["measured"], gate["limit"]]
        case = cases[gate["name"]]
        assert (case.find("failure") is not None) == (gate["status"] == "FAIL")
        assert (case.find("skipped") is not None) == (gate["status"] == "SKIP")
    assert suite.get("failures") == "0" and suite.get("tests") == "3"
    mse = data["gates"][0]["details"]
    # re-measured on other inputs than the compile's: other seed and timesteps, every layer measured
    assert mse["inputs"]["seed"] != 0 and mse["inputs"]["timesteps"] != [0.05, 0.35, 0.65, 0.95]
    assert mse["layers"] == 40 and max(mse["rel_mse"].values()) <= 0.01
    conv = data["gates"][1]["details"]
    assert len(conv["losses"]["bf16"]) == 20 and len(conv["losses"]["quantized"]) == 25
    assert conv["relative_gap"] <= 0.02 and (tmp_path / "good.slab.accept" / "convergence.png").stat().st_size > 1000
    size = data["gates"][2]["details"]["size"]
    assert size["status"] == "PASS" and size["bytes"] == sum(p.stat().st_size for p in good_slab.iterdir())


def test_a_layer_replaced_by_noise_fails_layer_mse(tmp_path):
    def noise(model, adapter):
        layer = model.get_submodule("transformer_blocks.1.attn.to_v")
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)))

    slab = _write(tmp_path, "noisy.slab", QuantSpec(bits=8), edit=noise)
    result, report, _ = _accept(slab, tmp_path)
    assert result.exit_code == 3, result.output
    mse = json.loads(report.read_text())["gates"][0]
    assert mse["status"] == "FAIL" and mse["details"]["over"] == ["transformer_blocks.1.attn.to_v"]
    assert mse["details"]["worst"][0]["layer"] == "transformer_blocks.1.attn.to_v"
    assert _table_rows(result.output)["layer MSE"][1] == "FAIL" and "FAILED: layer MSE" in result.output


def test_a_slab_quantized_far_too_coarsely_fails_convergence(tmp_path):
    # one 4-bit grid per 256 inputs, clipped at 2% of the largest weight: nearly every weight is lost
    slab = _write(tmp_path, "coarse.slab", QuantSpec(bits=4, group_size=256, symmetric=True, clip_ratio=0.02),
                  clip_search=False)
    result, report, _ = _accept(slab, tmp_path, "--steps", "30")
    assert result.exit_code == 3, result.output
    conv = json.loads(report.read_text())["gates"][1]
    assert conv["status"] == "FAIL" and conv["details"]["relative_gap"] > 0.02


def test_size_over_budget_and_a_required_gpu_fail(good_slab, tmp_path):
    result, report, junit = _accept(good_slab, tmp_path, "--budget", "100KB", "--require-gpu")
    assert result.exit_code == 3, result.output
    gate = json.loads(report.read_text())["gates"][2]
    assert gate["status"] == "FAIL" and gate["details"]["size"]["status"] == "FAIL"
    if not torch.cuda.is_available():
        assert gate["details"]["vram"]["status"] == "FAIL" and "--require-gpu" in gate["note"]
    failure = ET.parse(junit).getroot().find("testsuite/testcase[@name='peak VRAM and size']/failure")
    assert failure is not None and "100.00 KB" in failure.text


def test_without_a_gpu_vram_is_skipped_not_failed(good_slab, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result, report, _ = _accept(good_slab, tmp_path, "--vram-budget", "1GB")
    assert result.exit_code == 0, result.output
    vram = json.loads(report.read_text())["gates"][2]["details"]["vram"]
    assert vram["status"] == "SKIP" and "without CUDA" in vram["note"]


def test_a_slab_of_another_model_is_refused_in_one_sentence(tmp_path):
    from diffusers import FluxTransformer2DModel

    model, adapter = load_builtin("tiny-flux")
    other = FluxTransformer2DModel(**{**dict(model.config), "num_single_layers": 1})
    out = tmp_path / "other.slab"
    write_slab(other, adapter.blocks(other), {}, out,
               WriteOptions(default_spec=QuantSpec(bits=8), family="flux", source="tiny-flux"))
    result, _, _ = _accept(out, tmp_path)
    assert result.exit_code == 1
    assert re.search(r"error: .*other\.slab was not compiled from --model tiny-flux", result.output)
