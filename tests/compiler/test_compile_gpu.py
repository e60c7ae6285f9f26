"""The compiler on CUDA: calibration, search and GPTQ run on the GPU and give a slab as good as the CPU's."""
import json

import pytest
import torch

from squareq.compiler import CompileOptions, compile_slab
from squareq.slab import open_slab
from squareq.sources import open_source


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


@pytest.mark.gpu
def test_a_tight_vram_budget_builds_the_same_slab(tmp_path, tiny_flux_images, monkeypatch):
    """Recorded inputs and the effect pass's block inputs in pinned host memory (the tightest budget the plan
    accepts) against everything on the GPU: the same tensor bytes and rungs, blocks run two samples at a time."""
    from squareq.compiler import chunks, compile_setup

    torch.backends.cuda.enable_cudnn_sdp(False)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1)  # one sample per chunk: the chunked paths run
    plans = []
    real_plan = compile_setup.plan_vram

    def record(needs, budget, device, *a):
        plan = real_plan(needs, budget, device, *a)
        plans.append(plan)
        return plan

    monkeypatch.setattr(compile_setup, "plan_vram", record)
    opts = dict(budget=2_000_000, device="cuda", calib_samples=8, calib_images=tiny_flux_images)
    compile_slab(open_source("tiny-flux"), tmp_path / "free.slab", CompileOptions(**opts))
    tight = plans[0].needs.peak(True, True)
    compile_slab(open_source("tiny-flux"), tmp_path / "tight.slab", CompileOptions(**opts, vram_budget=tight))
    assert not plans[0].host_tape and plans[1].host_tape and plans[1].host_saved
    a, b = ((tmp_path / f"{n}.slab" / "slab.safetensors").read_bytes() for n in ("free", "tight"))
    assert a == b
    rungs = [[layer["rung"] for layer in json.loads((tmp_path / f"{n}.slab" / "manifest.json").read_text())["layers"]]
             for n in ("free", "tight")]
    assert rungs[0] == rungs[1]
    assert torch.cuda.max_memory_reserved() > 0


@pytest.mark.gpu
def test_the_effects_replay_runs_lean_attention_on_cuda(tmp_path, tiny_flux_images, monkeypatch):
    """The effects pass's backward replays run in the autograd engine's CUDA thread: the attention mode must reach
    them there (else the math kernel's probabilities come back, and with them the memory the plan left out)."""
    from squareq.kernels import lean_attention as lean

    torch.backends.cuda.enable_cudnn_sdp(False)
    calls = []
    real = lean.lean_attention
    monkeypatch.setattr(lean, "lean_attention", lambda *a, **kw: (calls.append(torch.is_grad_enabled()),
                                                                   real(*a, **kw))[1])
    compile_slab(open_source("tiny-flux"), tmp_path / "t.slab",
                 CompileOptions(budget=2_000_000, device="cuda", calib_samples=8, calib_images=tiny_flux_images))
    assert any(calls), "no attention call with a graph went through lean_attention"


@pytest.mark.gpu
def test_squareq_compile_runs_on_the_gpu_without_device_flag(tmp_path):
    """`--device auto`, the default: the compile's calibration, search and effects run on CUDA."""
    from click.testing import CliRunner

    from squareq.cli import main

    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.cuda.reset_peak_memory_stats()
    out = tmp_path / "tiny.slab"
    result = CliRunner().invoke(main, ["compile", "tiny-flux", "--budget", "2MB", "-o", str(out),
                                       "--calib-resolution", "64", "--calib-samples", "4"])
    assert result.exit_code == 0, result.output
    assert "compiling tiny-flux on cuda:" in result.output and torch.cuda.get_device_name() in result.output
    vram = json.loads((out / "manifest.json").read_text())["calibration"]["vram"]
    assert vram["peak_reserved_bytes"] and vram["peak_reserved_bytes"] > 0  # None when a compile runs on the CPU
    assert torch.cuda.max_memory_allocated() > 0


@pytest.mark.gpu
def test_a_tight_host_budget_spills_and_builds_the_same_slab_on_cuda(tmp_path, tiny_flux_images, monkeypatch):
    """On CUDA, at the tightest VRAM budget (recorded and effect inputs off the GPU) and the tightest host budget
    (both spilled to the state folder through the pinned staging buffer): the same slab bytes and rungs as with
    everything on the GPU, and as with them in pinned host memory."""
    from squareq.compiler import chunks, compile_setup, host_plan, spill

    torch.backends.cuda.enable_cudnn_sdp(False)
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 1)  # one sample per chunk: the joins and the row reads run
    # a 4 KB staging buffer and checksum segment: tiny-flux's waiting tensors (KBs) then cost more than it, so the
    # plan spills them, and each goes through the staging buffer in many pieces
    monkeypatch.setattr(spill, "SEGMENT", 4096)
    monkeypatch.setattr(host_plan, "SEGMENT", 4096)
    vram_plans, host_plans = [], []
    real_vram, real_host = compile_setup.plan_vram, compile_setup.plan_host
    monkeypatch.setattr(compile_setup, "plan_vram",
                        lambda *a, **kw: vram_plans.append(real_vram(*a, **kw)) or vram_plans[-1])
    monkeypatch.setattr(compile_setup, "plan_host",
                        lambda *a, **kw: host_plans.append(real_host(*a, **kw)) or host_plans[-1])
    opts = dict(budget=2_000_000, device="cuda", calib_samples=8, calib_images=tiny_flux_images)
    compile_slab(open_source("tiny-flux"), tmp_path / "gpu.slab", CompileOptions(**opts, host_budget=10**13))
    tight_vram = vram_plans[0].needs.peak(True, True)
    compile_slab(open_source("tiny-flux"), tmp_path / "pinned.slab",
                 CompileOptions(**opts, vram_budget=tight_vram, host_budget=10**13))
    least = host_plans[1].needs.peak(True, True)
    compile_slab(open_source("tiny-flux"), tmp_path / "spilled.slab",
                 CompileOptions(**opts, vram_budget=tight_vram, host_budget=least))
    wheres = [(p.tape_where, p.saved_where) for p in host_plans]
    assert wheres[:2] == [("gpu", "gpu"), ("pinned", "pinned")] and "spilled" in wheres[2], wheres
    assert host_plans[1].needs.saved > 0 and host_plans[2].expected_peak <= least
    names = ("gpu", "pinned", "spilled")
    slabs = [(tmp_path / f"{n}.slab" / "slab.safetensors").read_bytes() for n in names]
    assert slabs[0] == slabs[1] == slabs[2]
    manifests = [json.loads((tmp_path / f"{n}.slab" / "manifest.json").read_text()) for n in names]
    assert [layer["rung"] for layer in manifests[0]["layers"]] == [layer["rung"] for layer in manifests[2]["layers"]]
    vram = manifests[2]["calibration"]["vram"]
    spilled = vram["recorded_inputs_spilled_bytes"] + vram["effect_inputs_spilled_bytes"]
    assert spilled > 0 and vram["recorded_inputs_on_host"] and vram["effect_inputs_on_host"]
    assert not (tmp_path / "spilled.slab.state").exists()
