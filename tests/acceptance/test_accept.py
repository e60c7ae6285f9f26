"""`squareq accept` on tiny-flux: every gate passes on a good slab and on a bf16 slab; each of block drift, image
drift, gradient agreement and convergence fails on its own on two damaged slabs (every weight clipped to half its
range; one layer at 16x its scale); a convergence run that learns nothing is INCONCLUSIVE, never PASS; the table,
JSON and JUnit reports agree; exit codes say pass (0), gate failed (3), inconclusive (4), cannot run (1)."""
import json
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.models import load_builtin
from squareq.quant import QuantSpec
from squareq.compiler.plain import PlainOptions, write_rtn_slab

from ..text_models import save_text_model

# the torch reference dequantizer (conftest.py), for the module fixtures too
pytestmark = pytest.mark.usefixtures("torch_kernels")


@pytest.fixture(scope="module")
def good_slab(tmp_path_factory, tiny_flux_images):
    from squareq.compiler import CompileOptions, compile_slab
    from squareq.sources import open_source

    out = tmp_path_factory.mktemp("accept") / "good.slab"
    compile_slab(open_source("tiny-flux"), out, CompileOptions(budget=2_000_000, calib_images=tiny_flux_images))
    return out


def _write(tmp_path, name, spec, edit=None, **opts):
    """A slab of tiny-flux (weights optionally edited first), recorded as compiled from tiny-flux."""
    model, adapter = load_builtin("tiny-flux")
    if edit:
        with torch.no_grad():
            edit(model, adapter)
    out = tmp_path / name
    write_rtn_slab(model, adapter.blocks(model), {}, out,
               PlainOptions(default_spec=spec, family="flux", source="tiny-flux", **opts))
    return out


# for tests about one gate or the reports: fewer, shorter images; and (BRIEF) a short convergence run as well,
# where no assertion reads it (its verdict may then be INCONCLUSIVE)
FEW_IMAGES = ("--images", "2", "--sample-steps", "8")
BRIEF = ("--steps", "8", *FEW_IMAGES)


def _accept(slab, tmp_path, *extra):
    report, junit = tmp_path / f"{slab.name}.json", tmp_path / f"{slab.name}.xml"
    result = CliRunner().invoke(main, ["accept", str(slab), "--model", "tiny-flux",
                                       "--workdir", str(tmp_path / f"{slab.name}.accept"), "--report", str(report),
                                       "--junit", str(junit), *extra])
    return result, report, junit


def _table_rows(output):
    rows = {}
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[1] in ("PASS", "FAIL", "SKIP", "INCONCLUSIVE"):
            rows[cells[0]] = cells
    return rows


def test_a_good_slab_passes_and_the_three_reports_agree(good_slab, tmp_path):
    result, report, junit = _accept(good_slab, tmp_path)
    assert result.exit_code == 0, result.output
    rows = _table_rows(result.output)
    data = json.loads(report.read_text())
    assert data["passed"] is True and [g["name"] for g in data["gates"]] == list(rows)
    assert list(rows) == ["layer MSE", "block drift", "image drift", "gradient agreement", "convergence",
                          "peak VRAM and size"]
    assert all(rows[name][1] == "PASS" for name in list(rows)[:5]), result.output
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    for gate in data["gates"]:
        assert rows[gate["name"]][1:4] == [gate["status"], gate["measured"], gate["limit"]]
        case = cases[gate["name"]]
        assert (case.find("failure") is not None) == (gate["status"] == "FAIL")
        assert (case.find("skipped") is not None) == (gate["status"] == "SKIP")
    assert suite.get("failures") == "0" and suite.get("tests") == "6"
    grid = data["gates"][2]["details"]["grid"]
    from PIL import Image

    assert Image.open(grid).size == (3 * 64, 14 + 4 * 64)  # bf16 | slab | difference, one row per prompt
    mse = data["gates"][0]["details"]
    # re-measured on other inputs than the compile's: other seed and timesteps, every layer measured
    assert mse["inputs"]["seed"] != 0 and mse["inputs"]["timesteps"] != [0.05, 0.35, 0.65, 0.95]
    assert mse["layers"] == 40 and max(mse["rel_mse"].values()) <= 0.01
    worst = mse["worst"][0]
    assert f"  {worst['layer']}: {worst['rel_mse']:.3g} [{worst['manifest_rel_mse']:.3g}]" in result.output
    conv = data["gates"][4]["details"]
    assert [len(conv["losses"][k]) for k in ("frozen", "bf16", "quantized")] == [40, 40, 40]
    assert -0.03 < conv["interval"][0] <= conv["interval"][1] < 0.03 and conv["p_learned"] < 0.05
    assert (tmp_path / "good.slab.accept" / "convergence.png").stat().st_size > 1000
    size = data["gates"][5]["details"]["size"]
    assert size["status"] == "PASS" and size["bytes"] == sum(p.stat().st_size for p in good_slab.iterdir())


