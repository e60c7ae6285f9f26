"""Compiling within a VRAM budget: blocks run a few samples at a time, the plan, its refusal, and identical slabs."""
from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner
from torch.utils._pytree import tree_flatten

from squareq.cli import main
from squareq.compiler import chunks as chunks_mod
from squareq.compiler.budget import BudgetError
from squareq.compiler.chunks import batched_kwargs, probe_batch_axes, run_chunked
from squareq.compiler.ladder import DEFAULT_FORMATS, rung_specs
from squareq.compiler.layer_statistics import StatsCollector
from squareq.compiler.vram import Needs, choose_placement, estimate_needs, plan_vram
from squareq.models import BUILTIN_MODELS
from squareq.sizes import parse_size
from squareq.sources import open_source

pytestmark = pytest.mark.usefixtures("torch_kernels")


def _probe(name: str, samples: int = 4, chunk_bytes: int = chunks_mod.CHUNK_BYTES):
    source = open_source(name)
    batch = source.family_adapter.calibration_inputs(source.skeleton(), samples, 0)
    batched = batched_kwargs(batch.kwargs, batch.heldout_kwargs, samples)
    return source, batch, probe_batch_axes(source, batch.kwargs, batched, samples, chunk_bytes)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_the_meta_probe_finds_every_familys_batched_block_arguments(name):
    """Every family's forward runs on the meta device, and in each block call the batched tensors are exactly those
    whose first axis is the batch (FLUX's rotary embeddings, first axis = tokens, are not)."""
    source, batch, axes = _probe(name)
    assert axes.chunk_samples is not None, axes.why
    assert len(axes.calls) >= len(source.block_paths)
    assert all(any(call.inputs) and call.sample_bytes > 0 for _, call in axes.calls)
    assert any(call.tape_bytes > 0 for _, call in axes.calls)
    if name == "tiny-flux":
        first = axes.calls[0][1]
        assert first.inputs == (True, True, True, False, False)  # hidden, text, temb | cos, sin
        assert first.outputs == (True, True)


def test_a_block_run_chunk_by_chunk_gives_the_whole_batchs_outputs():
    source, batch, axes = _probe("tiny-flux", samples=5, chunk_bytes=1)  # one sample per chunk
    assert axes.chunk_samples == 1
    seen = {}

    def run(index, path, args, kwargs):
        block = source.load_block(path, "cpu", torch.float32, upcast_linears=True)
        whole = block(*args, **kwargs)
        parts = run_chunked(block, args, kwargs, axes.calls[index][1], axes.ranges(5))
        seen[index] = [torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5) or True
                       for a, b in zip(tree_flatten(whole)[0], tree_flatten(parts)[0])]
        return whole

    with torch.no_grad():
        source.shell(run, "cpu")(**batch.kwargs)
    assert len(seen) == len(source.block_paths) and all(all(v) for v in seen.values())


