#!/usr/bin/env python3
"""Dequantization throughput of the Triton kernel on FLUX shapes, next to a measured copy (issue 2).

    python benchmarks/dequant.py [--out DIR] [--quick] [--tiny]

Everything printed is measured in this run. For each weight shape (out N, in K) and format it

* checks that ``triton_dequantize_into`` equals the torch reference ``squareq.quant.dequantize``
  bit for bit on fresh random weights, with the output poisoned with NaN first, for every tile;
* times the kernel on independent weight copies and output buffers whose total exceeds the L2
  cache (rotating among them), as a CUDA graph of back-to-back launches timed with CUDA events
  (median over replays), for the default tile and a sweep of tiles;
* counts bytes as every stored tensor read once plus ``N*K*2`` bytes of bf16 written, and reports
  GB/s and the fraction of a device-to-device copy's bandwidth (>= 1 GiB buffer, bytes read plus
  written, median of CUDA-event timings) measured in the same run.

Peer rows: bitsandbytes NF4 ``dequantize_4bit`` (blocksize 64) when bitsandbytes imports, and a
plain bf16 ``copy_`` of an N x K weight, timed the same way as the kernel.

Output: one JSON object per line per measurement, then a markdown table. ``--out DIR`` also writes
the JSON lines to ``DIR/dequant.jsonl``.

``--tiny``: one 64 x 256 shape, the three target formats and a rotated one, the default tile, a 16 MiB copy reference,
one call per replay and two replays. On a CPU the kernel runs where it runs there (Triton's interpreter with
``TRITON_INTERPRET=1``), eagerly and timed by the host's clock; CUDA graphs and bitsandbytes are GPU-only here and
skipped (said on stderr).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from common import RECORDS, Column, emit, log, not_measured, table, write_records  # noqa: E402

SHAPES = [(3072, 3072), (12288, 3072), (3072, 15360)]  # (out N, in K) of FLUX linear layers
COPY_BYTES = 1 << 30  # the copy reference moves a 1 GiB buffer (2 GiB read + written)
TARGET = 0.70  # fraction of copy bandwidth asked for in issue 2

# (label, QuantSpec kwargs, smoothing): the three formats of the target, then two extra rows.
FORMATS = [
    ("W4 g64 asym", dict(bits=4, group_size=64, symmetric=False), False),
    ("W6 g64 asym", dict(bits=6, group_size=64, symmetric=False), False),
    ("W8 g64 asym", dict(bits=8, group_size=64, symmetric=False), False),
    ("W4 g64 asym +smooth", dict(bits=4, group_size=64, symmetric=False, smooth=True), True),
    ("W4 g128 sym", dict(bits=4, group_size=128, symmetric=True), False),
    # Hadamard-rotated (QuantSpec.rotate): the butterfly on the fp32 tile, launched with fp fusion off
    ("W4 g64 asym H", dict(bits=4, group_size=64, symmetric=False, rotate=True), False),
    ("W8 g64 asym H", dict(bits=8, group_size=64, symmetric=False, rotate=True), False),
    ("W4 g128 sym H", dict(bits=4, group_size=128, symmetric=True, rotate=True), False),
]
TARGET_FORMATS = {"W4 g64 asym", "W6 g64 asym", "W8 g64 asym"}
TINY_SHAPES = [(64, 256)]
TINY_FORMATS = (*TARGET_FORMATS, "W4 g64 asym H")
TINY_COPY_BYTES = 16 << 20
TIMING = {"min_calls": 32, "replays": 15}  # calls per replay (at least) and replays of time_calls; --tiny: fewer

# (BLOCK_N, BLOCK_K, num_warps) tried besides the default; BLOCK_K must be a multiple of the group.
SWEEP_TILES = [
    (32, 256, 4),
    (16, 256, 4),
    (16, 512, 4),
    (8, 1024, 4),
    (32, 512, 4),
    (8, 512, 2),
    (16, 1024, 8),
    (32, 512, 8),
    (64, 256, 8),
    (64, 128, 4),
]

# ----------------------------------------------------------------------------------------- timing


def _device(torch) -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sleep_cycles(torch, ms: float) -> int:
    clock_mhz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) / 1000 or 2000
    return int(ms * 1e3 * clock_mhz)


def time_calls(torch, fns) -> dict:
    """Median time of one call, running ``fns`` (one callable per independent buffer set) round robin.

    A replay is ``calls`` back-to-back launches cycling through ``fns``, captured as a CUDA graph
    (falling back to plain stream launches if capture fails). Before each replay the stream is
    held by a short spin kernel so that the launches are queued before the timed region starts;
    ``starved`` counts replays where the host had not finished queueing when the GPU got there. On a CPU
    (``--tiny``) the calls run eagerly, timed by the host's clock.
    """
    min_calls, replays = TIMING["min_calls"], TIMING["replays"]
    calls = [fns[i % len(fns)] for i in range(len(fns) * max(1, math.ceil(min_calls / len(fns))))]
    for f in fns:  # warm up: compile, load modules, create handles
        f()
    if not torch.cuda.is_available():
        return _time_on_host(calls, replays)
    torch.cuda.synchronize()
    method, g = "stream", None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in calls:
                f()
        method = "cuda_graph"
    except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager launches
        torch.cuda.synchronize()
        g, method = None, f"stream (graph capture failed: {type(e).__name__}: {str(e)[:120]})"

    def run():
        if g is not None:
            g.replay()
        else:
            for f in calls:
                f()

    run()
    torch.cuda.synchronize()
    spin = _sleep_cycles(torch, 0.3 if g is not None else 3.0)
    times, starved = [], 0
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)
        a.record()
        run()
        b.record()
        if a.query():  # the GPU reached the start event before the host finished queueing
            starved += 1
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "calls_per_replay": len(calls),
        "replays": replays,
        "timing": method,
        "starved_replays": starved,
    }


def _time_on_host(calls, replays: int) -> dict:
    """time_calls' figures for calls run eagerly on the host, timed by its clock."""
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        for f in calls:
            f()
        times.append(1e3 * (time.perf_counter() - start) / len(calls))
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "calls_per_replay": len(calls), "replays": replays, "timing": "host clock (no CUDA device)",
            "starved_replays": 0}


