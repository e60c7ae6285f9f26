"""The compiler on CUDA: calibration, search and GPTQ run on the GPU and give a slab as good as the CPU's."""
import json

import pytest
import torch

from squareq.compiler import CompileOptions, compile_slab, open_source
from squareq.slab import open_slab


@pytest.mark.gpu
def test_compile_on_cuda_matches_the_cpu_decisions(tmp_path, tiny_flux_images):
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    slabs = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.slab"
        compile_slab(open_source("tiny-flux"), out, CompileOptions(budget=2_000_000, device=device, calib_samples=8,
                                                                    calib_images=tiny_flux_images))
        with open_slab(out, verify=True):
            pass
        slabs[device] = {layer["name"]: layer for layer in json.loads((out / "manifest.json").read_text())["layers"]}
    cpu, gpu = slabs["cpu"], slabs["cuda"]
    assert {n: layer["rung"] for n, layer in gpu.items()} == {n: layer["rung"] for n, layer in cpu.items()}
    for name, layer in gpu.items():
        assert layer["metrics"]["output_rel_mse"] <= 2 * cpu[name]["metrics"]["output_rel_mse"] + 1e-6, name
