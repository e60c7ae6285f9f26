"""``pip install squareq`` without extras compiles (with --calib-data), trains and samples; what needs an extra (accept,
demo, the built-in photographs) is refused in one sentence naming the pip command (squareq/extras.py). Each command
runs in a fresh interpreter in which scipy, torchmetrics and scikit-image cannot be imported, as on a machine
without the extras."""
import subprocess
import sys

import pytest

from squareq.extras import MissingExtra, pip_command, require
from squareq.train.tiny_dataset import write_tiny_dataset

EXTRA_MODULES = ("scipy", "torchmetrics", "skimage")
# None in sys.modules: importing the module raises ModuleNotFoundError and importlib.util.find_spec returns None,
# as when it is not installed (diffusers and transformers then treat it as absent too)
WITHOUT_EXTRAS = ("import sys\n"
                  f"sys.modules.update(dict.fromkeys({EXTRA_MODULES!r}))\n"
                  "from squareq.cli import main\n"
                  "main(sys.argv[1:], prog_name='squareq')\n")


def squareq(*args: str, extras: bool = False) -> subprocess.CompletedProcess:
    code = "from squareq.cli import main; import sys; main(sys.argv[1:], prog_name='squareq')" if extras \
        else WITHOUT_EXTRAS
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "SQUAREQ_KERNELS": "torch"})


def test_require_names_the_extra_and_a_present_module_is_returned(monkeypatch):
    import json

    assert require("json", "reading") is json
    for name in ("scipy", "scipy.stats"):  # another test may have imported scipy.stats in this process
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtra, match=r"squareq accept needs scipy, which is not installed; install SquareQ's "
                                           r"accept extra with: pip install .*\[accept\]'\."):
        require("scipy.stats", "squareq accept")


def test_the_pip_command_is_the_checkouts_from_a_clone_and_pypis_otherwise(tmp_path):
    """From a clone (pyproject.toml and .git beside the package folder) the extra is installed editable from the
    checkout; installed from PyPI (site-packages has neither), by name. A folder with pyproject.toml but no .git (an
    unpacked sdist) is no clone: the negative control."""
    package = tmp_path / "squareq"
    package.mkdir()
    assert pip_command("accept", package) == "pip install 'squareq[accept]'"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'squareq'\n")
    assert pip_command("accept", package) == "pip install 'squareq[accept]'"
    (tmp_path / ".git").mkdir()
    assert pip_command("accept", package) == "pip install -e '.[accept]'"
    assert pip_command("photos", package) == "pip install -e '.[photos]'"


def test_without_extras_compile_train_and_sample_work_and_accept_says_which_extra(tmp_path):
    data = write_tiny_dataset(tmp_path / "data")
    slab = tmp_path / "tiny.slab"
    done = squareq("compile", "tiny-flux", "-o", str(slab), "--budget", "8MB", "--calib-data", str(data),
                   "--calib-samples", "4", "--calib-resolution", "64", "--rounding", "nearest", "--formats", "W4,W8",
                   "--effect-probes", "1")
    assert done.returncode == 0, done.stderr
    done = squareq("train", str(slab), "--data", str(data), "-o", str(tmp_path / "lora"), "--steps", "2",
                   "--resolution", "64", "--max-sequence-length", "32", "--save-every", "0")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    done = squareq("sample", str(slab), "--prompt", "a cat", "-o", str(tmp_path / "samples"), "--resolution", "64",
                   "--steps", "2", "--max-sequence-length", "32")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "samples" / "sample-000.png").is_file()

    # what needs an extra: one sentence, non-zero exit, before any work
    done = squareq("accept", str(slab), "--model", "tiny-flux")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: squareq accept needs scipy, which is not installed; install SquareQ's accept extra with: "
        f"{pip_command('accept')}.")
    done = squareq("compile", "tiny-flux", "-o", str(tmp_path / "photos.slab"), "--budget", "8MB")
    assert done.returncode == 1 and pip_command("photos") in done.stderr and "--calib-data" in done.stderr
    assert not (tmp_path / "photos.slab").exists()
    done = squareq("demo", "-o", str(tmp_path / "demo"))
    assert done.returncode == 1 and pip_command("photos") in done.stderr
    assert not (tmp_path / "demo").exists()


def test_negative_control_with_the_extras_accept_gets_past_the_check(tmp_path):
    """With the extras installed the same accept call is not refused for them (it fails later, on the missing slab)."""
    done = squareq("accept", str(tmp_path / "missing.slab"), "--model", "tiny-flux", extras=True)
    assert done.returncode == 1 and "[accept]" not in done.stderr and "missing.slab" in done.stderr
