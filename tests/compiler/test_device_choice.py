"""`squareq compile --device auto`: the GPU when there is one; on a CPU a 12B model is refused unless --device cpu is
given, with the time it would take measured on this machine."""
import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.compiler import CompileOptions
from squareq.compiler.device_choice import CPU_LIMIT_PARAMETERS, choose_device, compile_flops, matmul_rate
from squareq.devices import DeviceError, run_on
from squareq.models.skeleton import build_meta
from squareq.sources import Source, open_source
from squareq.sources.tensors import Tensors

pytestmark = pytest.mark.usefixtures("torch_kernels")

# FLUX.1-dev's transformer config (black-forest-labs/FLUX.1-dev, transformer/config.json)
FLUX1_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56))


class _HeadersOnly(Tensors):
    """A checkpoint's names and shapes without data: a source as big as FLUX.1-dev that reads nothing."""

    def __init__(self, skeleton):
        self.label = "flux1-dev shapes (meta)"
        self.shapes = {n: tuple(t.shape) for n, t in skeleton.state_dict(keep_vars=True).items()}

    def read(self, names):
        raise AssertionError("the device choice must not read weights")


@pytest.fixture(scope="module")
def flux1_dev_on_meta():
    from diffusers import FluxTransformer2DModel

    skeleton = build_meta(lambda: FluxTransformer2DModel(**FLUX1_DEV))
    source = Source("black-forest-labs/FLUX.1-dev@meta", skeleton, _HeadersOnly(skeleton))
    assert all(p.is_meta for p in source.skeleton().parameters())
    return source


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def compile_work(source, resolution=512, **options):
    opts = CompileOptions(budget=12 * 10**9, **options)
    return lambda skeleton: compile_flops(source, skeleton, opts, resolution)


def test_a_12b_source_is_refused_on_a_cpu_unless_asked_for(flux1_dev_on_meta, no_gpu):
    with pytest.raises(DeviceError) as err:
        choose_device("auto", flux1_dev_on_meta, compile_work(flux1_dev_on_meta))
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith(".")
    assert "11.9B parameters" in msg and "PyTorch sees no CUDA GPU" in msg and "--device cpu" in msg
    assert "compiling it on this CPU would take at least" in msg and "GFLOP/s, measured" in msg
    assert "hours" in msg or "days" in msg, msg
    assert choose_device("cpu", flux1_dev_on_meta, compile_work(flux1_dev_on_meta)) == "cpu"  # asked for by name


def test_the_estimate_is_the_least_arithmetic_of_a_compile(flux1_dev_on_meta):
    skeleton = flux1_dev_on_meta.skeleton()
    block_weights = 11.9e9 - 0.09e9  # FLUX.1-dev's 11.9B less the embedders and the final layer outside the blocks
    flops = compile_work(flux1_dev_on_meta, calib_samples=32, effect_probes=4)(skeleton)
    passes = 32 + 3 * 4 * 8  # every sample once, the held-out quarter in the effects pass's three passes, 4 probes
    tokens = (512 // 16) ** 2 + 512  # FLUX.1 at 512 px: 1024 image tokens and the caption's 512
    assert flops == pytest.approx(2 * block_weights * tokens * passes, rel=0.01)
    assert 1e9 < matmul_rate(skeleton) < 1e14  # a float32 matmul speed this machine can have


def test_small_models_compile_on_the_cpu_and_auto_takes_the_gpu(no_gpu, monkeypatch):
    tiny = open_source("tiny-flux")
    assert sum(p.numel() for p in tiny.skeleton().parameters()) < CPU_LIMIT_PARAMETERS
    assert choose_device("auto", tiny, compile_work(tiny, 64)) == "cpu"
    with pytest.raises(DeviceError, match="PyTorch sees no CUDA GPU here"):
        choose_device("cuda", tiny, compile_work(tiny, 64))
    with pytest.raises(DeviceError, match="not a device"):
        choose_device("gpu0", tiny, compile_work(tiny, 64))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert choose_device("auto", tiny, compile_work(tiny, 64)) == "cuda"
    assert choose_device("cuda:0", tiny, compile_work(tiny, 64)) == "cuda:0"
    with pytest.raises(DeviceError, match="--device cuda:3: this machine has 1 CUDA GPU"):
        choose_device("cuda:3", tiny, compile_work(tiny, 64))


def test_the_cli_refuses_a_12b_source_on_a_cpu_in_one_sentence(flux1_dev_on_meta, no_gpu, monkeypatch, tmp_path):
    import squareq.sources

    def open_meta(model, blocks=None, revision=None, check=None, model_class=None):
        check(flux1_dev_on_meta)  # the refusal comes before any weight is read (a Hub ID's: before it downloads)
        raise AssertionError("the device check should have refused")

    monkeypatch.setattr(squareq.sources, "open_source", open_meta)
    result = CliRunner().invoke(main, ["compile", "black-forest-labs/FLUX.1-dev", "--budget", "12GB",
                                       "-o", str(tmp_path / "flux.slab")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: black-forest-labs/FLUX.1-dev@meta has 11.9B parameters")
    assert not (tmp_path / "flux.slab").exists()


def test_squareq_accept_refuses_gating_a_12b_source_on_a_cpu(flux1_dev_on_meta, no_gpu, monkeypatch, tiny_slab):
    import squareq.acceptance.runner as runner

    def open_meta(model, blocks=None, revision=None, check=None, model_class=None):
        check(flux1_dev_on_meta)  # the refusal comes before any weight is read
        raise AssertionError("the device check should have refused")

    monkeypatch.setattr(runner, "open_source", open_meta)
    result = CliRunner().invoke(main, ["accept", str(tiny_slab), "--model", "black-forest-labs/FLUX.1-dev"])
    lines = [line for line in result.output.splitlines() if line]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert "11.9B parameters" in lines[0] and "gating it on this CPU would take at least" in lines[0]
    assert "--device cpu" in lines[0]


def test_run_on_sets_the_default_device_of_a_whole_command(no_gpu):
    from squareq.devices import default_device

    with run_on("cpu") as device:
        assert device == torch.device("cpu") and default_device() == torch.device("cpu")
    with pytest.raises(DeviceError, match="--device cuda:1: PyTorch sees no CUDA GPU"):
        with run_on("cuda:1"):
            pass
