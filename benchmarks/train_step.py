#!/usr/bin/env python3
"""LoRA training step time of a full-size transformer: SquareQ streaming vs its peers (issues 4 and 7).

    python benchmarks/train_step.py [--family flux|flux2|qwen-image|wan|wan2.2-5b|hunyuan-video] [--out DIR]
                                    [--workdir DIR]
                                    [--res 512 1024] [--frames 49 81 --size 480x832] [--rank 16] [--targets attention]
                                    [--offload-activations off on]
                                    [--steps 5 --warmup 2] [--only slab,squareq,resident,compiled,bnb,group_offload]
                                    [--phase-timeout S] [--tiny] [--rotate]

The model is the family's diffusers class at its released config with seeded random weights
(normal(0, 0.02) for matrices, norm weights 1, other vectors 0), built directly on the GPU: ``flux``
is FLUX.1-dev's ``FluxTransformer2DModel`` (11.9B), ``flux2`` FLUX.2-dev's ``Flux2Transformer2DModel``
(diffusers' defaults: 8 double + 48 single blocks, 32B), ``qwen-image`` Qwen-Image's
``QwenImageTransformer2DModel`` (60 blocks, 20B), ``wan`` Wan 2.1-T2V-14B's ``WanTransformer3DModel`` (40 blocks,
14.3B), ``wan2.2-5b`` Wan 2.2-TI2V-5B's (30 blocks, 5.0B, 48 latent channels of its 16x VAE: squareq's ``wan`` family,
a slab of its own; :data:`SHAPE_FAMILIES`), ``hunyuan-video`` HunyuanVideo's ``HunyuanVideoTransformer3DModel``
(20 + 40 blocks, 13B; its slab only, ``--only slab``, for benchmarks/cards.py). Every setup trains LoRA rank 16
(``--rank``) on ``to_q,to_k,to_v,to_out.0`` (``--targets``: ``flux-default``, FLUX.1's default target set;
``attention-ffn``, Wan's attention and FFN) with AdamW (lr 1e-4),
gradient checkpointing, batch 1, 512 text tokens, bf16
autocast and an MSE loss against a random target; the step time is the median of ``--steps`` steps after
``--warmup`` steps. The FLUX.2, Qwen-Image and Wan inputs come from their family adapters' calibration inputs
(noise latents packed 2x2 or video latents, Gaussian text embeddings). A video family measures clips, not squares:
``--frames`` pixel frames (49 81; the VAE makes 1 + (N-1)/4 latent frames) at ``--size`` pixels (480x832; latents
8x smaller a side, Wan 2.2-TI2V-5B's 16x), every record naming its frames, size and tokens (``--res`` takes such a
clip as ``49x480x832`` too, and RES below is either). Setups, each one a phase in its own subprocess so
that GPU memory statistics start clean and a crash or timeout costs only that phase:

* ``slab``: writes the SquareQ slab (fixed W8/W6/W4 mix, <= 4.5 bits per weight; Wan's is W4 alone: mix_spec) unless
  one made by this script already exists in ``--workdir``;
* ``squareq RES K HOST LORA COMPUTE``: ``squareq.runtime.load(slab, options=LoadOptions(prefetch=K, host=HOST,
  compute=COMPUTE))`` + ``add_lora``; COMPUTE ``auto`` (``--compute``'s default, as squareq train's) is FP8 on GPUs
  with FP8 tensor cores; reports copy wait, bytes copied and demand loads of the median step and the
  ``runtime.plan`` prediction. K ``auto`` is
  ``squareq train``'s default: two slots, then a StreamTuner sizes the ring from the second (warm-up) step, as the
  trainer does, and the record says how many slots it chose;
* ``squareq ... graphs`` (``--graphs on``): the same with ``cuda_graphs=True`` (``squareq train --cuda-graphs``); the
  warm-up goes on while a step still captures graphs, and the record counts the graph replays of each step;
* ``squareq ... compiled`` (``--block-compile on``): the same with ``compile_blocks=True`` (``squareq train
  --compile on``): each block class's forward under ``torch.compile`` as one graph (``pieces``: the quantized
  layers left eager between compiled pieces); the record's ``block_compile_s`` is Dynamo's count of the compile,
  ``compile_s`` the warm-up steps' excess;
* ``squareq ... offload`` (``--offload-activations on``): the checkpointed block inputs in page-locked host memory
  (``runtime.ActivationOffload``, squareq train --offload-activations on), for long clips; the record says how many
  GB a step moved out (``offloaded_GB``);
* ``squareq ... fp8grad`` (``--fp8-backward on``): the frozen layers' input gradients in FP8 too
  (``runtime.compute.FP8_BACKWARD``);
* ``gradients RES``: one LoRA step of the streamed slab in bf16 compute and again in FP8 compute, same batch and
  LoRA (B nudged off zero so every factor has a gradient): the cosine and norm ratio of the LoRA gradients and the
  output's rel-MSE, FP8 against bf16, for each FP8 set-up ``--gradient-variants`` names (``GRADIENT_VARIANTS``:
  input gradients in FP8 too, fp32 accumulation, FP8 for calls of any row count; issue 41);
* ``resident RES``: the bf16 model fully on the GPU with PEFT LoRA, the speed to match;
* ``resident RES compiled`` (``--only compiled``): the same with each transformer block under ``torch.compile``
  (default mode), the setup a careful user trains with (issue 41); the warm-up steps carry the compilation, which is
  reported (``compile_s``: the warm-up steps' time beyond as many measured steps) and kept out of the median;
* ``bnb RES``: bitsandbytes NF4 linears (QLoRA) with PEFT LoRA, when bitsandbytes imports;
* ``group_offload RES``: diffusers block-level group offloading with streams and PEFT LoRA.

Each phase prints one JSON line per measurement; the driver echoes them, adds ``ratio_to_resident`` and
``ratio_to_compiled`` (null, and listed as not measured, where the run has no such resident peer), writes
``--out DIR/train_step.jsonl`` after every phase and prints a markdown table last. Set
``SQUAREQ_COMMIT`` on a machine without git history and ``SQUAREQ_TRACE_DIR`` for a Chrome trace of
the 512², K=3 pinned phase. ``--tiny`` swaps in the family's tiny config at 128² and runs every phase in this one
process (seconds on the CPU when no GPU is present, where memory figures are null: not measured; bitsandbytes and
group offloading, GPU-only, are records that say they were skipped) so the script can be smoke-tested anywhere; a
video family's tiny clip is 5 frames at 32x48 (``wan2.2-5b``'s at 64x96, the same tokens).
``--rotate`` stores every layer of the slab Hadamard-rotated (``QuantSpec.rotate``; a slab of its own,
``full-FAMILY-rotated.slab``): the same bytes, plus the rotation's work in the kernels.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (str(ROOT), str(ROOT / "benchmarks")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import RECORDS, Column, emit, git_commit, not_measured, set_figure, table, write_records  # noqa: E402

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
# family -> (diffusers class, full-size config); {} is the class's defaults, which diffusers sets to the release
# Wan-AI/Wan2.1-T2V-14B-Diffusers' transformer/config.json (diffusers' defaults, spelt out: the release is the point)
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, rope_max_seq_len=1024)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers' transformer/config.json (5.0B): the same class and squareq family as the 14B, over
# the 48 latent channels of the Wan 2.2 VAE (16x a side), so a slab of its own (SHAPE_FAMILIES)
WAN22_5B = dict(patch_size=(1, 2, 2), num_attention_heads=24, attention_head_dim=128, in_channels=48,
                out_channels=48, text_dim=4096, freq_dim=256, ffn_dim=14336, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, rope_max_seq_len=1024)
# hunyuanvideo-community/HunyuanVideo's transformer/config.json (13B): its slab only (SLAB_ONLY), for cards.py
HUNYUAN_VIDEO_13B = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                         num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                         patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                         pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56))
FAMILIES = {"flux": ("FluxTransformer2DModel", FLUX_DEV), "flux2": ("Flux2Transformer2DModel", {}),
            "qwen-image": ("QwenImageTransformer2DModel", {}), "wan": ("WanTransformer3DModel", WAN_14B),
            "wan2.2-5b": ("WanTransformer3DModel", WAN22_5B),
            "hunyuan-video": ("HunyuanVideoTransformer3DModel", HUNYUAN_VIDEO_13B)}
# the FAMILIES keys (--family: the shapes a slab is built at) that are not a squareq family themselves -> the squareq
# family whose adapter, built-in tiny model and manifest they take; the others are their own
SHAPE_FAMILIES = {"wan2.2-5b": "wan"}
# what a shape key changes in its family's built-in tiny config (--tiny): the 5B's 48 latent channels, so that its
# tiny slab takes the tiny Wan 2.2 VAE's latents (benchmarks/cards.py) and squareq's memory plan counts a 16x VAE's
# tokens (it tells the Wan 2.2 VAE by those 48 channels: squareq/models/wan.py wan_sequence_shape)
TINY_CHANGES = {"wan2.2-5b": dict(in_channels=48, out_channels=48)}
# pixels per latent a side where a shape key's VAE is not the 8x one (VAE_SIDE): Wan 2.2's VAE, 16x
VAE_SIDES = {"wan2.2-5b": 16}
# families whose slab is all this script makes (--only slab): their calibration inputs take square latents, not the
# clips of --size
SLAB_ONLY = ("hunyuan-video",)
LORA_RANK = 16  # --rank
# --targets: the attention projections (the diffusers script's set, SquareQ's default before issue 19), FLUX.1's
# default now (squareq.models.flux.FLUX_LORA_TARGETS: every attention and MLP linear of both streams, as kohya's), or
# Wan's attention (self and cross: attn1, attn2) and FFN, which are all ten linears of its blocks
TARGET_SETS = ("attention", "flux-default", "attention-ffn")
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
WAN_FFN = ("ffn.net.0.proj", "ffn.net.2")
LORA_TARGETS = list(ATTENTION_TARGETS)  # --targets
# a clip's pixels to latents (Wan 2.1's VAE, and HunyuanVideo's): one latent frame per 4 pixel frames after the first,
# one latent per 8x8 pixels; the transformer then patches 2x2 (16 pixels a side)
VAE_FRAMES, VAE_SIDE, CLIP_SIDE_MULTIPLE = 4, 8, 16
MAX_BITS = 4.5  # the slab's average bits per layer weight must not exceed this (full config)
# Identifies slabs written by this script with this mix, so a stale slab is rebuilt rather than reused.
SLAB_SOURCE = "benchmarks/train_step.py: random N(0,0.02) seed 0; mix w8g128 to_out.0, w6g128 ff.net.2, w4g64 qkv, w4g128"  # noqa: E501
T0 = time.perf_counter()
_CUDNN_FIRST = None  # the resident phase's attention priority context (--resident-attention cudnn)
MAX_CAPTURE_STEPS = 8  # extra warm-up steps allowed while CUDA graphs are still being captured
# what train() measures of GPU memory: None on a CPU, and listed in the record as not measured
GPU_MEMORY_FIGURES = ("peak_alloc_GB", "peak_reserved_GB", "peak_reserved_all_steps_GB")
PEER_UNMEASURED = ("copy_wait_share",)  # the wait on SquareQ's ring of block copies: the peers have no such ring


def log(msg: str) -> None:
    """A timestamped progress line on stderr (stdout carries only JSON lines and the table)."""
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def squareq_family(shape: str) -> str:
    """The squareq family of ``--family`` ``shape`` (:data:`SHAPE_FAMILIES`): its adapter, tiny model, manifest."""
    return SHAPE_FAMILIES.get(shape, shape)


def patched(latents, patch) -> int:
    """Tokens of one sample's latent sizes (frames, height, width) over the model's patch sizes."""
    return math.prod(n // p for n, p in zip(latents, patch, strict=True))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One measurement's input, as its phase token names it: ``512``, a square image of 512² pixels, or
    ``49x480x832``, a clip of 49 pixel frames at 480x832 (a video family's --frames and --size)."""

    res: int | None = None
    frames: int | None = None
    height: int | None = None
    width: int | None = None

    @classmethod
    def parse(cls, token) -> Shape:
        """The shape of a phase token, or of a square resolution given as a number (sample.py's)."""
        if isinstance(token, cls):
            return token
        try:
            parts = [int(p) for p in str(token).split("x")]
        except ValueError:
            parts = []
        if len(parts) == 1 and parts[0] > 0:
            return cls(res=parts[0])
        if len(parts) != 3 or min(parts) < 1:
            raise ValueError(f"{token!r} is no shape: give a square side (512) or a clip, FRAMESxHEIGHTxWIDTH "
                             "(49x480x832)")
        frames, height, width = parts
        if frames % VAE_FRAMES != 1 or height % CLIP_SIDE_MULTIPLE or width % CLIP_SIDE_MULTIPLE:
            raise ValueError(f"{token}: a clip takes 4k+1 frames (the VAE's {VAE_FRAMES}x in time) and sides that "
                             f"are multiples of {CLIP_SIDE_MULTIPLE} (its {VAE_SIDE}x, then 2x2 patches)")
        return cls(frames=frames, height=height, width=width)

    def __str__(self) -> str:
        return str(self.res) if self.res is not None else f"{self.frames}x{self.height}x{self.width}"

    def latents(self, vae_side: int = VAE_SIDE) -> dict:
        """The adapter's calibration_inputs size keywords: an image's latent side, or a clip's latent frames and
        sides (``vae_side``: the VAE's pixels per latent a side)."""
        if self.res is not None:
            return {"side": self.res // vae_side}
        return {"frames": 1 + (self.frames - 1) // VAE_FRAMES, "height": self.height // vae_side,
                "width": self.width // vae_side}

    def fields(self) -> dict:
        """What a record says of its shape: the token (``shape``), and ``res`` or a clip's frames, size and latent
        frames (train() adds the tokens it fed)."""
        if self.res is not None:
            return {"shape": str(self), "res": self.res}
        return {"shape": str(self), "frames": self.frames, "size": f"{self.height}x{self.width}",
                "latent_frames": self.latents()["frames"]}

    def clip_tokens(self, patch, vae_side: int = VAE_SIDE) -> int:
        """A clip's video tokens, its latents over ``patch``."""
        return patched(self.latents(vae_side).values(), patch)


def shape_arg(token: str) -> str:
    """argparse's type of a shape option: the token, checked."""
    try:
        return str(Shape.parse(token))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shape_label(token: str) -> str:
    """A table's shape cell: 512² or 49×480×832."""
    return f"{token}²" if "x" not in token else token.replace("x", "×")


# ----------------------------------------------------------------------------------------------------------
# Phases (each runs in its own process)
# ----------------------------------------------------------------------------------------------------------

class Setup:
    """What every phase shares: model config, device, token counts and step counts."""

    def __init__(self, args) -> None:
        import torch

        from squareq.models import ADAPTERS, BUILTIN_MODELS

        self.tiny, self.family = args.tiny, squareq_family(args.family)  # args.family: the shape key
        self.class_name, config = FAMILIES[args.family]
        self.adapter = ADAPTERS[self.family]
        self.vae_side = VAE_SIDES.get(args.family, VAE_SIDE)
        if args.tiny:
            tiny = next(build for name, (family, build) in BUILTIN_MODELS.items() if family == self.family)
            self.config, self.text_tokens = {**tiny().config, **TINY_CHANGES.get(args.family, {})}, 16
        else:
            self.config, self.text_tokens = dict(config), 512
        self.cuda = torch.cuda.is_available()
        if not self.cuda and not args.tiny:
            raise RuntimeError("the full-size benchmark needs a CUDA device; use --tiny on a CPU.")
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.device_name = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.steps, self.warmup = args.steps, args.warmup
        self.guidance = getattr(args, "guidance", 3.5)  # the embedded guidance of every batch (sample.py: 3.5)
        self.controls = getattr(args, "controls", 0)  # Kontext's control images per sample (flux only)
        self.rotate = args.rotate
        self.slab = slab_path(args.workdir, args.family, args.tiny, args.rotate)

    def sync(self) -> None:
        import torch
        if self.cuda:
            torch.cuda.synchronize()


def slab_path(workdir, family: str, tiny: bool, rotate: bool = False) -> Path:
    """Where the slab phase writes (or finds) the slab of ``family``'s full or tiny config."""
    return Path(workdir) / f"{'tiny' if tiny else 'full'}-{family}{'-rotated' if rotate else ''}.slab"


def build_model(setup: Setup):
    """The family's transformer in bf16 on the device, seeded random weights, no host copy of them."""
    import torch

    from squareq.models.skeleton import skeleton_from_record

    # parameters on meta, buffers and tensors computed in __init__ (rotary tables) real and in their own dtype
    model = skeleton_from_record(setup.class_name, {k: v for k, v in setup.config.items() if not k.startswith("_")})
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model = model.to(torch.bfloat16).to_empty(device=setup.device)
    g = torch.Generator(device=setup.device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=g)
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
        for name, value in buffers.items():  # to_empty left them uninitialized
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = value.to(setup.device)
    return model.requires_grad_(False)


def make_batch(setup: Setup, shape: Shape | str | int, model):
    """Forward inputs of ``shape`` (a square side in pixels: FLUX.1 (res/16)² image tokens; or a video family's clip)
    and a random target, seeded."""
    import torch

    shape = Shape.parse(shape)
    if setup.family != "flux":
        batch = setup.adapter.calibration_inputs(model, 1, 1, device=setup.device, dtype=torch.bfloat16,
                                                 text_tokens=setup.text_tokens,
                                                 **shape.latents(setup.vae_side)).kwargs
        g = torch.Generator(device=setup.device).manual_seed(1)
        x = batch["hidden_states"]
        return batch, torch.randn(x.shape, generator=g, device=x.device).to(x.dtype)
    cfg, dev, side = setup.config, setup.device, shape.res // 16
    g = torch.Generator(device=dev).manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(torch.bfloat16)

    img_ids = torch.zeros(side, side, 3, device=dev)
    img_ids[..., 1] = torch.arange(side, device=dev)[:, None]
    img_ids[..., 2] = torch.arange(side, device=dev)[None, :]
    # Kontext: each control image's tokens after the target's, on the same grid with the first id 1 (models/flux.py)
    img_ids = torch.cat([img_ids] + [img_ids.clone().index_fill_(-1, torch.tensor([0], device=dev), 1.0)
                                     for _ in range(setup.controls)])
    batch = dict(hidden_states=rand(1, side * side * (1 + setup.controls), cfg["in_channels"]),
                 encoder_hidden_states=rand(1, setup.text_tokens, cfg["joint_attention_dim"]),
                 pooled_projections=rand(1, cfg["pooled_projection_dim"]),
                 timestep=torch.full((1,), 0.5, device=dev, dtype=torch.bfloat16),
                 guidance=torch.full((1,), setup.guidance, device=dev, dtype=torch.bfloat16),
                 img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(setup.text_tokens, 3, device=dev))
    return batch, rand(1, side * side, cfg["in_channels"])


def memory_peaks(setup: Setup) -> dict:
    """Peak allocated/reserved since the last call, and reserved now; resets the peaks (0 on a CPU)."""
    import torch
    if not setup.cuda:
        return {"peak_allocated": 0, "peak_reserved": 0, "reserved": 0}
    out = {"peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
           "reserved": torch.cuda.memory_reserved()}
    torch.cuda.reset_peak_memory_stats()
    return out


def profile_step(one_step, setup: Setup, path: Path) -> float:
    """One more step under torch.profiler: the top host-side ops to ``path``; returns GPU kernel seconds."""
    from torch.profiler import ProfilerActivity, profile

    setup.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step()
        setup.sync()
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
                    + events.table(sort_by="self_device_time_total", row_limit=25))
    # every op and kernel with device time, for sums by kind (the tables above keep the top rows only)
    rows = [{"name": e.key, "calls": e.count, "self_device_us": e.self_device_time_total}
            for e in events if e.self_device_time_total > 0]
    path.with_suffix(".json").write_text(json.dumps(sorted(rows, key=lambda r: -r["self_device_us"])))
    return kernel_us / 1e6


def predicted(out, target):
    """The model's prediction for ``target``: its first tokens, where control tokens follow them (Kontext)."""
    return out[:, :target.shape[1]] if out.dim() == 3 else out


def batch_tokens(setup: Setup, batch: dict) -> int:
    """The image or video tokens of one sample of ``batch``: packed latents [B, tokens, C], or a clip's latents
    [B, C, frames, height, width] over the model's patches."""
    x = batch["hidden_states"]
    return x.shape[1] if x.dim() == 3 else patched(x.shape[2:], setup.config["patch_size"])


def train(setup: Setup, model, params, shape: Shape, after_step, label: str | None = None, fp16: bool = False) -> dict:
    """Warm-up plus measured LoRA steps at ``shape``; ``after_step()`` returns a dict of per-step figures (memory
    peaks at least). Returns the tokens fed, the median time, the median step's figures and the max peaks over
    measured steps. ``fp16``: the batch and autocast in fp16 and the loss scaled as squareq train --dtype fp16 scales
    it (train/loss_scale.py; a step whose gradients overflow halves the scale and skips the update, as GradScaler)."""
    import torch

    from squareq.train.loss_scale import LossScale

    opt = torch.optim.AdamW(params, lr=1e-4)
    batch, target = make_batch(setup, shape, model)
    dtype = torch.float16 if fp16 else torch.bfloat16
    if fp16:
        batch = {k: v.to(dtype) if v.dtype == torch.bfloat16 else v for k, v in batch.items()}
    scale, overflows = LossScale() if fp16 else None, []  # fp16's loss scale, and the scales of its skipped steps
    model.train()
    after_step()  # start counting at the first step, not at load
    times, cpu, figures, losses, every_step, all_times = [], [], [], [], [], []

    def one_step():
        with torch.autocast(setup.device.type, dtype=dtype):
            out = model(**batch, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(predicted(out, target).float(), target.float())
        if scale is None:
            loss.backward()
            opt.step()
        else:
            scale.scale(loss).backward()
            grads = [p.grad for p in params if p.grad is not None]
            scale.unscale(grads)
            if torch.isfinite(torch.nn.utils.get_total_norm(grads)):
                opt.step()
                scale.stepped()
            else:
                overflows.append(scale.value)
                scale.overflowed()
        opt.zero_grad(set_to_none=True)
        return loss

    warmup, i = setup.warmup, -1
    while i + 1 < warmup + setup.steps:
        i += 1
        setup.sync()
        start, cpu_start = time.perf_counter(), time.thread_time()
        loss = one_step()
        cpu_s = time.thread_time() - cpu_start  # the Python thread's own work: launches, autograd, hooks
        setup.sync()
        dt = time.perf_counter() - start
        fig = after_step()  # outside the timed region: it synchronizes and resolves events
        all_times.append(dt)
        losses.append(loss.item())
        every_step.append(fig)
        if i >= warmup:
            times.append(dt)
            cpu.append(cpu_s)
            figures.append(fig)
        log(f"  step {i}{' (warm-up)' if i < warmup else ''}: {dt:.3f} s (host thread busy {cpu_s:.3f} s), "
            f"loss {losses[-1]:.5f}" + (f", {fig['graph_captures']} graphs captured, {fig['graph_replays']} replayed"
                                        if "graph_captures" in fig else ""))
        settling = fig.get("graph_captures") or fig.get("graph_eager")  # a graph's eager runs, or its capture
        if i == warmup - 1 and settling and warmup < setup.warmup + MAX_CAPTURE_STEPS:
            warmup += 1  # CUDA graphs are still being made: measure the steps that only replay them
    profile = os.environ.get("SQUAREQ_PROFILE_DIR")
    if profile and label:
        gpu_busy = profile_step(one_step, setup, Path(profile) / f"profile_{label}.txt")
    median_step = sorted(range(len(times)), key=times.__getitem__)[(len(times) - 1) // 2]
    warm = all_times[:warmup]
    result = {"tokens": batch_tokens(setup, batch), "step_s": statistics.median(times), "warmup_steps": warmup,
            "steps": [round(t, 4) for t in times], "warmup_steps_s": [round(t, 3) for t in warm],
            "beyond_steady_s": sum(warm) - warmup * statistics.median(times),
            "host_busy_s": statistics.median(cpu), **({"gpu_kernel_s": gpu_busy} if profile and label else {}),
            "peak_alloc_GB": gb(setup, max(f["peak_allocated"] for f in figures)),
            "peak_reserved_GB": gb(setup, max(f["peak_reserved"] for f in figures)),
            # warm-up included: the steps that capture CUDA graphs hold the eager cache and the graph pool at once
            "peak_reserved_all_steps_GB": gb(setup, max(f["peak_reserved"] for f in every_step)),
            "reserved_GB_per_step": [gb(setup, f["reserved"], 3) for f in figures],
            "loss_first": losses[0], "loss": losses[-1], "median_figures": figures[median_step],
            **({"losses": [round(x, 6) for x in losses], "losses_finite": all(math.isfinite(x) for x in losses),
                "loss_scale_overflows": overflows, "loss_scale": scale.value} if fp16 else {})}
    return result if setup.cuda else not_measured(result, *GPU_MEMORY_FIGURES)


def gb(setup: Setup, nbytes: int, digits: int | None = None) -> float | None:
    """GPU memory in GB; None on a CPU, where it is not measured."""
    if not setup.cuda:
        return None
    return nbytes / 1e9 if digits is None else round(nbytes / 1e9, digits)


def allocated_GB(setup: Setup) -> float | None:
    import torch
    return gb(setup, torch.cuda.memory_allocated()) if setup.cuda else None


def peft_lora(model) -> list:
    """PEFT LoRA (rank --rank, alpha = rank) on --targets, factors in fp32 as SquareQ keeps them."""
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, init_lora_weights="gaussian",
                                 target_modules=LORA_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    return params


# Slab mix. W4 g64 asymmetric alone already costs 4 + 24/64 = 4.375 bits per weight (fp16 scale + int8 zero
# per group), which leaves no room under 4.5 for W6/W8 layers, so the bulk uses W4 g128 (4.1875 bits) and
# the finer W4 g64 is kept for the LoRA-trained q/k/v projections. On FLUX-12B this averages ~4.40 bits. Wan-14B's
# names (attn1, attn2, ffn) take only the q/k/v rule: 4.27 bits. Its FFN is 40% of its weights, so W6 there, or W8 on
# attn1.to_out.0 (4.57 bits), would pass 4.5.
def mix_spec(name: str):
    """The QuantSpec of block linear ``name`` in the fixed benchmark mix (first matching suffix wins)."""
    from squareq.quant import QuantSpec

    if name.endswith(".attn.to_out.0"):  # double-block attention output (single blocks have none)
        return QuantSpec(bits=8, group_size=128)
    if name.endswith(".ff.net.2"):  # image-stream MLP down projection (ff_context keeps W4)
        return QuantSpec(bits=6, group_size=128)
    if name.endswith((".to_q", ".to_k", ".to_v")):  # FLUX's attn.to_q and Wan's attn1/attn2.to_q alike
        return QuantSpec(bits=4, group_size=64)
    return QuantSpec(bits=4, group_size=128)


def mix_bits(model, plan: dict) -> float:
    """Average stored bits per layer weight of ``plan``, from shapes alone (as the writer lays tensors out)."""
    from squareq import quant

    weights = nbytes = 0
    for name, spec in plan.items():
        mod = model.get_submodule(name)
        weights += mod.out_features * mod.in_features
        layout = quant.tensor_layout(spec, (mod.out_features, mod.in_features))
        nbytes += sum(dtype.itemsize * math.prod(shape) for dtype, shape in layout.values())
    return 8 * nbytes / weights


def existing_slab(setup: Setup):
    """The manifest of a slab this script already wrote for this config, or None."""
    from squareq.slab import open_slab

    try:
        m = open_slab(setup.slab, verify="off").manifest
    except Exception:  # absent, partial or unreadable: rebuild
        return None
    same = m.model.source == SLAB_SOURCE and all(
        m.model.config.get(k) == json.loads(json.dumps(v)) for k, v in setup.config.items())
    return m if same else None


def phase_slab(setup: Setup) -> None:
    from squareq.compiler.plain import PlainOptions, write_rtn_slab
    from squareq.quant import QuantSpec
    from squareq.slab.writer import block_linears

    rec = {"what": "slab", "device": setup.device_name, "path": str(setup.slab)}
    manifest = existing_slab(setup)
    if manifest is not None:
        log(f"slab: reusing {setup.slab}")
        rec.update(reused=True)
    else:
        start = time.perf_counter()
        model = build_model(setup)
        setup.sync()
        rec["build_s"] = time.perf_counter() - start
        rec["parameters_B"] = sum(p.numel() for p in model.parameters()) / 1e9
        blocks = setup.adapter.blocks(model)
        plan = {name: mix_spec(name) for p in blocks for name, _ in block_linears(p, model.get_submodule(p))}
        if setup.rotate:  # every layer whose inputs are whole groups (all of them at full size)
            plan = {name: dataclasses.replace(spec, rotate=True)
                    if model.get_submodule(name).in_features % spec.group_size == 0 else spec
                    for name, spec in plan.items()}
        rec["predicted_bits_per_weight"] = mix_bits(model, plan)
        log(f"slab: model built in {rec['build_s']:.1f} s; mix averages {rec['predicted_bits_per_weight']:.3f} "
            f"bits/weight; writing {setup.slab}")
        if not setup.tiny and rec["predicted_bits_per_weight"] > MAX_BITS:
            raise RuntimeError(f"the slab mix averages {rec['predicted_bits_per_weight']:.3f} bits per weight, "
                               f"over {MAX_BITS}; change mix_spec.")
        setup.slab.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        manifest = write_rtn_slab(model, blocks, plan, setup.slab, PlainOptions(
            default_spec=QuantSpec(bits=4, group_size=128), clip_search=False, family=setup.family,
            source=SLAB_SOURCE, overwrite=True))
        rec.update(reused=False, write_s=time.perf_counter() - start)
    totals = manifest.totals  # the writer's (squareq/slab/writer.py)
    rec.update(slab_bytes=sum(p.stat().st_size for p in setup.slab.iterdir()),
               bits_per_weight=totals["bits_per_layer_weight"], streamed_GB=totals["streamed_bytes"] / 1e9,
               largest_block_MB=totals["largest_block_bytes"] / 1e6, formats=totals["formats"])
    emit(rec)
    if not setup.tiny and (rec["bits_per_weight"] or 99) > MAX_BITS:
        raise RuntimeError(f"the written slab stores {rec['bits_per_weight']} bits per weight, over {MAX_BITS}.")


# --lora-layers: SquareQ's own LoRA layer, PEFT's lora.Linear around the QuantLinear (plain), PEFT's DoRA
LORA_LAYERS = ("squareq", "peft", "dora")


def evict_page_cache(slab: Path) -> None:
    """Ask the kernel to drop the slab's files from the page cache (posix_fadvise DONTNEED: no root needed)."""
    for path in Path(slab).iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plan_figures(setup: Setup, shape: Shape, prefetch: int | str, compute: str, offload: bool = False) -> dict:
    """runtime.plan's expected peak of this step (``plan_peak_GB``, ``plan_peak_reserved_GB``), or why there is none
    (``plan_error``). The plan takes square sides only, so a clip's is made for a square and scaled to the clip's
    tokens: the checkpointed block inputs (on the device or offloaded) and one block's recompute grow with them."""
    import squareq.runtime as rt
    from squareq.runtime.compute import resolve_compute
    from squareq.runtime.memory_plan import RESERVE_OVERHEAD

    try:
        plan = rt.plan(setup.slab, resolution=shape.res or 256, batch=1, text_tokens=setup.text_tokens,  # any side
                       prefetch=2 if prefetch == "auto" else prefetch, lora_rank=LORA_RANK, lora_targets=LORA_TARGETS,
                       compute=resolve_compute(compute, setup.device)[0], offload=offload,
                       control_tokens=setup.controls * (shape.res or 0) ** 2 // 256)  # a control: the target's size
        if shape.res is None:
            tokens = shape.clip_tokens(setup.config["patch_size"], setup.vae_side)
            grown = {k: getattr(plan, k) * tokens // plan.tokens for k in ("checkpoints", "recompute", "offloaded")}
            allocated = plan.peak_allocated + grown["checkpoints"] + grown["recompute"] - plan.checkpoints \
                - plan.recompute
            plan = dataclasses.replace(plan, **grown, tokens=tokens, peak_allocated=allocated,
                                       peak_reserved=int(allocated * RESERVE_OVERHEAD))
    except Exception as exc:  # the plan is a prediction beside the measurement: record why it failed, measure anyway
        return {"plan_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"plan_peak_GB": plan.peak_allocated / 1e9, "plan_peak_reserved_GB": plan.peak_reserved / 1e9}


def phase_squareq(setup: Setup, shape: Shape, prefetch: int | str, host: str, lora: str = "squareq",
                  compute: str = "bf16", cold: bool = False, graphs: bool = False, block_compile: bool = False,
                  fp8_backward: bool = False, attention: str = "auto", pieces: bool = False,
                  resident_blocks: int | str = 0, vram_budget_gb: float | None = None, fp16: bool = False,
                  offload: bool = False) -> None:
    import squareq.runtime as rt
    from squareq.runtime import block_compile as block_compile_module
    from squareq.runtime import compute as compute_module

    compute_module.FP8_BACKWARD = fp8_backward
    block_compile_module.WHOLE_BLOCKS = not pieces
    rec = {"what": "squareq", **shape.fields(), "prefetch": prefetch, "host": host, "lora": lora, "compute": compute,
           "cuda_graphs": graphs, "block_compile": block_compile, "fp8_backward": fp8_backward,
           "block_compile_pieces": block_compile and pieces, "offload_activations": offload,
           "attention": attention, "device": setup.device_name}
    if resident_blocks:
        rec.update(resident_blocks=resident_blocks, vram_budget_GB=vram_budget_gb)
    if fp16:  # squareq train --dtype fp16: no FP8 (its products are bf16)
        rec.update(dtype="fp16")
        compute = "bf16"
    if cold:
        rec["cold_cache"] = True  # the slab's pages are dropped from the page cache before every step
    trace_dir = os.environ.get("SQUAREQ_TRACE_DIR")
    trace = None
    if trace_dir and host == "pinned" and prefetch == 3 and shape.res == (128 if setup.tiny else 512):
        trace = str(Path(trace_dir) / f"trace_{shape}_{prefetch}.json")
        rec["trace"] = trace  # tracing adds events per block: this phase's timings carry that overhead
    if host == "disk" and not cold:
        rec["note"] = "the slab is far smaller than host RAM, so reads after the first come from the page cache"
    rec.update(plan_figures(setup, shape, prefetch, compute, offload))
    start = time.perf_counter()
    # verify="off": the slab was written (or checked to open) by this run's slab phase, and hashing
    # 6.7 GB in every phase would only lengthen the run.
    model = rt.load(setup.slab, setup.device, options=rt.LoadOptions(
        prefetch=2 if prefetch == "auto" else prefetch, host=host, verify="off", trace=trace, compute=compute,
        cuda_graphs=graphs, compile_blocks=block_compile, attention=attention, dtype="fp16" if fp16 else "bf16"))
    params = rt.add_lora(model, rank=LORA_RANK, targets=LORA_TARGETS, peft=lora == "peft",
                         variant=rt.LoraVariant(dora=True) if lora == "dora" else None)
    model.enable_gradient_checkpointing()
    runtime = rt.runtime_of(model)
    if offload:  # as squareq train --offload-activations on: the checkpointed block inputs wait in host memory
        runtime.activation_offload = rt.ActivationOffload(setup.device)
    setup.sync()
    rec.update(load_s=time.perf_counter() - start, setup_allocated_GB=allocated_GB(setup),
               lora_params=sum(p.numel() for p in params))
    rec["compute_used"] = runtime.compute
    rec["cudnn_attention_first"] = runtime.prefer_cudnn
    log(f"squareq {shape} K={prefetch} {host} {runtime.compute}: loaded in {rec['load_s']:.1f} s")
    tuner, after_step = squareq_stepper(setup, model, prefetch, resident_blocks, vram_budget_gb, cold)
    result = train(setup, model, params, shape, after_step,
                   label=f"squareq_{shape}_{prefetch}_{host}_{runtime.compute}"
                   + ("" if lora == "squareq" else f"_{lora}")
                   + ("_graphs" if graphs else "") + ("_compiled" if block_compile else "")
                   + ("_pieces" if block_compile and pieces else "")
                   + ("_fp8grad" if fp8_backward else "") + ("" if attention == "auto" else f"_attn-{attention}")
                   + (f"_keep{resident_blocks}" if resident_blocks else "") + ("_fp16" if fp16 else "")
                   + ("_offload" if offload else ""), fp16=fp16)
    if tuner is not None:
        rec.update(slots=len(runtime.streamer.slots), tuned=tuner.plan.describe() if tuner.plan else None,
                   kept_blocks=len(runtime.resident_blocks),
                   kept_GB=sum(runtime.streamer.block_sizes[b] for b in runtime.resident_blocks) / 1e9)
    stats = result.pop("median_figures")
    rec.update(result)
    if block_compile:  # the first steps compile each block class's graphs (Dynamo's count; the steps' excess)
        from squareq.runtime.block_compile import compile_seconds

        rec.update(block_compile_s=compile_seconds(), compile_s=result["beyond_steady_s"], dynamo=dynamo_figures())
    if graphs:
        rec.update({k: stats[k] for k in ("graph_captures", "graph_replays", "graph_eager", "graph_failures",
                                          "graph_ungraphed", "graph_at_once")})
    rec.update(copy_wait_s=stats["copy_wait_s"], copy_wait_share=stats["copy_wait_s"] / rec["step_s"],
               read_wait_s=stats["read_wait_s"],
               bytes_copied_GB=stats["bytes_copied"] / 1e9, copies=stats["copies"],
               demand_loads=stats["demand_loads"])
    if offload:
        rec["offloaded_GB"] = stats["offloaded_bytes"] / 1e9
    runtime.close()
    emit(rec)


def squareq_stepper(setup: Setup, model, prefetch: int | str, resident_blocks: int | str,
                    vram_budget_gb: float | None, cold: bool) -> tuple:
    """The StreamTuner that sizes the ring as squareq train's does (None where K and the kept blocks are fixed), and
    train()'s ``after_step``: it steps the tuner and returns the runtime's figures of the step just run (copies, graph
    counts, bytes offloaded), then drops the slab from the page cache for a cold-cache setup."""
    import torch

    import squareq.runtime as rt
    from squareq.runtime.residency import StreamTuner

    runtime, tuner, steps = rt.runtime_of(model), None, iter(range(-1, 1 << 30))
    if prefetch == "auto" or resident_blocks:  # as squareq train: measure the second step, then size the ring
        budget = None
        if vram_budget_gb is not None and setup.device.type == "cuda":  # as squareq train --vram-budget
            budget = lambda: max(0, int(vram_budget_gb * 1e9) - torch.cuda.max_memory_reserved(setup.device))  # noqa: E731
        tuner = StreamTuner(model, prefetch=prefetch, resident=resident_blocks, probe_step=1, budget_bytes=budget)

    def after_step() -> dict:
        i = next(steps)
        if tuner is not None:
            if i >= 0:
                tuner.after_step(i)
            tuner.before_step(i + 1)
        stats = runtime.step_stats().to_dict()
        if runtime.graphs is not None:  # captures in a step make train() warm up one step more
            counts = runtime.graphs.reset_stats()
            stats.update(graph_captures=counts.captures, graph_replays=counts.replays, graph_eager=counts.eager,
                         graph_failures=counts.failures, graph_ungraphed=counts.ungraphed,
                         graph_at_once=counts.at_once)
        if runtime.activation_offload is not None:  # what this step's checkpointed inputs moved to the host
            stats["offloaded_bytes"] = runtime.activation_offload.bytes_out
            runtime.activation_offload.clear()
        if cold:  # outside the timed step; the ring's prefetched blocks are already in flight
            runtime.streamer.settle()
            evict_page_cache(setup.slab)
        return stats

    return tuner, after_step


def lora_step(setup: Setup, shape: Shape, compute: str, dtype: str = "bf16") -> tuple:
    """One LoRA step of the streamed slab in ``compute`` and ``dtype``: the output and every LoRA gradient, on the
    host (fp16: the batch and autocast in fp16, the loss scaled by squareq train's first loss scale)."""
    import gc

    import torch

    import squareq.runtime as rt
    from squareq.runtime import compute as compute_mode
    from squareq.train.loss_scale import LossScale

    if dtype == "fp32":  # the reference only: the same effective weights and activations in fp32, no autocast
        compute_mode.DTYPES["fp32"] = torch.float32
    try:
        model = rt.load(setup.slab, setup.device,
                        options=rt.LoadOptions(prefetch=3, host="pinned", verify="off", compute=compute, dtype=dtype))
    finally:  # not a dtype SquareQ offers: gone again once this model is built
        compute_mode.DTYPES.pop("fp32", None) if dtype == "fp32" else None
    params = rt.add_lora(model, rank=LORA_RANK, targets=LORA_TARGETS, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B off zero: every A gets a gradient too
        for p in params:
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))
    model.enable_gradient_checkpointing()
    model.train()
    batch, target = make_batch(setup, shape, model)
    amp = torch.float32 if dtype == "fp32" else rt.autocast_dtype(model)
    batch = {k: v.to(amp) if v.dtype == torch.bfloat16 else v for k, v in batch.items()}
    with torch.autocast(setup.device.type, dtype=amp, enabled=dtype != "fp32"):
        out = model(**batch, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(predicted(out, target).float(), target.float())
    scale = LossScale().value if dtype == "fp16" else 1.0
    (loss * scale).backward()
    grads = {n: p.grad.float().cpu() / scale for n, p in rt.lora_parameters(model).items()}
    result = out.float().cpu(), grads, loss.item(), rt.runtime_of(model).compute
    rt.runtime_of(model).close()
    del model, params, out, loss
    gc.collect()
    if setup.cuda:
        torch.cuda.empty_cache()
    return result


# --gradient-variants: FP8 compute set up in other ways (runtime/compute.py's and kernels/fp8.py's switches),
# each compared with bf16 compute on the same step (issue 41's gradient cosine)
KERNEL_SWITCHES = ("FAST_ACCUM", "FP8_MIN_ROWS")  # kernels/fp8.py's; the others are runtime/compute.py's
GRADIENT_VARIANTS = {
    "fp8": {},  # squareq train's FP8 compute: the forward and recompute in FP8, input gradients bf16
    "fp8-backward": {"FP8_BACKWARD": True},  # the input gradients in FP8 too
    "slow-accum": {"FAST_ACCUM": False},  # fp32 accumulation in the tensor cores
    "small-rows": {"FP8_MIN_ROWS": 1},  # calls of any row count in FP8 (the modulation's one row per sample too)
    "fp16": {},  # not FP8: squareq train --dtype fp16 (issue 43), the same step in fp16 against bf16
    # the reference: the same step in fp32 (bf16's own error); named, it runs first and every other variant is
    # compared with it too
    "fp32": {},
}
VARIANT_RUNS = {"fp16": ("bf16", "fp16"), "fp32": ("bf16", "fp32")}  # variant -> (compute, dtype); others fp8, bf16


def phase_gradients(setup: Setup, shape: Shape, variants: list[str]) -> None:
    """The LoRA gradients and output of one step in FP8 compute against bf16's, for each of ``variants``
    (:data:`GRADIENT_VARIANTS`); a variant after ``fp8`` is also compared with ``fp8`` (its own share)."""
    from squareq.kernels import fp8 as fp8_kernels
    from squareq.runtime import compute as compute_mode

    out_b, grads_b, loss_b, _ = lora_step(setup, shape, "bf16")
    grads_fp8 = reference = None
    if "fp32" in variants:
        variants = ["fp32"] + [v for v in variants if v != "fp32"]
    for variant in variants:
        switches = GRADIENT_VARIANTS[variant]
        owner = {k: fp8_kernels if k in KERNEL_SWITCHES else compute_mode for k in switches}
        saved = {k: getattr(owner[k], k) for k in switches}
        for k, v in switches.items():
            setattr(owner[k], k, v)
        try:
            start = time.perf_counter()
            out_f, grads_f, loss_f, used = lora_step(setup, shape, *VARIANT_RUNS.get(variant, ("fp8", "bf16")))
            seconds = time.perf_counter() - start
        finally:
            for k, v in saved.items():
                setattr(owner[k], k, v)
        own = {} if grads_fp8 is None or variant == "fp8" else {
            "vs_fp8_" + k: v for k, v in gradient_agreement(grads_fp8, grads_f).items()}
        if variant == "fp32":
            reference = out_f, grads_f
        elif reference is not None:
            own.update({"vs_fp32_" + k: v for k, v in gradient_agreement(reference[1], grads_f).items()},
                       vs_fp32_out_rel_mse=((out_f - reference[0]).pow(2).mean() / reference[0].pow(2).mean()).item())
        if variant == "fp8":
            grads_fp8 = grads_f
        emit({"what": "gradients", **shape.fields(), "device": setup.device_name, "variant": variant,
              "dtype": VARIANT_RUNS.get(variant, ("fp8", "bf16"))[1],
              "backward": "fp8" if switches.get("FP8_BACKWARD") else "bf16",
              "switches": switches,
              "compute_used": used, **gradient_agreement(grads_b, grads_f), **own, "loss_bf16": loss_b,
              "loss_fp8": loss_f, "out_rel_mse": ((out_f - out_b).pow(2).mean() / out_b.pow(2).mean()).item(),
              "load_step_s": seconds})


def gradient_agreement(grads_b: dict, grads_f: dict) -> dict:
    """Cosines (per tensor and over all) and the norm ratio of ``grads_f`` against ``grads_b``."""
    import torch

    # float64: a float32 dot product over 65M entries rounds past a cosine of 1
    cos = {n: torch.nn.functional.cosine_similarity(grads_b[n].double().flatten(), grads_f[n].double().flatten(),
                                                    dim=0).item() for n in grads_b}
    flat_b = torch.cat([g.double().flatten() for g in grads_b.values()])
    flat_f = torch.cat([grads_f[n].double().flatten() for n in grads_b])
    worst = min(cos, key=cos.get)
    return {"tensors": len(cos), "cos_global": torch.nn.functional.cosine_similarity(flat_b, flat_f, dim=0).item(),
            "cos_median": statistics.median(cos.values()), "cos_min": cos[worst], "cos_min_tensor": worst,
            "norm_ratio": (flat_f.norm() / flat_b.norm()).item()}


def compile_blocks(model) -> int:
    """Put each transformer block of ``model`` under ``torch.compile`` (default mode, in place); the blocks
    compiled. Per block, as diffusers documents for its transformers (``mode="reduce-overhead"`` per block failed on
    this model: CUDA-graph outputs overwritten, issue 41). The blocks are those SquareQ streams (the family adapter's:
    Wan's ``blocks`` too)."""
    from squareq.models import adapter_for

    blocks = adapter_for(model).blocks(model)
    for name in blocks:
        model.get_submodule(name).compile()
    return len(blocks)


def phase_resident(setup: Setup, shape: Shape, compiled: bool = False, cudnn_first: bool = False) -> None:
    """The resident bf16 model, eager or compiled per block; ``cudnn_first``: with cuDNN attention first in torch's
    priority (what a user who knows it can set, ``sdpa_kernel(..., set_priority=True)``), else torch's own order."""
    rec = {"what": "resident", **shape.fields(), "device": setup.device_name, "compiled": compiled,
           "cudnn_attention_first": cudnn_first}
    if cudnn_first:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        global _CUDNN_FIRST  # held for the rest of this phase's process: a dropped context manager would exit
        _CUDNN_FIRST = sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)
        _CUDNN_FIRST.__enter__()
        rec["sdpa_priority"] = _sdpa_priority()
    start = time.perf_counter()
    model = build_model(setup)
    params = peft_lora(model)
    model.enable_gradient_checkpointing()
    if compiled:
        rec["compiled_blocks"] = compile_blocks(model)
    setup.sync()
    rec.update(build_s=time.perf_counter() - start, setup_allocated_GB=allocated_GB(setup),
               lora_params=sum(p.numel() for p in params))
    label = f"resident{'_compiled' if compiled else ''}{'_cudnn' if cudnn_first else ''}_{shape}"
    result = train(setup, model, params, shape, lambda: memory_peaks(setup), label=label)
    result.pop("median_figures")
    if compiled:  # the first steps compile each block kind's forward and backward graphs
        result["compile_s"] = result["beyond_steady_s"]
    emit(not_measured({**rec, **result}, *PEER_UNMEASURED))


def phase_bnb(setup: Setup, shape: Shape) -> None:
    import gc

    import bitsandbytes as bnb
    import torch

    rec = {"what": "bnb", **shape.fields(), "device": setup.device_name, "bnb": bnb.__version__}
    model = build_model(setup)
    start = time.perf_counter()

    def swap(module):
        # Linear4bit is made on meta (no host allocation or init) and quantizes the bf16 weight already on
        # the GPU when moved there; peer_baselines went through the host, which only costs time.
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child.in_features >= 1024:
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                if child.bias is not None:
                    q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(module, name, q.to(setup.device))
            else:
                swap(child)

    swap(model)
    gc.collect()
    torch.cuda.empty_cache()
    setup.sync()
    rec.update(quantize_s=time.perf_counter() - start, weights_GB=allocated_GB(setup))
    params = peft_lora(model)
    model.enable_gradient_checkpointing()
    result = train(setup, model, params, shape, lambda: memory_peaks(setup))
    result.pop("median_figures")
    emit(not_measured({**rec, **result}, *PEER_UNMEASURED))


def phase_group_offload(setup: Setup, shape: Shape) -> None:
    import torch

    rec = {"what": "group_offload", **shape.fields(), "device": setup.device_name}
    start = time.perf_counter()
    model = build_model(setup)
    params = peft_lora(model)
    model = model.to("cpu")  # the offload hooks own placement from here on
    torch.cuda.empty_cache()
    model.enable_gradient_checkpointing()
    model.enable_group_offload(onload_device=setup.device, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    rec["setup_s"] = time.perf_counter() - start
    result = train(setup, model, params, shape, lambda: memory_peaks(setup))
    result.pop("median_figures")
    emit(not_measured({**rec, **result}, *PEER_UNMEASURED))


def _sdpa_priority() -> list[str]:
    """torch's scaled-dot-product-attention backends in its priority order (what a user gets by default)."""
    import torch
    from torch.nn.attention import SDPBackend

    names = {int(b): name for name, b in SDPBackend.__members__.items()}
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    return [names.get(int(i), str(i)) for i in order()] if order else []


def dynamo_figures() -> dict:
    """What Dynamo compiled in this process: graphs, graph breaks, frames, and seconds per compile stage."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "break_reasons": sorted(counters["graph_break"])[:10], "aot_autograd": dict(counters["aot_autograd"]),
            "fxgraph_cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            "seconds": {k: [round(sum(v), 2), len(v)] for k, v in compilation_time_metrics.items()}}


def phase_record(phase: list[str]) -> dict:
    """The identifying keys of a phase's record, from its command line (``squareq 512 3 pinned``, ``resident
    49x480x832``)."""
    rec: dict = {"what": phase[0]}
    if phase[0] != "slab":
        rec.update(Shape.parse(phase[1]).fields())
    if phase[0] == "gradients":
        rec["variants"] = phase[2:] or ["fp8", "fp8-backward"]
    if phase[0] == "resident":
        rec["compiled"] = "compiled" in phase[2:]
        rec["cudnn_attention_first"] = "cudnn" in phase[2:]
    if phase[0] == "squareq":
        k = phase[2]
        rec.update(prefetch=k if k == "auto" else int(k), host=phase[3], lora=phase[4] if len(phase) > 4 else "squareq",
                   compute=phase[5] if len(phase) > 5 else "bf16", cold="cold" in phase[6:],
                   graphs="graphs" in phase[6:], block_compile="compiled" in phase[6:],
                   fp8_backward="fp8grad" in phase[6:], pieces="pieces" in phase[6:],
                   attention=next((t[5:] for t in phase[6:] if t in ("attn-default", "attn-cudnn")), "auto"))
        keep = next((t[4:] for t in phase[6:] if t.startswith("keep")), "0")
        budget = next((float(t[6:]) for t in phase[6:] if t.startswith("budget")), None)
        rec.update(resident_blocks=keep if keep == "auto" else int(keep), vram_budget_GB=budget,
                   fp16="fp16" in phase[6:], offload_activations="offload" in phase[6:])
    return rec


def run_here(phase: list[str], args) -> list[dict]:
    """``--tiny``: one phase in this process, as :func:`spawn` runs it in its own; its records (an error record if
    it failed)."""
    start, first = time.perf_counter(), len(RECORDS)
    try:
        phase_body(argparse.Namespace(**{**vars(args), "phase": phase}))
    except Exception as exc:
        import traceback

        traceback.print_exc()
        emit({**phase_record(phase), "error": f"{type(exc).__name__}: {exc}"[:500]})
    records = RECORDS[first:]
    for r in records:
        r["phase_wall_s"] = round(time.perf_counter() - start, 1)
    log(f"phase {' '.join(phase)}: {'FAILED' if any('error' in r for r in records) else 'ok'}")
    return records


def slab_here(workdir, family: str, tiny: bool) -> None:
    """The slab phase in this process, for another script's ``--tiny`` path (seconds, not a process start): the slab
    of ``family`` in ``workdir`` written, or reused when there; its JSON line goes to stderr, whose stdout carries
    the caller's own records."""
    import contextlib

    args = parse_args(["--workdir", str(workdir), "--family", family, "--phase", "slab"] + (["--tiny"] if tiny else []))
    with contextlib.redirect_stdout(sys.stderr):
        phase_body(args)


def run_phase(args) -> None:
    """Run one phase in this process; an exception becomes an error record and a nonzero exit."""
    try:
        phase_body(args)
    except Exception as exc:
        import traceback
        traceback.print_exc()
        emit({**phase_record(args.phase), "error": f"{type(exc).__name__}: {exc}"[:500]})
        sys.exit(1)


def phase_body(args) -> None:
    """The phase ``args.phase`` names, in this process."""
    import torch

    name, rec = args.phase[0], phase_record(args.phase)
    # The cuDNN attention backward fails on the device image for some shapes (tiny-flux's narrow heads: NaN);
    # only the setups that choose cuDNN attention (SquareQ's attention="auto" at FLUX.1's head width, the
    # resident model with it first) keep it on.
    torch.backends.cuda.enable_cudnn_sdp(rec.get("cudnn_attention_first", False)
                                         or (name == "squareq" and rec["attention"] in ("auto", "cudnn")))
    setup = Setup(args)
    log(f"phase {' '.join(args.phase)} on {setup.device_name}")
    shape = None if name == "slab" else Shape.parse(args.phase[1])
    if name == "slab":
        phase_slab(setup)
    elif name == "squareq":
        phase_squareq(setup, shape, rec["prefetch"], rec["host"], rec["lora"], rec["compute"], rec["cold"],
                      rec["graphs"], rec["block_compile"], rec["fp8_backward"], rec["attention"],
                      rec["pieces"], rec["resident_blocks"], rec["vram_budget_GB"], rec["fp16"],
                      rec["offload_activations"])
    elif name == "resident":
        phase_resident(setup, shape, rec["compiled"], rec["cudnn_attention_first"])
    elif name == "gradients":
        phase_gradients(setup, shape, rec["variants"])
    else:
        {"bnb": phase_bnb, "group_offload": phase_group_offload}[name](setup, shape)


# ----------------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------------

def spawn(phase: list[str], args, timeout: float) -> list[dict]:
    """Run a phase subprocess, echo its output, return its JSON records (an error record if it died)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", *phase, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--workdir", str(args.workdir), "--family", args.family,
           "--targets", args.targets, "--rank", str(args.rank), "--guidance", repr(args.guidance),
           "--controls", str(args.controls)] + \
        (["--tiny"] if args.tiny else []) + (["--rotate"] if args.rotate else [])
    log(f"phase {' '.join(phase)}: start (timeout {timeout:.0f} s)")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    tail: collections.deque = collections.deque(maxlen=15)

    def pump_stderr():
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    pump = threading.Thread(target=pump_stderr, daemon=True)
    pump.start()
    killed = threading.Event()

    def kill():
        killed.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    records = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    rc = proc.wait()
    timer.cancel()
    pump.join(timeout=5)
    wall = time.perf_counter() - start
    if rc != 0 and not any("error" in r for r in records):
        why = f"timed out after {timeout:.0f} s" if killed.is_set() else f"exit code {rc}"
        records.append({**phase_record(phase), "error": f"{why}; stderr tail: {' | '.join(list(tail)[-4:])}"[:800]})
    for r in records:
        r["phase_wall_s"] = round(wall, 1)
    log(f"phase {' '.join(phase)}: {'ok' if rc == 0 else 'FAILED'} in {wall:.1f} s")
    return records


def add_ratios(records: list[dict]) -> None:
    """Each step time over the eager resident model's (``ratio_to_resident``) and the compiled one's
    (``ratio_to_compiled``) at its shape; not measured where the run has not measured that peer (yet)."""
    for key, compiled in (("ratio_to_resident", False), ("ratio_to_compiled", True)):
        base = {r["shape"]: r["step_s"] for r in records
                if r.get("what") == "resident" and bool(r.get("compiled")) == compiled and "step_s" in r}
        for r in records:
            if "step_s" in r:
                set_figure(r, key, r["step_s"] / base[r["shape"]] if r.get("shape") in base else None)


LABELS = {"squareq": "SquareQ", "resident": "bf16 resident", "bnb": "bitsandbytes NF4",
          "gradients": "LoRA grads vs bf16",
          "group_offload": "diffusers group offload"}


def setup_label(r: dict) -> str:
    """A steps row's setup: what ran, with the options that tell it from its neighbours."""
    what = r.get("what")
    setup = LABELS.get(what, what)
    if what == "squareq":
        setup += f" K={r.get('prefetch')} {r.get('host')}{' (cold cache)' if r.get('cold_cache') else ''}" \
            f"{' graphs' if r.get('cuda_graphs') else ''}{' compiled' if r.get('block_compile') else ''}" \
            f"{' (pieces)' if r.get('block_compile_pieces') else ''}" \
            f"{' fp8-backward' if r.get('fp8_backward') else ''}" \
            f"{' cuDNN attention' if r.get('cudnn_attention_first') else ''}" \
            f"{'' if r.get('attention', 'auto') == 'auto' else ' attention=' + r['attention']}" \
            f" {r.get('compute', 'bf16')}" + (
            f" ({r['compute_used']})" if r.get("compute") == "auto" and r.get("compute_used") else "") + (
            "" if r.get("lora", "squareq") == "squareq" else f", {r['lora']} LoRA layers") + (
            f", resident_blocks {r['resident_blocks']}" if r.get("resident_blocks") else "") + (
            f" within {r['vram_budget_GB']} GB" if r.get("resident_blocks") and r.get("vram_budget_GB") else "") + (
            ", dtype fp16" if r.get("dtype") == "fp16" else "") + (
            ", activations offloaded" if r.get("offload_activations") else "")
    if r.get("compiled"):
        setup += ", torch.compile per block" + (", cuDNN attention first" if r.get("cudnn_attention_first") else "")
    return setup


def squareq_notes(r: dict) -> list[str]:
    notes = []
    if r.get("dtype") == "fp16" and "losses" in r:
        notes.append(f"{len(r['losses'])} steps, losses {'all finite' if r['losses_finite'] else 'NOT finite'}"
                     f", {len(r['loss_scale_overflows'])} loss-scale halvings (scale {r['loss_scale']:g})")
    if r.get("slots") is not None:
        notes.append(f"auto chose {r['slots']} slots" + (
            f", kept {r['kept_blocks']} blocks ({r['kept_GB']:.2f} GB)" if r.get("kept_blocks") else ""))
    if r.get("cuda_graphs") and "graph_replays" in r:
        notes.append(f"{r['graph_replays']} graph replays/step after {r['warmup_steps']} warm-up steps"
                     + (f", {r['graph_failures']} failed captures" if r["graph_failures"] else "")
                     + (f"; {r['peak_reserved_all_steps_GB']:.2f} GB reserved at peak with the warm-up"
                        if "peak_reserved_all_steps_GB" in r else ""))
    if "step_s" in r:
        notes.append(f"{r['bytes_copied_GB']:.2f} GB copied/step, {r['demand_loads']} demand loads")
    if "offloaded_GB" in r:
        notes.append(f"{r['offloaded_GB']:.2f} GB of block inputs to the host/step")
    if "block_compile_s" in r:
        notes.append(f"torch.compile {r['block_compile_s']:.1f} s (warm-up beyond steady {r['compile_s']:.1f} s)")
    if "plan_peak_GB" in r:
        notes.append(f"plan peak {r['plan_peak_GB']:.2f} GB"
                     + (f" / {r['plan_peak_reserved_GB']:.2f} GB reserved" if "plan_peak_reserved_GB" in r else ""))
    elif "plan_error" in r:
        notes.append(f"plan: {r['plan_error'][:60]}")
    return notes


def step_notes(r: dict) -> str:
    notes = squareq_notes(r) if r.get("what") == "squareq" else []
    if r.get("compiled") and "compile_s" in r:
        notes.append(f"compile {r['compile_s']:.1f} s in the warm-up steps")
    if "loss_first" in r:
        notes.append(f"loss₀ {r['loss_first']:.5f}")
    if "error" in r:
        notes.append(f"error: {r['error'][:160]}")
    if "skipped" in r:
        notes.append(f"skipped: {r['skipped']}")
    return "; ".join(notes)


def gradient_notes(r: dict) -> str:
    notes = []
    if "vs_fp8_cos_global" in r:
        notes.append(f"against the fp8 variant: cos {r['vs_fp8_cos_global']:.4f} (min {r['vs_fp8_cos_min']:.4f}), "
                     f"norm ratio {r['vs_fp8_norm_ratio']:.4f}")
    if "vs_fp32_cos_global" in r:
        notes.append(f"against fp32: cos {r['vs_fp32_cos_global']:.4f} (min {r['vs_fp32_cos_min']:.4f}), "
                     f"norm ratio {r['vs_fp32_norm_ratio']:.4f}, output rel-MSE {r['vs_fp32_out_rel_mse']:.2e}")
    return "; ".join(notes + ([f"error: {r['error'][:160]}"] if "error" in r else []))


STEP_COLUMNS = [
    Column("setup", "what", setup_label), Column("shape", "shape", lambda r: shape_label(r["shape"])),
    Column("tokens", "tokens"), Column("step s", "step_s", ".3f"),
    Column("× bf16 resident", "ratio_to_resident", ".2f"),
    Column("× compiled resident", "ratio_to_compiled", ".2f"),
    Column("peak alloc GB", "peak_alloc_GB", ".2f"), Column("peak reserved GB", "peak_reserved_GB", ".2f"),
    Column("copy-wait %", "copy_wait_share", lambda r: f"{100 * r['copy_wait_share']:.1f}"),
    Column("notes", None, step_notes)]
SLAB_COLUMNS = [
    Column("slab", "path"), Column("GB", "slab_bytes", lambda r: f"{r['slab_bytes'] / 1e9:.2f}"),
    Column("bits/w", "bits_per_weight"), Column("streamed GB", "streamed_GB", ".2f"),
    Column("written", "reused", lambda r: "reused" if r["reused"] else f"in {r['write_s']:.0f} s")]
GRADIENT_COLUMNS = [
    Column("LoRA grads vs bf16", "variant"), Column("shape", "shape", lambda r: shape_label(r["shape"])),
    Column("cos", "cos_global", ".4f"), Column("cos median", "cos_median", ".4f"), Column("cos min", "cos_min", ".4f"),
    Column("norm ratio", "norm_ratio", ".4f"), Column("output rel-MSE", "out_rel_mse", ".2e"),
    Column("notes", None, gradient_notes)]


def tables(records: list[dict]) -> str:
    env = records[0]
    head = (f"{env.get('family', 'flux')}; device: {env.get('device')}, torch {env['torch']}, {env['date_utc']}, "
            f"commit {env['commit']}{' (tiny config)' if env['tiny'] else ''}; median of {env['steps']} steps after "
            f"{env['warmup']} warm-up; LoRA targets: {env.get('targets', 'attention')}, rank "
            f"{env.get('rank', LORA_RANK)}")
    parts = [head, ""]
    if any(r.get("what") == "slab" for r in records):
        parts += [table(records, SLAB_COLUMNS, where={"what": "slab"}), ""]
    parts.append(table(records, STEP_COLUMNS, where={"what": ["squareq", "resident", "bnb", "group_offload"]}))
    if any(r.get("what") == "gradients" for r in records):
        parts += ["", table(records, GRADIENT_COLUMNS, where={"what": "gradients"})]
    return "\n".join(parts)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write DIR/train_step.jsonl")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/squareq_bench"), help="where the slab goes")
    ap.add_argument("--res", type=shape_arg, nargs="*",
                    help="resolutions for squareq pinned, resident, bnb (512 1024; none: only the other phases); a "
                         "video family's clip as FRAMESxHEIGHTxWIDTH (49x480x832) too")
    ap.add_argument("--frames", type=int, nargs="+",
                    help="a video family's clips: pixel frames, 4k+1 (default 49 81; tiny 5), each at --size; added "
                         "to --res's shapes")
    ap.add_argument("--size", help="a video family's clips: HEIGHTxWIDTH pixels, multiples of 16 (default 480x832; "
                                   "tiny 32x48)")
    ap.add_argument("--disk-res", type=shape_arg, nargs="*",
                    help="shapes for squareq host=disk K=3 (the first of --res's)")
    ap.add_argument("--offload-res", type=shape_arg, nargs="*", help="shapes for group offload (the first of --res's)")
    ap.add_argument("--bnb-res", type=shape_arg, nargs="*", help="shapes for bnb (same as --res)")
    ap.add_argument("--prefetch", nargs="+", default=["2", "3"],
                    help="ring sizes K for host=pinned: whole numbers, or auto (squareq train's default)")
    ap.add_argument("--compute", nargs="+", default=["auto"],
                    help="compute modes of the SquareQ setups: bf16, fp8, auto (squareq train's default)")
    ap.add_argument("--graphs", nargs="+", choices=("off", "on"), default=["off"],
                    help="SquareQ setups without and/or with CUDA graphs per block (squareq train --cuda-graphs); "
                         "with them, warm-up goes on while a step still captures graphs (at most "
                         f"{MAX_CAPTURE_STEPS} steps more)")
    ap.add_argument("--block-compile", nargs="+", choices=("off", "on", "pieces"), default=["off"],
                    help="SquareQ setups without and/or with each block class's forward under torch.compile "
                         "(squareq train --compile); the first steps compile, reported as compile_s. pieces: the "
                         "quantized layers kept eager between compiled pieces (block_compile.WHOLE_BLOCKS off)")
    ap.add_argument("--attention", nargs="+", choices=("auto", "default", "cudnn"), default=["auto"],
                    help="SquareQ's attention kernel choice (LoadOptions.attention): auto (cuDNN first where "
                         "measured faster), default (torch's order), cudnn (cuDNN first on any GPU); several: one "
                         "phase each")
    ap.add_argument("--resident-attention", nargs="+", choices=("default", "cudnn"), default=["default"],
                    help="the compiled resident model's attention: torch's order (default), or cuDNN first; several: "
                         "one phase each")
    ap.add_argument("--fp8-backward", nargs="+", choices=("off", "on"), default=["off"],
                    help="SquareQ setups with the frozen layers' input gradients in bf16 and/or FP8 "
                         "(runtime.compute.FP8_BACKWARD; FP8 compute only)")
    ap.add_argument("--resident-blocks", nargs="+", default=["0"],
                    help="squareq train --resident-blocks of the pinned SquareQ setups: 0, a count or auto (each one "
                         "a setup)")
    ap.add_argument("--vram-budget", type=float,
                    help="GB: squareq train --vram-budget of the --resident-blocks auto setup (counts are kept whole)")
    ap.add_argument("--dtype", nargs="+", choices=("bf16", "fp16"), default=["bf16"],
                    help="squareq train --dtype of the pinned SquareQ setups (fp16: no FP8, the loss scaled)")
    ap.add_argument("--offload-activations", nargs="+", choices=("off", "on"), default=["off"],
                    help="pinned SquareQ setups without and/or with the checkpointed block inputs in host memory "
                         "(squareq train --offload-activations on: long clips)")
    ap.add_argument("--disk-prefetch", default="3", help="ring size K of the host=disk setups (a number or auto)")
    ap.add_argument("--disk-cold", action="store_true",
                    help="also run each host=disk setup with the slab dropped from the page cache before every step")
    ap.add_argument("--gradients-res", type=shape_arg, nargs="*", default=[],
                    help="resolutions at which to compare LoRA gradients in FP8 and bf16 compute (e.g. 512)")
    ap.add_argument("--gradient-variants", nargs="+", choices=sorted(GRADIENT_VARIANTS),
                    default=["fp8", "fp8-backward"],
                    help="the FP8 set-ups --gradients-res compares with bf16 (GRADIENT_VARIANTS)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps (median)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", default="slab,squareq,resident,compiled,bnb,group_offload",
                    help="setups: slab, squareq, resident (eager), compiled (resident, torch.compile per block), bnb, "
                         "group_offload")
    ap.add_argument("--phase-timeout", type=float, default=240, help="seconds per training phase")
    ap.add_argument("--slab-timeout", type=float, default=480, help="seconds for the slab phase")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="flux", help="which model (default flux)")
    ap.add_argument("--tiny", action="store_true",
                    help="the family's tiny config, every phase in this process; runs on the CPU without a GPU")
    ap.add_argument("--rotate", action="store_true",
                    help="every slab layer Hadamard-rotated (its own slab): the rotation's cost in the step (issue 42)")
    ap.add_argument("--targets", choices=TARGET_SETS, default="attention",
                    help="LoRA targets: the attention projections, FLUX.1's default set (every attention and MLP "
                         "linear of both streams), or Wan's attention and FFN (attention-ffn: every linear of its "
                         "blocks)")
    ap.add_argument("--rank", type=int, default=LORA_RANK, help=f"LoRA rank (alpha = rank; default {LORA_RANK})")
    ap.add_argument("--lora-layers", default="squareq",
                    help="comma list of LoRA layers for the pinned SquareQ setups: squareq (its own fast path), peft "
                         "(PEFT's lora.Linear around the quantized layer), dora (PEFT's DoRA)")
    from squareq.models.noising import DEFAULT_GUIDANCE

    ap.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE,
                    help="the embedded guidance of every training batch (default: squareq train's). The model "
                         "multiplies it by 1000 in the activations' type, where bf16 rounds 3500 to 3504 but not "
                         "1000: a guidance of 3.5 gives bf16 another input than fp16 and fp32 (docs/benchmarks.md)")
    ap.add_argument("--controls", type=int, choices=(0, 1), default=0,
                    help="FLUX.1 Kontext: control images per sample, each as many tokens as the target and "
                         "appended after them (ids (1, i, j)); the loss is on the target's tokens (default 0)")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)  # internal: run one phase in this process
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def use_lora_options(args) -> None:
    """--targets and --rank, for every phase this process runs."""
    from squareq.models.flux import FLUX_LORA_TARGETS

    global LORA_RANK, LORA_TARGETS
    LORA_RANK = args.rank
    LORA_TARGETS = list({"attention": ATTENTION_TARGETS, "flux-default": FLUX_LORA_TARGETS,
                         "attention-ffn": ATTENTION_TARGETS + WAN_FFN}[args.targets])


