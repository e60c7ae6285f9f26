#!/usr/bin/env python3
"""`squareq train` data-parallel on several GPUs of one host against one GPU, on the 12B FLUX.1-shaped slab (issue 22).

    python benchmarks/train_ddp.py --workdir DIR [--out DIR] [--gpus 2] [--res 1024] [--steps 20] [--skip 6]
                                   [--only setup,scale,resume] [--resume-res 512] [--resume-steps 6] [--tiny]

Phases, each in its own process:

* ``setup``: the slab of ``benchmarks/train_step.py`` (random N(0, 0.02) weights, its W4/W6/W8 mix; reused when
  present), the random-weight FLUX pipeline folder and noise images of ``benchmarks/train_e2e.py``;
* ``scale``: ``torchrun --nproc-per-node N`` of the trainer (batch 1 per rank, the trainer's defaults otherwise:
  K=auto, compute auto, CUDA graphs auto) for N = 1, then N = ``--gpus``, one after the other on the same machine.
  Per run: the median step after ``--skip`` steps from ``metrics.jsonl``, images/s (N images a step), each rank's
  peak reserved memory and copy wait (the trainer gathers them from every rank), and the host memory of the whole
  process tree, sampled every half second: the sum of the processes' PSS (a page shared by several processes
  counts once, split between them) and /proc/meminfo's Shmem (the ranks' shared copy of the slab lives there);
* ``resume``: with N = ``--gpus`` at ``--resume-res``, ``--resume-steps`` steps with a checkpoint every half: a
  straight run, a second straight run, and a run killed (every rank raises) after the checkpoint and resumed with
  ``--resume latest``. Attention runs on torch's math backend here: the flash backward adds with atomics, so two
  straight runs would differ in the last bits and "exact" could not be told apart from "close". Reports the largest
  difference between the LoRA files, resumed against straight and straight against straight.

Prints one JSON line per measurement and a markdown table; ``--out DIR`` writes DIR/train_ddp.jsonl. ``--tiny``
runs tiny-flux at 64² with gloo processes on the CPU (the setup in this process), to check the script anywhere; the
memory figures a CPU cannot measure are null there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import RECORDS, Column, emit, git_commit, log, not_measured, table, write_records  # noqa: E402
from train_step import slab_path  # noqa: E402

KILLED = 17  # the exit status of a rank stopped on purpose by the resume check


def phase_setup(args) -> None:
    """Slab, pipeline folder and images, each reused when already there."""
    from train_e2e import write_data, write_pipeline

    work = Path(args.workdir)
    if args.tiny:
        import train_step

        train_step.slab_here(work, "flux", tiny=True)
    else:
        subprocess.run([sys.executable, str(HERE / "train_step.py"), "--workdir", str(work), "--phase", "slab"],
                       check=True)
    write_pipeline(work / "pipeline", args.tiny)
    write_data(work / "data", args.images, max(args.res, args.resume_res))


def rank_main(args) -> None:
    """One rank of a torchrun job: the trainer on the benchmark's data (run by ``torchrun ... --phase rank``)."""
    import contextlib

    import torch

    from squareq.train.config import load_config
    from squareq.train.loop import train

    torch.backends.cuda.enable_cudnn_sdp(False)  # the cuDNN attention backward fails on the device image
    work = Path(args.workdir)
    values = {"slab": str(slab_path(args.workdir, "flux", args.tiny)), "data": str(work / "data"),
              "output": args.run_out,
              "model": str(work / "pipeline"), "cache_dir": str(work / "cache"), "resolution": args.run_res,
              "max_sequence_length": 16 if args.tiny else 512, "steps": args.run_steps, "batch_size": 1,
              "save_every": args.save_every, "seed": 0}
    if args.resume_latest:
        values["resume"] = "latest"
    cfg = load_config(None, values)

    def kill(step: int) -> None:
        if args.kill_at and step == args.kill_at:
            sys.exit(KILLED)  # every rank stops after the same step, as a killed job would

    attention = contextlib.nullcontext()
    if args.math_attention:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        attention = sdpa_kernel(SDPBackend.MATH)
    with attention:
        train(cfg, echo=lambda s: print(s, file=sys.stderr, flush=True), after_step=kill)