def measure_copy(torch, tag: str, nbytes: int = COPY_BYTES) -> dict:
    """Device-to-device copy bandwidth of an ``nbytes`` (>= 1 GiB but with --tiny) bf16 buffer, bytes read +
    written (on a CPU: host memory, timed by the host's clock)."""
    src = torch.randn(nbytes // 2, device=_device(torch), dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(torch)
    times = []
    spin = _sleep_cycles(torch, 0.3) if torch.cuda.is_available() else 0
    for _ in range(TIMING["replays"] + 10):
        if not torch.cuda.is_available():
            start = time.perf_counter()
            dst.copy_(src)
            times.append(1e3 * (time.perf_counter() - start))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(spin)  # queue the copy before the start event fires
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    ok = torch.equal(dst, src)
    ms = statistics.median(times)
    moved = 2 * nbytes
    del src, dst
    _free(torch)
    return emit({
        "kind": "copy", "tag": tag, "buffer_bytes": nbytes, "bytes_moved": moved, "ms": ms,
        "ms_min": min(times), "ms_max": max(times), "repeats": len(times), "gbps": moved / ms / 1e6,
        "copy_matches_source": ok, "timing": "cuda_events" if torch.cuda.is_available() else "host clock",
    })


# ------------------------------------------------------------------------------------ the kernel


def n_copies(bytes_per_set: int, min_total: int) -> int:
    return max(2, math.ceil(min_total / bytes_per_set))


def bench_shape_format(torch, shape, label, spec_kwargs, smooth, tiles, copy_gbps, min_ws, check_tiles):
    from squareq.kernels.triton_dequant import default_tile, triton_dequantize_into
    from squareq.quant import QuantSpec, dequantize, quantize

    n, k = shape
    spec = QuantSpec(**spec_kwargs)

    def make(seed: int):
        gen = torch.Generator(device=_device(torch)).manual_seed(seed)
        w = torch.randn(n, k, device=_device(torch), generator=gen) * 0.02
        s = (torch.rand(k, device=_device(torch), generator=gen) + 0.5) if smooth else None
        return quantize(w, spec, s)

    default = default_tile(spec.group_size, k, spec.bits, spec.smooth)  # what tile=None launches
    tiles = [default] + [t for t in tiles if t != default and t[1] % spec.group_size == 0]

    # Exactness on fresh random data (a seed not used for timing), every tile, NaN-poisoned output.
    qw = make(1_000_003 + 7 * n + k)
    ref = dequantize(qw).view(torch.int16)
    exact = {}
    for t in tiles if check_tiles else [default]:
        out = torch.full((n, k), float("nan"), device=_device(torch), dtype=torch.bfloat16)
        triton_dequantize_into(out, qw, tile=None if t == default else t)
        _sync(torch)
        exact[t] = bool(torch.equal(out.view(torch.int16), ref))
    emit({"kind": "check", "shape": [n, k], "format": label, "tiles": [list(t) for t in exact],
          "bit_exact": [exact[t] for t in exact], "all_bit_exact": all(exact.values())})
    del qw, ref

    # Independent copies (weights and outputs) whose total is well past the L2 cache.
    probe = make(0)
    bytes_read = probe.nbytes
    bytes_written = n * k * 2
    copies = n_copies(bytes_read + bytes_written, min_ws)
    sets = [probe] + [make(i) for i in range(1, copies)]
    outs = [torch.empty(n, k, device=_device(torch), dtype=torch.bfloat16) for _ in sets]
    moved = bytes_read + bytes_written
    results = []
    for t in tiles:
        arg = None if t == default else t
        fns = [(lambda o=o, q=q, arg=arg: triton_dequantize_into(o, q, tile=arg)) for o, q in zip(outs, sets)]
        r = time_calls(torch, fns)
        gbps = moved / r["ms"] / 1e6
        rec = emit({
            "kind": "dequant" if t == default else "sweep", "shape": [n, k], "format": label,
            "tile": list(t), "default_tile": t == default, "bytes_read": bytes_read,
            "bytes_written": bytes_written, "copies": copies, "working_set_bytes": copies * moved,
            "gbps": gbps, "frac_copy": gbps / copy_gbps, "bit_exact": exact.get(t), **r,
        })
        results.append(rec)
    del sets, outs, probe
    _free(torch)
    return results


def bench_resident_copy(torch, shape, copy_gbps, min_ws):
    n, k = shape
    moved = 2 * n * k * 2
    copies = n_copies(moved, min_ws)
    srcs = [torch.randn(n, k, device=_device(torch)).to(torch.bfloat16) for _ in range(copies)]
    dsts = [torch.empty_like(s) for s in srcs]
    r = time_calls(torch, [(lambda d=d, s=s: d.copy_(s)) for d, s in zip(dsts, srcs)])
    ok = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    gbps = moved / r["ms"] / 1e6
    rec = emit({"kind": "bf16_copy", "shape": [n, k], "format": "bf16 copy_ (N x K)", "bytes_read": n * k * 2,
                "bytes_written": n * k * 2, "copies": copies, "working_set_bytes": copies * moved, "gbps": gbps,
                "frac_copy": gbps / copy_gbps, "copy_matches_source": ok, **r})
    del srcs, dsts
    _free(torch)
    return rec


def bench_bnb(torch, shape, copy_gbps, min_ws, bnb):
    import bitsandbytes.functional as F

    n, k = shape
    sets, outs = [], []
    packed, state = None, None
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w0 = None
    while True:
        w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
        bytes_read = packed.numel() * packed.element_size() + state.absmax.numel() * state.absmax.element_size()
        if w0 is None:
            w0 = w
        sets.append((packed, state))
        outs.append(torch.empty(n, k, device="cuda", dtype=torch.bfloat16))
        if len(sets) >= n_copies(bytes_read + n * k * 2, min_ws):
            break
    # Sanity: it writes every element and approximates the weight (NF4 is not bit-comparable to ours).
    out = torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
    F.dequantize_4bit(sets[0][0], sets[0][1], out=out)
    finite = bool(torch.isfinite(out).all())
    rel = float(((out.float() - w0.float()).pow(2).sum() / w0.float().pow(2).sum()).sqrt())
    fns = [(lambda p=p, s=s, o=o: F.dequantize_4bit(p, s, out=o)) for (p, s), o in zip(sets, outs)]
    r = time_calls(torch, fns)
    moved = bytes_read + n * k * 2
    gbps = moved / r["ms"] / 1e6
    rec = emit({"kind": "peer_bnb_nf4", "shape": [n, k], "format": "bnb NF4 b64 (dequantize_4bit)",
                "bitsandbytes": bnb.__version__, "bytes_read": bytes_read, "bytes_written": n * k * 2,
                "copies": len(sets), "working_set_bytes": len(sets) * moved, "gbps": gbps,
                "frac_copy": gbps / copy_gbps, "all_written": finite, "rel_l2_err_vs_weight": rel, **r})
    del sets, outs, out, w0
    torch.cuda.empty_cache()
    return rec


# ------------------------------------------------------------------------------------------ main


def _fmt_tile(t):
    return f"{t[0]}x{t[1]} w{t[2]}"


def markdown(copy_gbps, dev_name):
    def same(r, kinds):  # the records of r's shape and format among kinds
        return [s for s in RECORDS if s["kind"] in kinds and s["shape"] == r["shape"] and s["format"] == r["format"]]

    def best(r):  # the fastest tile of a dequant row (its own or a sweep's); None for the other rows
        return max(same(r, ("dequant", "sweep")), key=lambda s: s["gbps"]) if r["kind"] == "dequant" else None

    def exact(r):
        if r["kind"] != "dequant":
            return "n/a"
        checks = same(r, ("check",))
        return "yes" if checks and all(c["all_bit_exact"] for c in checks) else "NO"

    columns = [
        Column("shape N x K", "shape", lambda r: f"{r['shape'][0]} x {r['shape'][1]}"), Column("format", "format"),
        Column("MB read", "bytes_read", lambda r: f"{r['bytes_read'] / 1e6:.2f}"),
        Column("MB written", "bytes_written", lambda r: f"{r['bytes_written'] / 1e6:.2f}"),
        Column("us/call", "ms", lambda r: f"{r['ms'] * 1e3:.1f}"), Column("GB/s", "gbps", ".0f"),
        Column("% of copy", "frac_copy", lambda r: f"{100 * r['frac_copy']:.0f}%"),
        Column("default tile", None, lambda r: _fmt_tile(r["tile"]) if r["kind"] == "dequant" else "", also=("kind",)),
        Column("best sweep tile", None, also=("kind",),
               show=lambda r: "" if best(r) is None else _fmt_tile(best(r)["tile"])),
        Column("best GB/s (% copy)", None, also=("kind",), show=lambda r: "" if best(r) is None else
               f"{best(r)['gbps']:.0f} ({100 * best(r)['frac_copy']:.0f}%)"),
        Column("bit-exact", None, exact, also=("kind",))]
    timing = "CUDA graph of back-to-back launches over copies that exceed L2" if dev_name != "cpu" else \
        "eager calls timed by the host's clock"
    return (f"Dequant throughput on {dev_name}; copy reference {copy_gbps:.0f} GB/s (read + written, "
            f"{RECORDS[1]['buffer_bytes'] / 2**30:g} GiB buffer). Bytes = stored tensors read + N*K*2 written; time = "
            f"median per call, {timing}.\n\n"
            + table(RECORDS, columns, where={"kind": ["dequant", "bf16_copy", "peer_bnb_nf4"]}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder to write dequant.jsonl into")
    ap.add_argument("--quick", action="store_true", help="first shape only and three tiles (a smoke run)")
    ap.add_argument("--tiny", action="store_true",
                    help="one small shape, four formats, the default tile; runs on a CPU")
    ap.add_argument("--min-working-set-mb", type=float, default=400.0,
                    help="bytes the rotated copies of one measurement span at least (default 400 MB)")
    ap.add_argument("--no-sweep", action="store_true", help="time the default tile only")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available() and not args.tiny:
        print("benchmarks/dequant.py needs a CUDA GPU and torch sees none, so nothing was measured (--tiny runs on a "
              "CPU).", file=sys.stderr)
        return 2
    torch.backends.cuda.enable_cudnn_sdp(False)
    import triton

    cuda = torch.cuda.is_available()
    dev_name = torch.cuda.get_device_name(0) if cuda else "cpu"
    min_ws = 1 if args.tiny else int(args.min_working_set_mb * 1e6)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) if cuda else 0
    if args.tiny:
        TIMING.update(min_calls=1, replays=2)
    with open(os.path.join(ROOT, "squareq", "kernels", "triton_dequant.py"), "rb") as f:
        kernel_sha = hashlib.sha256(f.read()).hexdigest()[:12]
    env = {"kind": "env", "device": dev_name, "kernel_sha256_12": kernel_sha, "torch": torch.__version__,
           "triton": triton.__version__, "python": sys.version.split()[0], "min_working_set_bytes": min_ws,
           "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if cuda:
        env.update(l2_bytes=l2, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    emit(env if cuda else not_measured(env, "l2_bytes", "sms"))  # the GPU's cache and multiprocessors
    if l2 and min_ws < 4 * l2:
        log(f"note: working set {min_ws / 1e6:.0f} MB is under 4x the {l2 / 1e6:.0f} MB L2.")

    copy_bytes = TINY_COPY_BYTES if args.tiny else COPY_BYTES
    copies = [measure_copy(torch, "start-1", copy_bytes), measure_copy(torch, "start-2", copy_bytes)]
    copy_gbps = max(c["gbps"] for c in copies)
    emit({"kind": "copy_reference", "gbps": copy_gbps, "from": [c["tag"] for c in copies],
          "rule": "the higher of two copy measurements taken before the kernels"})

    shapes = TINY_SHAPES if args.tiny else SHAPES[:1] if args.quick else SHAPES
    formats = [f for f in FORMATS if f[0] in TINY_FORMATS] if args.tiny else FORMATS
    tiles = [] if args.no_sweep or args.tiny else (SWEEP_TILES[:3] if args.quick else SWEEP_TILES)
    bnb = None
    if not cuda:
        log("no CUDA device: CUDA graphs and the bitsandbytes NF4 peer rows skipped (GPU-only here); "
            "the kernel runs eagerly")
    else:
        try:
            import bitsandbytes as bnb
        except Exception as e:  # noqa: BLE001 - report any import failure and carry on
            log(f"bitsandbytes peer rows skipped: import bitsandbytes failed ({type(e).__name__}: {e}).")
    t0 = time.time()
    for shape in shapes:
        for label, kw, smooth in formats:
            bench_shape_format(torch, shape, label, kw, smooth, tiles, copy_gbps, min_ws, check_tiles=True)
        if bnb is not None:
            try:
                bench_bnb(torch, shape, copy_gbps, min_ws, bnb)
            except Exception as e:  # noqa: BLE001
                log(f"bitsandbytes peer row for {shape} skipped: {type(e).__name__}: {e}")
        bench_resident_copy(torch, shape, copy_gbps, min_ws)
    end_copy = measure_copy(torch, "end", copy_bytes)
    emit({"kind": "drift", "copy_end_over_reference": end_copy["gbps"] / copy_gbps, "kernel_seconds": time.time() - t0})
    return summary(args, copy_gbps, dev_name)


def summary(args, copy_gbps: float, dev_name: str) -> int:
    """The targets met or not, the JSON lines to --out, the table; exit status 1 when a kernel was not bit-exact."""
    main_rows = [r for r in RECORDS if r["kind"] == "dequant" and r["format"] in TARGET_FORMATS]
    failing = [f"{r['format']} {r['shape'][0]}x{r['shape'][1]} ({100 * r['frac_copy']:.0f}%)"
               for r in main_rows if r["frac_copy"] < TARGET]
    inexact = [f"{c['format']} {c['shape'][0]}x{c['shape'][1]}" for c in RECORDS
               if c["kind"] == "check" and not c["all_bit_exact"]]
    emit({"kind": "summary", "copy_gbps": copy_gbps, "target_frac": TARGET,
          "all_targets_met": not failing, "below_target": failing, "inexact": inexact})
    write_records(args.out, "dequant.jsonl")
    print()
    print(markdown(copy_gbps, dev_name))
    if failing:
        print(f"\nBelow {int(TARGET * 100)}% of copy bandwidth: {', '.join(failing)}.")
    if inexact:
        print(f"\nNOT bit-exact: {', '.join(inexact)}.")
    return 1 if inexact else 0


if __name__ == "__main__":
    sys.exit(main())
