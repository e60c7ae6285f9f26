"""The streamed blocks under torch.compile (runtime/block_compile.py): the same outputs and LoRA gradients as eager,
one compiled forward per block class shared by every block and slot, and no compiling once a run's shapes are seen.
On a CPU the graphs go through AOT autograd without inductor (``aot_eager``), which keeps eager's values exactly."""
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from squareq import runtime
from squareq.runtime import block_compile

from .harness import assert_same, inputs, step, with_lora


@pytest.fixture(autouse=True)
def cpu_compile(monkeypatch):
    monkeypatch.setenv("SQUAREQ_KERNELS", "torch")  # the Triton interpreter would make each step 30x slower
    monkeypatch.setattr(block_compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()  # every test starts with no compiled code
    yield
    torch._dynamo.reset()


def _train(model, steps: int):
    params = with_lora(model)
    opt = torch.optim.SGD(params, lr=0.5)
    results, compiling = [], []
    for i in range(steps):
        before = block_compile.compile_seconds()
        out, grads = step(model, inputs("cpu", seed=i), checkpointing=True)
        compiling.append(block_compile.compile_seconds() - before)
        for name, p in runtime.lora_parameters(model).items():
            p.grad = grads[name].clone()
        opt.step()
        results.append((out, grads))
    return results, compiling


def test_compiled_streamed_steps_equal_eager_and_stop_compiling(tiny_slab):
    eager, _ = _train(runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2)), 3)
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, compile_blocks=True))
    assert runtime.runtime_of(model).compiled
    compiled, compiling = _train(model, 3)
    for a, b in zip(eager, compiled, strict=True):
        assert_same(a, b)
    # the first step compiles the forward with gradients recorded, the second the no-grad forward; after that every
    # shape and grad mode of the run has its graphs (compile_seconds counts each new forward graph, and a backward
    # graph is only ever compiled for a new forward graph)
    assert compiling[0] > 0 and compiling[2] == 0


def _graphs_compiled(slab, counter, change=None) -> int:
    """How many graphs Dynamo compiles (``counter``: the backend that counts them) for one no-grad forward of the
    model in ``slab`` with LoRA, after ``change(model)``."""
    block_compile.BACKEND = counter  # one backend throughout: Dynamo's cached graphs are the backend's
    before = counter.frame_count
    model = runtime.load(slab, "cpu", options=runtime.LoadOptions(prefetch=2, compile_blocks=True))
    with_lora(model)
    if change is not None:
        change(model)
    with torch.no_grad():
        model(**inputs("cpu"), return_dict=False)
    return counter.frame_count - before


def test_each_block_class_compiles_to_one_graph_shared_by_its_blocks(tiny_slab):
    """The quantized layers are traced as custom operators (runtime/linear_op.py), so a no-grad forward compiles one
    graph per block class (double, single), whatever formats its blocks' layers
    have (the tiny slab mixes W4 g128, W6, W8 and bf16 layers across blocks) and whichever slots they sit in; a
    second model's blocks (other modules,
    slot tensors and LoRA factors) compile nothing. Negative controls: a double block whose layer norm has another
    epsilon (a constant the graphs hold) compiles a graph of its own, and so, with the layers kept eager between
    compiled pieces (``WHOLE_BLOCKS`` off), does each piece."""
    def other_eps(model):
        model.transformer_blocks[1].norm1.norm.eps = 1e-5

    counter = CompileCounterWithBackend("aot_eager")
    assert _graphs_compiled(tiny_slab, counter) == 2  # inputs made dense: a slice would compile again
    assert _graphs_compiled(tiny_slab, counter) == 0
    assert _graphs_compiled(tiny_slab, counter, other_eps) == 1
    torch._dynamo.reset()
    block_compile.WHOLE_BLOCKS = False
    try:
        assert _graphs_compiled(tiny_slab, counter) > 4
    finally:
        block_compile.WHOLE_BLOCKS = True