def shape_lists(ap: argparse.ArgumentParser, args) -> tuple[list[str], ...]:
    """The shapes of the pinned setups (--res, and the clips of --frames at --size), of the disk, group offload, bnb
    and gradients setups. By default an image family's are 512² and 1024² (tiny: 128², (128/16)² = 64 image tokens),
    a video family's clips of 49 and 81 frames at 480x832 (tiny: 5 frames at 32x48, 2 x 2 x 3 = 12 tokens; a 16x VAE's,
    :data:`VAE_SIDES`, at 64x96, the same tokens)."""
    from squareq.models import ADAPTERS

    recipe = ADAPTERS[squareq_family(args.family)].recipe
    vae_side = VAE_SIDES.get(args.family, VAE_SIDE)
    video = bool(recipe and recipe.frames)
    clips = args.frames is not None or args.size is not None or (video and args.res is None)
    res = list(args.res) if args.res is not None else [] if clips else ["128"] if args.tiny else ["512", "1024"]
    if clips:
        scale = vae_side // VAE_SIDE
        size = args.size or (f"{32 * scale}x{48 * scale}" if args.tiny else "480x832")
        frames = args.frames or ([5] if args.tiny else [49, 81])
        try:
            res += [str(Shape.parse(f"{n}x{size}")) for n in frames]
        except ValueError as exc:
            ap.error(f"--frames/--size: {exc}")
    lists = (res, res[:1] if args.disk_res is None else args.disk_res,
             res[:1] if args.offload_res is None else args.offload_res, res if args.bnb_res is None else args.bnb_res,
             args.gradients_res)
    if not video and any(Shape.parse(s).res is None for shapes in lists for s in shapes):
        ap.error(f"--family {args.family} takes square sides: clips (--frames, --size, FxHxW) are for video families")
    clip_shapes = [Shape.parse(s) for shapes in lists for s in shapes if Shape.parse(s).res is None]
    odd = [c for c in clip_shapes if c.height % (2 * vae_side) or c.width % (2 * vae_side)]
    if odd:  # Shape.parse checks the 8x VAE's multiples of 16 only
        ap.error(f"--family {args.family}: the clip {odd[0]} needs sides that are multiples of {2 * vae_side} (its "
                 f"VAE's {vae_side}x, then 2x2 patches)")
    return lists


