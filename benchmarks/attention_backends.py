#!/usr/bin/env python3
"""Scaled dot-product attention backends at FLUX.1's attention shapes: forward alone (a no-grad pass) and forward +
backward, per backend and input layout, with any backend that fails named and its error's first line.

    PYTHONPATH=. python benchmarks/attention_backends.py [--seq 4608 1536] [--iters 20] [--out DIR] [--tiny]

Shapes: batch 1, 24 heads of 128, sequence 4,608 (1024²: 4,096 image + 512 text tokens) and 1,536 (512²). Layouts:
``bhsd`` (contiguous [B, H, S, D]) and ``bshd`` (a [B, S, H, D] tensor transposed, as diffusers' FLUX attention hands
it over). Backends: flash, cuDNN, memory-efficient (``torch.nn.attention.sdpa_kernel``). Times are CUDA-event medians
in ms. Prints a JSON line per measurement and a markdown table last. ``--tiny``: 2 heads of 16, a 64-token sequence
and 3 iterations; without a GPU the backends above are skipped (each says so on stderr) and torch's math backend,
the reference, runs through the same measuring, timed by the host's clock.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RECORDS, Column, device_name, emit, log, table, write_records  # noqa: E402

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
CPU_BACKENDS = {"math": SDPBackend.MATH}  # what runs without a GPU: the reference the GPU backends are checked with
HEADS, HEAD_DIM = 24, 128
TINY_HEADS, TINY_HEAD_DIM = 2, 16


def make(seq: int, layout: str, grad: bool, heads: int, dim: int, device: str):
    shape = (1, heads, seq, dim) if layout == "bhsd" else (1, seq, heads, dim)
    out = []
    for _ in range(3):
        t = torch.randn(shape, device=device, dtype=torch.bfloat16)
        t = t if layout == "bhsd" else t.transpose(1, 2)
        out.append(t.requires_grad_(grad))
    return out


def timed(fn, iters: int) -> float:
    """Median ms of ``fn`` after 3 warm-up calls: CUDA events on a GPU, the host's clock on a CPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(backend: str, seq: int, layout: str, args) -> dict:
    rec = {"what": "attention", "backend": backend, "seq": seq, "layout": layout, "device": device_name()}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (args.heads, args.head_dim, device)
    torch.backends.cuda.enable_cudnn_sdp(backend == "cudnn")
    try:
        with sdpa_kernel([{**BACKENDS, **CPU_BACKENDS}[backend]]):
            q, k, v = make(seq, layout, False, *shape)
            with torch.no_grad():
                rec["forward_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v), args.iters)
                ref = F.scaled_dot_product_attention(q, k, v)
            q, k, v = make(seq, layout, True, *shape)
            g = torch.randn_like(ref)

            def step():
                out = F.scaled_dot_product_attention(q, k, v)
                torch.autograd.grad(out, (q, k, v), g)

            rec["forward_backward_ms"] = timed(step, args.iters)
            out = F.scaled_dot_product_attention(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), g)
            with sdpa_kernel([SDPBackend.MATH]):  # the reference: math in fp32
                q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
                out32 = F.scaled_dot_product_attention(q32, k32, v32)
                ref_grads = torch.autograd.grad(out32, (q32, k32, v32), g.float())
            rec["out_rel_err"] = ((out.float() - out32).norm() / out32.norm()).item()
            rec["grad_rel_err"] = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(grads, ref_grads))
            rec["finite"] = bool(all(torch.isfinite(t).all() for t in (out, *grads)))
    except Exception as exc:  # a backend that refuses or fails: say which and why
        rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(False)
    return rec


COLUMNS = [Column("seq", "seq"), Column("layout", "layout"), Column("backend", "backend"),
           Column("forward ms", "forward_ms", ".3f"), Column("forward+backward ms", "forward_backward_ms", ".3f"),
           Column("out rel err", "out_rel_err", ".1e"), Column("grad rel err", "grad_rel_err", ".1e"),
           Column("note", None, lambda r: r.get("error", ""))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4608, 1536])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="2 heads of 16, 64 tokens, 3 iterations; runs on a CPU")
    args = ap.parse_args()
    args.heads, args.head_dim = (TINY_HEADS, TINY_HEAD_DIM) if args.tiny else (HEADS, HEAD_DIM)
    if args.tiny:
        args.seq, args.iters = [64], 3
    if torch.cuda.is_available():
        backends = list(BACKENDS)
    elif args.tiny:
        backends = list(CPU_BACKENDS)
        log(f"no CUDA device: {', '.join(BACKENDS)} attention skipped (GPU kernels); {', '.join(backends)} runs")
    else:
        sys.exit("benchmarks/attention_backends.py needs a CUDA device (or --tiny, which runs math on a CPU).")
    for seq in args.seq:
        for layout in ("bhsd", "bshd"):
            for backend in backends:
                emit(measure(backend, seq, layout, args))
    write_records(args.out, "attention_backends.jsonl")
    print()
    print(table(RECORDS, COLUMNS, where={"what": "attention"}))


if __name__ == "__main__":
    main()
