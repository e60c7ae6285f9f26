import gc
import os

import pytest
import torch

# Without CUDA, run Triton kernels in the interpreter; this must happen before triton.jit decorates them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# `make test` runs two xdist workers that take whole files in collection order. These files take a quarter of a minute
# to a minute and a half each (longest first, as measured on one CPU core); started last, they would leave the other
# worker idle that long, so they are collected first.
SLOW_FILES = ("test_benchmarks.py", "compiler/test_real_model.py", "acceptance/test_accept.py", "train/test_loop.py",
              "test_snippets.py", "test_fuzz.py", "models/test_families.py", "compiler/test_compile.py",
              "test_extras.py", "runtime/test_block_compile.py", "models/test_family_training.py", "test_cli.py",
              "compiler/test_real_calibration.py", "compiler/test_rebuild.py", "kernels/test_fused.py",
              "ui/test_browser.py")


def pytest_configure(config):
    # xdist (3.6 on) queues whole files by their number of tests unless told not to, which would start the one-test
    # real-model file last; collection order it is
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


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


_frozen_for = [None]  # the test file whose first test froze the heap
# Resident memory the frozen heap may gain before it is all unfrozen and collected: a full collection walks 1.6 million
# objects in about 2 s, which at every one of a worker's sixty files took a fifth of the suite's time; collecting only
# at this growth, a worker peaked within 0.3 GB of doing it at every file.
FULL_COLLECTION_GROWTH = 256 << 20
_collected_at = [0]  # the resident memory after the last full collection


def pytest_runtest_setup(item):
    """Before each test, what is alive is frozen out of the garbage collector's sight (gc.freeze). squareq calls
    gc.collect() where it lets a model's memory go (encoders after caching, effects passes), and a full collection
    walks every object the process holds: in a test process with the libraries and a hundred files' fixtures, over a
    million objects and a second or two a call, which made up about 40% of the acceptance and training tests' time. A
    test's own objects stay in sight. At each new file, what the last test left is collected; once the process has
    grown by FULL_COLLECTION_GROWTH, everything is unfrozen and collected first, so what earlier files left unreachable
    (cycles frozen while still in use) does not pile up."""
    from squareq.runtime.host.budget import resident_memory

    module = getattr(item, "module", None)
    if module is not _frozen_for[0]:
        _frozen_for[0] = module
        if resident_memory() - _collected_at[0] >= FULL_COLLECTION_GROWTH:
            gc.unfreeze()
            gc.collect()
            _collected_at[0] = resident_memory()
        else:
            gc.collect()  # the objects not frozen: those of the last test
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()  # the interpreter's own last collection sees everything again


@pytest.fixture(scope="module")
def torch_kernels():
    """The torch reference dequantizer instead of the Triton kernels: bit-identical to them (tests/kernels checks each
    kernel against it bit for bit), and on a CPU, where the kernels run in the Triton interpreter, a training step
    or a compile takes a fraction of the time. A file whose subject is not the kernels takes it for all its tests
    and module fixtures with ``pytestmark = pytest.mark.usefixtures("torch_kernels")``; a test of such a file that
    runs the kernels on purpose marks itself ``triton`` and deletes SQUAREQ_KERNELS with its monkeypatch."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SQUAREQ_KERNELS", "torch")
        yield


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
    from squareq.compiler.calibration_images import calibration_images

    return calibration_images(open_source("tiny-flux"), resolution=64, max_sequence_length=32)
