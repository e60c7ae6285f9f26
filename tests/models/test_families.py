"""Every family adapter, on its built-in tiny model: compile → stream, equal to the resident quantized model in
outputs and LoRA gradients; a LoRA saved for it loads back; `squareq families` and docs/families.md list it."""
from pathlib import Path

import pytest
import torch

from squareq import runtime
from squareq.compiler import CompileOptions, compile_slab, open_source
from squareq.models import ADAPTERS, BUILTIN_MODELS, families_table, load_builtin

FAMILIES = sorted(BUILTIN_MODELS)


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")


@pytest.fixture(scope="module")
def slabs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("families")
    return {name: compile_slab(open_source(name), folder / f"{name}.slab", CompileOptions(budget=2_000_000)) and
            folder / f"{name}.slab" for name in FAMILIES}


def _inputs(name):
    model, adapter = load_builtin(name)
    return adapter.calibration_inputs(model, 2, 7, dtype=torch.bfloat16).kwargs


def _step(model, kwargs, seed=0):
    params = runtime.add_lora(model, rank=4, seed=seed)
    with torch.no_grad():
        for p in params:  # B off zero, so every factor gets a gradient
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1)))
    model.enable_gradient_checkpointing()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**kwargs, return_dict=False)[0]
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in runtime.lora_parameters(model).items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_streamed_equals_resident_in_outputs_and_lora_gradients(slabs, name):
    kwargs = _inputs(name)
    out_r, grads_r = _step(runtime.load(slabs[name], "cpu", stream=False), kwargs)
    out_s, grads_s = _step(runtime.load(slabs[name], "cpu", prefetch=2), kwargs)
    assert torch.equal(out_s, out_r) and grads_r.keys() == grads_s.keys() and len(grads_r) > 0
    for key in grads_r:
        assert torch.equal(grads_s[key], grads_r[key]), key
    assert all(g.abs().sum() > 0 for g in grads_r.values())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_lora_saved_for_the_family_loads_back(slabs, name, tmp_path):
    from squareq.train.lora_files import attach_lora, load_lora, save_diffusers_lora

    kwargs = _inputs(name)
    trained = runtime.load(slabs[name], "cpu", prefetch=2)
    _step(trained, kwargs, seed=3)
    path = save_diffusers_lora(runtime.lora_state_dict(trained), tmp_path, 4, 4.0, list(runtime.DEFAULT_TARGETS),
                               dtype=torch.float32)
    fresh = runtime.load(slabs[name], "cpu", prefetch=2)
    attach_lora(fresh, *load_lora(path))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a = trained(**kwargs, return_dict=False)[0]
        b = fresh(**kwargs, return_dict=False)[0]
    assert torch.equal(a, b)


def test_the_families_table_lists_every_adapter_and_the_docs_carry_it():
    table = families_table()
    for adapter in ADAPTERS.values():
        row = next(line for line in table.splitlines() if line.startswith(f"| {adapter.family} |"))
        assert f"`{adapter.class_name}`" in row
        assert row.count("yes") == len(adapter.supports)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "families.md").read_text()
    assert table in docs, "docs/families.md is out of date: paste the output of `squareq families` into it"
