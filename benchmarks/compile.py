#!/usr/bin/env python3
"""Compile speed on a FLUX.1-dev-shaped source (random weights written to local safetensors) (issue 3).

    python benchmarks/compile.py --workdir DIR [--out DIR] [--budget 8GB] [--single-layers 38] [--layers 19]

Phase 1 writes the source (diffusers folder, bf16, random N(0, 0.02) weights, sharded) unless it is
already in the work dir. Phase 2 runs `squareq compile` on it through the library and measures wall
time, host RSS peak and GPU memory peaks. One JSON line per measurement, a markdown table last; the
progress log has a timestamp per block, so a run cut short still shows the per-block rate.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
SHARD_BYTES = 4 << 30


def emit(rec: dict, sink: list) -> None:
    sink.append(rec)
    print(json.dumps(rec), flush=True)


def write_source(folder: Path, config: dict, device: str) -> dict:
    """A diffusers model folder with random bf16 weights, written shard by shard."""
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    with torch.device("meta"):
        skeleton = FluxTransformer2DModel(**config)
    folder.mkdir(parents=True, exist_ok=True)
    skeleton.save_config(folder)
    g = torch.Generator(device=device).manual_seed(0)
    shard, shard_bytes, index, n = {}, 0, {}, 0
    start = time.perf_counter()
    total = 0

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"diffusion_pytorch_model-{n:05d}.safetensors"
            save_file(shard, str(folder / name))
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, t in skeleton.state_dict().items():
        if t.dim() >= 2:
            v = torch.empty(t.shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        elif "norm" in name and name.endswith(("weight", "scale")):
            v = torch.ones(t.shape, device=device, dtype=torch.bfloat16)
        else:
            v = torch.empty(t.shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        shard[name] = v.cpu()
        shard_bytes += v.numel() * 2
        total += v.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}))
    return {"params": total, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget", default="8GB")
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--single-layers", type=int, default=38)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--rounding", default="gptq")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/compile.py needs a CUDA device; run it on the GPU machine.")
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    from squareq.compiler import CompileOptions, compile_slab, open_source, parse_size

    records: list = []
    # The device gets a copy of the working tree without git history: pass SQUAREQ_COMMIT there.
    commit = os.environ.get("SQUAREQ_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    env = {"kind": "env", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit}
    emit(env, records)
    config = {**FLUX_DEV, "num_layers": args.layers, "num_single_layers": args.single_layers}
    src = args.workdir / f"flux-dev-shaped-{args.layers}-{args.single_layers}"
    if not (src / "config.json").is_file():
        emit({"kind": "source_written", **write_source(src, config, "cuda")}, records)

    out = args.workdir / "flux.slab"
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()

    def progress(line: str) -> None:
        if "calibrating" in line or "reusing" in line:
            print(f"[{time.perf_counter() - start:8.1f}s] {line}", flush=True)

    manifest = compile_slab(open_source(str(src)), out, CompileOptions(
        budget=parse_size(args.budget), device="cuda", calib_samples=args.samples, rounding=args.rounding,
        overwrite=True, resume=(out.parent / f"{out.name}.state").exists()), progress=progress)
    wall = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.iterdir())
    rungs: dict = {}
    for layer in manifest.layers:
        rungs[layer.spec.bits] = rungs.get(layer.spec.bits, 0) + 1
    weights = sum(layer.shape[0] * layer.shape[1] for layer in manifest.layers)
    layer_bytes = sum(t.nbytes for layer in manifest.layers for t in layer.tensors.values())
    rec = {"kind": "compile", "blocks": len(manifest.blocks), "layers": len(manifest.layers), "wall_s": wall,
           "slab_bytes": size, "bits_per_layer_weight": 8 * layer_bytes / weights, "rungs": rungs,
           "host_rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
           "vram_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
           "vram_peak_reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
           "calibrate_s": manifest.calibration["calibrate_seconds"], "target_s": 900}
    emit(rec, records)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print("\n| device | blocks | layers | wall s | target s | slab GB | bits/w | host RSS peak GB | VRAM peak alloc / reserved GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {env['device']} | {rec['blocks']} | {rec['layers']} | {wall:.0f} | 900 | {size / 1e9:.2f} | "
          f"{rec['bits_per_layer_weight']:.2f} | {rec['host_rss_peak_gb']:.1f} | "
          f"{rec['vram_peak_allocated_gb']:.1f} / {rec['vram_peak_reserved_gb']:.1f} |")


if __name__ == "__main__":
    main()