def test_statistics_of_chunks_are_those_of_the_whole_batch():
    """Recording a layer's inputs chunk by chunk keeps each sample's rows in the fit or the held-out part by the
    sample's global index."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(6, 4))
    x = torch.randn(6, 5, 6)
    held = (1, 4)
    with StatsCollector("b", block, max_rows=1000, samples=6, heldout_samples=held) as whole:
        block(x)
    with StatsCollector("b", block, max_rows=1000, samples=6, heldout_samples=held) as chunked:
        for start in range(0, 6, 2):
            with chunked.window(start, start + 2):
                block(x[start:start + 2])
    a, b = whole.stats["b.0"], chunked.stats["b.0"]
    fit = torch.cat([x[i] for i in range(6) if i not in held])
    assert torch.equal(b.absmax, a.absmax) and b.count == a.count == fit.shape[0]
    assert torch.allclose(b.hessian, a.hessian, rtol=1e-6) and torch.allclose(b.hessian, fit.T @ fit / 20, rtol=1e-5)
    assert sorted(map(tuple, b.heldout_rows.tolist())) == sorted(map(tuple, torch.cat([x[1], x[4]]).tolist()))


def test_layers_reading_one_input_share_one_recording_and_one_set_of_statistics():
    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            return self.o(self.q(x) + self.k(x) + self.v(x))

    block = QKV()
    with StatsCollector("b", block, samples=2, heldout_samples=(1,)) as col:
        block(torch.randn(2, 3, 8))
    assert col.groups() == [["b.q", "b.k", "b.v"], ["b.o"]]
    assert len(col._entries) == 2
    assert col.stats["b.q"] is col.stats["b.k"] is col.stats["b.v"]


def test_the_plan_keeps_everything_on_the_gpu_when_it_fits_and_moves_the_effect_inputs_first():
    n = Needs(base=100, hidden=50, held_base=150, block=200, chunk=300, tape=1000, search=400, effects=500, saved=2000)
    assert choose_placement(n, n.peak(False, False)) == (False, False)
    assert choose_placement(n, n.peak(False, False) - 1) == (False, True)
    assert choose_placement(n, n.peak(False, True) - 1) == (True, True)
    assert choose_placement(n, n.peak(True, True)) == (True, True)
    with pytest.raises(BudgetError, match="give it at least"):  # negative control: below the least
        choose_placement(n, n.peak(True, True) - 1)


def _minimum_from(output: str) -> int:
    m = re.search(r"give it at least ([0-9.]+ [KMGT]?B)", output)
    assert m, output
    return parse_size(m.group(1).replace(" ", ""))


def tiny_compile_args(out) -> list[str]:
    """A quick `squareq compile tiny-flux` to ``out`` (the budget-refusal tests add the flag under test)."""
    return ["compile", "tiny-flux", "-o", str(out), "--budget", "2MB", "--calib-samples", "8", "--calib-resolution",
            "64", "--rounding", "nearest", "--effect-probes", "1"]


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith("error:")]


def test_a_budget_below_one_layers_work_is_refused_with_the_smallest_budget_that_works(tmp_path):
    out = tmp_path / "t.slab"
    args = tiny_compile_args(out)
    refused = CliRunner().invoke(main, args + ["--vram-budget", "10KB"])
    errors = error_lines(refused)
    assert refused.exit_code == 1 and len(errors) == 1 and "--vram-budget 10.00 KB cannot hold" in errors[0]
    assert "largest layer's search" in errors[0]
    assert not out.exists() and not (tmp_path / "t.slab.state").exists()
    least = _minimum_from(refused.output)
    # negative control: the stated minimum itself is accepted (the compile runs to the end)
    ok = CliRunner().invoke(main, args + ["--vram-budget", str(least)])
    assert ok.exit_code == 0, ok.output
    assert "wrote" in ok.output


def test_the_estimate_counts_the_largest_layers_gptq_factorization():
    source, batch, axes = _probe("tiny-flux", samples=8)
    skeleton = source.skeleton()
    specs = rung_specs(DEFAULT_FORMATS)
    gptq = estimate_needs(source, skeleton, batch, axes, gptq=True, max_rows=512, probes=4, specs=specs)
    nearest = estimate_needs(source, skeleton, batch, axes, gptq=False, max_rows=512, probes=4, specs=specs)
    n, k = gptq.layer_shape
    assert gptq.search - nearest.search >= 16 * k * k
    assert gptq.saved == 4 * 8 * sum(c.sample_bytes for _, c in axes.calls)
    with pytest.raises(BudgetError, match="give it at least"):
        plan_vram(gptq, 1000, "cpu")
    assert plan_vram(gptq, gptq.peak(True, True), "cpu").budget == gptq.peak(True, True)


def test_an_upcast_block_saves_no_float32_weights_and_is_freed_at_once():
    """A block loaded with its linears kept as stored (bf16) and cast while they run: its backward saves the stored
    weights, never float32 copies; its input gradient is that of the block cast whole; and dropping it frees it at
    once, without waiting for the garbage collector (a cycle there held a 2 GB FLUX.2 block into the next one)."""
    import gc
    import weakref

    source = open_source("tiny-flux")
    path = source.block_paths[-1]
    block = source.load_block(path, "cpu", torch.float32, upcast_linears=True)
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:  # as a bf16 checkpoint stores them (tiny-flux's own are float32)
        m.weight.data = m.weight.data.to(torch.bfloat16)
    whole = source.load_block(path, "cpu", torch.float32)
    for a, b in zip(linears, [m for m in whole.modules() if isinstance(m, torch.nn.Linear)]):
        b.weight.data = a.weight.data.float()
    batch = source.family_adapter.calibration_inputs(source.skeleton(), 2, 0)
    args = {}

    def grab(index, p, a, kw):
        if p == path:
            args.update(a=a, kw=kw)
        return source.load_block(p, "cpu", torch.float32)(*a, **kw)

    with torch.no_grad():
        source.shell(grab, "cpu")(**batch.kwargs)
    grads, saved = [], []
    for model in (block, whole):
        x = [t.detach().clone().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t for t in args["a"]]
        kw = {k: v.detach().clone().requires_grad_(v.is_floating_point()) if torch.is_tensor(v) else v
              for k, v in args["kw"].items()}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            out = tree_flatten(model(*x, **kw))[0]
        sum(o.float().square().sum() for o in out if torch.is_tensor(o) and o.requires_grad).backward()
        grads.append([t.grad for t in tree_flatten((x, kw))[0] if torch.is_tensor(t) and t.grad is not None])
        if model is block:
            weights = {tuple(m.weight.shape) for m in linears}
            frozen = [t for t in saved if not t.requires_grad and tuple(t.shape) in weights]  # not activations
            assert frozen and not [t for t in frozen if t.dtype == torch.float32]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    refs = [weakref.ref(block), *[weakref.ref(m) for m in linears]]
    gc.disable()
    try:
        del block, linears, out, saved, m  # m: the last linear of the loops above
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def _effects_setup(samples: int):
    """tiny-flux's held-out batch with its block axes, and every linear's W4 candidate by block index."""
    from squareq import quant
    from squareq.slab.writer import block_linears

    source, batch, axes = _probe("tiny-flux", samples=samples)
    kwargs = batch.heldout_kwargs or batch.kwargs
    held = int(next(v.shape[0] for v in kwargs.values() if torch.is_tensor(v) and v.dim()))

    def candidates_of(i):
        path = source.block_paths[i]
        return {name: {4: quant.quantize(m.weight.detach().float(), quant.QuantSpec(bits=4, group_size=16))}
                for name, m in block_linears(path, source.load_block(path))}

    return source, axes, kwargs, held, candidates_of


def test_effects_run_a_few_probes_per_pass_and_fill_every_probes_rows(monkeypatch):
    """With one probe per pass (a model whose held-out hidden states are large), each pass's per-sample terms land
    in their own rows: every row of every layer's sums is filled, none twice."""
    from squareq.compiler import effect

    source, axes, kwargs, samples, candidates_of = _effects_setup(samples=6)

    passes = []
    real = effect._ProbePasses
    monkeypatch.setattr(effect, "_ProbePasses", lambda *a: passes.append(real(*a)) or passes[-1])
    monkeypatch.setattr(chunks_mod, "EFFECT_PASS_BYTES", 1)
    effects, info = effect.measure_effects(source, kwargs, None, candidates_of, probes=3, axes=axes,
                                           batched=batched_kwargs(kwargs, None, samples))
    assert info["probes_per_pass"] == 1 and len(passes) == 1
    rows = [t for rungs in passes[0].sums.values() for t in rungs.values()]
    assert rows and all(t.shape[0] == 3 * samples and bool((t != 0).all()) for t in rows)
    assert all(v[4] > 0 for v in effects.values())