def test_a_layer_replaced_by_noise_fails_layer_mse(tmp_path):
    def noise(model, adapter):
        layer = model.get_submodule("transformer_blocks.1.attn.to_v")
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)))

    slab = _write(tmp_path, "noisy.slab", QuantSpec(bits=8), edit=noise)
    result, report, _ = _accept(slab, tmp_path, *BRIEF)
    assert result.exit_code == 3, result.output
    mse = json.loads(report.read_text())["gates"][0]
    assert mse["status"] == "FAIL" and mse["details"]["over"] == ["transformer_blocks.1.attn.to_v"]
    assert mse["details"]["worst"][0]["layer"] == "transformer_blocks.1.attn.to_v"
    assert _table_rows(result.output)["layer MSE"][1] == "FAIL" and "FAILED: layer MSE" in result.output


DAMAGED = {
    # the slab of the issue: W4, every weight clipped to half its range, no clip search (26% model-output rel-MSE)
    "clipped": dict(spec=QuantSpec(bits=4, clip_ratio=0.5), clip_search=False),
    # one layer at a wrong scale: 16x, what mixing up a 4-bit and an 8-bit grid's step does
    "wrong-scale": dict(spec=QuantSpec(bits=8),
                        edit=lambda model, adapter: model.get_submodule("single_transformer_blocks.1.proj_out")
                        .weight.mul_(16.0)),
}
NEW_GATES = ("block drift", "image drift", "gradient agreement", "convergence")


