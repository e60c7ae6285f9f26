#!/usr/bin/env python3
"""What the compiler's per-layer search costs, transform by transform, on FLUX.1's layer shapes (issue 39, 42).

    python benchmarks/search_cost.py [--out DIR] [--shapes 3072x3072,...] [--profile] [--tiny]

For each weight shape (out N, in K) it builds a random weight and the statistics the compiler keeps for it (512 fit
and 512 held-out rows, ``E[x xᵀ]`` in pinned host memory as the compile keeps it), with a few outlier input channels,
and times ``measure_rungs`` over the default rungs (W4, W6, W8, bf16) four ways: no transform, the Hadamard rotation,
learned rounding, both. It also times learned rounding alone per rung (with its rounds), and with ``--profile`` prints
the torch profiler's top operations for both transforms on the largest shape. Then it scales the per-layer seconds by
the FLUX.1 block composition (19 double blocks, 38 single blocks) into a predicted search time for the 12B compile.

Random weights: the times are the arithmetic's, not the decisions' (learned rounding may stop sooner on real weights).
Output: one JSON line per measurement, then markdown tables; ``--out DIR`` also writes ``DIR/search_cost.jsonl``.
``--tiny``: two small shapes (64x128 and 128x64) with 32 fit and 32 held-out rows of 128 tokens, scaled by a toy
composition of them instead of FLUX.1's (runs on a CPU in seconds).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.common import RECORDS, Column, emit, git_commit, log, table, write_records  # noqa: E402
from squareq import quant  # noqa: E402
from squareq.compiler.ladder import DEFAULT_FORMATS, measure_rungs, rung_specs  # noqa: E402
from squareq.compiler.layer_search import GPTQ_DAMP, search_layer  # noqa: E402
from squareq.compiler.layer_statistics import LayerStats  # noqa: E402

# (out N, in K): how many of each a FLUX.1 double and single block holds
DOUBLE = {(3072, 3072): 8, (18432, 3072): 2, (12288, 3072): 2, (3072, 12288): 2}
SINGLE = {(3072, 3072): 3, (9216, 3072): 1, (12288, 3072): 1, (3072, 15360): 1}
BLOCKS = {"double": (19, DOUBLE), "single": (38, SINGLE)}
TINY_BLOCKS = {"double": (2, {(64, 128): 4}), "single": (1, {(128, 64): 2})}  # --tiny's toy composition
VARIANTS = {"none": (False, False), "rotation": (True, False), "learned": (False, True), "both": (True, True)}


def layer_stats(k: int, device, rows: int = 512, tokens: int = 4096, seed: int = 0) -> LayerStats:
    """Statistics of ``tokens`` random inputs with 1% outlier channels, kept as the compile keeps them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens + rows, k, generator=g)
    x[:, torch.randperm(k, generator=g)[: max(1, k // 100)]] *= 20
    fit, held = x[:tokens].to(device), x[tokens:].to(device)
    hessian = torch.empty((k, k), dtype=torch.float32, pin_memory=device.type == "cuda")
    hessian.copy_((fit.T @ fit / tokens).float())
    return LayerStats(absmax=fit.abs().amax(0).to(device), sq_sum=fit.pow(2).sum(0).double().to(device),
                      count=tokens, rows=fit[:rows].clone(), heldout_rows=held, _hessian=hessian)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and its wall seconds, the device synchronized on both sides."""
    sync(device)
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    sync(device)
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--shapes", default=None, help="NxK,... (default: every FLUX.1 block shape)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="two small shapes and few rows; runs on a CPU in seconds")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    blocks, model = (TINY_BLOCKS, "toy") if args.tiny else (BLOCKS, "FLUX.1 12B")
    every = sorted({s for _, comp in blocks.values() for s in comp})
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else every
    emit({"kind": "env", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
          "torch": torch.__version__, "date_utc": datetime.datetime.now(datetime.UTC).isoformat(
              timespec="seconds"), "commit": git_commit()})
    rungs = rung_specs(DEFAULT_FORMATS)
    per_layer: dict[tuple, dict[str, float]] = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(device) * 0.02
        stats = layer_stats(k, device, rows=32, tokens=128) if args.tiny else layer_stats(k, device)
        measure_rungs("warmup", w[:256], stats, rungs[:1])  # kernels compiled and autotuned outside the timings
        for variant, (rotate, refine) in VARIANTS.items():
            _, s = timed(device, measure_rungs, f"{n}x{k}", w, stats, rungs, "gptq", rotate, refine)
            per_layer.setdefault((n, k), {})[variant] = s
            emit({"kind": "search", "shape": [n, k], "variant": variant, "rungs": len(rungs), "seconds": s})
        emit({"kind": "layer", "shape": [n, k], **{f"{v}_s": s for v, s in per_layer[(n, k)].items()}})
        refine_each_rung(device, w, stats, rungs, n, k)
        if args.profile and (n, k) == max(shapes, key=lambda s: s[0] * s[1]):
            profile_search(device, w, stats, rungs)
    if all(s in per_layer for _, comp in blocks.values() for s in comp):
        for variant in VARIANTS:
            total = sum(count * sum(per_layer[s][variant] * c for s, c in comp.items())
                        for count, comp in blocks.values())
            emit({"kind": "predicted_search", "model": model, "variant": variant, "seconds": total})
    write_records(args.out, "search_cost.jsonl")
    log("done")
    columns = [Column("shape", "shape", lambda r: "x".join(map(str, r["shape"])))]
    columns += [Column(f"{v} s", f"{v}_s", ".2f") for v in VARIANTS]
    print(table(RECORDS, columns, where={"kind": "layer"}))
    if any(r["kind"] == "predicted_search" for r in RECORDS):
        print()
        print(table(RECORDS, [Column("search, predicted", "model"), Column("variant", "variant"),
                              Column("s", "seconds", ".0f")], where={"kind": "predicted_search"}))


def refine_each_rung(device, w, stats, rungs, n: int, k: int) -> None:
    """Learned rounding alone per rung (on the rotation search's winner), with its rounds."""
    for spec in rungs:
        if spec.is_passthrough:
            continue
        winner = search_layer(w, stats, spec, rotate=True, refine=False).qweight
        (_, rounds), s = timed(device, quant.refine_rounding, winner, w, stats.hessian, damp=GPTQ_DAMP)
        emit({"kind": "refine", "shape": [n, k], "rung": spec.short_label, "rotated": winner.spec.rotate,
              "rounds": rounds, "seconds": s})


def profile_search(device, w, stats, rungs) -> None:
    """The torch profiler's top operations of both transforms on ``w``, on stderr."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        measure_rungs("profiled", w, stats, rungs, "gptq", True, True)
        sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=20), file=sys.stderr)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20), file=sys.stderr)


if __name__ == "__main__":
    main()
