"""SquareQ's quantized linear as custom operators (squareq/kernels/ops.py): the eager layer's output and input
gradient, registered so torch.compile traces through it in one graph, and refused for tensors its spec does not
describe."""
import pytest
import torch
import torch.nn.functional as F

from squareq import kernels, quant
from squareq.kernels import ops
from squareq.quant import QuantSpec

N, K = 48, 128
SPECS = [QuantSpec(bits=4), QuantSpec(bits=6, smooth=True), QuantSpec(bits=8, rotate=True), QuantSpec(bits=16)]


def _layer(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    smooth = torch.rand(K, generator=g) + 0.5 if spec.smooth else None
    return quant.quantize(w, spec, smooth), torch.randn(N, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_it_computes_the_eager_layer_s_output_and_input_gradient(spec):
    qw, bias = _layer(spec)
    w = kernels.dequantize(qw, "cpu")
    x = torch.randn(3, 5, K, requires_grad=True)
    y = ops.quant_linear(x, *ops.operands(qw), bias)
    assert y.dtype == torch.bfloat16 and torch.equal(y, F.linear(x.detach().to(torch.bfloat16), w, bias))
    grad = torch.randn_like(y)
    y.backward(grad)
    assert x.grad.dtype == x.dtype and torch.equal(x.grad, grad.matmul(w).to(x.dtype))


def test_the_registration_passes_torch_s_checks():
    qw, bias = _layer(SPECS[1])
    x = torch.randn(4, K, requires_grad=True)
    torch.library.opcheck(ops.quant_linear, (x, *ops.operands(qw), bias))
    torch.library.opcheck(ops.quant_linear_input_grad, (torch.randn(4, N).to(torch.bfloat16), *ops.operands(qw)))


def test_torch_compile_traces_a_block_through_it_in_one_graph():
    """Two quantized layers with the elementwise work between them, compiled with fullgraph=True (a graph break
    raises) through AOT autograd: the forward and the input gradient of the eager run."""
    qa, ba = _layer(SPECS[0], 1)
    qb = quant.quantize(torch.randn(K, N) * 0.05, QuantSpec(bits=4, rotate=True, group_size=16))  # back to K

    def block(x, a, b):
        h = F.gelu(ops.quant_linear(x, *a, ba), approximate="tanh")
        return x + ops.quant_linear(h, *b, None).float()

    a, b = ops.operands(qa), ops.operands(qb)
    x = torch.randn(2, 7, K, requires_grad=True)
    eager = block(x, a, b)
    eager.sum().backward()
    want = x.grad.clone()
    x.grad = None
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    got = compiled(x, a, b)
    got.sum().backward()
    assert torch.equal(got, eager) and torch.equal(x.grad, want)


def test_tensors_the_spec_does_not_describe_are_refused():
    qw, bias = _layer(SPECS[0])
    tensors, spec, shape = ops.operands(qw)
    with pytest.raises(ValueError):
        ops.quant_linear(torch.randn(2, K), tensors[:-1], spec, shape, bias)  # the zero points left out
