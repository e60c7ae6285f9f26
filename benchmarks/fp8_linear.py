#!/usr/bin/env python3
"""One frozen linear layer's forward and input gradient on FLUX shapes: bf16 compute against FP8 compute, parts and
whole (issues 21 and 41).

    python benchmarks/fp8_linear.py [--out DIR] [--rows 1536,5120] [--parts forward,grad] [--tiny]

For each FLUX linear shape (out N, in K), a W4 g64 weight (seeded random: speed only, never a quality claim) and M
input rows (1,536 and 5,120 are the token counts of a FLUX.1 step at 512² and 1024² with 512 text tokens):

* ``bf16``: the runtime's bf16 path, dequantize into bf16 + ``F.linear``;
* ``fp8``: the runtime's FP8 path (squareq/kernels/fp8.py): the weight straight to E4M3 rows, the input quantized
  per token, ``torch._scaled_mm``; with ``fast_accum`` on and off;
* its parts: the weight kernel, the activation kernel, and ``torch._scaled_mm`` alone;
* ``bf16 resident``: ``F.linear`` on a bf16 weight already in memory, what the resident model runs;
* ``grad: ...`` (``--parts grad``): the input gradient ``g·W`` of M rows: bf16 (dequantize + matmul, the runtime's
  backward), FP8 (the weight to E4M3 + ``kernels/fp8.py`` ``fp8_input_grad``; with the codes row-major and copied
  transposed, and written transposed by the weight kernel, what ``compute.FP8_BACKWARD`` runs), and ``g·W`` on a
  resident bf16 weight.

Times are CUDA-graph medians over copies whose weights exceed the L2 cache (benchmarks/matmul.py's ``time_graph``).
Each FP8 row also gives the output's rel-MSE against the bf16 path on the same input. It checks first that the
kernels equal their torch reference on the GPU. Prints one JSON line per measurement and a markdown table.
``--tiny``: one 128→64 shape, M = 16, two weight copies (one on a CPU), two replays. On a CPU every variant runs
there too (``torch._scaled_mm`` has a CPU kernel; the operand kernels run where they run there: Triton's interpreter
with ``TRITON_INTERPRET=1``), called eagerly and timed by the host's clock (CUDA graphs are GPU-only: skipped, said
on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import RECORDS, Column, device_name, emit, git_commit, log, not_measured, table, write_records  # noqa: E402
from matmul import SHAPES, TINY_REPS, TINY_SHAPES, time_graph, weight_copies  # noqa: E402


def variants(n: int, k: int, m: int, parts=("forward",), tiny: bool = False):
    """{name: [callables]} of one shape, each over enough weight copies to exceed L2, and the rel-MSE per FP8 name."""
    import torch
    import torch.nn.functional as F

    from squareq import quant
    from squareq.kernels import fp8 as kfp8
    from squareq.kernels.backend import prepare_dequantize
    from squareq.quant.fp8_rows import quantize_rows

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    spec = quant.QuantSpec(bits=4, group_size=64)
    copies = weight_copies(n * k, tiny)
    weights = [quant.quantize(torch.randn(n, k, generator=g, device=dev) * 0.02, spec) for _ in range(copies)]
    x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    bf16 = torch.empty(n, k, dtype=torch.bfloat16, device=dev)
    codes = torch.empty(n, k, dtype=kfp8.FP8, device=dev)
    scales = torch.empty(n, dtype=torch.float32, device=dev)
    deq = [prepare_dequantize(bf16, qw) for qw in weights]
    to_fp8 = [kfp8.prepare_weight_fp8(codes, scales, qw, bf16) for qw in weights]
    codes_t = torch.empty(k, n, dtype=kfp8.FP8, device=dev).t()  # the input gradient's column-major operand
    to_fp8_t = [kfp8.prepare_weight_fp8(codes_t, scales, qw, bf16) for qw in weights]
    # the kernels against their torch reference on this device, bit for bit
    to_fp8[0]()
    ref_codes, ref_scales = quantize_rows(quant.dequantize(weights[0]))
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scales, ref_scales), \
        "the E4M3 weight kernel differs from its torch reference"
    xq, xs = kfp8.quantize_activations(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(xs, rs), \
        "the per-token activation kernel differs from its torch reference"
    resident = [quant.dequantize(qw) for qw in weights]

    def scaled(fast: bool):
        return torch._scaled_mm(xq, codes.t(), scale_a=xs[:, None], scale_b=scales[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)

    def fp8_path(i: int, fast: bool, with_bias=None, epilogue: bool = False):
        kfp8.FAST_ACCUM, kfp8.BIAS_IN_EPILOGUE = fast, epilogue
        return kfp8.fp8_linear(x, to_fp8[i](), with_bias)

    grad = torch.randn(m, n, generator=g, device=dev).to(torch.bfloat16)
    out = {} if "forward" not in parts else {
        "bf16 resident": [lambda w=w: F.linear(x, w) for w in resident],
        "bf16 (dequant + F.linear)": [lambda i=i: F.linear(x, deq[i]()) for i in range(copies)],
        "fp8": [lambda i=i: fp8_path(i, False) for i in range(copies)],
        "fp8 fast_accum": [lambda i=i: fp8_path(i, True) for i in range(copies)],
        "fp8 fast_accum + bias (separate add)": [lambda i=i: fp8_path(i, True, bias) for i in range(copies)],
        "fp8 fast_accum + bias (epilogue)": [lambda i=i: fp8_path(i, True, bias, True) for i in range(copies)],
        "bf16 resident + bias": [lambda w=w: F.linear(x, w, bias) for w in resident],
        "part: weight to E4M3": [lambda i=i: to_fp8[i]() for i in range(copies)],
        "part: activations to E4M3": [lambda: kfp8.quantize_activations(x)] * copies,
        "part: _scaled_mm": [lambda: scaled(False)] * copies,
        "part: _scaled_mm fast_accum": [lambda: scaled(True)] * copies,
    }
    if "grad" in parts:
        out.update({
            "grad: bf16 resident": [lambda w=w: grad.matmul(w) for w in resident],
            "grad: bf16 (dequant + matmul)": [lambda i=i: grad.matmul(deq[i]()) for i in range(copies)],
            "grad: fp8 (weight to E4M3 + fp8_input_grad)": [lambda i=i: kfp8.fp8_input_grad(grad, to_fp8[i]())
                                                            for i in range(copies)],
            "grad: fp8, codes written transposed": [lambda i=i: kfp8.fp8_input_grad(grad, to_fp8_t[i]())
                                                    for i in range(copies)],
            "grad part: fp8_input_grad": [lambda: kfp8.fp8_input_grad(grad, (codes, scales))] * copies,
            "grad part: fp8_input_grad, transposed codes": [lambda: kfp8.fp8_input_grad(grad, (codes_t, scales))]
            * copies,
        })
    errors = {}

    def rel(y, reference):
        return ((y.float() - reference).pow(2).mean() / reference.pow(2).mean()).item()

    if "forward" in parts:
        reference = F.linear(x, deq[0]()).float()
        for name, fast in (("fp8", False), ("fp8 fast_accum", True)):
            errors[name] = rel(fp8_path(0, fast), reference)
    if "grad" in parts:
        reference = grad.matmul(deq[0]()).float()
        errors["grad: fp8 (weight to E4M3 + fp8_input_grad)"] = rel(kfp8.fp8_input_grad(grad, to_fp8[0]()), reference)
        errors["grad: fp8, codes written transposed"] = rel(kfp8.fp8_input_grad(grad, to_fp8_t[0]()), reference)
    kfp8.FAST_ACCUM, kfp8.BIAS_IN_EPILOGUE = True, False
    return out, errors


def table_of(records: list[dict]) -> str:
    """µs per variant and its ratio to the bf16 resident matmul of the same shape, M and direction."""
    base = {(r["shape"], r["m"], r["variant"].startswith("grad")): r["ms"] for r in records
            if r.get("variant") in ("bf16 resident", "grad: bf16 resident")}

    def ratio(r):
        key = (r["shape"], r["m"], r["variant"].startswith("grad"))
        return f"{r['ms'] / base[key]:.2f}" if key in base else None

    columns = [Column("shape", "shape"), Column("M", "m"), Column("variant", "variant"), Column("ms", "ms", ".3f"),
               Column("× bf16 resident (its direction)", "ms", ratio),
               Column("rel-MSE vs bf16 path", "rel_mse", ".2e")]
    return table(records, columns, where={"what": "linear"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", default="1536,5120", help="comma-separated M values")
    ap.add_argument("--parts", default="forward,grad", help="forward, grad (the input gradient), or both")
    ap.add_argument("--tiny", action="store_true", help="one small shape, M = 16, two replays; runs on a CPU")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        if not args.tiny:
            sys.exit("benchmarks/fp8_linear.py measures CUDA kernels; run it on the GPU machine (or --tiny on a CPU).")
        log("no CUDA device: CUDA graphs skipped (GPU-only); every variant runs on the CPU, timed eagerly")
    shapes, rows = (TINY_SHAPES, "16") if args.tiny else (SHAPES, args.rows)
    env = emit({"what": "env", "device": device_name(), "torch": torch.__version__, "commit": git_commit(),
                "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")})
    for shape, (n, k) in shapes.items():
        for m in (int(v) for v in rows.split(",")):
            log(f"{shape} M={m}")
            calls, errors = variants(n, k, m, args.parts.split(","), args.tiny)
            for name, fns in calls.items():
                rec = {"what": "linear", "shape": shape, "n": n, "k": k, "m": m, "variant": name,
                       "ms": 1e3 * time_graph(fns, TINY_REPS if args.tiny else 20)}
                # the error is measured for the FP8 paths only, against the bf16 one
                emit({**rec, "rel_mse": errors[name]} if name in errors else not_measured(rec, "rel_mse"))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    write_records(args.out, "fp8_linear.jsonl")
    print(f"\n{env['device']}, torch {env['torch']}, {env['date_utc']}, commit {env['commit']}\n")
    print(table_of(RECORDS))


if __name__ == "__main__":
    main()
