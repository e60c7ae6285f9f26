#!/usr/bin/env python3
"""Scaled dot-product attention backends at FLUX.1's attention shapes: forward alone (a no-grad pass) and forward +
backward, per backend and input layout, with any backend that fails named and its error's first line.

    PYTHONPATH=. python benchmarks/attention_backends.py [--seq 4608 1536] [--iters 20] [--out DIR]

Shapes: batch 1, 24 heads of 128, sequence 4,608 (1024²: 4,096 image + 512 text tokens) and 1,536 (512²). Layouts:
``bhsd`` (contiguous [B, H, S, D]) and ``bshd`` (a [B, S, H, D] tensor transposed, as diffusers' FLUX attention hands
it over). Backends: flash, cuDNN, memory-efficient (``torch.nn.attention.sdpa_kernel``). Times are CUDA-event medians
in ms. Prints a JSON line per measurement and a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def make(seq: int, layout: str, grad: bool):
    shape = (1, 24, seq, 128) if layout == "bhsd" else (1, seq, 24, 128)
    out = []
    for _ in range(3):
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        t = t if layout == "bhsd" else t.transpose(1, 2)
        out.append(t.requires_grad_(grad))
    return out


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(backend: str, seq: int, layout: str, iters: int) -> dict:
    rec = {"what": "attention", "backend": backend, "seq": seq, "layout": layout,
           "device": torch.cuda.get_device_name()}
    torch.backends.cuda.enable_cudnn_sdp(backend == "cudnn")
    try:
        with sdpa_kernel([BACKENDS[backend]]):
            q, k, v = make(seq, layout, grad=False)
            with torch.no_grad():
                rec["forward_ms"] = timed(lambda: F.scaled_dot_product_attention(q, k, v), iters)
                ref = F.scaled_dot_product_attention(q, k, v)
            q, k, v = make(seq, layout, grad=True)
            g = torch.randn_like(ref)

            def step():
                out = F.scaled_dot_product_attention(q, k, v)
                torch.autograd.grad(out, (q, k, v), g)

            rec["forward_backward_ms"] = timed(step, iters)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4608, 1536])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_backends.py needs a CUDA device.")
    records = []
    for seq in args.seq:
        for layout in ("bhsd", "bshd"):
            for backend in BACKENDS:
                rec = measure(backend, seq, layout, args.iters)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_backends.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print("\n| seq | layout | backend | forward ms | forward+backward ms | out rel err | grad rel err | note |")
    print("|---|---|---|---|---|---|---|---|")
    def f(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else ""

    for r in records:
        print(f"| {r['seq']} | {r['layout']} | {r['backend']} | {f(r, 'forward_ms', '.3f')} | "
              f"{f(r, 'forward_backward_ms', '.3f')} | {f(r, 'out_rel_err', '.1e')} | {f(r, 'grad_rel_err', '.1e')} | "
              f"{r.get('error', '')} |")


if __name__ == "__main__":
    main()
