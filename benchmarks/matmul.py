#!/usr/bin/env python3
"""Quantized matmul speed on FLUX shapes: fused kernel, dequantize + vendor matmul, bf16 matmul, bnb NF4 (issue 8).

    python benchmarks/matmul.py [--out DIR] [--quick] [--tiny]

For each FLUX linear shape (out N, in K), format and number of rows M it measures, forward ``x @ Wᵀ`` and input
gradient ``dy @ W``:

* ``fused``: squareq's fused Triton kernels (squareq/kernels/triton_fused.py), autotuned first;
* ``dequant+mm``: squareq's dequant kernel into a bf16 buffer, then ``F.linear`` / ``matmul`` (the path used above
  the crossover);
* ``bf16``: the matmul on a resident bf16 weight, the speed to match;
* ``bnb``: bitsandbytes NF4 ``matmul_4bit`` (forward only), when bitsandbytes imports.

Each variant is captured in a CUDA graph that calls it once per weight copy, with enough copies that the weights
exceed the L2 cache (a weight-bound matmul must not be served from L2); the time per call is the median over graph
replays (CUDA events). Before timing, each squareq variant is checked against the torch reference on that shape.
Prints one JSON line per measurement, the crossover M per format (largest M of the grid at which fused beat
dequant+mm on every shape, forward and gradient), and a markdown table. ``--out DIR`` writes DIR/matmul.jsonl.
``--tiny``: one 128→64 shape, W4, M 1 and 16, two weight copies (one on a CPU), two replays; on a CPU the kernels
run where they run there (Triton's interpreter with ``TRITON_INTERPRET=1``), timed eagerly by the host's clock (CUDA
graphs and bitsandbytes are GPU-only here: skipped, each said on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import RECORDS, Column, emit, git_commit, log, table, write_records  # noqa: E402

SHAPES = {"3072→18432 (modulation)": (18432, 3072), "3072→3072": (3072, 3072), "3072→12288": (12288, 3072),
          "15360→3072": (3072, 15360)}
ROWS = [1, 16, 64, 256, 1024, 4608]
FORMATS = {"W4 g64": dict(bits=4, group_size=64, symmetric=False),
           "W6 g64": dict(bits=6, group_size=64, symmetric=False),
           "W8 g64": dict(bits=8, group_size=64, symmetric=False)}
L2_BYTES = 256 << 20  # rotate weight copies until the set is at least this large (H100/H200 L2: 50-60 MB)
TINY_SHAPES = {"128→64": (64, 128)}
TINY_ROWS = [1, 16]
TINY_REPS = 2


def weight_copies(nbytes: int, tiny: bool = False) -> int:
    """How many copies (two at least) of an ``nbytes`` weight exceed the L2 cache together; one on a CPU, where there
    is no L2 of a GPU to defeat, and two with ``--tiny`` (a tiny weight would need thousands)."""
    import torch

    if not torch.cuda.is_available():
        return 1
    return 2 if tiny else max(2, -(-L2_BYTES // nbytes))


def time_graph(calls, reps: int = 20) -> float:
    """Median seconds per call of ``calls`` (a list of zero-argument callables) replayed as one CUDA graph; on a CPU
    (``--tiny``), called eagerly and timed by the host's clock."""
    import torch

    for c in calls:  # warm up (and autotune) outside the capture
        c()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            for c in calls:
                c()
            times.append((time.perf_counter() - start) / len(calls))
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="two shapes, three M, W4 only")
    ap.add_argument("--tiny", action="store_true", help="one small shape, W4, M 1 and 16; runs on a CPU")
    ap.add_argument("--rows", help="comma-separated M values instead of the grid (e.g. 1,4,16)")
    ap.add_argument("--formats", help="comma-separated bit widths to measure (e.g. 4,8); default all")
    args = ap.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.tiny:
        sys.exit("benchmarks/matmul.py measures CUDA kernels; run it on the GPU machine (or --tiny on a CPU).")
    shapes = TINY_SHAPES if args.tiny else dict(list(SHAPES.items())[:2]) if args.quick else SHAPES
    rows = TINY_ROWS if args.tiny else [1, 16, 1024] if args.quick else ROWS
    formats = {"W4 g64": FORMATS["W4 g64"]} if args.quick or args.tiny else FORMATS
    if args.rows:
        rows = [int(m) for m in args.rows.split(",")]
    if args.formats:
        formats = {f: kw for f, kw in FORMATS.items() if str(kw["bits"]) in args.formats.split(",")}
    bnb = None
    if dev.type == "cpu":
        log("no CUDA device: CUDA graphs and bitsandbytes NF4 skipped (GPU-only here); the calls are timed eagerly")
    else:
        try:
            import bitsandbytes as bnb
        except ImportError:
            log("bitsandbytes does not import: its NF4 rows are skipped")
    emit({"what": "env", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
          "torch": torch.__version__, "commit": git_commit(), "bnb": getattr(bnb, "__version__", None),
          "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    g = torch.Generator(device=dev).manual_seed(0)
    for shape_name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02)
        copies_bf16 = [w.to(torch.bfloat16) for _ in range(weight_copies(n * k * 2, args.tiny))]
        nf4 = None if bnb is None else [bnb.functional.quantize_4bit(c, quant_type="nf4") for c in copies_bf16]
        for fmt, spec_kw in formats.items():
            measure_format(shape_name, w, fmt, spec_kw, rows, copies_bf16, nf4, bnb, g, args.tiny)
    write_records(args.out, "matmul.jsonl")
    print()
    print(report(RECORDS))


def measure_format(shape_name, w, fmt, spec_kw, rows, copies_bf16, nf4, bnb, g, tiny: bool) -> None:
    """Every variant of one shape and format at each M: checked against the torch reference, then timed."""
    import torch
    import torch.nn.functional as F

    from squareq.kernels import triton_fused
    from squareq.kernels.backend import dequantize_into
    from squareq.kernels.triton_fused import fused_input_grad, fused_linear
    from squareq.quant import QuantSpec, dequantize, quantize

    (n, k), dev = w.shape, w.device
    qw = quantize(w, QuantSpec(**spec_kw))
    packed = sum(t.nbytes for t in qw.tensors.values())
    copies = [type(qw)(qw.spec, qw.shape, {a: t.clone() for a, t in qw.tensors.items()})
              for _ in range(weight_copies(packed, tiny))]
    ref_w = dequantize(qw).float()
    scratch = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
    for m in rows:
        x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        dy = torch.randn(m, n, device=dev, generator=g).to(torch.bfloat16)
        # correctness on this shape before timing
        want = x.float() @ ref_w.T
        fwd_err = float((fused_linear(x, qw).float() - want).norm() / want.norm())
        want_dx = dy.float() @ ref_w
        grad_err = float((fused_input_grad(dy, qw).float() - want_dx).norm() / want_dx.norm())
        if max(fwd_err, grad_err) > 1e-2:
            raise SystemExit(f"{shape_name} {fmt} M={m}: fused kernels differ from the reference "
                             f"(rel. error {fwd_err:.2e} / {grad_err:.2e}).")
        y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)

        def deq_fwd(c, x=x, y=y):
            return lambda: torch.matmul(x, dequantize_into(scratch, c).T, out=y)

        def deq_grad(c, dy=dy):
            return lambda: torch.matmul(dy, dequantize_into(scratch, c))

        variants = {
            ("fused", "forward"): [lambda c=c, x=x: fused_linear(x, c) for c in copies],
            ("dequant+mm", "forward"): [deq_fwd(c) for c in copies],
            ("bf16", "forward"): [lambda c=c, x=x: F.linear(x, c) for c in copies_bf16],
            ("fused", "input grad"): [lambda c=c, dy=dy: fused_input_grad(dy, c) for c in copies],
            ("dequant+mm", "input grad"): [deq_grad(c) for c in copies],
            ("bf16", "input grad"): [lambda c=c, dy=dy: torch.matmul(dy, c) for c in copies_bf16],
        }
        if nf4 is not None and fmt == "W4 g64":
            variants[("bnb NF4", "forward")] = [lambda q=q, x=x: bnb.matmul_4bit(x, q[0].t(), quant_state=q[1])
                                                for q in nf4]
        for (variant, direction), calls in variants.items():
            seconds = time_graph(calls, TINY_REPS if tiny else 20)
            rec = {"what": "matmul", "shape": shape_name, "N": n, "K": k, "format": fmt, "M": m,
                   "variant": variant, "direction": direction, "us": seconds * 1e6,
                   "TFLOPS": 2 * m * n * k / seconds / 1e12, "copies": len(calls)}
            if variant == "fused":
                rec["rel_error"] = fwd_err if direction == "forward" else grad_err
                rec["config"], rec["tuning_us"] = chosen_config(triton_fused, spec_kw["bits"], direction, m)
            emit(rec)


