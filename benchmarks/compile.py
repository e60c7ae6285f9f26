#!/usr/bin/env python3
"""Compile speed and GPU memory on a FLUX.1-dev- or FLUX.2-dev-shaped source (random weights written to local
safetensors) (issues 3, 15, 23).

    python benchmarks/compile.py --workdir DIR [--out DIR] [--model flux1|flux2] [--budget 8GB]
        [--vram-budgets free,8GB] [--host-budget 32GB] [--layers N] [--single-layers N] [--samples N]
        [--no-rotation] [--phase all|source|compile] [--tiny]

Phase 1 writes the source unless it is already in the work dir. flux1: a FluxPipeline folder whose transformer
(FLUX.1-dev's config, 11.9 B parameters), VAE (FLUX.1's AutoencoderKL config), CLIP-L and T5-XXL text encoders have
FLUX.1-dev's shapes, with random bf16 N(0, 0.02) weights written shard by shard, and the built-in tiny tokenizers
(their ids fit both vocabularies). flux2: a FLUX.2-dev-shaped transformer folder alone (its 24B Mistral encoder is
not written; the calibration set is random latents and text states of the real shapes). Phase 2 does what
`squareq compile FOLDER --device cuda [--vram-budget B] [--host-budget H]` does with its defaults, once per budget in
``--vram-budgets``: for flux1 the built-in photographs and captions encoded by that VAE and those text encoders (512 px,
512 T5 tokens), then the compile; it measures wall time, host RSS peak (each compile's own on Linux, where the peak
can be reset; else the process's so far), GPU memory peaks and the host plan (which parts waited in pinned memory or
were spilled to disk), and whether the slabs of the different budgets have the same tensor bytes. Random weights
measure speed and memory, not quality. One JSON line per measurement, a markdown table last; the progress log has a
timestamp per block, so a run cut short still shows the per-block rate (and a rerun resumes it).

``--tiny``: the source is tiny (flux1: the built-in tiny-flux pipeline folder; flux2: a two-block FLUX.2 with random
weights), calibrated on 4 samples at 64 px and compiled within 2 MB by the compiler's search in its cheapest form
(``common.TINY_SEARCH``), on the CPU when there is no GPU (seconds; the GPU memory figures are null there, not
measured).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import re
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import NOT_MEASURED, TINY_SEARCH, Column, device_name, git_commit, log, not_measured, table, write_records  # noqa: E402

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
LAYER_LINE = re.compile(r"^block \d+/\d+ \S+: [^ ]+$")
TINY_RESOLUTION, TINY_TOKENS = 64, 16


def emit(rec: dict, sink: list) -> None:
    sink.append(rec)
    print(json.dumps(rec, sort_keys=True), flush=True)


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


# black-forest-labs/FLUX.2-dev transformer/config.json (diffusers Flux2Transformer2DModel's defaults)
FLUX2_DEV = dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                 num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True)
TINY_FLUX2 = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=16,
                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)


def write_flux2_source(folder: Path, config: dict, layers: int, single_layers: int, device: str) -> dict:
    """A FLUX.2-dev-shaped (or, --tiny, a tiny) transformer folder (random bf16 weights); FLUX.2's Mistral encoder is
    not written, so its calibration set is made of random latents and text states of the real shapes (speed and
    memory, not quality)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    start = time.perf_counter()
    with torch.device("meta"):
        skeleton = Flux2Transformer2DModel(**{**config, "num_layers": layers, "num_single_layers": single_layers})
    params = write_random(folder, skeleton, device, "diffusion_pytorch_model")
    return {"params": {"transformer": params}, "seconds": time.perf_counter() - start}


