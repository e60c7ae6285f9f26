"""The fused quantized matmuls (forward and input gradient) against the torch reference: dequantize, then matmul."""
import os

import pytest
import torch

from squareq.quant import QuantSpec, dequantize, quantize

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernels in the Triton interpreter; test_fused_gpu.py covers CUDA",
)

# (M, N, K, group): odd M, N not a multiple of any tile, K with a partial last group, tiny and one-row layers
SHAPES = [(1, 96, 256, 64), (5, 37, 200, 64), (17, 64, 128, 128), (3, 129, 16, 16), (2, 1, 64, 32)]


def _case(bits, symmetric, smooth, shape, seed, device="cpu"):
    m, n, k, group = shape
    g = torch.Generator().manual_seed(seed)
    spec = QuantSpec(bits=bits, group_size=group, symmetric=symmetric, smooth=smooth)
    s = torch.rand(k, generator=g) + 0.5 if smooth else None
    qw = quantize(torch.randn(n, k, generator=g), spec, s)
    qw = type(qw)(qw.spec, qw.shape, {name: t.to(device) for name, t in qw.tensors.items()})
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
    bias = torch.randn(n, generator=g).to(device, torch.bfloat16)
    return qw, x, dy, bias


VARIANTS = ["gemv", "mma"]  # the one-row kernel (M = 1 shapes only; more rows go to MMA) and MMA for all


def check_against_reference(bits, symmetric, smooth, with_bias, variant, monkeypatch, device="cpu"):
    from squareq.kernels.triton_fused import fused_input_grad, fused_linear

    monkeypatch.setenv("SQUAREQ_FUSED_VARIANT", variant)
    for i, shape in enumerate(SHAPES):
        qw, x, dy, bias = _case(bits, symmetric, smooth, shape, seed=100 * bits + i, device=device)
        w = dequantize(qw).float()
        b = bias if with_bias else None
        want = x.float() @ w.T + (b.float() if b is not None else 0)
        got = fused_linear(x, qw, b)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        # fp32 sums; besides the summation order, the GEMV kernels do not round the weight to bf16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        want_dx = dy.float() @ w
        got_dx = fused_input_grad(dy, qw)
        torch.testing.assert_close(got_dx.float(), want_dx, rtol=1e-2, atol=1e-2 * want_dx.abs().max().item())


