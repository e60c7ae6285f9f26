#!/usr/bin/env python3
"""Denoising-step time of a FLUX.1-dev-shaped 12B transformer at inference: SquareQ streaming vs its peers (issue 8).

    python benchmarks/sample.py [--out DIR] [--workdir DIR] [--res 1024] [--steps 28] [--only ...] [--tiny]

One denoising step is one transformer forward under ``torch.no_grad`` at ``res``² ((res/16)² image tokens, 512
text tokens, batch 1, embedded guidance 3.5: FLUX.1-dev samples without CFG), on the seeded random-weight model
and inputs of ``benchmarks/train_step.py`` (whose slab phase writes, or reuses, the same SquareQ slab). Setups, each
in its own process so memory statistics start clean:

* ``resident``: the bf16 model on the GPU, the speed to match;
* ``compiled``: the same with each transformer block under ``torch.compile`` (default mode), what a careful user
  samples with (issue 41); one forward compiles it before the timed run (``compile_s``), so its run is warm;
* ``squareq K``: ``squareq.runtime.load(slab, options=LoadOptions(prefetch=K, compute=C))``, blocks streamed
  forward-only through K slots, for each ``--compute`` C (``auto``, squareq sample's default, is FP8 on GPUs with
  FP8 tensor cores);
* ``squareq ... graphs`` (``--graphs on``): the same with ``cuda_graphs=True`` (``squareq sample --cuda-graphs``):
  each block's forward is captured as a CUDA graph per slot during the first steps and replayed after;
* ``squareq ... compiled`` (``--block-compile on``): the same with ``compile_blocks=True`` (``squareq sample
  --compile on``): each block class's forward under ``torch.compile``, compiled during the run's first step, which
  is counted in the run's time as a user's first step is (``block_compile_s``: Dynamo's own count of it);
* ``... attention=fused`` / ``attention=stock`` (``--attention``): FLUX attention with SquareQ's fused query/key
  norm + rotary embedding (runtime/flux_attention.py; what ``squareq.runtime.load`` installs by default) or with
  diffusers' stock processor; the resident model runs the stock one always (every ratio divides by it) and also
  the fused one when ``--attention`` names it, so the share of the step the processor saves is measured apart;
* ``... kernels=auto`` / ``kernels=default`` (``--sdpa-kernels``): the SquareQ setups' attention kernels,
  ``LoadOptions(attention=...)``: cuDNN first where measured faster (``squareq sample --attention cudnn``) or
  torch's order;
  cuDNN attention is switched off for every other setup, as before (its backward fails on the device image for
  narrow heads), so the peers run torch's order;
* ``squareq auto`` / ``squareq auto+resident[+budgetG]``: what ``squareq sample --prefetch auto [--resident-blocks
  auto] [--vram-budget G GB]`` does: K = 3 slots, then after the first step that replays its blocks' CUDA graphs
  (or the second step) a ``StreamTuner`` (squareq/runtime/residency.py) adds slots and (with ``+resident``) keeps
  blocks on the GPU from the measured copy and compute times, within G GB reserved; the plan is reported;
* ``group_offload``: diffusers block-level group offloading with CUDA streams;
* ``model_offload``: accelerate's ``cpu_offload_with_hook`` (what ``enable_model_cpu_offload`` applies to the
  transformer): moved to the GPU at the first step of a sampling run, so its one transfer is counted over the run;
* ``sequential_offload``: accelerate's ``cpu_offload`` (what ``enable_sequential_cpu_offload`` applies); slow, so
  it runs ``--sequential-steps`` steps.

Each setup reports seconds per step (a whole run of ``--steps`` steps, first step included, divided by the steps;
the first step is also reported on its own) and peak reserved memory. The compiled peer's run is warm (compiled
before it); so each SquareQ setup also runs a second whole run in the same process (``second_run``: the next image
of a ``squareq sample`` call), and the peer's run with its compile counted in (``run_with_compile_s``) is set
against SquareQ's first (``ratio_to_compiled_with_compile``). Prints one JSON line per setup and a markdown
table; ``--out DIR`` writes DIR/sample.jsonl. ``SQUAREQ_PROFILE_DIR=DIR`` profiles one more step of each setup
(left out of its figures): DIR/profile_sample_<setup>.txt has the kernel table, and the record the step's GPU time
by kind of kernel (``gpu_ms``).

``--tiny``: the tiny FLUX config at 128², every setup in this one process (seconds on a CPU, where memory figures are
null: not measured); without a GPU the offload peers, which move the weights onto one, are skipped with a record that
says so.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import train_step as ts  # noqa: E402  (the model, inputs and slab of the training benchmark)
from common import RECORDS, Column, emit, git_commit, log, not_measured, set_figure, table, write_records  # noqa: E402

SETUPS = ("slab", "resident", "compiled", "squareq", "group_offload", "model_offload", "sequential_offload")
OFFLOAD = ("group_offload", "model_offload", "sequential_offload")  # peers that move weights between host and GPU


def run_steps(setup, model, batch, steps: int, tuner=None, graphs=None) -> dict:
    """``steps`` forwards under no_grad, timed as one sampling run (synchronized at its ends); ``tuner``: a
    StreamTuner told where each step begins and ends (its probe and plan count in the steps' time); ``graphs``: the
    runtime's BlockGraphs, told where each step ends."""
    import torch

    ts.memory_peaks(setup)  # reset the peaks
    times = []
    with torch.no_grad():
        for i in range(steps):
            setup.sync()
            start = time.perf_counter()
            if tuner is not None:
                tuner.before_step(i)
            model(**batch, return_dict=False)
            if tuner is not None:
                tuner.after_step(i)
            if graphs is not None:  # as squareq sample does after every denoising step
                graphs.end_step()
            setup.sync()
            times.append(time.perf_counter() - start)
    peaks = ts.memory_peaks(setup)
    run = {"step_s": sum(times) / len(times), "first_step_s": times[0],
           "steady_step_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0],
           "steps": len(times), "peak_reserved_GB": ts.gb(setup, peaks["peak_reserved"]),
           "peak_alloc_GB": ts.gb(setup, peaks["peak_allocated"])}
    return run if setup.cuda else not_measured(run, "peak_reserved_GB", "peak_alloc_GB")


# kind of kernel -> name fragments (lower case); the first kind that matches a kernel's name takes it
KERNEL_KINDS = (("copy", ("memcpy", "memset")),  # host-to-device mostly (streamed blocks), on their own stream
                ("attention", ("flash", "fmha", "attention")),
                ("fp8 operands", ("_rows_kernel", "_int_fp8", "_int_amax")),
                ("dequant", ("dequant", "_fused_", "fused_linear", "_gptq")),
                ("matmul", ("gemm", "nvjet", "sm90", "sm80", "cutlass", "xmma", "ampere", "cublas")))


def profile_step(setup, model, batch, path: Path) -> dict:
    """One more denoising step under torch.profiler: its kernel table to ``path``; returns the step's wall time and
    GPU milliseconds by kind of kernel (a kernel inside a replayed CUDA graph counts where the profiler sees it)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    setup.sync()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        model(**batch, return_dict=False)
        setup.sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kinds: dict[str, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, frags in KERNEL_KINDS if any(f in name for f in frags)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e3
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="self_device_time_total", row_limit=45))
    return {"profiled_step_s": wall, "gpu_ms": {k: round(v, 2) for k, v in sorted(kinds.items())},
            "gpu_ms_total": round(sum(kinds.values()), 2)}


def _phase_value(words: list[str], name: str, default: str) -> str:
    """The value of ``name=value`` among a phase's words, or ``default``."""
    return next((w.split("=", 1)[1] for w in words if w.startswith(f"{name}=")), default)


def phase(args) -> None:
    import torch

    name = args.phase[0]
    kernels = _phase_value(args.phase, "kernels", "default")
    # cuDNN attention stays off (its backward fails on the device image for narrow heads) except for the SquareQ
    # setups that choose it: LoadOptions(attention="auto") at FLUX.1's head width
    torch.backends.cuda.enable_cudnn_sdp(name == "squareq" and kernels == "auto")
    setup = ts.Setup(args)
    attention = _phase_value(args.phase, "attention", "stock")
    rec = {"what": name, "res": args.res, "device": setup.device_name, "attention": attention}
    tuner = None
    try:
        if name == "slab":
            ts.phase_slab(setup)
            return
        if name == "squareq":
            import squareq.runtime as rt
            from squareq.runtime.residency import StreamTuner
            from squareq.train.sample import FORWARD_SLOTS

            k, *rest = args.phase[1:]
            compute = _phase_value(rest, "compute", "bf16")
            graphs = "graphs" in rest
            block_compile = "compiled" in rest
            rec["prefetch"] = k if k == "auto" else int(k)
            model = rt.load(setup.slab, setup.device, options=rt.LoadOptions(
                prefetch=FORWARD_SLOTS if k == "auto" else int(k), host="pinned", verify="off", compute=compute,
                cuda_graphs=graphs, fused_attention=attention == "fused", compile_blocks=block_compile,
                attention=kernels))
            rec.update(compute=compute, compute_used=rt.runtime_of(model).compute, cuda_graphs=graphs,
                       block_compile=block_compile, attention_kernels=kernels,
                       cudnn_attention_first=rt.runtime_of(model).prefer_cudnn)
            if k == "auto":
                resident = "auto" if "resident" in rest else 0
                budget = next((float(w[6:]) for w in rest if w.startswith("budget")), None)
                rec.update(resident_blocks=resident, vram_budget_GB=budget)
                tuner = StreamTuner(model, prefetch="auto", resident=resident, forward_only=True,
                                    peak_limit=int(budget * 1e9) if budget else None)  # as squareq sample's
        else:
            model = ts.build_model(setup)
            if attention == "fused":
                from squareq.runtime.flux_attention import install_fused_attention

                rec["fused_modules"] = install_fused_attention(model)
            if name == "compiled":
                rec["compiled_blocks"] = ts.compile_blocks(model)
            if name not in ("resident", "compiled"):
                model = model.to("cpu")
                torch.cuda.empty_cache()
            if name == "group_offload":
                model.enable_group_offload(onload_device=setup.device, offload_device=torch.device("cpu"),
                                           offload_type="block_level", num_blocks_per_group=1, use_stream=True)
            elif name == "model_offload":
                from accelerate import cpu_offload_with_hook

                model, _ = cpu_offload_with_hook(model, setup.device)
            elif name == "sequential_offload":
                from accelerate import cpu_offload

                cpu_offload(model, setup.device)
        model.eval()
        batch, _ = ts.make_batch(setup, args.res, model)
        steps = args.sequential_steps if name == "sequential_offload" else args.steps
        if name == "compiled":  # the compilation, outside the timed run
            started = time.perf_counter()
            with torch.no_grad():
                model(**batch, return_dict=False)
            setup.sync()
            rec["compile_s"] = time.perf_counter() - started
        graphs = rt.runtime_of(model).graphs if name == "squareq" else None
        rec.update(run_steps(setup, model, batch, steps, tuner, graphs))
        if tuner is not None and tuner.plan is not None:
            p = tuner.plan
            rec.update(plan_slots=p.slots, plan_resident=len(p.resident), plan=p.describe())
        if graphs is not None:
            rec["graphs"] = dict(vars(graphs.stats))  # captures and replays over the run (a copy: the counts go on)
        if rec.get("block_compile"):  # compiled within the run: its first step pays it, as a user's does
            from squareq.runtime.block_compile import compile_seconds

            rec["block_compile_s"] = compile_seconds()
        if name == "squareq":  # a second image in the same process (squareq sample's next prompt): warm, as the
            rec["second_run"] = run_steps(setup, model, batch, steps, tuner, graphs)  # compiled peer's run is
        if name == "compiled":  # the peer's run with its compile counted in, as SquareQ's first run counts its own
            rec["run_with_compile_s"] = (rec["compile_s"] + rec["step_s"] * rec["steps"]) / rec["steps"]
        profile_dir = os.environ.get("SQUAREQ_PROFILE_DIR")
        if profile_dir and setup.cuda:
            label = "_".join(args.phase).replace("=", "-")
            rec.update(profile_step(setup, model, batch, Path(profile_dir) / f"profile_sample_{label}.txt"))
    except Exception as exc:  # a failed setup is a row, not the end of the benchmark
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    emit(rec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/squareq_bench"))
    ap.add_argument("--res", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--sequential-steps", type=int, default=2)
    ap.add_argument("--prefetch", nargs="+", default=["2", "3", "auto", "auto+resident"],
                    help="ring sizes K, auto, auto+resident, auto+resident+budget3 (within 3 GB reserved)")
    ap.add_argument("--compute", nargs="+", default=["auto"], help="SquareQ compute modes: bf16, fp8, auto")
    ap.add_argument("--graphs", nargs="+", choices=("off", "on"), default=["off"],
                    help="SquareQ without and/or with CUDA graphs per block (squareq sample --cuda-graphs)")
    ap.add_argument("--block-compile", nargs="+", choices=("off", "on"), default=["off"],
                    help="SquareQ without and/or with its blocks under torch.compile (squareq sample --compile); the "
                         "compile happens in the run's first step")
    ap.add_argument("--attention", nargs="+", choices=("stock", "fused"), default=["fused"],
                    help="FLUX attention processors of the SquareQ setups; with fused, the resident model runs both "
                         "(other peers: stock)")
    ap.add_argument("--sdpa-kernels", nargs="+", choices=("auto", "default"), default=["default"],
                    help="the SquareQ setups' attention kernels (LoadOptions.attention): auto (cuDNN first where "
                         "measured faster, squareq sample's default) or default (torch's order, flash first)")
    ap.add_argument("--only", default=",".join(SETUPS))
    ap.add_argument("--tiny", action="store_true",
                    help="the tiny FLUX config at 128², every setup in this process (runs on a CPU)")
    ap.add_argument("--family", default="flux", help=argparse.SUPPRESS)  # train_step's Setup reads it
    ap.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--rotate", action="store_true", help=argparse.SUPPRESS)  # train_step's Setup reads it
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per setup")
    args = ap.parse_args()
    if args.tiny and args.res == 1024:
        args.res = 128  # (128/16)² = 64 image tokens
    if args.phase:
        return phase(args)
    import torch

    env = emit({"what": "env", "torch": torch.__version__, "commit": git_commit(), "res": args.res,
                "steps": args.steps, "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    records = [env]
    for p in phases_of(args):
        log(f"setup {' '.join(p)}")
        if p[0] in OFFLOAD and not torch.cuda.is_available():
            records.append(emit({"what": p[0], "skipped": "no CUDA device: it moves the weights onto a GPU"}))
        else:  # --tiny: in this process (seconds, not a process start each); else each in its own
            records += run_here(p, args) if args.tiny else run_apart(p, args)
    add_ratios(records)
    write_records(args.out, "sample.jsonl", records)
    print(f"\n{records[1].get('device') if len(records) > 1 else ''}, {env['date_utc']}, commit {env['commit']}; "
          f"{args.res}², {args.steps} steps\n")
    print(step_table(records))
    for r in records:
        if r.get("what") == "slab" and "error" in r:
            print(f"\nslab: {r['error']}")


def phases_of(args) -> list[list[str]]:
    phases = []
    # the order of SETUPS: the slab first, then the resident model every ratio divides by
    for s in args.only.split(","):
        if s == "squareq":
            phases += [["squareq", *str(k).split("+"), f"compute={c}", f"attention={a}", f"kernels={kn}"]
                       + (["graphs"] if g == "on" else []) + (["compiled"] if bc == "on" else [])
                       for k in args.prefetch for c in args.compute for a in args.attention for g in args.graphs
                       for bc in args.block_compile for kn in args.sdpa_kernels]
        elif s == "resident":
            # the stock model always runs: every ratio divides by it
            phases += [["resident", "attention=stock"]] + ([["resident", "attention=fused"]]
                                                           if "fused" in args.attention else [])
        else:
            phases.append([s])
    return phases


def run_here(p: list[str], args) -> list[dict]:
    """``--tiny``: one setup in this process; the records it emitted."""
    first = len(RECORDS)
    phase(argparse.Namespace(**{**vars(args), "phase": p}))
    return [r for r in RECORDS[first:] if r.get("what") in SETUPS]


def run_apart(p: list[str], args) -> list[dict]:
    """One setup in a process of its own (its memory statistics start clean); its records, echoed."""
    cmd = [sys.executable, __file__, "--phase", *p, "--workdir", str(args.workdir), "--res", str(args.res),
           "--steps", str(args.steps), "--sequential-steps", str(args.sequential_steps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout).stdout
    except subprocess.TimeoutExpired:
        out = json.dumps({"what": p[0], "error": f"timed out after {args.timeout:.0f} s"})
    records = []
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("what") in SETUPS:
                records.append(rec)
                print(line, flush=True)
    return records


def add_ratios(records: list[dict]) -> None:
    """Each run's step over the stock resident model's and the compiled one's, whole run and steady; not measured
    where the run left that peer out."""
    base = next((r for r in records if r.get("what") == "resident" and "step_s" in r and r["attention"] == "stock"),
                None)  # the stock diffusers model on the GPU: every ratio divides by it
    compiled = next((r for r in records if r.get("what") == "compiled" and "step_s" in r), None)
    for r in records[1:]:
        for key, ref in (("ratio_to_resident", base), ("ratio_to_compiled", compiled)):
            for run in (r, r.get("second_run")):
                if run and "step_s" in run:
                    set_figure(run, key, run["step_s"] / ref["step_s"] if ref else None)
                    set_figure(run, key.replace("ratio", "steady_ratio"),
                               run["steady_step_s"] / ref["steady_step_s"] if ref else None)
        if compiled and "step_s" in r and r.get("what") == "squareq":  # first runs both with their compile
            r["ratio_to_compiled_with_compile"] = r["step_s"] / compiled["run_with_compile_s"]


def setup_label(r: dict) -> str:
    label = r["what"] + (f" K={r['prefetch']}" if "prefetch" in r else "") + (
        " +resident" if r.get("resident_blocks") == "auto" else "") + (
        f" within {r['vram_budget_GB']:g} GB" if r.get("vram_budget_GB") else "") + (
        f" {r['compute']}" + (f" ({r['compute_used']})" if r["compute"] == "auto" else "") if "compute" in r else "")
    label += " graphs" if r.get("cuda_graphs") else ""
    label += " compiled" if r.get("block_compile") else ""
    label += " cuDNN attention" if r.get("cudnn_attention_first") else ""
    label += f", {r['attention']} attention" if r["what"] in ("resident", "compiled", "squareq") else ""
    return label + (", second run" if r.get("run") == "second" else "")


def setup_note(r: dict) -> str:
    if r.get("run") == "second":
        return "the same process's next image"
    if "step_s" not in r:
        return r.get("skipped") or r.get("error", "")
    note = f"{r['steps']} steps" + (f"; {r['plan']}" if "plan" in r else "") + (
        f"; {r['graphs']['captures']} graphs captured, {r['graphs']['replays']} replays" if "graphs" in r else "")
    note += f"; profiled step {r['profiled_step_s']:.3f} s, GPU ms {r['gpu_ms']}" if "gpu_ms" in r else ""
    note += f"; compiled in {r['compile_s']:.1f} s before the run" if "compile_s" in r else ""
    note += f"; {r['block_compile_s']:.1f} s compiling in the run" if "block_compile_s" in r else ""
    note += (f"; with its compile {r['run_with_compile_s']:.3f} s/step" if "run_with_compile_s" in r else "")
    note += (f"; {r['ratio_to_compiled_with_compile']:.2f}x the compiled peer's run with its compile"
             if "ratio_to_compiled_with_compile" in r else "")
    return note


STEP_COLUMNS = [
    Column("setup", "what", setup_label), Column("run s / step", "step_s", ".3f"),
    Column("steady s / step", "steady_step_s", ".3f"),
    Column("× bf16 resident (run)", "ratio_to_resident", ".2f"),
    Column("× bf16 resident (steady)", "steady_ratio_to_resident", ".2f"),
    Column("× compiled (run)", "ratio_to_compiled", ".2f"),
    Column("× compiled (steady)", "steady_ratio_to_compiled", ".2f"),
    Column("first step s", "first_step_s", ".3f"), Column("peak reserved GB", "peak_reserved_GB", ".2f"),
    Column("note", None, setup_note)]


def step_table(records: list[dict]) -> str:
    """A row per setup, and one more for each setup's second run in its process (``second_run``)."""
    rows = []
    for r in records:
        rows.append(r)
        if r.get("second_run"):
            rows.append({**r, **r["second_run"], "run": "second"})
    return table(rows, STEP_COLUMNS, where={"what": [s for s in SETUPS if s != "slab"]})


if __name__ == "__main__":
    main()