class HostMemory:
    """Peak host memory of a process tree, sampled in a thread: the sum of PSS and /proc/meminfo's Shmem."""

    def __init__(self, pid: int) -> None:
        self.pid, self.pss_peak, self.shmem_peak, self.samples, self.stop = pid, 0, 0, 0, threading.Event()
        self.shmem_before = _shmem()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.wait(0.5):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except psutil.Error:
                    pass
            self.pss_peak = max(self.pss_peak, total)
            self.shmem_peak = max(self.shmem_peak, _shmem() - self.shmem_before)
            self.samples += 1

    def finish(self) -> dict:
        """The peaks in GB; None where the tree ended before its first sample (not measured)."""
        self.stop.set()
        self.thread.join()
        if not self.samples:
            return {"host_pss_peak_GB": None, "shmem_peak_GB": None}
        return {"host_pss_peak_GB": self.pss_peak / 1e9, "shmem_peak_GB": self.shmem_peak / 1e9}


def _shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def torchrun(args, ranks: int, out: Path, res: int, steps: int, save_every: int = 0, kill_at: int = 0,
             resume: bool = False, math_attention: bool = False) -> tuple[int, dict]:
    """One trainer job of ``ranks`` processes; its exit status and host-memory peaks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(HERE / "train_ddp.py"), "--phase", "rank", "--workdir", args.workdir, "--run-out", str(out),
           "--run-res", str(res), "--run-steps", str(steps), "--save-every", str(save_every),
           "--kill-at", str(kill_at)] + (["--resume-latest"] if resume else []) + \
        (["--math-attention"] if math_attention else []) + (["--tiny"] if args.tiny else [])
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if args.tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
    log(f"{ranks} rank(s): {out.name} ({res}², {steps} steps{', killed after ' + str(kill_at) if kill_at else ''}"
        f"{', resumed' if resume else ''})")
    # its own process group: on a timeout the ranks go too, not only the launcher (they would keep their GPUs)
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    memory = HostMemory(proc.pid)
    try:
        code = proc.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code, memory.finish()


def phase_scale(args) -> None:
    """Step time, images/s, per-rank memory and copy wait, host memory: 1 rank, then ``--gpus`` ranks."""
    work = Path(args.workdir)
    for ranks in dict.fromkeys((1, args.gpus)):
        out = work / f"scale-{ranks}"
        shutil.rmtree(out, ignore_errors=True)
        code, host = torchrun(args, ranks, out, args.res, args.steps)
        rows = _metrics(out)
        rec = {"what": "scale", "ranks": ranks, "res": args.res, "exit": code, **host}
        measured = rows[args.skip:]
        if code == 0 and measured:
            step_s = statistics.median(r["seconds"] for r in measured)
            rec.update(step_s=step_s, images_per_s=ranks / step_s, steps=[round(r["seconds"], 4) for r in rows])
            if "peak_reserved_GB" in rows[0]:  # the trainer's GPU figures (each rank's, with several)
                rec["rank_peak_reserved_GB"] = [max(r.get("rank_peak_reserved_GB", [r["peak_reserved_GB"]])[i]
                                                    for r in measured) for i in range(ranks)]
                rec["rank_copy_wait_share"] = [statistics.median(
                    r.get("rank_copy_wait_s", [r["copy_wait_s"]])[i] / r["seconds"] for r in measured)
                    for i in range(ranks)]
            else:  # a CPU: the ranks measure no GPU memory or copies
                not_measured(rec, "rank_peak_reserved_GB", "rank_copy_wait_share")
        emit(not_measured(rec, *(k for k, v in host.items() if v is None)))


def phase_resume(args) -> None:
    """Straight twice, and killed + resumed, with ``--gpus`` ranks: the largest LoRA differences."""
    work, steps = Path(args.workdir), args.resume_steps
    half = max(1, steps // 2)
    runs = {name: work / f"resume-{name}" for name in ("straight", "again", "killed")}
    for out in runs.values():
        shutil.rmtree(out, ignore_errors=True)
    common = dict(res=args.resume_res, steps=steps, save_every=half, math_attention=not args.tiny)
    codes = {"straight": torchrun(args, args.gpus, runs["straight"], **common)[0],
             "again": torchrun(args, args.gpus, runs["again"], **common)[0],
             "killed": torchrun(args, args.gpus, runs["killed"], kill_at=half + 1, **common)[0]}
    codes["resumed"] = torchrun(args, args.gpus, runs["killed"], resume=True, **common)[0]
    rec = {"what": "resume", "ranks": args.gpus, "res": args.resume_res, "steps": steps, "checkpoint_every": half,
           "killed_after": half + 1, "exits": codes}
    if codes["straight"] == codes["again"] == codes["resumed"] == 0 and codes["killed"] != 0:
        rec.update(resumed_vs_straight=_max_difference(runs["killed"], runs["straight"]),
                   straight_vs_straight=_max_difference(runs["again"], runs["straight"]),
                   resumed_steps=len(_metrics(runs["killed"])))
        rec["exact"] = rec["resumed_vs_straight"] == 0.0
    emit(rec)


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _max_difference(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    name = "pytorch_lora_weights.safetensors"  # the diffusers file; the kohya one holds the same numbers
    ta, tb = load_file(str(a / name)), load_file(str(b / name))
    if ta.keys() != tb.keys():
        return float("inf")
    return max(float((ta[k].float() - tb[k].float()).abs().max()) for k in ta)


def tables() -> str:
    scale = [r for r in RECORDS if r.get("what") == "scale"]
    one = next((r for r in scale if r["ranks"] == 1 and "images_per_s" in r), None)

    def per_rank(key, fmt, scale=1):
        return lambda r: ", ".join(format(scale * v, fmt) for v in r[key])

    columns = [Column("ranks", "ranks"), Column("res", "res", lambda r: f"{r['res']}²"),
               Column("step s", "step_s", ".3f"), Column("images/s", "images_per_s", ".2f"),
               Column("× 1 GPU", "images_per_s", lambda r: f"{r['images_per_s'] / one['images_per_s']:.2f}"
                      if one else None),
               Column("peak reserved GB per rank", "rank_peak_reserved_GB", per_rank("rank_peak_reserved_GB", ".2f")),
               Column("copy-wait % per rank", "rank_copy_wait_share", per_rank("rank_copy_wait_share", ".1f", 100)),
               Column("host PSS peak GB", "host_pss_peak_GB", ".2f"), Column("Shmem peak GB", "shmem_peak_GB", ".2f"),
               Column("note", None, lambda r: "" if "step_s" in r else f"failed (exit {r['exit']})")]
    parts = [table(RECORDS, columns, where={"what": "scale"})]
    if any(r.get("what") == "resume" for r in RECORDS):
        resume = [Column("resume: ranks", "ranks"), Column("res", "res", lambda r: f"{r['res']}²"),
                  Column("steps", "steps"), Column("killed after step", "killed_after"),
                  Column("largest LoRA difference resumed vs straight", "resumed_vs_straight", ".3g"),
                  Column("straight vs straight", "straight_vs_straight", ".3g"),
                  Column("exits", "exits", lambda r: "" if "exact" in r else f"not compared, exits {r['exits']}")]
        parts += ["", table(RECORDS, resume, where={"what": "resume"})]
    return "\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=6, help="first steps left out of the median (warm-up, graph captures)")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--resume-res", type=int, default=512)
    ap.add_argument("--resume-steps", type=int, default=6)
    ap.add_argument("--only", default="setup,scale,resume")
    ap.add_argument("--run-timeout", type=float, default=400, help="seconds per trainer job")
    ap.add_argument("--tiny", action="store_true", help="tiny-flux on the CPU with gloo, to check the script")
    for flag in ("--phase", "--run-out", "--run-res", "--run-steps", "--save-every", "--kill-at"):
        ap.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--resume-latest", "--math-attention"):
        ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "rank":
        args.run_res, args.run_steps = int(args.run_res), int(args.run_steps)
        args.save_every, args.kill_at = int(args.save_every), int(args.kill_at)
        return rank_main(args)
    if args.tiny:
        args.res, args.resume_res = min(args.res, 64), min(args.resume_res, 64)
    emit({"what": "env", "commit": git_commit(), "gpus": args.gpus, "tiny": args.tiny,
          "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    phases = {"setup": phase_setup, "scale": phase_scale, "resume": phase_resume}
    for name in args.only.split(","):
        phases[name](args)
        write_records(args.out, "train_ddp.jsonl")
    print(tables())


if __name__ == "__main__":
    main()