@interpreted
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("symmetric,smooth", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_kernels_match_the_reference(bits, symmetric, smooth, with_bias, variant, monkeypatch):
    check_against_reference(bits, symmetric, smooth, with_bias, variant, monkeypatch)


ROTATED_SHAPES = [(1, 96, 256, 64), (5, 37, 256, 64), (17, 64, 128, 128), (1, 24, 64, 32)]


def check_rotated(bits, variant, monkeypatch, device="cpu"):
    """Rotated layers (forward and input gradient, with and without smoothing) against dequantize + matmul; the
    GEMV rotates the input row or the result instead of the weight, MMA rotates the weight tile. The same codes read
    as unrotated miss the reference by far (negative control)."""
    import dataclasses

    from squareq.kernels.triton_fused import fused_input_grad, fused_linear

    monkeypatch.setenv("SQUAREQ_FUSED_VARIANT", variant)
    g = torch.Generator().manual_seed(bits)
    for i, (m, n, k, group) in enumerate(ROTATED_SHAPES):
        spec = QuantSpec(bits=bits, group_size=group, symmetric=i % 2 == 0, smooth=i % 2 == 1, rotate=True)
        qw = quantize(torch.randn(n, k, generator=g), spec, torch.rand(k, generator=g) + 0.5 if spec.smooth else None)
        qw = qw.to(device)
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
        w = dequantize(qw).float()
        for got, want in ((fused_linear(x, qw).float(), x.float() @ w.T),
                          (fused_input_grad(dy, qw).float(), dy.float() @ w)):
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        unrotated = type(qw)(dataclasses.replace(spec, rotate=False), qw.shape, qw.tensors)
        want = x.float() @ w.T
        assert (fused_linear(x, unrotated).float() - want).abs().max() > 0.1 * want.abs().max()


@interpreted
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_kernels_apply_the_rotation(bits, variant, monkeypatch):
    check_rotated(bits, variant, monkeypatch)


@interpreted
def test_more_rows_than_split_configurations_serve(monkeypatch):
    """Past SPLIT_MAX_M rows the tuned configurations do not split, but the one untuned configuration (tests,
    SQUAREQ_FUSED_AUTOTUNE=0) may: its planes must still be there."""
    from squareq.kernels.triton_fused import SPLIT_MAX_M, fused_input_grad, fused_linear

    qw, x, dy, _ = _case(4, False, False, (SPLIT_MAX_M + 16, 24, 64, 32), seed=3)
    w = dequantize(qw).float()
    want, want_dx = x.float() @ w.T, dy.float() @ w
    torch.testing.assert_close(fused_linear(x, qw).float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    torch.testing.assert_close(fused_input_grad(dy, qw).float(), want_dx, rtol=1e-2,
                               atol=1e-2 * want_dx.abs().max().item())


@interpreted
def test_a_batch_of_rows_keeps_its_leading_shape():
    from squareq.kernels.triton_fused import fused_linear

    qw, x, _, _ = _case(4, False, False, (6, 64, 128, 64), seed=1)
    y = fused_linear(x.view(2, 3, 128), qw)
    assert y.shape == (2, 3, 64) and torch.equal(y.view(6, 64), fused_linear(x, qw))


def test_the_env_override_and_its_refusal(monkeypatch):
    from squareq.kernels.crossover import fused_max_m

    cpu = torch.device("cpu")
    monkeypatch.setenv("SQUAREQ_FUSED_MAX_M", "4:64,8:2")
    assert (fused_max_m(cpu, 4), fused_max_m(cpu, 6), fused_max_m(cpu, 8)) == (64, 0, 2)
    monkeypatch.setenv("SQUAREQ_FUSED_MAX_M", "32")
    assert fused_max_m(cpu, 6) == 32
    monkeypatch.setenv("SQUAREQ_FUSED_MAX_M", "many")
    with pytest.raises(ValueError, match="SQUAREQ_FUSED_MAX_M='many': give one number"):
        fused_max_m(cpu, 4)


@interpreted
@pytest.mark.parametrize("max_m,rows,fused", [("0", 2, False), ("16", 2, True), ("16", 40, False), ("4:64", 40, True)])
def test_quant_linear_dispatches_by_rows(monkeypatch, tmp_path, max_m, rows, fused):
    """A W4 layer of a loaded slab runs fused exactly where the configured largest M allows, in the forward and the
    backward, and either path gives the reference's output and input gradient."""
    from squareq import runtime
    from squareq.kernels import triton_fused
    from squareq.compiler.plain import PlainOptions, write_rtn_slab

    monkeypatch.setenv("SQUAREQ_FUSED_MAX_M", max_m)
    calls = []
    for name in ("fused_linear", "fused_input_grad"):
        original = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    from squareq.models import load_builtin

    model, adapter = load_builtin("tiny-flux")
    write_rtn_slab(model, adapter.blocks(model), {}, tmp_path / "s.slab",
               PlainOptions(default_spec=QuantSpec(bits=4, group_size=16), family="flux", source="tiny-flux"))
    loaded = runtime.load(tmp_path / "s.slab", "cpu", options=runtime.LoadOptions(stream=False))
    layer = loaded.transformer_blocks[0].norm1.linear  # a modulation layer: M = batch size in a model
    x = torch.randn(rows, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert calls == (["fused_linear", "fused_input_grad"] if fused else [])
    w = dequantize(layer.quantized).float()
    torch.testing.assert_close(y.float(), x.detach().float() @ w.T + layer.bias.float(), rtol=1e-2, atol=5e-2)
    torch.testing.assert_close(x.grad.float(), torch.ones(rows, layer.out_features) @ w, rtol=1e-2, atol=5e-2)


def test_the_crossover_is_looked_up_by_device_name(monkeypatch):
    """A measured device gets its table; any other device keeps dequantize + matmul (0)."""
    from squareq.kernels import crossover as dispatch

    monkeypatch.delenv("SQUAREQ_FUSED_MAX_M", raising=False)
    monkeypatch.setattr(dispatch, "CROSSOVERS", {"Measured GPU": {4: 64, 6: 16, 8: 32}})
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Measured GPU")
    assert [dispatch.fused_max_m(cuda, b) for b in (4, 6, 8)] == [64, 16, 32]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some other GPU")
    assert [dispatch.fused_max_m(cuda, b) for b in (4, 6, 8)] == [0, 0, 0]
