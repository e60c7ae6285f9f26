"""The page's job queue (squareq/ui/queue.py): a file in the runs folder that a restarted server reads back, one
job at a time per lane (a GPU, or the CPU), with runs started from a terminal holding their lane too; Stop takes a
queued job out, refuses a run that is not running, and stops a real run even when the server ignores SIGINT."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from squareq.train.checkpoint import latest_checkpoint
from squareq.train.run_record import read_run_record
from squareq.train.tiny_dataset import write_tiny_dataset
from squareq.ui.paths import Roots, UiError
from squareq.ui.queue import Queue

from ..train.tiny_run import w8_tiny_slab


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "runs").mkdir()
    return Roots(tmp_path / "runs", (tmp_path,))


@pytest.fixture
def started(monkeypatch):
    """The jobs a tick starts, by run and lane, with no process started."""
    calls = []

    def start(self, job, lane):
        calls.append((job["run"], lane))
        job.update(state="running", lane=lane, pid=os.getpid())  # a live process stands for the job's

    monkeypatch.setattr(Queue, "_start", start)
    return calls


@pytest.fixture
def sleeper():
    """A live process of its own, to stand for a run started from a terminal."""
    process = subprocess.Popen(["sleep", "60"])
    yield process.pid
    process.kill()
    process.wait()


def _terminal_run(roots, name, pid, visible=None):
    """A run started from a terminal: its record in its folder, as train/run_record.py writes it."""
    (roots.runs / name).mkdir()
    (roots.runs / name / "run.json").write_text(json.dumps(
        {"status": "running", "pid": pid, "host": socket.gethostname(), "cuda_visible_devices": visible}))


def test_the_queue_is_a_file_a_restarted_server_reads_back(roots):
    Queue(roots, [None]).add("a", "start", ["--config", "a.toml"], "/somewhere")
    again = Queue(roots, [None]).jobs()  # a new server over the same folder
    assert [(j["run"], j["state"], j["argv"], j["cwd"]) for j in again] == [("a", "queued", ["--config", "a.toml"],
                                                                            "/somewhere")]
    assert sorted(p.name for p in roots.state.iterdir()) == ["queue.json", "queue.lock"]  # no temporary left
    with pytest.raises(UiError, match="a is already queued or running"):
        Queue(roots, [None]).add("a", "start", [], "/")


def test_one_job_at_a_time_per_lane_and_a_terminal_run_holds_its_lane(roots, started):
    queue = Queue(roots, [None])
    for name in ("a", "b"):
        queue.add(name, "start", [], "/")
    queue.tick()
    queue.tick()
    assert started == [("a", None)]  # b waits for the lane
    two = Queue(roots, ["0", "1"])
    two.tick()
    assert started == [("a", None), ("b", "1")]  # a holds lane 0 (it was started without a GPU: the first lane)


def test_a_live_terminal_run_holds_the_gpu_it_was_given(roots, started, sleeper):
    _terminal_run(roots, "typed", sleeper, visible="1")
    queue = Queue(roots, ["0", "1"])
    queue.add("a", "start", [], "/")
    queue.add("b", "start", [], "/")
    queue.tick()
    assert started == [("a", "0")]
    _terminal_run(roots, "typed-too", sleeper)
    Queue(roots, [None]).tick()
    assert started == [("a", "0")]  # the one lane of a CPU machine is the terminal runs'


def test_a_job_whose_process_ended_while_no_server_ran_is_marked_ended(roots):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    queue = Queue(roots, [None])
    queue.add("a", "start", [], "/")
    with queue._editing() as jobs:
        jobs[0].update(state="running", pid=gone.pid, lane=None)
    queue.tick()
    assert [(j["state"], j["exit_code"]) for j in queue.jobs()] == [("ended", None)]  # not our child: no code known


def test_stop_takes_a_queued_job_out_and_refuses_a_run_that_is_not_running(roots, started):
    queue = Queue(roots, [None])
    queue.add("a", "start", [], "/")
    assert queue.stop("a") == "taken out of the queue"
    queue.tick()
    assert started == [] and [j["state"] for j in queue.jobs()] == ["cancelled"]
    with pytest.raises(UiError, match="a is not running on this machine"):
        queue.stop("a")


def test_stop_stops_a_run_started_by_a_server_that_ignores_sigint(roots, tmp_path, torch_kernels, monkeypatch):
    """A server run as `nohup squareq ui &` ignores SIGINT; its runs must not, or Stop (a SIGINT) does nothing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    w8_tiny_slab(tmp_path / "tiny.slab")
    write_tiny_dataset(tmp_path / "data", count=4)
    (tmp_path / "tiny.toml").write_text(f'slab = "{tmp_path / "tiny.slab"}"\nresolution = 64\nsteps = 10000\n'
                                        "max_sequence_length = 16\nrank = 4\nbatch_size = 2\nsave_every = 0\n")
    queue, folder = Queue(roots, [None]), roots.runs / "a"
    queue.add("a", "start", ["--config", str(tmp_path / "tiny.toml"), "--data", str(tmp_path / "data"),
                             "-o", str(folder)], str(tmp_path))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `nohup ... &` leaves it; a child inherits it
    try:
        queue.tick()
    finally:
        signal.signal(signal.SIGINT, previous)
    child = next(iter(queue.children.values()))
    try:
        deadline = time.monotonic() + 60
        while not (folder / "metrics.jsonl").is_file() or not (folder / "metrics.jsonl").read_text():
            assert child.poll() is None and time.monotonic() < deadline, queue.log_path(queue.jobs()[0]).read_text()
            time.sleep(0.05)  # a first step done: Ctrl-C now saves a checkpoint
        assert queue.stop("a").startswith("sent Ctrl-C (SIGINT)")
        try:
            code = child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the run ignored Stop's SIGINT: it inherited the server's SIG_IGN")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    queue.tick()
    assert code == 130 and [(j["state"], j["exit_code"]) for j in queue.jobs()] == [("ended", 130)]
    assert read_run_record(folder)["status"] == "stopped" and latest_checkpoint(folder) is not None
