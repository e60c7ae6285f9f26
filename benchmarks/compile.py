#!/usr/bin/env python3
"""Compile speed on a FLUX.1-dev-shaped pipeline folder (random weights written to local safetensors) (issues 3, 15).

    python benchmarks/compile.py --workdir DIR [--out DIR] [--budget 8GB] [--single-layers 38] [--layers 19]
        [--samples N] [--phase all|source|compile]

Phase 1 writes the source unless it is already in the work dir: a FluxPipeline folder whose transformer (FLUX.1-dev's
config, 11.9 B parameters), VAE (FLUX.1's AutoencoderKL config), CLIP-L and T5-XXL text encoders have FLUX.1-dev's
shapes, with random bf16 N(0, 0.02) weights written shard by shard, and the built-in tiny tokenizers (their ids fit
both vocabularies). Phase 2 does what `squareq compile FOLDER --device cuda` does with its defaults: the built-in
photographs and captions encoded by that VAE and those text encoders (512 px, 512 T5 tokens), then the compile; it
measures both, wall time, host RSS peak and GPU memory peaks. Random weights measure speed, not quality. One JSON line
per measurement, a markdown table last; the progress log has a timestamp per block, so a run cut short still shows
the per-block rate (and a rerun resumes it).
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
# black-forest-labs/FLUX.1-dev vae/config.json
FLUX_VAE = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                act_fn="silu", latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False, force_upcast=True)
# openai/clip-vit-large-patch14's text tower and google/t5-v1_1-xxl's encoder (FLUX.1's text_encoder, text_encoder_2)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, tie_word_embeddings=False)
SHARD_BYTES = 4 << 30


def emit(rec: dict, sink: list) -> None:
    sink.append(rec)
    print(json.dumps(rec), flush=True)


def write_random(folder: Path, skeleton, device: str, weights: str, seed: int = 0) -> int:
    """``skeleton`` (on the meta device) as a model folder: its config and random bf16 weights in 4 GB safetensors
    shards with their index (``weights``: the index's stem, e.g. ``diffusion_pytorch_model``). Returns parameters."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (skeleton.save_config if hasattr(skeleton, "save_config") else skeleton.config.save_pretrained)(folder)
    g = torch.Generator(device=device).manual_seed(seed)
    shard, shard_bytes, index, n, total = {}, 0, {}, 0, 0
    persistent = skeleton.state_dict(keep_vars=True)
    tensors = dict(skeleton.named_parameters())  # tied weights once, under their first name
    tensors.update({k: v for k, v in skeleton.named_buffers() if k in persistent})

    def flush():
        nonlocal shard, shard_bytes, n
        if shard:
            name = f"{weights}-{n:05d}.safetensors"
            save_file(shard, str(folder / name))
            index.update({k: name for k in shard})
            shard, shard_bytes, n = {}, 0, n + 1

    for name, t in tensors.items():
        if "norm" in name and name.endswith(("weight", "scale")) or name.endswith("layer_norm.weight"):
            v = torch.ones(t.shape, device=device, dtype=torch.bfloat16)
        else:
            v = torch.empty(t.shape, device=device, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        shard[name] = v.cpu()
        shard_bytes += v.numel() * 2
        total += v.numel()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (folder / f"{weights}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": index}))
    return total


def write_source(folder: Path, config: dict, device: str) -> dict:
    """The FLUX.1-dev-shaped pipeline folder: the tiny pipeline saved for its index, scheduler and tokenizers, then
    its transformer, VAE and text encoders replaced by FLUX.1-dev-shaped random ones."""
    import shutil

    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from squareq.models import write_tiny_flux_pipeline

    start = time.perf_counter()
    write_tiny_flux_pipeline(folder)
    params = {}
    with torch.device("meta"):
        parts = {"transformer": (FluxTransformer2DModel(**config), "diffusion_pytorch_model"),
                 "vae": (AutoencoderKL(**FLUX_VAE), "diffusion_pytorch_model"),
                 "text_encoder": (CLIPTextModel(CLIPTextConfig(**CLIP_L)), "model"),
                 "text_encoder_2": (T5EncoderModel(T5Config(**T5_XXL)), "model")}
    for i, (part, (skeleton, weights)) in enumerate(parts.items()):
        shutil.rmtree(folder / part)
        params[part] = write_random(folder / part, skeleton, device, weights, seed=i)
    return {"params": params, "seconds": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget", default="8GB")
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--single-layers", type=int, default=38)
    ap.add_argument("--samples", type=int, default=None, help="calibration samples (default: the compiler's)")
    ap.add_argument("--rounding", default="gptq")
    ap.add_argument("--phase", choices=("all", "source", "compile"), default="all")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/compile.py needs a CUDA device; run it on the GPU machine.")
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    from squareq.compiler import CompileOptions, compile_slab, open_source, parse_size
    from squareq.train.calibration import calibration_images

    records: list = []
    # The device gets a copy of the working tree without git history: pass SQUAREQ_COMMIT there.
    commit = os.environ.get("SQUAREQ_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    env = {"kind": "env", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit}
    emit(env, records)
    config = {**FLUX_DEV, "num_layers": args.layers, "num_single_layers": args.single_layers}
    src = args.workdir / f"flux-dev-pipeline-{args.layers}-{args.single_layers}"
    if not (src / "model_index.json").is_file():
        emit({"kind": "source_written", **write_source(src, config, "cuda")}, records)
    if args.phase == "source":
        return

    out = args.workdir / "flux.slab"
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()

    def progress(line: str) -> None:
        if "calibrating" in line or "reusing" in line or "encoding" in line:
            print(f"[{time.perf_counter() - start:8.1f}s] {line}", flush=True)

    source = open_source(str(src))
    opts = CompileOptions(budget=parse_size(args.budget), device="cuda", calib_samples=args.samples,
                          rounding=args.rounding, overwrite=True, resume=(out.parent / f"{out.name}.state").exists())
    opts.calib_images = calibration_images(source, device="cuda", limit=args.samples or 32, echo=progress)
    encode_s = time.perf_counter() - start
    emit({"kind": "encode", "seconds": encode_s, "images": opts.calib_images.description["images"],
          "vram_peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}, records)
    manifest = compile_slab(source, out, opts, progress=progress)
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
           "encode_s": encode_s, "calibrate_s": manifest.calibration["calibrate_seconds"],
           "write_s": wall - encode_s - manifest.calibration["calibrate_seconds"],
           "calibration": {k: manifest.calibration.get(k) for k in ("kind", "source", "samples", "heldout_samples",
                                                                    "resolution", "text_tokens", "latent_shape")},
           "resumed": opts.resume, "target_s": 900}
    emit(rec, records)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "compile.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print("\n| device | blocks | layers | wall s (encode s) | target s | slab GB | bits/w | host RSS peak GB | "
          "VRAM peak alloc / reserved GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {env['device']} | {rec['blocks']} | {rec['layers']} | {wall:.0f} ({encode_s:.0f}) | 900 | {size / 1e9:.2f} | "
          f"{rec['bits_per_layer_weight']:.2f} | {rec['host_rss_peak_gb']:.1f} | "
          f"{rec['vram_peak_allocated_gb']:.1f} / {rec['vram_peak_reserved_gb']:.1f} |")


if __name__ == "__main__":
    main()
