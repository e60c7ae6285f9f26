"""A run's host memory (train/host_plan.py): the plan keeps within host_budget what it can (the slab and a streamed
encoder pinned, else read from their files through page-locked rings), says so in one line, and refuses before any
work a run that cannot fit, naming the smallest budget that would; the budget it names is enough."""
import re

import pytest
import torch
from click.testing import CliRunner

from squareq.cli import main
from squareq.runtime.host.budget import working_room
from squareq.runtime.host.staging import STAGES
from squareq.sizes import format_size_up, parse_size
from squareq.sources.encoder_placement import EncoderRun
from squareq.train import host_plan
from squareq.train.config import load_config
from squareq.train.errors import TrainError
from squareq.train.host_plan import plan_host_memory
from squareq.train.loop import train
from squareq.train.tiny_dataset import write_tiny_dataset

from ..models.tiny_folders import write_pipeline
from .tiny_run import w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")

CPU = torch.device("cpu")
PROCESS = 1 << 30  # the process's own memory, fixed so that the figures are exact
WORKING_BYTES = working_room(CPU)
GB = 10**9


@pytest.fixture(autouse=True)
def fixed_process(monkeypatch):
    monkeypatch.setattr(host_plan, "anonymous_memory", lambda: PROCESS)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("host")
    w8_tiny_slab(root / "tiny.slab")
    write_tiny_dataset(root / "data", count=2)
    # a FLUX.1 pipeline folder with an eight-block T5: the encoders a plan reads from configs and file headers
    write_pipeline("tiny-flux", root / "pipeline", text_layers=8)
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": 2, "rank": 4, "save_every": 0, "cache_dir": str(out / "cache")}
    return load_config(None, {**values, **kw})


def test_a_run_over_the_budget_is_refused_before_any_work_naming_the_budget_that_fits(workspace, tmp_path):
    out = tmp_path / "small"
    with pytest.raises(TrainError) as caught:
        train(_config(workspace, out, host_budget="1.5GB"), echo=lambda s: None)
    message = str(caught.value)
    assert message.startswith("host_budget 1.5GB leaves 1.50 GB of host memory, and this run needs at least ")
    assert "read from the slab file through" in message  # the least it could hold: the slab from its file
    named = re.search(r"give host_budget at least ([0-9.]+ [KMG]B)\.$", message).group(1)
    assert not (out / "cache").exists()  # before any work: nothing cached
    # the budget it names is enough; just under it is refused (the negative control)
    least = parse_size(named)
    assert least >= PROCESS + WORKING_BYTES
    with pytest.raises(TrainError, match="give host_budget at least"):
        train(_config(workspace, tmp_path / "under", host_budget=str(least - 10**7)), echo=lambda s: None)
    said = []
    result = train(_config(workspace, tmp_path / "named", host_budget=named.replace(" ", "")), echo=said.append)
    assert result.steps == 2
    (line,) = [s for s in said if s.startswith("host memory within ")]
    assert f"within {named}, host_budget {named.replace(' ', '')}:" in line and "the slab's blocks" in line


def _plan(workspace, budget, blobs, kind="train", vram=None):
    return plan_host_memory(kind, CPU, budget, "auto", "auto", EncoderRun(vram, 16, 64 * 64),
                            blobs, str(workspace / "pipeline"), "flux")


