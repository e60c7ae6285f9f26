#!/usr/bin/env python3
"""End-to-end `squareq train` on the FLUX.1-dev-shaped 12B slab, next to the bare streamed step (issue 5).

    python benchmarks/train_e2e.py --workdir DIR [--out DIR] [--steps 50] [--res 512] [--tiny]

Phases, each in its own process:

* ``slab``: the slab of ``benchmarks/train_step.py`` (same random weights and W4/W6/W8 mix), reused when present;
* ``pipeline``: a FLUX-layout pipeline folder with random weights for what the cache needs: the FLUX.1 VAE
  at full size, a CLIP text encoder and a T5 encoder at FLUX.1's widths (768 pooled, 4096 per token) but
  with one layer each, and the offline tokenizers of tiny-flux (no hub download is possible on the device);
* ``data``: ``--images`` noise images at ``--res`` with captions;
* ``bare``: ``train_step.py``'s SquareQ phase (K=3, pinned) at ``--res``: the bare streamed step;
* ``train``: ``squareq.train.loop.train`` for ``--steps`` steps (batch 1, 512 T5 tokens, K=3, pinned),
  the cache filled first; per-step times and peaks are read from its ``metrics.jsonl``;
* ``bare`` again after each trainer run (``--rounds`` trainer runs), so drift of the machine shows in both;
  the comparison is the median of the trainer runs' medians against the median of the bare runs'.

``SQUAREQ_PROFILE_DIR=DIR`` adds a torch.profiler table of two late trainer steps (left out of the median).

Prints one JSON line per measurement and a markdown table: median step (after ``--skip`` steps), steps/s,
peak reserved, and the trainer's overhead over the bare step (target: under 5%). ``--tiny``: tiny-flux at 128² on
its tiny pipeline, every phase in this one process (seconds on a CPU, where memory figures are null: not measured).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import RECORDS, Column, emit, git_commit, not_measured, table, write_records  # noqa: E402


def write_pipeline(folder: Path, tiny: bool) -> None:
    """VAE, CLIP, T5 and tokenizers with random weights at FLUX.1's widths (one layer per text encoder)."""
    import torch
    from diffusers import AutoencoderKL, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from squareq.models.tiny_pipeline import build_tiny_flux_pipeline, build_tiny_scheduler, build_tiny_tokenizers
    from squareq.slab.atomic import atomic_directory

    if (folder / "model_index.json").is_file():
        return
    if tiny:
        pipe = build_tiny_flux_pipeline()
        pipe.transformer = None
    else:
        torch.manual_seed(0)
        clip_tok, t5_tok = build_tiny_tokenizers()
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            block_out_channels=(128, 256, 512, 512), layers_per_block=2, scaling_factor=0.3611,
                            shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=1, num_attention_heads=12, max_position_embeddings=77,
                                            bos_token_id=clip_tok.bos_token_id, eos_token_id=clip_tok.eos_token_id,
                                            pad_token_id=clip_tok.pad_token_id))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=4096, d_kv=64, d_ff=10240, num_layers=1,
                                     num_heads=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                     pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id))
        pipe = FluxPipeline(scheduler=build_tiny_scheduler(), vae=vae, text_encoder=clip, tokenizer=clip_tok,
                            text_encoder_2=t5, tokenizer_2=t5_tok, transformer=None)
    with atomic_directory(folder, overwrite=True) as tmp:
        pipe.save_pretrained(tmp)