def chosen_config(triton_fused, bits: int, direction: str, m: int) -> tuple[str, dict]:
    """The autotuned configuration the last fused call of ``direction`` at ``m`` rows ran, and the µs the tuner
    measured per candidate when it tuned that kernel last (this shape's key: the check above tuned it)."""
    variant = triton_fused._variant(m, bits, direction)
    kernel = triton_fused._KERNELS[(variant, direction)]
    def name(c):
        return " ".join(f"{k}={v}" for k, v in c.kwargs.items()) + f" w{c.num_warps}"

    timings = {name(c): round(float(t[0] if isinstance(t, (list, tuple)) else t) * 1e3, 2)
               for c, t in (getattr(kernel, "configs_timings", None) or {}).items()}
    return f"{variant} " + name(kernel.best_config), timings


def report(records: list[dict]) -> str:
    """Crossovers per format and a table: µs per call and speed relative to bf16 for each variant."""
    env, rows = records[0], [r for r in records if r.get("what") == "matmul"]
    t = {(r["shape"], r["format"], r["M"], r["variant"], r["direction"]): r["us"] for r in rows}
    lines = [f"device: {env['device']}, torch {env['torch']}, {env['date_utc']}, commit {env['commit']}", ""]
    crossover = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        ms = sorted({r["M"] for r in rows if r["format"] == fmt})
        shapes = dict.fromkeys(r["shape"] for r in rows)
        wins = [m for m in ms if all(t[(s, fmt, m, "fused", d)] < t[(s, fmt, m, "dequant+mm", d)]
                                     for s in shapes for d in ("forward", "input grad"))]
        crossover[fmt] = max((m for m in ms if all(x in wins for x in ms if x <= m)), default=0)
        lines.append(f"crossover {fmt}: fused beats dequant+mm on every shape and direction up to M = {crossover[fmt]}")

    def peer(variant):  # a variant's µs at the fused row's shape, format, M and direction
        return lambda r: t.get((r["shape"], r["format"], r["M"], variant, r["direction"]))

    def speed(r, dispatched=False):
        us = r["us"] if not dispatched or r["M"] <= crossover[r["format"]] else peer("dequant+mm")(r)
        return f"{peer('bf16')(r) / us:.2f}"

    def us(variant):
        return lambda r: None if peer(variant)(r) is None else f"{peer(variant)(r):.1f}"

    columns = [Column("shape", "shape"), Column("format", "format"), Column("M", "M"),
               Column("direction", "direction"), Column("fused µs", "us", ".1f"),
               Column("dequant+mm µs", None, us("dequant+mm")), Column("bf16 µs", None, us("bf16")),
               Column("bnb µs", None, us("bnb NF4")), Column("fused speed", "us", speed),
               Column("dispatched speed", "us", lambda r: speed(r, dispatched=True))]
    lines += ["", "speed = bf16 µs / variant µs (above 1: faster than the bf16 matmul); dispatched = fused up to the "
              "crossover, dequant+mm above it", "",
              table(records, columns, where={"what": "matmul", "variant": "fused"})]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