def test_the_plan_pins_what_fits_and_reads_the_rest_from_files(workspace):
    """The fast choices while they fit: the slab's blocks and the streamed T5 pinned; with less, the T5 from its file
    through a ring of STAGES blocks, or the slab's blocks from the slab file; with less still, a refusal naming the
    least. The cache's encoders and the steps' slab are held one after the other, never at once."""
    whole = _plan(workspace, 1000 * GB, None)
    assert whole.encoders.streamed == ()  # no VRAM budget: nothing streams, nothing pinned for the encoders
    vram = whole.encoders.expected - 1  # one byte short: the T5 streams on the device
    small = [16 << 10] * 4  # a slab smaller than the T5's ring
    roomy = _plan(workspace, 1000 * GB, small, vram=vram)
    t5, encoders = roomy.encoders.streamed, roomy.encoders
    assert t5 == ("text_encoder_2",) and encoders.ring == () and roomy.slab_host == "pinned"
    assert roomy.slab_bytes == sum(small) and "pinned whole" in roomy.line() and "(pinned)" in roomy.line()
    pinned, ring = encoders.pinned_sizes["text_encoder_2"], encoders.ring_sizes["text_encoder_2"]
    copies = sum(encoders.copies.values())
    assert STAGES * max(1, pinned // 8) <= ring < pinned and roomy.peak == roomy.base + copies + pinned

    # no room for the T5 pinned: it is read from its file through its ring
    budget = PROCESS + WORKING_BYTES + copies + (ring + pinned) // 2
    tight = _plan(workspace, budget, small, vram=vram)
    assert tight.encoders.ring == t5 and tight.slab_host == "pinned" and tight.peak <= budget
    assert "text_encoder_2 from its file through" in tight.line()

    # a slab larger than its room: its blocks from the slab file through a ring of STAGES blocks
    large = [40 << 20] * 10
    budget = PROCESS + WORKING_BYTES + sum(large) - 1
    disk = _plan(workspace, budget, large, vram=vram)
    assert disk.slab_host == "disk" and disk.slab_bytes == STAGES * max(large) and disk.peak <= budget
    assert "read from the slab file through" in disk.line()

    # the least of both: refused one byte under it, naming it
    least = PROCESS + WORKING_BYTES + max(copies + ring, STAGES * max(large))
    assert _plan(workspace, least, large, vram=vram).peak == least
    with pytest.raises(TrainError, match=f"give host_budget at least {re.escape(format_size_up(least))}"):
        _plan(workspace, least - 1, large, vram=vram)


def test_sample_holds_the_slab_and_the_encoders_at_once(workspace):
    blobs = [40 << 20] * 10
    vram = _plan(workspace, 1000 * GB, None).encoders.expected - 1
    sample = _plan(workspace, 1000 * GB, blobs, kind="sample", vram=vram)
    train_run = _plan(workspace, 1000 * GB, blobs, vram=vram)
    assert sample.peak == sample.base + sample.slab_bytes + sample.encoder_bytes
    assert train_run.peak == train_run.base + max(train_run.encoder_bytes, train_run.slab_bytes) < sample.peak
    assert sample.encoder_budget == sample.budget - sample.base - sample.slab_bytes


def test_cache_and_sample_refuse_a_budget_in_one_sentence_and_leave_nothing(workspace, tmp_path):
    runner = CliRunner()
    cache = tmp_path / "cache"
    done = runner.invoke(main, ["cache", str(workspace / "tiny.slab"), "--data", str(workspace / "data"),
                                "--cache-dir", str(cache), "--host-budget", "1GB"])
    assert done.exit_code == 1 and not cache.exists()
    assert done.output.startswith("error: host_budget 1GB leaves 1.00 GB of host memory") and \
        done.output.count("\n") == 1
    out = tmp_path / "images"
    done = runner.invoke(main, ["sample", str(workspace / "tiny.slab"), "--prompt", "a square", "--resolution", "64",
                                "--steps", "1", "-o", str(out), "--host-budget", "1GB"])
    assert done.exit_code == 1 and not out.exists()
    assert done.output.startswith("error: --host-budget 1GB leaves 1.00 GB") and "give --host-budget at least" in \
        done.output
    done = runner.invoke(main, ["cache", str(workspace / "tiny.slab"), "--data", str(workspace / "data"),
                                "--cache-dir", str(cache), "--host-budget", "lots"])
    assert done.exit_code == 1 and "host_budget: 'lots' is not a size; write it like 24GB" in done.output