@pytest.fixture(scope="module", params=sorted(DAMAGED))
def damaged_report(request, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp(request.param)
    opts = dict(DAMAGED[request.param])
    slab = _write(tmp_path, f"{request.param}.slab", opts.pop("spec"), **opts)
    result, report, junit = _accept(slab, tmp_path)
    return request.param, result, json.loads(report.read_text()), junit


def test_each_new_gate_fails_a_damaged_slab_on_its_own(damaged_report):
    name, result, data, junit = damaged_report
    assert result.exit_code == 3, result.output
    gates = {g["name"]: g for g in data["gates"]}
    for gate in NEW_GATES:  # each measured on its own inputs: none reads another gate's result
        assert gates[gate]["status"] == "FAIL", (name, gate, gates[gate]["measured"])
    drift, grads, conv = gates["image drift"]["details"], gates["gradient agreement"]["details"], gates["convergence"]["details"]
    assert drift["mean_psnr_db"] < 27 and drift["mean_ssim"] < 0.9
    # far past a threshold, not at its edge (with FLUX.1's default targets, every attention and MLP linear, the
    # clipped slab's gradients keep their size, 1.03x, and turn away: cosine 0.61)
    assert grads["cosine"] < 0.8 or abs(grads["norm_ratio"] - 1) > 0.2
    assert conv["p_learned"] < 0.05 and not -0.03 < conv["interval"][0] <= conv["interval"][1] < 0.03
    failures = {c.get("name") for c in ET.parse(junit).getroot().iter("testcase") if c.find("failure") is not None}
    assert set(NEW_GATES) <= failures


def test_a_bf16_slab_draws_the_same_images_and_passes_every_gate(tmp_path):
    slab = _write(tmp_path, "bf16.slab", QuantSpec(bits=16))
    result, report, _ = _accept(slab, tmp_path)
    assert result.exit_code == 0, result.output
    gates = {g["name"]: g for g in json.loads(report.read_text())["gates"]}
    assert min(gates["image drift"]["details"]["psnr_db"]) >= 40
    assert gates["gradient agreement"]["details"]["cosine"] > 0.9999


def test_a_run_that_learns_nothing_is_inconclusive_never_a_pass(good_slab, tmp_path):
    result, report, junit = _accept(good_slab, tmp_path, "--lr", "1e-7", *FEW_IMAGES)
    assert result.exit_code == 4, result.output
    data = json.loads(report.read_text())
    conv = data["gates"][4]
    assert conv["status"] == "INCONCLUSIVE" and data["verdict"] == "INCONCLUSIVE" and data["passed"] is False
    assert "raise --steps or --lr" in conv["note"] and "INCONCLUSIVE: convergence" in result.output
    error = ET.parse(junit).getroot().find("testsuite/testcase[@name='convergence']/error")
    assert error is not None and error.get("type") == "inconclusive"


def test_the_convergence_statistics_decide_by_interval_and_power():
    from squareq.acceptance.convergence import decide

    frozen = [1.0 + 0.1 * ((7 * i) % 5) for i in range(40)]
    ref = [f * (0.7 if i >= 20 else 0.9) for i, f in enumerate(frozen)]
    wobble = [0.002 * ((3 * i) % 5 - 2) for i in range(40)]
    assert decide(frozen, ref, [r * (1 + w) for r, w in zip(ref, wobble)], 0.02)["status"] == "PASS"
    assert decide(frozen, ref, [r * (1.05 + w) for r, w in zip(ref, wobble)], 0.02)["status"] == "FAIL"
    assert decide(frozen, ref, [r * (0.95 + w) for r, w in zip(ref, wobble)], 0.02)["status"] == "FAIL"  # lower too
    assert decide(frozen, ref, list(ref), 0.02)["status"] == "PASS"  # identical runs
    # the reference learned nothing: undecidable whatever the slab did
    assert decide(frozen, list(frozen), list(frozen), 0.02)["status"] == "INCONCLUSIVE"


def test_size_over_budget_and_a_required_gpu_fail(good_slab, tmp_path):
    result, report, junit = _accept(good_slab, tmp_path, "--budget", "100KB", "--require-gpu", *BRIEF)
    assert result.exit_code == 3, result.output
    gate = json.loads(report.read_text())["gates"][5]
    assert gate["status"] == "FAIL" and gate["details"]["size"]["status"] == "FAIL"
    if not torch.cuda.is_available():
        assert gate["details"]["vram"]["status"] == "FAIL" and "--require-gpu" in gate["note"]
    failure = ET.parse(junit).getroot().find("testsuite/testcase[@name='peak VRAM and size']/failure")
    assert failure is not None and "100.00 KB" in failure.text


def test_a_slab_of_another_model_is_refused_in_one_sentence(tmp_path):
    from diffusers import FluxTransformer2DModel

    model, adapter = load_builtin("tiny-flux")
    other = FluxTransformer2DModel(**{**dict(model.config), "num_single_layers": 1})
    out = tmp_path / "other.slab"
    write_rtn_slab(other, adapter.blocks(other), {}, out,
               PlainOptions(default_spec=QuantSpec(bits=8), family="flux", source="tiny-flux"))
    result, _, _ = _accept(out, tmp_path)
    assert result.exit_code == 1
    assert re.search(r"error: .*other\.slab was not compiled from --model tiny-flux", result.output)


def test_thresholds_file_sets_tau_conv_and_the_drift_limits(good_slab, tmp_path):
    toml = tmp_path / "strict.toml"
    toml.write_text("[thresholds]\nconv = 0.00001\npsnr = 60\n")
    result, report, _ = _accept(good_slab, tmp_path, "--thresholds", str(toml), *FEW_IMAGES)
    assert result.exit_code == 3, result.output
    gates = {g["name"]: g for g in json.loads(report.read_text())["gates"]}
    conv = gates["convergence"]
    assert conv["status"] == "FAIL" and conv["details"]["tau"] == 0.00001
    assert len(conv["details"]["losses"]["quantized"]) == 40
    assert gates["image drift"]["status"] == "FAIL" and gates["image drift"]["details"]["tau_psnr_db"] == 60


def test_an_old_thresholds_file_with_conv_steps_is_refused_in_one_sentence(good_slab, tmp_path):
    toml = tmp_path / "old.toml"
    toml.write_text("[thresholds]\nconv_steps = 5\n")
    result, _, _ = _accept(good_slab, tmp_path, "--thresholds", str(toml))
    assert result.exit_code != 0 and "conv_steps is no longer used" in result.output and "delete the key" in result.output


def test_a_clip_folder_without_its_processor_config_is_named(good_slab, tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    result, _, _ = _accept(good_slab, tmp_path, "--clip-model", str(folder))
    assert result.exit_code == 1 and "has no preprocessor_config.json" in result.output
    assert not (tmp_path / "good.slab.accept").exists()


def _tiny_clip(folder):
    """A CLIP model of one-layer towers with the tiny pipeline's tokenizer, saved with its processor in ``folder``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from squareq.models.tiny_pipeline import build_tiny_tokenizers

    tokenizer, _ = build_tiny_tokenizers()
    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=77),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
    CLIPModel(config).save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
                  tokenizer=tokenizer).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vram_and_clip_run(good_slab, tmp_path_factory):
    """One accept run of the good slab with --vram-budget and a local CLIP model, which the next two tests read: the
    options reach separate gates (peak VRAM and size; image drift), and each test checks the pass and its own gate."""
    tmp_path = tmp_path_factory.mktemp("vram-clip")
    result, report, _ = _accept(good_slab, tmp_path, "--vram-budget", "1GB", "--clip-model",
                                str(_tiny_clip(tmp_path / "clip")), *FEW_IMAGES)
    return result, report


def _gates(report) -> dict:
    return {g["name"]: g for g in json.loads(report.read_text())["gates"]}


def test_without_a_gpu_vram_is_skipped_not_failed(vram_and_clip_run):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result, report = vram_and_clip_run
    assert result.exit_code == 0, result.output
    vram = _gates(report)["peak VRAM and size"]["details"]["vram"]
    assert vram["status"] == "SKIP" and "without CUDA" in vram["note"]


def test_a_local_clip_model_adds_clip_scores(vram_and_clip_run):
    result, report = vram_and_clip_run
    assert result.exit_code == 0, result.output
    drift = _gates(report)["image drift"]
    scores = drift["details"]["clip_score"]
    assert len(scores["bf16"]) == len(scores["slab"]) == 2 and "CLIP score" in drift["note"]
    assert all(isinstance(v, float) for v in scores["bf16"] + scores["slab"])


def test_a_generic_model_is_gated_on_layer_mse_and_size_and_says_why_not_on_training(tmp_path):
    from transformers import T5Config, T5EncoderModel

    from squareq.compiler import CompileOptions, compile_slab
    from squareq.sources import open_source

    torch.manual_seed(0)
    folder = save_text_model(T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                     num_heads=4)), tmp_path / "t5")
    slab = tmp_path / "t5.slab"
    compile_slab(open_source(folder, ["encoder.block"]), slab, CompileOptions(budget=1_000_000, calib_samples=16))
    result = CliRunner().invoke(main, ["accept", str(slab), "--model", str(folder), "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    gates = {g["name"]: g for g in json.loads((tmp_path / "r.json").read_text())["gates"]}
    layers = len(json.loads((slab / "manifest.json").read_text())["layers"])
    assert gates["layer MSE"]["status"] == "PASS" and gates["layer MSE"]["details"]["layers"] == layers == 12
    assert gates["layer MSE"]["details"]["inputs"]["kind"] == "text"  # real sentences, as the compile used
    assert gates["convergence"]["status"] == "SKIP" and "cannot train" in gates["convergence"]["note"]
    assert gates["peak VRAM and size"]["details"]["size"]["status"] == "PASS"


def test_another_family_is_gated_on_convergence_with_its_own_objective(tmp_path):
    from squareq.compiler import CompileOptions, compile_slab
    from squareq.sources import open_source

    from squareq.compiler.calibration_images import calibration_images

    slab = tmp_path / "sd3.slab"
    source = open_source("tiny-sd3")
    compile_slab(source, slab, CompileOptions(budget=4_000_000, calib_samples=8,
                                              calib_images=calibration_images(source, resolution=64)))
    result = CliRunner().invoke(main, ["accept", str(slab), "--model", "tiny-sd3", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    gates = {g["name"]: g for g in json.loads((tmp_path / "r.json").read_text())["gates"]}
    assert gates["convergence"]["status"] == "PASS" and "training a sd3 LoRA with the flow objective" in result.output


def test_a_report_into_a_missing_folder_is_refused_before_any_work(good_slab, tmp_path):
    result = CliRunner().invoke(main, ["accept", str(good_slab), "--model", "tiny-flux",
                                       "--junit", str(tmp_path / "nope" / "a.xml")])
    assert result.exit_code == 2 and "--junit" in result.output and "does not exist" in result.output
    assert not (tmp_path / "good.slab.accept").exists()


@pytest.mark.parametrize("key, value", [("budget_bytes", "2MB"), ("budget_bytes", True), ("seed", 1.5),
                                        ("resolution", 0), ("timesteps", [0.5, "x"]), ("cache", 3)])
def test_a_calibration_field_of_the_wrong_type_is_one_sentence_before_any_gate(tmp_path, key, value):
    """Issue 40: calibration.budget_bytes "2MB" crashed the last gate after every other had run, and no report was
    written; the manifest's fields the gates read are checked first. The control: the compile's own values pass."""
    from squareq.acceptance.runner import check_recorded
    from squareq.slab import open_slab

    slab = _write(tmp_path, "s.slab", QuantSpec(bits=8))
    m = json.loads((slab / "manifest.json").read_text())
    sound = {"budget_bytes": 2_000_000, "seed": 0, "samples": 8, "resolution": 64, "timesteps": [0.5, 0.25],
             "kind": "images", "cache": None}
    m["calibration"] = {**sound, key: value}
    (slab / "manifest.json").write_text(json.dumps(m))
    result, report, junit = _accept(slab, tmp_path)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert result.output.startswith(f"error: {slab / 'manifest.json'}'s calibration.{key} is {str(value)!r}, not "), \
        result.output
    assert "[1/" not in result.output and not report.exists() and not junit.exists()
    m["calibration"] = sound
    (slab / "manifest.json").write_text(json.dumps(m))
    with open_slab(slab) as s:
        check_recorded(s)


def test_fresh_inputs_are_real_images_at_other_noise_levels_than_the_compiles(good_slab):
    from squareq.acceptance.layer_mse import _fresh_timesteps, fresh_inputs
    from squareq.slab import open_slab
    from squareq.sources import open_source

    used = [round(0.05 + 0.9 * i / 8, 4) for i in range(9)]  # the grid of a synthetic 9-sample compile
    grid = _fresh_timesteps(2, used)
    assert all(abs(float(t) - u) > 1e-3 for t in grid for u in used) and len(set(grid.tolist())) == 2
    with open_slab(good_slab) as slab:
        recorded = slab.manifest.calibration
        _, description = fresh_inputs(open_source("tiny-flux"), slab, 4, "cpu")
    assert description["kind"] == "images" and description["source"] == recorded["source"]
    assert description["seed"] != recorded["seed"] and description["resolution"] == recorded["resolution"]
    assert not set(description["timesteps"]) & set(recorded["timesteps"])


def test_the_bf16_reference_is_rewritten_when_the_source_weights_change(tmp_path):
    import os

    from safetensors.torch import load_file, save_file

    from squareq.acceptance.convergence import reference_slab
    from squareq.models import write_tiny_flux_pipeline
    from squareq.sources import open_source

    folder = write_tiny_flux_pipeline(tmp_path / "pipe")
    lines = []

    def writes() -> int:  # the line that says the reference is written (the others count its blocks)
        return sum(line.startswith("writing the bf16 reference slab") for line in lines)

    reference_slab(open_source(folder), tmp_path, lines.append)
    reference_slab(open_source(folder), tmp_path, lines.append)
    assert writes() == 1  # the second call reused it
    weights = next((folder / "transformer").glob("*.safetensors"))
    state = load_file(str(weights))
    save_file({k: v * 3 for k, v in state.items()}, str(weights))
    os.utime(weights, ns=(1, 1))  # even with an old timestamp: the size or time differs from what was recorded
    reference_slab(open_source(folder), tmp_path, lines.append)
    assert writes() == 2


def test_train_config_settings_come_below_flags_and_above_the_gates_defaults(tmp_path):
    from pathlib import Path

    from squareq.acceptance.convergence import ConvergenceSettings, training_config

    base = tmp_path / "train.toml"
    base.write_text("lr = 0.05\nresolution = 128\nepochs = 3\nsave_every = 7\n")
    args = (Path("s.slab"), "tiny-flux", tmp_path / "out", tmp_path / "cache", 25)
    cfg = training_config(ConvergenceSettings(base=str(base), data="d"), *args)
    assert (cfg.lr, cfg.resolution, cfg.rank, cfg.steps, cfg.epochs, cfg.save_every) == (0.05, [128], 16, 25, None, 0)
    cfg = training_config(ConvergenceSettings(base=str(base), data="d", lr=0.2, rank=4), *args)
    assert (cfg.lr, cfg.rank, cfg.resolution) == (0.2, 4, [128])
    cfg = training_config(ConvergenceSettings(data="d"), *args)
    assert (cfg.lr, cfg.resolution, cfg.max_sequence_length) == (1e-3, [512], 512)
    base.write_text("lr = 0.05\n")  # a base file that leaves the resolution (a list field) at the trainer's default
    cfg = training_config(ConvergenceSettings(base=str(base), data="d"), *args)
    assert (cfg.lr, cfg.resolution) == (0.05, [512])
