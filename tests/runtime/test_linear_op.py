"""The quantized layer as a custom operator (runtime/linear_op.py): inside a compiled graph it computes what the eager
layer computes, output and input gradient, for every format; it passes torch's operator checks; and a handle that
names no layer is refused with a sentence that says why."""
import pytest
import torch

from squareq import quant
from squareq.quant import QuantSpec
from squareq.runtime import linear_op
from squareq.runtime.qlinear import DequantScratch, QuantLinear

N, K = 48, 128
SPECS = [QuantSpec(bits=4), QuantSpec(bits=6, smooth=True), QuantSpec(bits=8), QuantSpec(bits=16)]


pytestmark = pytest.mark.usefixtures("torch_kernels")  # the torch reference dequantizer (conftest.py)


def _layer(spec: QuantSpec, seed: int = 0) -> QuantLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    smooth = torch.rand(K, generator=g) + 0.5 if spec.smooth else None
    layer = QuantLinear(K, N, DequantScratch(N * K, "cpu"))
    layer.bind(quant.quantize(w, spec, smooth))
    layer.bias = torch.nn.Parameter(torch.randn(N, generator=g).to(torch.bfloat16), requires_grad=False)
    layer.handle = linear_op.register(layer)
    return layer


def _run(layer: QuantLinear, compiled: bool, graphs: list | None = None):
    x = torch.randn(3, 5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_()

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    forward = torch.compile(layer.forward, backend=backend, fullgraph=True) if compiled else layer.forward
    y = forward(x)
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y).to(y.dtype))
    return y.detach(), x.grad


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_in_a_compiled_graph_it_computes_the_eager_layer_s_output_and_input_gradient(spec):
    layer = _layer(spec)
    torch._dynamo.reset()
    graphs = []
    eager, compiled = _run(layer, False), _run(layer, True, graphs)
    assert len(graphs) == 1 and "streamed_linear" in graphs[0]
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_the_registration_passes_torch_s_checks():
    layer = _layer(SPECS[1])
    x = torch.randn(4, K).to(torch.bfloat16).requires_grad_()
    torch.library.opcheck(linear_op.streamed_linear, (x, layer.handle, N))
    grad = torch.randn(4, N).to(torch.bfloat16)
    torch.library.opcheck(linear_op.streamed_linear_input_grad, (grad, layer.handle, K))


def test_a_copy_of_a_layer_gets_no_handle_of_its_original():
    """A deepcopy (or pickle) must not name the original layer: its compiled graph would run the original's weights."""
    import copy

    layer = _layer(SPECS[0])
    assert copy.deepcopy(layer).handle is None and layer.handle is not None


def test_a_handle_that_names_no_layer_is_refused():
    gone = _layer(SPECS[0]).handle  # the layer is collected: its handle names nothing
    with pytest.raises(RuntimeError, match="no layer is registered under handle"):
        linear_op.streamed_linear(torch.randn(2, K).to(torch.bfloat16), gone, N)
