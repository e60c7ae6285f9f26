"""Ctrl-C during `squareq train` keeps the run: a real SIGINT mid-training writes a checkpoint and the LoRA so far and
names `--resume latest`, the resumed run ends bit for bit like an unbroken one, and a second SIGINT during the save
leaves the previous checkpoint intact. Also the summary a run prints before its first step (train/run_summary.py)."""
import os
import signal

import pytest
import torch
from PIL import Image
from safetensors import safe_open

import squareq.train.checkpoint as ckpt
import squareq.train.loop as loop
from squareq.train.checkpoint import latest_checkpoint
from squareq.train.config import load_config
from squareq.train.buckets import make_buckets
from squareq.train.data import scan_dataset
from squareq.train.errors import TrainInterrupted
from squareq.train.loop import train
from squareq.train.lora_reader import load_lora
from squareq.train.run_summary import StepClock, data_lines, device_line
from squareq.train.tiny_dataset import write_tiny_dataset

from .tiny_run import w8_tiny_slab

pytestmark = pytest.mark.usefixtures("torch_kernels")

STEPS = 6


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    w8_tiny_slab(root / "tiny.slab")
    write_tiny_dataset(root / "data", count=4)
    return root


def _config(ws, out, **kw):
    values = {"slab": str(ws / "tiny.slab"), "data": str(ws / "data"), "output": str(out), "resolution": 64,
              "max_sequence_length": 16, "steps": STEPS, "lr": 3e-3, "rank": 4, "save_every": 0, "batch_size": 2,
              "cache_dir": str(ws / "cache")}
    values.update(kw)
    return load_config(None, values)


@pytest.fixture(scope="module")
def straight(ws):
    """An unbroken run, and every line it printed."""
    lines = []
    result = train(_config(ws, ws / "straight"), echo=lines.append)
    return result, lines


def ctrl_c_at(step_wanted):
    """An after_step hook that sends this process a real SIGINT after step ``step_wanted``."""
    def hook(step):
        if step == step_wanted:
            os.kill(os.getpid(), signal.SIGINT)
    return hook


def kept(out, step):
    """What the first Ctrl-C must leave: the step's checkpoint, loadable, and the LoRA files written after it."""
    last = latest_checkpoint(out)
    assert last is not None and last.name == f"step-{step:08d}", last
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    with safe_open(str(out / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert f.metadata()["ss_max_train_steps"] == str(step)  # the LoRA says the steps it holds
    return last


def test_ctrl_c_saves_the_run_and_the_resumed_run_ends_like_an_unbroken_one(ws, straight, capfd):
    """Ctrl-C after step 3, mid-epoch (4 images, 2 a batch): the checkpoint keeps the data position too."""
    out = ws / "interrupted"
    lines = []
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainInterrupted) as caught:
        train(_config(ws, out), echo=lines.append, after_step=ctrl_c_at(3))
    assert signal.getsignal(signal.SIGINT) is before  # the previous handler is back
    message = str(caught.value)
    assert "--resume latest" in message and "step 3 of 6" in message and str(out / "checkpoints") in message, message
    assert caught.value.exit_code == 130
    assert "press Ctrl-C again" in capfd.readouterr().err  # said at once, from the handler
    assert any(line.startswith("Ctrl-C: stopping after step 3") for line in lines), lines
    assert any(line.startswith("LoRA written to") and "after 3 steps" in line for line in lines), lines
    kept(out, 3)
    a, _ = load_lora(straight[0].lora_file)
    so_far, _ = load_lora(out / "pytorch_lora_weights.safetensors")
    assert any(not torch.equal(a[name], so_far[name]) for name in a)  # 3 steps, not the unbroken run's 6
    said = []
    resumed = train(_config(ws, out, resume="latest"), echo=said.append)
    assert any(line.startswith("resumed from") and line.endswith("at step 3") for line in said), said  # no restart
    b, _ = load_lora(resumed.lora_file)
    assert resumed.steps == STEPS and a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_a_plain_keyboard_interrupt_writes_nothing_so_the_check_above_would_notice(ws, tmp_path, monkeypatch):
    """Negative control: with the handler left out, the same SIGINT stops the run at once and ``kept`` fails."""
    class Absent(loop.CtrlC):
        def __enter__(self):
            return self

    monkeypatch.setattr(loop, "CtrlC", Absent)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(_config(ws, out), echo=lambda s: None, after_step=ctrl_c_at(2))
    with pytest.raises(AssertionError):
        kept(out, 2)


def test_a_second_ctrl_c_during_the_save_leaves_the_previous_checkpoint(ws, straight, tmp_path, monkeypatch):
    real = ckpt._write_tensors
    calls = {"n": 0}

    def write_then_ctrl_c(path, tensors, metadata=None):
        real(path, tensors, metadata)
        if path.parent.name.startswith(".step-00000003"):  # the save Ctrl-C asked for, halfway through its files
            calls["n"] += 1
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ckpt, "_write_tensors", write_then_ctrl_c)
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C stops at once
        train(_config(ws, out, save_every=2), echo=lambda s: None, after_step=ctrl_c_at(3))
    assert calls["n"] == 1 and signal.getsignal(signal.SIGINT) is before
    last = latest_checkpoint(out)
    assert last is not None and last.name == "step-00000002"
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no half-written folder
    assert not (out / "pytorch_lora_weights.safetensors").exists()  # the stopped run wrote no LoRA
    monkeypatch.setattr(ckpt, "_write_tensors", real)
    resumed = train(_config(ws, out, save_every=2, resume="latest"), echo=lambda s: None)  # step 2 is whole
    a, _ = load_lora(straight[0].lora_file)
    b, _ = load_lora(resumed.lora_file)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_summary_comes_before_the_first_step_and_the_progress_lines_have_an_eta(straight):
    result, lines = straight
    assert lines[0].startswith("device: the CPU: no CUDA GPU was found"), lines[:3]  # the very first line
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/"))
    summary = lines[:first_step]
    assert any(line.startswith("data: 4 images from ") and "4 entries an epoch at 64 px" in line
               for line in summary), summary
    assert "buckets: 64x64: 4 entries" in summary and "upscaled: none of the 4 images" in summary, summary
    assert any(line.startswith(f"steps: {STEPS} (2 images a batch; about 3 epochs)") for line in summary), summary
    progress = [line for line in lines if line.startswith("step ") and "/6:" in line]
    assert progress and all(", ETA " in line for line in progress), progress
    assert "ETA ?" in progress[0] and "ETA ?" not in progress[-1]  # the warm-up step alone measures nothing
    eta = [line for line in lines if line.startswith("eta: about ")]
    assert len(eta) == 1 and "for the 3 steps left" in eta[0], eta  # once, after steps 2 and 3 were measured