def test_the_effects_forward_keeps_no_blocks_outputs_beside_their_saved_copies(monkeypatch):
    """While the effects pass's forward runs, each block's inputs wait (as ``keep`` copies) for the backward pass and
    nothing else of a finished block stays alive: after the forward, only the last block's outputs (which the
    model's own tail saved for its backward) are still referenced. A runner that kept its call's tensors would hold
    every block's hidden states on the GPU at once (a 12B FLUX.1 ran out of 8 GB after a few blocks)."""
    import weakref

    from squareq.compiler import effect

    source, axes, kwargs, samples, candidates_of = _effects_setup(samples=4)

    outputs: list[list] = []
    real_run = effect.run_chunked

    def recording_run(*a, **kw):
        out = real_run(*a, **kw)
        outputs.append([weakref.ref(t) for t in tree_flatten(out)[0] if torch.is_tensor(t)])
        return out

    alive: list[int] = []

    def lap(phase):
        if phase == "effects forward" and not alive:
            alive.extend(i for i, refs in enumerate(outputs) if any(r() is not None for r in refs))

    monkeypatch.setattr(effect, "run_chunked", recording_run)
    effect.measure_effects(source, kwargs, None, candidates_of, probes=1, axes=axes, lap=lap,
                           batched=batched_kwargs(kwargs, None, samples), keep=lambda t: t.clone())
    assert len(outputs) >= len(source.block_paths) >= 3
    assert alive and set(alive) <= {len(source.block_paths) - 1}, alive