@pytest.mark.parametrize("batch", [1, 2])
def test_training_steps_compile_each_block_class_once_per_grad_mode(tiny_slab, batch):
    """Two training steps compile five graphs: per block class one without autograd (the checkpointed forward) and one
    with it (the recompute, whose graph the first step's pass that learns the constant outputs shares: it runs with
    autocast's cast cache as the recompute does), and the double class one more for its first block, whose inputs
    need no gradient. A third step compiles nothing. At batch 1 too, where a single block's inputs are slices that
    ``Tensor.contiguous`` would keep (their batch dimension's stride is another)."""
    counter = CompileCounterWithBackend("aot_eager")
    block_compile.BACKEND = counter
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, compile_blocks=True))
    with_lora(model)
    for i in range(2):
        step(model, inputs("cpu", batch=batch, seed=i), checkpointing=True)
    assert counter.frame_count == 5
    step(model, inputs("cpu", batch=batch, seed=2), checkpointing=True)
    assert counter.frame_count == 5


def test_lora_on_some_layers_of_a_class_compiles_a_graph_for_that_code_path(tiny_slab):
    """LoRA is in the graph, so a block with LoRA on one layer only runs another graph than its class's others, once:
    the same outputs as eager."""
    def one_lora_layer(model):
        for name, layer in model.named_modules():
            if name != "transformer_blocks.0.attn.to_q" and getattr(layer, "lora_A", None) is not None:
                layer.lora_A = layer.lora_B = None

    counter = CompileCounterWithBackend("aot_eager")
    assert _graphs_compiled(tiny_slab, counter, one_lora_layer) > 0
    assert _graphs_compiled(tiny_slab, counter, one_lora_layer) == 0
    outs = []
    for compiled in (False, True):
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, compile_blocks=compiled))
        with_lora(model)
        one_lora_layer(model)
        with torch.no_grad():
            outs.append(model(**inputs("cpu"), return_dict=False)[0])
    assert torch.equal(*outs)


def test_a_resident_model_compiles_too(tiny_slab):
    eager = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False))
    model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(stream=False, compile_blocks=True))
    with torch.no_grad():
        want = eager(**inputs("cpu"), return_dict=False)[0]
        got = model(**inputs("cpu"), return_dict=False)[0]
    assert torch.equal(got, want) and block_compile.compile_seconds() > 0


def test_auto_is_off_on_a_cpu_and_unknown_modes_are_refused():
    on, why = block_compile.resolve_compile("auto", "cpu")
    assert not on and "cpu" in why
    assert block_compile.resolve_compile("on", "cpu") == (True, "asked for")
    assert block_compile.resolve_compile("off", "cpu")[0] is False
    with pytest.raises(block_compile.CompileModeError, match="auto, on, off"):
        block_compile.resolve_compile("max-autotune", "cpu")


def test_auto_is_on_for_training_flux_on_a_hopper_class_gpu_only(monkeypatch):
    """Auto follows the measurements: FLUX.1 training on compute capability 9.0+; not an older GPU, another family,
    or sampling."""
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    assert block_compile.resolve_compile("auto", "cuda", family="flux")[0]
    on, why = block_compile.resolve_compile("auto", "cuda", family="sdxl")
    assert not on and "sdxl" in why and "--compile on" in why
    on, why = block_compile.resolve_compile("auto", "cuda", training=False, family="flux")
    assert not on and "sampling" in why
    capability[0] = (8, 6)
    on, why = block_compile.resolve_compile("auto", "cuda", family="flux")
    assert not on and "8.6" in why


def test_peft_dora_layers_run_eagerly_and_train_like_eager(tiny_slab):
    """PEFT's DoRA reads the quantized weight; its wrappers, added after the load, run as eager code between the
    compiled pieces as the layers they wrap do: the same output and gradients as eager, and a second step compiles
    nothing (a wrapper traced by Dynamo would compile once per layer shape)."""
    pytest.importorskip("peft")

    def dora_step(compiled: bool, steps: int = 1):
        model = runtime.load(tiny_slab, "cpu", options=runtime.LoadOptions(prefetch=2, compile_blocks=compiled))
        params = runtime.add_lora(model, rank=4, variant=runtime.LoraVariant(dora=True))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in params:
                p.add_(0.02 * torch.randn(p.shape, generator=g))
        results = []
        for _ in range(steps):
            before = block_compile.compile_seconds()
            results.append((step(model, inputs("cpu"), checkpointing=True), block_compile.compile_seconds() - before))
        return results

    eager = dora_step(False)[0][0]
    compiled = dora_step(True, steps=3)  # no optimizer step between them: each step computes the same values
    for result, _ in compiled:
        assert_same(result, eager)
    assert compiled[0][1] > 0 and compiled[2][1] == 0