def random_calibration_set(images: int, latent: tuple[int, int, int], text: tuple[int, int]):
    """``images`` 'images' of N(0, 1) latents and captions of N(0, 1) text states, at the shapes the real encoders
    give."""
    import torch

    from squareq.models.calibration_set import CalibrationSet

    g = torch.Generator().manual_seed(0)
    return CalibrationSet([{"latents": torch.randn(latent, generator=g)} for _ in range(images)],
                          [{"prompt_embeds": torch.randn(text, generator=g)} for _ in range(images)],
                          {"kind": "images", "source": "random latents and text states (speed and memory only)",
                           "images": images, "files": [f"random-{i}" for i in range(images)]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", choices=("flux1", "flux2"), default="flux1")
    ap.add_argument("--budget", default=None, help="the slab's budget (default 8GB; --tiny: 2MB)")
    ap.add_argument("--vram-budgets", default="free",
                    help="comma-separated --vram-budget values, one compile each in this run ('free': the default); "
                         "the slabs' tensor bytes are compared")
    ap.add_argument("--host-budget", default=None,
                    help="--host-budget for every compile of the run (default: the compile's, what the machine has "
                         "available less a margin)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--single-layers", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="calibration samples (default: the compiler's)")
    ap.add_argument("--rounding", default="gptq")
    ap.add_argument("--no-rotation", action="store_true",
                    help="the search without its Hadamard-rotated candidates (squareq compile --no-rotation)")
    ap.add_argument("--phase", choices=("all", "source", "compile"), default="all")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny source, 4 samples at 64 px, the cheapest search; runs on a CPU")
    args = ap.parse_args()

    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.tiny:
        sys.exit("benchmarks/compile.py needs a CUDA device; run it on the GPU machine (or --tiny on a CPU).")
    args.budget = args.budget or ("2MB" if args.tiny else "8GB")
    args.samples = args.samples or (TINY_SEARCH["calib_samples"] if args.tiny else None)
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image
    from squareq.sources import open_source

    records: list = []
    env = {"kind": "env", "device": device_name(), "torch": torch.__version__, "commit": git_commit(),
           "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": args.model,
           "tiny": args.tiny}
    emit(env, records)
    src = write_source_once(args, records)
    if args.phase == "source":
        return
    source = open_source(str(src))
    budgets = [None if b == "free" else b for b in args.vram_budgets.split(",")]
    images, encode = calibration(args, source, budgets, records)
    runs = [r for r in (compile_once(args, source, images, encode, budget, records) for budget in budgets) if r]
    same = len({r["slab_sha256"] for r in runs}) == 1 and len({json.dumps(r["rungs"]) for r in runs}) == 1
    emit({"kind": "identical", "value": same, "budgets": [r["vram_budget"] for r in runs]}, records)
    write_records(args.out, f"compile-{args.model}.jsonl", records)
    if not runs:
        return
    print(f"\n{env['device']}, {args.model}, {runs[0]['blocks']} blocks; slabs identical across budgets: {same}\n")
    print(table(records, COLUMNS, where={"kind": "compile"}))


def write_source_once(args, records: list) -> Path:
    """The source folder in the work dir, written unless it is already there."""
    base = FLUX_DEV if args.model == "flux1" else FLUX2_DEV
    if args.tiny:
        base = {"num_layers": 0, "num_single_layers": 0} if args.model == "flux1" else TINY_FLUX2
    layers = args.layers if args.layers is not None else base["num_layers"]
    single = args.single_layers if args.single_layers is not None else base["num_single_layers"]
    src = args.workdir / (f"{args.model}-tiny" if args.tiny else f"{args.model}-dev-{layers}-{single}")
    if not (src / ("model_index.json" if args.model == "flux1" else "config.json")).is_file():
        if args.model == "flux2":
            written = write_flux2_source(src, base, layers, single, args.device)
        elif args.tiny:  # the built-in tiny-flux pipeline as it is
            from squareq.models import write_tiny_flux_pipeline

            start = time.perf_counter()
            write_tiny_flux_pipeline(src)
            written = {"params": "tiny-flux", "seconds": time.perf_counter() - start}
        else:
            written = write_source(src, {**FLUX_DEV, "num_layers": layers, "num_single_layers": single}, args.device)
        emit({"kind": "source_written", **written}, records)
    return src


def gb(key: str, digits: int):
    return lambda r: NOT_MEASURED if r[key] is None else f"{r[key]:.{digits}f}"


COLUMNS = [
    Column("--vram-budget", "vram_budget"), Column("--host-budget", "host_budget"), Column("wall s", "wall_s", ".0f"),
    Column("encode s", "encode_s", ".0f"), Column("calibrate s", "calibrate_s", ".0f"),
    Column("target s", "target_s"), Column("slab GB", "slab_bytes", lambda r: f"{r['slab_bytes'] / 1e9:.2f}"),
    Column("bits/w", "bits_per_layer_weight", ".2f"),
    Column("host RSS peak / expected GB", "host_rss_peak_gb",
           lambda r: f"{r['host_rss_peak_gb']:.1f} / {r['vram']['host_expected_peak_bytes'] / 1e9:.1f}",
           also=("vram",)),
    Column("VRAM peak alloc / reserved GB", "vram_peak_allocated_gb",
           lambda r: f"{gb('vram_peak_allocated_gb', 2)(r)} / {gb('vram_peak_reserved_gb', 2)(r)}",
           also=("vram_peak_reserved_gb",)),
    Column("expected GB", "vram", lambda r: f"{r['vram']['expected_peak_bytes'] / 1e9:.2f}"),
    Column("recorded inputs", "vram", lambda r: where(r["vram"], "recorded_inputs")),
    Column("effect inputs", "vram", lambda r: where(r["vram"], "effect_inputs"))]


def where(vram: dict, part: str) -> str:
    """Where a part waited (gpu, pinned or spilled), with the bytes written to its spill file."""
    if vram[part] != "spilled":
        return vram[part]
    return f"spilled ({vram[f'{part}_spilled_bytes'] / 1e9:.2f} GB written)"  # compiler/host_plan.py's record


def reset_peak_rss() -> bool:
    """Start a new resident-memory peak for this process (Linux: clear_refs 5 resets VmHWM); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """This process's resident-memory peak in bytes: VmHWM on Linux (since the last reset), else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def calibration(args, source, budgets, records):
    """The calibration set (FLUX.1: the built-in photographs through the source's encoders, under the tightest
    budget's cap, as `squareq compile` does; FLUX.2: random) and the seconds it took."""
    import torch

    from squareq.compiler import parse_size
    from squareq.compiler.vram import memory_cap

    own_peak = reset_peak_rss()  # the encoders' host memory, apart from the source writing before it
    start = time.perf_counter()
    cuda = args.device == "cuda"
    resolution, tokens = (TINY_RESOLUTION, TINY_TOKENS) if args.tiny else (512, 512)
    if args.model == "flux2":
        config, side = TINY_FLUX2 if args.tiny else FLUX2_DEV, resolution // 8
        images = random_calibration_set(args.samples or 16, (config["in_channels"] // 4, side, side),
                                        (tokens, config["joint_attention_dim"]))
    else:
        from squareq.compiler.calibration_images import calibration_images

        tight = min((parse_size(b) for b in budgets if b), default=None)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with memory_cap(tight, "cuda") if cuda else contextlib.nullcontext():
            images = calibration_images(source, device=args.device, limit=args.samples or 32, echo=log,
                                        resolution=resolution, max_sequence_length=tokens)
    seconds = time.perf_counter() - start
    rec = {"kind": "encode", "seconds": seconds, "images": images.description["images"],
           "host_rss_peak_gb": peak_rss() / 1e9,
           "host_rss_peak_of": "the encoding" if own_peak else "the process so far"}
    if cuda:
        rec["vram_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    emit(rec if cuda else not_measured(rec, "vram_peak_reserved_gb"), records)
    return images, seconds


def compile_once(args, source, images, encode_s, budget, records) -> dict:
    import hashlib

    import torch

    from squareq.compiler import CompileOptions, compile_slab, parse_size
    from squareq.compiler.budget import BudgetError

    folder = source.pipeline or source.folder
    out = args.workdir / (f"{folder.name if folder else args.model}-{budget or 'free'}"
                          f"{'-no-rotation' if args.no_rotation else ''}.slab")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    own_peak = reset_peak_rss()
    start = time.perf_counter()
    plan_lines = []

    def progress(line: str) -> None:
        if LAYER_LINE.match(line):  # one line per layer: too many to print
            return
        if line.startswith(("VRAM plan:", "Host plan:")):
            plan_lines.append(line)
        # the compile resets the peak counters phase by phase (its log lines carry the peaks): these are current
        now = f"[now alloc/reserved {torch.cuda.memory_allocated() / 1e9:5.2f}/" \
              f"{torch.cuda.memory_reserved() / 1e9:5.2f} GB] " if cuda else ""
        print(f"[{time.perf_counter() - start:8.1f}s] {now}{line}", file=sys.stderr, flush=True)

    state = out.parent / f"{out.name}.state"  # may exist empty (e.g. a link to a roomier disk) or hold a cut-off run
    reused = len(list(state.glob("block.*.json"))) if state.exists() else 0
    search = {"calib_samples": args.samples, "rounding": args.rounding, "rotation": not args.no_rotation}
    if args.tiny:
        search.update({k: v for k, v in TINY_SEARCH.items() if k != "calib_samples"})
    opts = CompileOptions(budget=parse_size(args.budget), device=args.device, **search, overwrite=True,
                          calib_images=images,
                          vram_budget=parse_size(budget) if budget else None,
                          host_budget=parse_size(args.host_budget) if args.host_budget else None,
                          resume=state.exists())
    try:
        manifest = compile_slab(source, out, opts, progress=progress)
    except BudgetError as exc:  # a budget the plan refuses, or an estimate that fell short: recorded, not fatal
        emit({"kind": "refused", "vram_budget": budget, "host_budget": args.host_budget, "message": str(exc)},
             records)
        return None
    wall = time.perf_counter() - start
    size = sum(p.stat().st_size for p in out.iterdir())
    digest = hashlib.sha256()
    with open(out / "slab.safetensors", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    rungs: dict = {}
    for layer in manifest.layers:
        rungs[layer.spec.bits] = rungs.get(layer.spec.bits, 0) + 1
    weights = sum(layer.shape[0] * layer.shape[1] for layer in manifest.layers)
    layer_bytes = sum(t.nbytes for layer in manifest.layers for t in layer.tensors.values())
    rec = {"kind": "compile", "rotation": not args.no_rotation, "vram_budget": budget or "free",
           "blocks": len(manifest.blocks), "layers": len(manifest.layers), "wall_s": wall + encode_s,
           "compile_s": wall, "encode_s": encode_s,
           "slab_bytes": size, "slab_sha256": digest.hexdigest(), "bits_per_layer_weight": 8 * layer_bytes / weights,
           "rungs": rungs, "host_budget": args.host_budget or "default", "host_rss_peak_gb": peak_rss() / 1e9,
           "host_rss_peak_of": "this compile" if own_peak else "the process so far",
           "host_plan": {k: manifest.calibration["vram"].get(k) for k in (
               "recorded_inputs", "effect_inputs", "host_budget_bytes", "host_expected_peak_bytes",
               "recorded_inputs_spilled_bytes", "effect_inputs_spilled_bytes")},
           "plan_lines": plan_lines,
           "vram": manifest.calibration["vram"], "effect": manifest.calibration["effect"],
           "chunk_samples": manifest.calibration.get("chunk_samples"),
           "calibrate_s": manifest.calibration["calibrate_seconds"],
           "calibration": {k: manifest.calibration.get(k) for k in ("kind", "source", "samples", "heldout_samples",
                                                                    "resolution", "text_tokens", "latent_shape")},
           "resumed_blocks": reused, "target_s": 900}
    if cuda:
        rec.update(vram_peak_allocated_gb=manifest.calibration["vram"]["peak_allocated_bytes"] / 1e9,
                   vram_peak_reserved_gb=manifest.calibration["vram"]["peak_reserved_bytes"] / 1e9)
    emit(rec if cuda else not_measured(rec, "vram_peak_allocated_gb", "vram_peak_reserved_gb"), records)
    return rec


if __name__ == "__main__":
    main()
