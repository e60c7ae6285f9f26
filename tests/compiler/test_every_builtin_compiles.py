"""Every built-in tiny model compiles with compile's default calibration resolution (512 px), with few samples and
the cheapest search (the third audit: tiny-sd3's positional embedding takes at most 256 px, and the default ended
in a traceback). Where a model takes less than the default, compile calibrates at what it takes and says so; an
explicit --calib-resolution above it is refused in one sentence naming the side that fits (the negative control).
The quality gate is loosened: random tiny weights are not what is tested here."""
import pytest
from click.testing import CliRunner

from squareq.cli import main
from squareq.models import BUILTIN_MODELS

# the torch reference dequantizer (conftest.py): the calibration resolution is under test here, not the kernels
pytestmark = pytest.mark.usefixtures("torch_kernels")

CHEAP = ["--calib-samples", "2", "--formats", "W4,W8", "--rounding", "nearest", "--effect-probes", "1"]


@pytest.fixture(scope="module")
def loose(tmp_path_factory):
    path = tmp_path_factory.mktemp("thresholds") / "loose.toml"
    path.write_text("[thresholds]\nout = 1e9\n")
    return path


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_a_builtin_model_compiles_at_the_default_calibration_resolution(name, tmp_path, loose):
    out = tmp_path / f"{name}.slab"
    result = CliRunner().invoke(main, ["compile", name, "-o", str(out), "--budget", "8MB", "--thresholds", str(loose),
                                       *CHEAP])
    assert result.exit_code == 0, result.output[-2000:]
    assert (out / "manifest.json").is_file()
    if name == "tiny-sd3":
        assert "calibrating at 256 px, not 512" in result.output


def test_a_calibration_resolution_over_what_the_model_takes_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["compile", "tiny-sd3", "-o", str(tmp_path / "s.slab"), "--budget", "8MB",
                                       "--calib-resolution", "512", *CHEAP])
    assert result.exit_code != 0 and "give --calib-resolution 256 or less" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "s.slab").exists()
