import os

import pytest
import torch

# Without CUDA, run Triton kernels in the interpreter; this must happen before triton.jit decorates them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# `make test` runs two xdist workers that take whole files in collection order. These files take half a minute to two
# minutes each; started last, they would leave the other worker idle that long, so they are collected first.
SLOW_FILES = ("compiler/test_real_model.py", "models/test_families.py", "acceptance/test_accept.py", "test_cli.py",
              "compiler/test_rebuild.py", "test_fuzz.py", "test_first_run.py")


def _slow_rank(item) -> int:
    path = item.path.as_posix()
    return next((i for i, name in enumerate(SLOW_FILES) if path.endswith(f"tests/{name}")), len(SLOW_FILES))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_slow_rank)  # stable: each file keeps its own order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_flux():
    from squareq.models import load_builtin

    return load_builtin("tiny-flux")


@pytest.fixture(scope="session")
def tiny_slab(tmp_path_factory, tiny_flux):
    """A W4 slab of tiny-flux with a mix of formats, written once for the session (read-only in tests)."""
    from squareq.quant import QuantSpec
    from squareq.compiler.plain import PlainOptions, write_rtn_slab

    model, adapter = tiny_flux
    blocks = adapter.blocks(model)
    plan = {
        "transformer_blocks.0.attn.to_q": QuantSpec(bits=8, group_size=32, symmetric=True),
        "transformer_blocks.0.attn.to_k": QuantSpec(bits=6, group_size=16),
        "transformer_blocks.1.ff.net.2": QuantSpec(bits=16),
        "single_transformer_blocks.0.proj_out": QuantSpec(bits=4, group_size=128, scale_dtype="bfloat16"),
    }
    out = tmp_path_factory.mktemp("slab") / "tiny.slab"
    write_rtn_slab(model, blocks, plan, out, PlainOptions(default_spec=QuantSpec(bits=4), family="flux", source="tiny-flux"))
    return out


@pytest.fixture(scope="session")
def tiny_flux_images():
    """The built-in calibration photographs encoded by tiny-flux's own toy VAE and text encoders at 64 px (what
    `squareq compile tiny-flux` calibrates on, smaller)."""
    from squareq.sources import open_source
    from squareq.train.calibration_images import calibration_images

    return calibration_images(open_source("tiny-flux"), resolution=64, max_sequence_length=32)
