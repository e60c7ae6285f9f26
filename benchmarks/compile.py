#!/usr/bin/env python3
"""Compile speed, GPU and host memory on a FLUX.1-dev- or FLUX.2-dev-shaped source (random weights written to local
safetensors) (issues 3, 15, 23, 39).

    python benchmarks/compile.py --workdir DIR [--out DIR] [--model flux1|flux2] [--budget 8GB]
        [--vram-budgets free,8GB] [--host-budget 32GB] [--layers N] [--single-layers N] [--samples N]
        [--no-rotation] [--phase all|source|compile] [--source-dir DIR] [--state-dir DIR] [--tiny]

Phase 1 writes the source into ``--source-dir`` (default: the work dir) unless it is there, under a temporary name
renamed when whole. flux1: a FluxPipeline folder whose transformer (FLUX.1-dev's config, 11.9 B parameters), VAE
(FLUX.1's AutoencoderKL config), CLIP-L and T5-XXL text encoders have FLUX.1-dev's shapes, with random bf16 N(0, 0.02)
weights written shard by shard, and the built-in tiny tokenizers (their ids fit both vocabularies). flux2: a
FLUX.2-dev-shaped transformer folder alone (its 24B Mistral encoder is not written; the calibration set is random
latents and text states of the real shapes). Phase 2 does what `squareq compile FOLDER --device cuda [--vram-budget B]
[--host-budget H]` does with its defaults, once per budget in ``--vram-budgets``: for flux1 the built-in photographs and
captions encoded by that VAE and those text encoders (512 px, 512 T5 tokens) within the tightest VRAM budget and the
host budget, then the compile. It records wall time, GPU memory peaks, the host plan (what waited in pinned memory or
was spilled to disk), whether the budgets' slabs have the same tensor bytes, and the host memory of the encoding and of
each compile: ``host_rss_anon_peak_gb`` (RssAnon, what ``--host-budget`` is judged by) and ``host_own_peak_gb`` (RssAnon
+ RssShmem, page-locked memory being shared anonymous pages, less the pages mapped from ``--source-dir`` and
``--state-dir`` where those are on a RAM file system: there they are RssShmem, on a disk page cache), both sampled every
100 ms (``common.HostPeaks``), and as before ``host_rss_peak_gb`` (VmHWM, reset per phase on Linux: RSS, so also the
mapped source's touched pages). Random weights measure speed and memory, not quality.

A compile longer than one command runs in two: the same command again resumes from the state folder ``<slab>.state``
in the work dir (with ``--state-dir``, a link to a folder there: the 12B model's state is 52 GB, and the spill files
of a small ``--host-budget`` go in it too) and records ``resumed_blocks``. SIGTERM (``timeout``) is raised as an
exception, so the compiler keeps the block it is writing and deletes its spill files; the run records a ``cut`` line
(its ``wall_s``, phase, host peaks so far) and adds that ``wall_s`` to ``<workdir>/compile-<model>.cut-calls.jsonl``,
which the next compile to finish records as ``cut_calls_wall_s`` beside its own call's ``wall_s`` (encoding + compile)
and their sum ``total_wall_s``. The state's writes are atomic (compiler/state.py): a SIGKILL leaves it usable too.

``--tiny``: the source is tiny (flux1: the built-in tiny-flux pipeline folder; flux2: a two-block FLUX.2 with random
weights), calibrated on 4 samples at 64 px and compiled within 2 MB by the compiler's search in its cheapest form
(``common.TINY_SEARCH``), on the CPU when there is no GPU (seconds; GPU memory figures are null there, not measured).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import resource
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import common  # noqa: E402
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
CUT_CALLS = "compile-{model}.cut-calls.jsonl"  # in the work dir: the wall time of each call SIGTERM cut


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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", type=Path, required=True, help="the slabs, their state folders, and the source")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--model", choices=("flux1", "flux2"), default="flux1")
    ap.add_argument("--budget", default=None, help="the slab's budget (default 8GB; --tiny: 2MB)")
    ap.add_argument("--vram-budgets", default="free",
                    help="comma-separated --vram-budget values, one compile each in this run ('free': the default); "
                         "the slabs' tensor bytes are compared")
    ap.add_argument("--host-budget", default=None,
                    help="--host-budget for the encoders and every compile of the run (default: the compile's, what "
                         "the machine has available less a margin)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--single-layers", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None, help="calibration samples (default: the compiler's)")
    ap.add_argument("--rounding", default="gptq")
    ap.add_argument("--no-rotation", action="store_true",
                    help="the search without its Hadamard-rotated candidates (squareq compile --no-rotation)")
    ap.add_argument("--phase", choices=("all", "source", "compile"), default="all")
    ap.add_argument("--source-dir", type=Path, default=None,
                    help="the source folder's parent (default: --workdir); on a RAM file system (/dev/shm/src) the "
                         "pages mapped from it are left out of host_own_peak_gb, as page cache on a disk would be")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="each compile's state folder (and its spill files) here, linked from --workdir as "
                         "<slab>.state for a later call to resume (default: in --workdir); counted as --source-dir")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny source, 4 samples at 64 px, the cheapest search; runs on a CPU")
    return ap.parse_args()


class Cut(BaseException):
    """SIGTERM as an exception (not an Exception, which the compiler's handlers might take): the calibration pass
    then keeps the block being written and the spill files are deleted, as for Ctrl-C."""


@dataclass
class Invocation:
    """Where this process is, for the ``cut`` line of a run ended by SIGTERM."""

    started: float = field(default_factory=time.perf_counter)
    phase: str = "source"
    phase_start: float = 0.0
    encode_s: float | None = None  # known once encoding ends: a compile's wall_s counts it
    state: Path | None = None  # the compile's state folder
    peaks: common.HostPeaks | None = None

    def enter(self, phase: str, state: Path | None = None) -> None:
        self.phase, self.phase_start, self.state, self.peaks = phase, time.perf_counter(), state, None

    def wall(self) -> float | None:
        """This call's encoding and compile so far (None before encoding)."""
        if self.phase == "source":
            return None
        return (self.encode_s if self.phase != "encode" else 0.0) + time.perf_counter() - self.phase_start


def main() -> None:
    args = parse_args()
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.tiny:
        sys.exit("benchmarks/compile.py needs a CUDA device; run it on the GPU machine (or --tiny on a CPU).")
    args.budget = args.budget or ("2MB" if args.tiny else "8GB")
    args.samples = args.samples or (TINY_SEARCH["calib_samples"] if args.tiny else None)
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward fails on the device image

    records: list = []
    env = {"kind": "env", "device": device_name(), "torch": torch.__version__, "commit": git_commit(),
           "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "model": args.model,
           "tiny": args.tiny, "source_dir": str(args.source_dir or args.workdir),
           "state_dir": str(args.state_dir or args.workdir)}
    emit(env, records)
    run = Invocation()
    signal.signal(signal.SIGTERM, raise_cut)
    try:
        runs = run_phases(args, records, run)
    except (Cut, KeyboardInterrupt) as exc:
        record_cut(args, run, exc, records)
        write_records(args.out, f"compile-{args.model}.jsonl", records)
        sys.exit(128 + (signal.SIGTERM if isinstance(exc, Cut) else signal.SIGINT))
    write_records(args.out, f"compile-{args.model}.jsonl", records)
    if runs:
        same = records[-1]["value"]
        print(f"\n{env['device']}, {args.model}, {runs[0]['blocks']} blocks; slabs identical across budgets: {same}\n")
        print(table(records, COLUMNS, where={"kind": "compile"}))


def run_phases(args, records: list, run: Invocation) -> list:
    """Phase 1, then unless ``--phase source`` the encoding and a compile per budget: the compile records."""
    from squareq.sources import open_source

    src = write_source_once(args, records)
    if args.phase == "source":
        return []
    source = open_source(str(src))
    budgets = [None if b == "free" else b for b in args.vram_budgets.split(",")]
    images, encoded = calibration(args, source, budgets, records, run)
    runs = [r for r in (compile_once(args, source, images, encoded, budget, records, run) for budget in budgets) if r]
    same = len({r["slab_sha256"] for r in runs}) == 1 and len({json.dumps(r["rungs"]) for r in runs}) == 1
    emit({"kind": "identical", "value": same, "budgets": [r["vram_budget"] for r in runs]}, records)
    return runs


def raise_cut(signum, frame) -> None:
    raise Cut(signum)


def cut_calls(args) -> list[dict]:
    """The calls cut before this one finished the compile (``record_cut``), as written in the work dir."""
    path = args.workdir / CUT_CALLS.format(model=args.model)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def record_cut(args, run: Invocation, exc: BaseException, records: list) -> None:
    """The ``cut`` line, and its wall time added to the cut-calls file for the compile that finishes later."""
    wall = run.wall()
    rec = {"kind": "cut", "signal": "SIGTERM" if isinstance(exc, Cut) else "SIGINT", "phase": run.phase,
           "wall_s": wall, "process_s": time.perf_counter() - run.started,
           "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "state_blocks": finished_blocks(run.state) if run.state else 0, "host_rss_peak_gb": peak_rss() / 1e9}
    if run.peaks is not None:
        host_fields(run.peaks, rec, "host")
    emit(rec, records)
    if wall is not None:
        calls = [*cut_calls(args), {"wall_s": wall, "phase": run.phase, "date_utc": rec["date_utc"]}]
        write_records(args.workdir, CUT_CALLS.format(model=args.model), calls)


def write_source_once(args, records: list) -> Path:
    """The source folder in ``--source-dir`` (default: the work dir), written unless it is already there."""
    base = FLUX_DEV if args.model == "flux1" else FLUX2_DEV
    if args.tiny:
        base = {"num_layers": 0, "num_single_layers": 0} if args.model == "flux1" else TINY_FLUX2
    layers = args.layers if args.layers is not None else base["num_layers"]
    single = args.single_layers if args.single_layers is not None else base["num_single_layers"]
    src = (args.source_dir or args.workdir) / (f"{args.model}-tiny" if args.tiny else
                                               f"{args.model}-dev-{layers}-{single}")
    if (src / ("model_index.json" if args.model == "flux1" else "config.json")).is_file():
        return src
    # written under another name and renamed when whole: a cut write must not pass for a source next time
    partial = src.with_name(src.name + ".partial")
    for stale in (partial, src):
        shutil.rmtree(stale, ignore_errors=True)
    if args.model == "flux2":
        written = write_flux2_source(partial, base, layers, single, args.device)
    elif args.tiny:  # the built-in tiny-flux pipeline as it is
        from squareq.models import write_tiny_flux_pipeline

        start = time.perf_counter()
        write_tiny_flux_pipeline(partial)
        written = {"params": "tiny-flux", "seconds": time.perf_counter() - start}
    else:
        written = write_source(partial, {**FLUX_DEV, "num_layers": layers, "num_single_layers": single}, args.device)
    partial.rename(src)
    emit({"kind": "source_written", "folder": str(src), **written}, records)
    return src


def gb(key: str, digits: int):
    return lambda r: NOT_MEASURED if r[key] is None else f"{r[key]:.{digits}f}"


def wall_cell(r: dict) -> str:
    """The compile's wall time: this call's, after those of the calls cut before it."""
    parts = [f"{w:.0f}" for w in r["cut_calls_wall_s"]] + [f"{r['wall_s']:.0f}"]
    return f"{r['total_wall_s']:.0f}" + (f" ({' + '.join(parts)}, {r['resumed_blocks']} blocks resumed)"
                                         if len(parts) > 1 else "")


COLUMNS = [
    Column("--vram-budget", "vram_budget"), Column("--host-budget", "host_budget"),
    Column("wall s", "total_wall_s", wall_cell, also=("wall_s", "cut_calls_wall_s", "resumed_blocks")),
    Column("encode s", "encode_s", ".0f"), Column("calibrate s", "calibrate_s", ".0f"),
    Column("target s", "target_s"), Column("slab GB", "slab_bytes", lambda r: f"{r['slab_bytes'] / 1e9:.2f}"),
    Column("bits/w", "bits_per_layer_weight", ".2f"),
    Column("host RSS (VmHWM) peak / expected GB", "host_rss_peak_gb",
           lambda r: f"{r['host_rss_peak_gb']:.1f} / {r['vram']['host_expected_peak_bytes'] / 1e9:.1f}",
           also=("vram",)),
    Column("host RssAnon / own peak GB: compile (encode)", "host_rss_anon_peak_gb",
           lambda r: f"{gb('host_rss_anon_peak_gb', 2)(r)} / {gb('host_own_peak_gb', 2)(r)} "
                     f"({gb('encode_rss_anon_peak_gb', 2)(r)} / {gb('encode_own_peak_gb', 2)(r)})",
           also=("host_own_peak_gb", "encode_rss_anon_peak_gb", "encode_own_peak_gb")),
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


def on_ram_fs(path: Path) -> bool:
    """Whether ``path`` lies on a RAM file system (tmpfs, ramfs: /proc/self/mounts' longest mount point above it)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    real = os.path.realpath(path)
    above = [(point, kind) for point, kind in mounts if real == point or real.startswith(point.rstrip("/") + "/")]
    return bool(above) and max(above, key=lambda m: len(m[0]))[1] in ("tmpfs", "ramfs")


def ram_files(args) -> list[str]:
    """The folders whose mapped files' pages come off the own-memory figure: --source-dir and --state-dir where on a
    RAM file system (on a disk those pages are page cache, outside RssShmem: taking them off would undercount)."""
    return [str(d) for d in (args.source_dir, args.state_dir) if d is not None and on_ram_fs(d)]


@contextlib.contextmanager
def watched(args, run: Invocation):
    """Host memory peaks (``common.HostPeaks``) of what runs inside, also kept in ``run`` for a ``cut`` line."""
    with common.HostPeaks(("it",), ram_files=ram_files(args)) as peaks:
        peaks.phase("it")
        run.peaks = peaks
        yield peaks


def host_fields(peaks: common.HostPeaks, rec: dict, prefix: str) -> dict:
    """``<prefix>_rss_anon_peak_gb`` and ``<prefix>_own_peak_gb`` from ``peaks`` (:func:`watched`) into ``rec``."""
    got = peaks.fields({})
    for what in ("rss_anon", "own"):
        common.set_figure(rec, f"{prefix}_{what}_peak_gb", got[f"it_{what}_peak_GB"])
    return rec


def finished_blocks(state: Path) -> int:
    return len(list(state.glob("block.*.json"))) if state.exists() else 0


def calibration(args, source, budgets, records, run: Invocation) -> tuple[object, dict]:
    """The calibration set (FLUX.1: the built-in photographs through the source's encoders, under the tightest
    budget's cap and the host budget, as `squareq compile` does; FLUX.2: random) and the encoding's record."""
    import torch

    from squareq.compiler import parse_size
    from squareq.compiler.vram import memory_cap

    run.enter("encode")
    own_peak = reset_peak_rss()  # the encoders' host memory, apart from the source writing before it
    cuda = args.device == "cuda"
    resolution, tokens = (TINY_RESOLUTION, TINY_TOKENS) if args.tiny else (512, 512)
    with watched(args, run) as peaks:
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
                                            resolution=resolution, max_sequence_length=tokens, vram_budget=tight,
                                            host_budget=parse_size(args.host_budget) if args.host_budget else None)
    run.encode_s = seconds = time.perf_counter() - run.phase_start
    rec = {"kind": "encode", "seconds": seconds, "images": images.description["images"],
           "host_rss_peak_gb": peak_rss() / 1e9,
           "host_rss_peak_of": "the encoding" if own_peak else "the process so far"}
    host_fields(peaks, rec, "host")
    if cuda:
        rec["vram_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    emit(rec if cuda else not_measured(rec, "vram_peak_reserved_gb"), records)
    return images, rec


def state_for(args, out: Path) -> Path:
    """The compile's state folder ``<out>.state``; with --state-dir a link to a folder of that name there (made
    once: a second call finds it and resumes)."""
    from squareq.compiler.state import state_folder

    state = state_folder(out)
    if args.state_dir is None:
        return state
    target = (args.state_dir / state.name).resolve()
    target.mkdir(parents=True, exist_ok=True)
    if state.is_symlink() and state.resolve() == target:
        return state
    if state.exists() or state.is_symlink():
        sys.exit(f"{state} is in the way of --state-dir {args.state_dir}: resume without --state-dir, or delete it.")
    state.parent.mkdir(parents=True, exist_ok=True)
    state.symlink_to(target, target_is_directory=True)
    return state


def drop_state(state: Path) -> None:
    """A linked state folder after its compile: the compiler removes a folder, not a link (rmtree refuses links)."""
    if state.is_symlink():
        shutil.rmtree(state.resolve(), ignore_errors=True)
        state.unlink()


def compile_once(args, source, images, encoded: dict, budget, records, run: Invocation) -> dict | None:
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
    state = state_for(args, out)  # may hold a cut-off run: the compile resumes it
    reused = finished_blocks(state)
    run.enter(f"compile {budget or 'free'}", state)
    own_peak = reset_peak_rss()
    plan_lines = []

    def progress(line: str) -> None:
        if LAYER_LINE.match(line):  # one line per layer: too many to print
            return
        if line.startswith(("VRAM plan:", "Host plan:")):
            plan_lines.append(line)
        # the compile resets the peak counters phase by phase (its log lines carry the peaks): these are current
        now = f"[now alloc/reserved {torch.cuda.memory_allocated() / 1e9:5.2f}/" \
              f"{torch.cuda.memory_reserved() / 1e9:5.2f} GB] " if cuda else ""
        print(f"[{time.perf_counter() - run.phase_start:8.1f}s] {now}{line}", file=sys.stderr, flush=True)

    search = {"calib_samples": args.samples, "rounding": args.rounding, "rotation": not args.no_rotation}
    if args.tiny:
        search.update({k: v for k, v in TINY_SEARCH.items() if k != "calib_samples"})
    opts = CompileOptions(budget=parse_size(args.budget), device=args.device, **search, overwrite=True,
                          calib_images=images,
                          vram_budget=parse_size(budget) if budget else None,
                          host_budget=parse_size(args.host_budget) if args.host_budget else None,
                          resume=state.exists())
    try:
        with watched(args, run) as peaks:
            manifest = compile_slab(source, out, opts, progress=progress)
    except BudgetError as exc:  # a budget the plan refuses, or an estimate that fell short: recorded, not fatal
        emit({"kind": "refused", "vram_budget": budget, "host_budget": args.host_budget, "message": str(exc)},
             records)
        return None
    wall = time.perf_counter() - run.phase_start
    drop_state(state)
    rec = {"kind": "compile", "rotation": not args.no_rotation, "vram_budget": budget or "free",
           "wall_s": wall + encoded["seconds"], "compile_s": wall, "encode_s": encoded["seconds"],
           "host_budget": args.host_budget or "default", "host_rss_peak_gb": peak_rss() / 1e9,
           "host_rss_peak_of": "this compile" if own_peak else "the process so far", "plan_lines": plan_lines,
           "resumed_blocks": reused, "target_s": 900, **slab_figures(out, manifest)}
    host_fields(peaks, rec, "host")
    for what in ("rss_anon", "own"):  # the encoding's, which the same --host-budget bounds
        common.set_figure(rec, f"encode_{what}_peak_gb", encoded[f"host_{what}_peak_gb"])
    rec["cut_calls_wall_s"] = [c["wall_s"] for c in cut_calls(args)]
    rec["total_wall_s"] = rec["wall_s"] + sum(rec["cut_calls_wall_s"])
    (args.workdir / CUT_CALLS.format(model=args.model)).unlink(missing_ok=True)
    if cuda:
        rec.update(vram_peak_allocated_gb=manifest.calibration["vram"]["peak_allocated_bytes"] / 1e9,
                   vram_peak_reserved_gb=manifest.calibration["vram"]["peak_reserved_bytes"] / 1e9)
    emit(rec if cuda else not_measured(rec, "vram_peak_allocated_gb", "vram_peak_reserved_gb"), records)
    return rec


def slab_figures(out: Path, manifest) -> dict:
    """The slab's size, its tensors' sha256 and rungs, and its manifest's records of the calibration and memory."""
    import hashlib

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
    vram = manifest.calibration["vram"]
    return {"blocks": len(manifest.blocks), "layers": len(manifest.layers), "slab_bytes": size,
            "slab_sha256": digest.hexdigest(), "bits_per_layer_weight": 8 * layer_bytes / weights, "rungs": rungs,
            "host_plan": {k: vram.get(k) for k in (
                "recorded_inputs", "effect_inputs", "host_budget_bytes", "host_expected_peak_bytes",
                "recorded_inputs_spilled_bytes", "effect_inputs_spilled_bytes")},
            "vram": vram, "effect": manifest.calibration["effect"],
            "chunk_samples": manifest.calibration.get("chunk_samples"),
            "calibrate_s": manifest.calibration["calibrate_seconds"],
            "calibration": {k: manifest.calibration.get(k) for k in ("kind", "source", "samples", "heldout_samples",
                                                                     "resolution", "text_tokens", "latent_shape")}}


if __name__ == "__main__":
    main()