def _rank_main(rank: int, port: int, values: dict, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", SQUAREQ_KERNELS="torch", SQUAREQ_SHM_DIR=report)
    torch.set_num_threads(1)
    try:  # Ctrl-C on rank 1 alone: every rank must stop after the same step
        train(load_config(None, values), echo=lambda s: None, after_step=ctrl_c_at(2) if rank == 1 else None)
        outcome = "finished"
    except TrainInterrupted as exc:
        outcome = "interrupted " + str(exc)
    with open(os.path.join(report, f"rank{rank}"), "w") as f:
        f.write(outcome)


def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(ws, tmp_path):
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    values = _config(ws, tmp_path / "ranks", batch_size=1, steps=4).to_dict()
    report = tmp_path / "report"
    report.mkdir()
    ranks = mp.spawn(_rank_main, args=(port, values, str(report)), nprocs=2, join=False)
    deadline = time.monotonic() + 120  # ranks that disagree would wait for each other for hours: fail instead
    while not ranks.join(timeout=2):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail("the ranks did not stop together after Ctrl-C on one of them")
    outcomes = [(report / f"rank{r}").read_text() for r in range(2)]
    assert all(o.startswith("interrupted Ctrl-C: stopped after step 2 of 4") for o in outcomes), outcomes
    kept(tmp_path / "ranks", 2)


def _images(root):
    """Two 64-px images and one 256-px image (its kohya folder repeats it 3 times): at 128 px the small ones are
    enlarged."""
    (root / "3_big").mkdir(parents=True)
    for i in range(2):
        Image.new("RGB", (64, 64), (200, 40 * i, 40)).save(root / f"small{i}.png")
        (root / f"small{i}.txt").write_text("a small square")
    Image.new("RGB", (256, 256), (20, 40, 200)).save(root / "3_big" / "big.png")
    (root / "3_big" / "big.txt").write_text("a big square")
    return scan_dataset(root)


@pytest.mark.parametrize("no_upscale", [False, True])
def test_the_data_summary_counts_repeats_buckets_and_upscaled_images(tmp_path, no_upscale):
    lines = data_lines(_images(tmp_path), [make_buckets(128)], [128], no_upscale)
    assert lines[0] == f"data: 3 images from {tmp_path} (repeats: 2 images once, 1 image 3 times), 5 entries an " \
                       "epoch at 128 px"
    if no_upscale:  # the negative control: the small images keep their size, so none is enlarged
        assert lines[1:] == ["buckets: 128x128: 3 entries, 64x64: 2 entries", "upscaled: none of the 3 images "
                                                                              "(no_upscale)"]
    else:
        assert lines[1] == "buckets: 128x128: 5 entries"
        assert lines[2].startswith("upscaled: 2 of 3 images are smaller than their bucket") and "--no-upscale" in \
            lines[2]


def test_the_device_line_says_cpu_plainly_and_a_gpu_by_name():
    assert device_line(torch.device("cpu"), "bf16", "bf16").startswith("device: the CPU: no CUDA GPU was found")
    assert "CPU" not in device_line(torch.device("meta"), "bf16", "fp8")  # not a CPU: no CPU notice


def test_the_eta_skips_the_warm_up_step():
    clock = StepClock(total=10, step=0)
    clock.add(1, 100.0)  # the warm-up: compilation, first allocations
    assert clock.eta() == "?" and clock.run_line() is None
    for step in (2, 3):
        clock.add(step, 2.0)
    assert clock.eta() == "14 s"  # 7 steps left at 2 s, the 100 s warm-up not counted
    assert clock.run_line().startswith("eta: about 14 s for the 7 steps left (20 s for all 10;")
    assert clock.run_line() is None  # said once
