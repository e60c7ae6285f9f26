"""The output correction on CUDA: a text model (where auto fits it) and tiny-flux (with on) compile on the GPU with it,
and the text model's decisions match the CPU's."""
import pytest
import torch

from squareq.compiler import CompileOptions, compile_slab
from squareq.sources import open_source

from ..sources.test_base_prefix import _bert
from ..text_models import save_text_model


@pytest.mark.gpu
def test_the_correction_runs_on_cuda_as_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")
    config, base, _, blocks = _bert()
    torch.manual_seed(0)
    folder = save_text_model(base(config).eval(), tmp_path / "model")
    records = {}
    for device in ("cpu", "cuda"):
        m = compile_slab(open_source(folder, [blocks]), tmp_path / f"{device}.slab",
                         CompileOptions(budget=1_000_000, calib_samples=32, calib_tokens=24, effect_probes=2,
                                        device=device))
        records[device] = m.calibration["output_correction"]
    cpu, gpu = records["cpu"], records["cuda"]
    assert gpu["fitted"] and gpu["layers"] == cpu["layers"] and gpu["passes"] == cpu["passes"]
    assert gpu["kept"] == (gpu["output_rel_mse_with"] < gpu["output_rel_mse_without"])
    # the same fit up to TF32 and kernel rounding
    assert gpu["output_rel_mse_with"] == pytest.approx(cpu["output_rel_mse_with"], rel=0.05)
    assert gpu["scale_min"] == pytest.approx(cpu["scale_min"], abs=2e-3)


@pytest.mark.gpu
def test_an_image_model_is_corrected_on_cuda_when_asked(tmp_path, tiny_flux_images):
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    m = compile_slab(open_source("tiny-flux"), tmp_path / "on.slab",
                     CompileOptions(budget=2_000_000, device="cuda", calib_samples=8, calib_images=tiny_flux_images,
                                    output_correction="on"))
    rec = m.calibration["output_correction"]
    assert rec["fitted"] and rec["layers"] > 0
    assert rec["kept"] == (rec["output_rel_mse_with"] < rec["output_rel_mse_without"])