def write_data(folder: Path, count: int, res: int) -> None:
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        if not (folder / f"{i:04d}.png").is_file():
            Image.fromarray(rng.integers(0, 256, (res, res, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
            (folder / f"{i:04d}.txt").write_text(f"a photo of sample {i}, noise texture")


def run_train(args) -> dict:
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)  # the cuDNN attention backward fails on the device image
    import train_step

    from squareq.train.config import load_config
    from squareq.train.loop import train

    work = Path(args.workdir)
    out = work / f"run-{int(time.time())}"
    cfg = load_config(None, {
        "slab": str(train_step.slab_path(work, "flux", args.tiny)), "data": str(work / "data"), "output": str(out),
        "model": str(work / "pipeline"), "cache_dir": str(work / "cache"), "resolution": args.res,
        "max_sequence_length": 16 if args.tiny else 512, "steps": args.steps, "batch_size": 1, "prefetch": 3,
        "save_every": 0, "seed": 0})
    host_busy, last = [], [time.thread_time()]
    profile_dir = os.environ.get("SQUAREQ_PROFILE_DIR")
    profiler = None

    def after_step(step: int) -> None:
        nonlocal profiler
        now = time.thread_time()
        host_busy.append(now - last[0])  # the training thread's own CPU time in this step
        last[0] = now
        if profile_dir and step == args.steps - 4:
            from torch.profiler import ProfilerActivity, profile

            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            profiler.start()
        elif profiler is not None and step == args.steps - 2:
            torch.cuda.synchronize()
            profiler.stop()
            events = profiler.key_averages()
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            (Path(profile_dir) / "profile_trainer.txt").write_text(
                "two trainer steps\n" + events.table(sort_by="self_cpu_time_total", row_limit=45) + "\n\n"
                + events.table(sort_by="self_device_time_total", row_limit=25))
            profiler = None

    start = time.perf_counter()
    train(cfg, echo=lambda s: print(s, file=sys.stderr, flush=True), after_step=after_step)
    wall = time.perf_counter() - start
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records[args.skip:] if not (profile_dir and r["step"] > args.steps - 4)]
    step_s = statistics.median(r["seconds"] for r in measured)
    rec = {"what": "squareq_train", "res": args.res, "steps": len(records), "wall_s": wall, "step_s": step_s,
           "steps_per_s": 1 / step_s, "host_busy_s": statistics.median(host_busy[args.skip:len(measured) + args.skip]),
           "step_times": [round(r["seconds"], 4) for r in records]}
    if not torch.cuda.is_available():  # the trainer's metrics.jsonl has GPU memory and copy waits on a GPU only
        return not_measured(rec, "peak_reserved_GB", "copy_wait_share")
    return {**rec, "peak_reserved_GB": max(r["peak_reserved_GB"] for r in measured),
            "copy_wait_share": statistics.median(r["copy_wait_s"] / r["seconds"] for r in measured)}


def phase(args, name: str) -> list[dict]:
    """Run a phase in a child process (``--tiny``: in this one); its JSON lines (or an error record) come back."""
    if args.tiny:
        return phase_here(args, name)
    cmd = [sys.executable, str(HERE / "train_e2e.py"), "--phase", name] + sys.argv[1:]
    if name in ("slab", "bare"):
        cmd = [sys.executable, str(HERE / "train_step.py"), "--workdir", args.workdir, "--steps", "8", "--warmup", "2",
               "--phase", *bare_phase(args, name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.phase_timeout, check=False)
    sys.stderr.write(proc.stderr[-4000:])
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 and not any("error" in r for r in lines):
        lines.append({"what": name, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"})
    for r in lines:
        print(json.dumps(r, sort_keys=True), flush=True)
    return lines


def bare_phase(args, name: str) -> list[str]:
    """train_step.py's phase for the slab or the bare streamed step at ``--res``."""
    return ["slab"] if name == "slab" else ["squareq", str(args.res), "3", "pinned"]


def phase_here(args, name: str) -> list[dict]:
    """``--tiny``: the phase in this process, as its own process would run it; its records."""
    import train_step

    work = Path(args.workdir)
    if name in ("slab", "bare"):
        step_args = train_step.parse_args(["--workdir", args.workdir, "--steps", str(args.steps), "--warmup", "1",
                                           "--tiny"])
        return train_step.run_here(bare_phase(args, name), step_args)
    if name == "pipeline":
        write_pipeline(work / "pipeline", args.tiny)
    elif name == "data":
        write_data(work / "data", args.images, args.res)
    else:
        return [emit(run_train(args))]
    return []


def median_row(records: list[dict], what: str, label: str) -> dict | None:
    """The median over runs of ``what`` (the bare step or the trainer), as a record of its own."""
    runs = [r for r in records if r.get("what") == what and "step_s" in r]
    if not runs:
        return None
    step_s = statistics.median(r["step_s"] for r in runs)
    first = {k: runs[0][k] for k in ("peak_reserved_GB", "copy_wait_share")}  # the first run's
    row = {"what": "median", "setup": label, "res": runs[0]["res"], "runs": len(runs), "step_s": step_s,
           "steps_per_s": 1 / step_s, "runs_s": [r["step_s"] for r in runs], **first}
    return emit(not_measured(row, *(k for k in first if k in runs[0].get("not_measured", ()))))


COLUMNS = [Column("setup", "setup", lambda r: f"{r['setup']} (median of {r['runs']} runs)", also=("runs",)),
           Column("res", "res", lambda r: f"{r['res']}²"), Column("step s", "step_s", ".3f"),
           Column("steps/s", "steps_per_s", ".2f"), Column("peak reserved GB", "peak_reserved_GB", ".2f"),
           Column("copy-wait %", "copy_wait_share", lambda r: f"{100 * r['copy_wait_share']:.1f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the median (warm-up)")
    ap.add_argument("--res", type=int, default=512)
    ap.add_argument("--images", type=int, default=60)
    ap.add_argument("--tiny", action="store_true", help="tiny-flux at 128², every phase in this process (a CPU)")
    ap.add_argument("--phase-timeout", type=float, default=540)
    ap.add_argument("--rounds", type=int, default=1, help="trainer runs, each followed by a bare run")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tiny:
        args.res, args.steps, args.skip, args.images = min(args.res, 128), min(args.steps, 3), min(args.skip, 1), 2
    work = Path(args.workdir)
    if args.phase == "pipeline":
        return write_pipeline(work / "pipeline", args.tiny)
    if args.phase == "data":
        return write_data(work / "data", args.images, args.res)
    if args.phase == "train":
        emit(run_train(args))
        return
    records = [emit({"what": "env", "commit": git_commit(), "tiny": args.tiny,
                     "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})]
    # bare and trainer runs alternate (bare, then --rounds × (trainer, bare)), so drift of the machine shows in
    # both instead of passing as overhead; the comparison is median against median over the runs
    for name in ("slab", "pipeline", "data", "bare", *(["train", "bare"] * args.rounds)):
        records += phase(args, name)
    rows = [median_row(records, "squareq", "bare streamed step (train_step.py, K=3)"),
            median_row(records, "squareq_train", f"squareq train, {args.steps} steps")]
    bare, run = rows
    if bare and run:
        emit({"what": "overhead", "trainer_over_bare": run["step_s"] / bare["step_s"] - 1,
              "bare_runs_s": bare["runs_s"], "trainer_runs_s": run["runs_s"]})
    write_records(args.out, "train_e2e.jsonl", [*records, *(r for r in RECORDS if r.get("what") in (
        "median", "overhead"))])
    print()
    print(table(RECORDS, COLUMNS, where={"what": "median"}))
    if bare and run:
        print(f"\ntrainer overhead over the bare step: {100 * (run['step_s'] / bare['step_s'] - 1):+.1f}% "
              f"(target < 5%); bare runs {[round(x, 3) for x in bare['runs_s']]} s, trainer runs "
              f"{[round(x, 3) for x in run['runs_s']]} s")
    for r in records:
        if "error" in r:
            print(f"error in {r.get('what')}: {r['error'][:300]}")


if __name__ == "__main__":
    main()