def squareq_options(ap: argparse.ArgumentParser, args, cuda: bool) -> tuple[list[list[str]], list[list[str]]]:
    """The tokens of the pinned SquareQ phases after their K (LoRA layers, compute, graphs and compile, kept blocks,
    dtype, activation offload: one phase each), and those of graphs and compile alone, which the disk phases take."""
    graph_tokens = [(["graphs"] if g == "on" else []) + {"off": [], "on": ["compiled"],
                                                          "pieces": ["compiled", "pieces"]}[bc]
                    + (["fp8grad"] if fb == "on" else []) + ([] if at == "auto" else [f"attn-{at}"])
                    for g in dict.fromkeys(args.graphs) for bc in dict.fromkeys(args.block_compile)
                    for fb in dict.fromkeys(args.fp8_backward) for at in dict.fromkeys(args.attention)]
    budget_token = [f"budget{args.vram_budget}"] if args.vram_budget is not None else []
    dtype_tokens = [([] if d == "bf16" else ["fp16"]) + ([] if o == "off" else ["offload"])
                    for d in dict.fromkeys(args.dtype) for o in dict.fromkeys(args.offload_activations)]
    keep_tokens = [[] if k == "0" else [f"keep{k}"] + (budget_token if k == "auto" else [])
                   for k in dict.fromkeys(args.resident_blocks)]
    if not cuda and any("graphs" in t for t in graph_tokens):
        ap.error("--graphs on needs a CUDA device (CUDA graphs)")
    lora_layers = args.lora_layers.split(",")
    if not set(lora_layers) <= set(LORA_LAYERS):
        ap.error(f"--lora-layers: choose from {', '.join(LORA_LAYERS)}")
    return [[lora, c] + graphs + keep + dtype for lora in lora_layers for c in args.compute for graphs in graph_tokens
            for keep in keep_tokens for dtype in dtype_tokens], graph_tokens


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    use_lora_options(args)
    if args.phase:
        return run_phase(args)

    import torch  # version only: touching CUDA here would hold GPU memory during every phase

    cuda = torch.cuda.is_available()
    res, disk_res, offload_res, bnb_res, gradients_res = shape_lists(ap, args)
    if args.targets == "attention-ffn" and squareq_family(args.family) != "wan":
        ap.error("--targets attention-ffn names Wan's FFN linears (ffn.net.0.proj, ffn.net.2): a Wan --family only "
                 f"({', '.join(f for f in FAMILIES if squareq_family(f) == 'wan')})")
    only = set(args.only.split(","))
    unknown = only - {"slab", "squareq", "resident", "compiled", "bnb", "group_offload"}
    if unknown:
        ap.error(f"--only: unknown setups {sorted(unknown)}")
    if args.controls and squareq_family(args.family) != "flux":
        ap.error(f"--controls: FLUX.1 Kontext's control images (--family flux), not --family {args.family}'s")
    if args.family in SLAB_ONLY and only != {"slab"}:
        ap.error(f"--family {args.family}: its slab only (--only slab, as benchmarks/cards.py builds it)")
    pinned, graph_tokens = squareq_options(ap, args, cuda)

    commit = git_commit()
    env = {"what": "env", "family": args.family, "device": None, "torch": torch.__version__, "tiny": args.tiny,
           "steps": args.steps, "targets": args.targets, "rank": args.rank, "rotate": args.rotate,
           "guidance": args.guidance, "controls": args.controls, "warmup": args.warmup, "commit": commit,
           "sdpa_priority": _sdpa_priority(),
           "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    emit(env)
    records = [env]

    phases: list[list[str]] = []
    if only & {"slab", "squareq"}:
        phases.append(["slab"])
    for r in res:  # resident first at each shape: it is what every ratio divides by
        if "resident" in only:
            phases.append(["resident", r])
        if "compiled" in only:
            phases += [["resident", r, "compiled"] + (["cudnn"] if a == "cudnn" else [])
                       for a in dict.fromkeys(args.resident_attention)]
        if "squareq" in only:
            phases += [["squareq", r, str(k), "pinned", *options] for k in args.prefetch for options in pinned]
    if "squareq" in only:
        phases += [["squareq", r, args.disk_prefetch, "disk", "squareq", args.compute[0]] + cold + graphs
                   for r in disk_res for cold in ([[], ["cold"]] if args.disk_cold else [[]])
                   for graphs in graph_tokens]
        phases += [["gradients", r, *args.gradient_variants] for r in gradients_res]
    skipped = []
    for name, rs in (("bnb", bnb_res), ("group_offload", offload_res)):
        if name not in only:
            continue
        if not cuda:
            skipped += [{"what": name, **Shape.parse(r).fields(), "skipped": "no CUDA device"} for r in rs]
        elif name == "bnb" and subprocess.run([sys.executable, "-c", "import bitsandbytes"],
                                              capture_output=True, check=False).returncode != 0:
            skipped += [{"what": name, **Shape.parse(r).fields(), "skipped": "bitsandbytes does not import"}
                        for r in rs]
        else:
            phases += [[name, r] for r in rs]

    log("phases: " + ", ".join(" ".join(p) for p in phases))
    for phase in phases:
        if phase[0] == "squareq" and any(r.get("what") == "slab" and "error" in r for r in records):
            records.append(emit({**phase_record(phase), "skipped": "no slab"}))
            continue
        # --tiny: every phase in this process (seconds, not a process start each); else each in its own
        new = run_here(phase, args) if args.tiny else \
            spawn(phase, args, args.slab_timeout if phase == ["slab"] else args.phase_timeout)
        env["device"] = env["device"] or next((r["device"] for r in new if r.get("device")), None)
        records += new
        add_ratios(records)
        write_records(args.out, "train_step.jsonl", records)
    records += [emit(r) for r in skipped]
    add_ratios(records)
    write_records(args.out, "train_step.jsonl", records)
    print()
    print(tables(records))


if __name__ == "__main__":
    main()
