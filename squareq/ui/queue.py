"""The page's job queue: runs it was asked to start or resume, one at a time per GPU (one lane on a machine without
one). The queue is a file, ``<runs>/.squareq-ui/queue.json``, rewritten whole under a temporary name at each change
and read back at each look, so a restarted server finds its queued jobs, and the runs it started, which live in their
own sessions, go on without it. Each job is ``squareq train`` in a process of its own, its console output in
``.squareq-ui/logs/<id>.log``; Stop is the SIGINT a Ctrl-C sends, so the run writes its checkpoint and LoRA so far."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

from ..slab.atomic import atomic_write_bytes
from ..train.run_record import read_run_record
from .paths import Roots, UiError
from .runs import pid_alive, run_folders, running_here

try:
    import fcntl
except ImportError:  # Windows: one server per runs folder, held by the thread lock alone
    fcntl = None

QUEUE_FILE = "queue.json"
KEPT_ENDED = 100  # ended jobs kept in the file, for their console logs and exit codes


def gpu_lanes() -> list[str | None]:
    """One lane per GPU this process may use (CUDA_VISIBLE_DEVICES' entries, or the devices' indices), or a single
    lane for the CPU."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return [None]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[:count] if visible else [str(i) for i in range(count)]


class Queue:
    """The jobs of one runs folder; :meth:`tick` starts the next queued job on each free lane."""

    def __init__(self, roots: Roots, lanes: list[str | None]) -> None:
        self.roots, self.lanes = roots, lanes
        self.path = roots.state / QUEUE_FILE
        self.lock = threading.Lock()
        self.children: dict[int, subprocess.Popen] = {}  # the processes this server started, to reap them

    @contextmanager
    def _editing(self):
        """The job list to change in place, written back when the block ends; one writer at a time, across
        threads and (where the system has file locks) across processes."""
        self.roots.state.mkdir(parents=True, exist_ok=True)
        with self.lock, open(self.roots.state / "queue.lock", "a") as held:
            if fcntl is not None:
                fcntl.flock(held, fcntl.LOCK_EX)
            jobs = self.jobs()
            before = json.dumps(jobs)
            for job in jobs:  # a process that ended since the last tick must not hold its run or lane
                if job["state"] == "running":
                    self._check_ended(job)
            yield jobs
            if json.dumps(jobs) != before:  # the scheduler looks twice a second; the file changes far less often
                atomic_write_bytes(self.path, (json.dumps({"version": 1, "jobs": jobs}, indent=1) + "\n").encode())

    def jobs(self) -> list[dict]:
        """Every job in the file, oldest first."""
        try:
            found = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise UiError(f"{self.path} cannot be read ({exc}); move it aside to start with an empty queue.") from None
        return list(found.get("jobs", [])) if isinstance(found, dict) else []

    def add(self, run: str, action: str, argv: list[str], cwd: str, job_id: str | None = None) -> dict:
        """A job at the end of the queue: ``squareq train *argv`` in ``cwd`` for the run folder ``run``."""
        job = {"id": job_id or new_id(), "run": run, "action": action, "argv": argv, "cwd": cwd, "state": "queued",
               "lane": None, "pid": None, "queued_at": time.time(), "started_at": None, "ended_at": None,
               "exit_code": None}
        with self._editing() as jobs:
            if any(j["run"] == run and self.holds(j) for j in jobs):
                raise UiError(f"{run} is already queued or running; wait for it, or stop it first.")
            jobs.append(job)
        return job

    def holds(self, job: dict) -> bool:
        """Whether ``job`` still holds its run: queued, or running and its run not yet recorded as ended (a process
        that wrote how it ended may take a moment to exit; its lane stays taken until it has)."""
        if job["state"] != "running":
            return job["state"] == "queued"
        record = read_run_record(self.roots.runs / job["run"])
        return not (record and record["status"] != "running" and record.get("pid") == job["pid"])

    def active(self, run: str) -> dict | None:
        """The queued or running job of ``run``, if any."""
        return next((j for j in self.jobs() if j["run"] == run and j["state"] in ("queued", "running")), None)

    def log_path(self, job: dict) -> Path:
        return self.roots.state / "logs" / f"{job['id']}.log"

    def stop(self, run: str) -> str:
        """Take ``run`` out of the queue, or send its process the SIGINT of a Ctrl-C; what was done, in words."""
        with self._editing() as jobs:
            for job in jobs:
                if job["run"] == run and job["state"] == "queued":
                    job.update(state="cancelled", ended_at=time.time())
                    return "taken out of the queue"
        folder = self.roots.run(run)
        record = read_run_record(folder) if folder.is_dir() else None
        pid = record["pid"] if running_here(record) else None
        job = self.active(run)
        if pid is None and job is not None and pid_alive(job["pid"], job["started_at"]):
            pid = job["pid"]  # started, and not yet past the point where it writes its record
        if pid is None:
            raise UiError(f"{run} is not running on this machine, so there is nothing to stop.")
        os.kill(pid, signal.SIGINT)
        return f"sent Ctrl-C (SIGINT) to process {pid}: it finishes its step, then writes its checkpoint"

    def tick(self) -> None:
        """Note the jobs whose process ended, then start the oldest queued job on each free lane."""
        with self._editing() as jobs:
            queued = [j for j in jobs if j["state"] == "queued"]
            busy = self._busy_lanes(jobs) if queued else set()  # read from every run folder: only when a job waits
            for lane, job in zip([lane for lane in self.lanes if lane not in busy], queued):
                self._start(job, lane)
            ended = [j for j in jobs if j["state"] in ("ended", "cancelled")]
            for old in ended[:max(0, len(ended) - KEPT_ENDED)]:
                jobs.remove(old)

    def _check_ended(self, job: dict) -> None:
        child = self.children.get(job["pid"])
        code = child.poll() if child is not None else None
        # a process of an earlier server is not this one's child: only whether it still lives can be known
        running = code is None if child is not None else pid_alive(job["pid"], job["started_at"])
        if running:
            return
        self.children.pop(job["pid"], None)
        job.update(state="ended", exit_code=code, ended_at=time.time())

    def _busy_lanes(self, jobs: list[dict]) -> set:
        """The lanes of the running jobs, and of runs started elsewhere (a terminal) that run on this machine: the
        GPU their CUDA_VISIBLE_DEVICES names first, else the first lane."""
        # a lane this server does not have (an earlier server's, on other GPUs) stands for the first
        busy = {j["lane"] if j["lane"] in self.lanes else self.lanes[0] for j in jobs if j["state"] == "running"}
        ours = {j["pid"] for j in jobs if j["state"] == "running"}
        for folder in run_folders(self.roots.runs):
            record = read_run_record(folder)
            if record and record.get("pid") not in ours and running_here(record):
                visible = (record.get("cuda_visible_devices") or "").split(",")[0].strip()
                busy.add(visible if visible in self.lanes else self.lanes[0])
        return busy

    def _start(self, job: dict, lane: str | None) -> None:
        log = self.log_path(job)
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if lane is not None:
            env["CUDA_VISIBLE_DEVICES"] = lane
        cwd = job["cwd"] if Path(job["cwd"]).is_dir() else os.getcwd()
        with open(log, "ab") as out:
            try:
                # a session of its own: a Ctrl-C of the server's terminal does not stop the runs it started
                child = subprocess.Popen([sys.executable, "-m", "squareq", "train", *job["argv"]], cwd=cwd, env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_default_sigint)
            except OSError as exc:  # said in its log, and out of the queue, rather than tried again every tick
                out.write(f"error: squareq train could not be started: {exc}\n".encode())
                job.update(state="ended", ended_at=time.time())
                return
        self.children[child.pid] = child
        job.update(state="running", lane=lane, pid=child.pid, started_at=time.time())


def _default_sigint() -> None:
    # in the child, before exec: SIGINT ignored by the server (`nohup ... &`) is inherited, and Stop would do nothing
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def new_id() -> str:
    """A job's id: its time, then random letters, so ids sort by age and never collide."""
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


class Scheduler:
    """A thread that ticks the queue every ``every`` seconds until :meth:`close`."""

    def __init__(self, queue: Queue, every: float = 0.5) -> None:
        self.queue, self.every = queue, every
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="squareq-ui-queue", daemon=True)

    def start(self) -> Scheduler:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.done.is_set():
            try:
                self.queue.tick()
            except Exception as exc:  # a queue file someone broke must not end the scheduling for good
                print(f"squareq ui: the queue could not be read or written: {exc}", file=sys.stderr)
            self.done.wait(self.every)

    def close(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
