"""The training loop behind ``squareq train``: cache, then LoRA steps on the streamed slab with the family's objective.

1. The slab is loaded through the runtime (blocks streamed, gradient checkpointing on) and LoRA factors
   are attached. With ``vram_budget`` set on a GPU, the memory plan is checked before anything else.
2. Images and captions are scanned; VAE latents and text embeddings are computed once into the cache
   (only entries that are missing), and the encoders are released before training starts.
3. Each step draws a batch of one bucket, noise and timesteps from the run's own generator, computes
   the family's loss (rectified flow, or DDPM epsilon / v-prediction for the UNets; the family's recipe in
   squareq/models turns latents and captions into the denoiser's arguments) and updates the LoRA with AdamW.
   A step whose loss or gradients are not finite is skipped and counted; ``nan_patience`` skips in a row
   stop the run with the last good checkpoint left untouched.
4. Every ``save_every`` steps a checkpoint (LoRA, optimizer, schedule, RNG states, data position) is
   written atomically; ``resume="latest"`` continues from the newest one exactly (bitwise on a CPU).
   The finished LoRA is written in the diffusers/PEFT layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..devices import default_device
from ..extras import require
from ..models import ADAPTERS
from ..plot import first_frame, plot_curves, smooth, write_png, write_sample
from ..runtime.block_compile import compile_seconds, resolve_compile
from ..runtime.compute import ComputeError, resolve_compute, resolve_dtype
from ..runtime.host_choice import choose_host
from ..runtime.host_memory import HostMemoryError
from ..runtime.peft_lora import lycoris_config
from ..runtime.residency import StreamTuner
from ..slab import open_slab
from ..slab.atomic import atomic_write_bytes, ensure_output_dir, os_error_sentence, remove_debris
from .cache import EmbeddingCache, content_key, file_digest
from .checkpoint import (
    check_resume_folder,
    checkpoint_config,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_checkpoint_debris,
    save_checkpoint,
)
from .config import MAX_TITLE_BYTES, TrainConfig
from .data import (
    TRIGGER_TOKEN,
    BucketBatches,
    DataError,
    caption_for,
    caption_orders,
    entry_buckets,
    hold_out,
    load_image,
    make_buckets,
    scan_dataset,
    with_regularisation,
)
from .distributed import Ranks
from .ema import LoraEma
from .encoder_placement import EncoderRun
from .encoder_source import EncoderSource, encoder_source_for, recorded_encoders
from .encoders import Encoders, encoder_dtype, open_decoder, open_encoders
from .family_encoders import training_objective
from .feed import CacheFeed
from .lora_files import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_metadata,
    save_diffusers_lora,
    save_kohya_lora,
    save_peft_adapter,
)
from .lora_metadata import dataset_summary, lora_header, source_date_epoch
from .loss_scale import LossScale
from .masks import ALPHA, latent_mask, load_mask, mask_sources
from .objective import denoising_loss, draw_times, image_tokens
from .prompt_options import PromptError, SamplePrompt, parse_prompt
from .sample import (
    FORWARD_SLOTS,
    SampleError,
    check_family,
    check_prompts,
    draw_image,
    draw_through_pipeline,
    draw_wuerstchen,
    negative_needs_true_cfg,
    wuerstchen_training_folders,
)
from .validation import VALIDATION_FILE, record_validation, validation_history, validation_loss
from .wuerstchen_sample import STAGES

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger("squareq.train")


class TrainError(RuntimeError):
    """The run cannot go on; the message says why and what to do."""


@dataclass
class TrainResult:
    steps: int
    skipped_steps: int
    losses: list[float]
    lora_file: Path  # the diffusers layout (pytorch_lora_weights.safetensors)
    kohya_file: Path | None = None  # the kohya / ComfyUI layout, when save_format has it


def lr_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total: int):
    """diffusers' ``get_scheduler`` (its training scripts' and kohya's schedules) by name, after a linear warm-up from
    0 over ``cfg.warmup`` steps, over ``total`` steps: constant, linear, cosine, cosine_with_restarts
    (``cfg.schedule_cycles``) or polynomial (``cfg.schedule_power``)."""
    from diffusers.optimization import get_scheduler

    name = cfg.schedule
    if name in ("constant", "constant_with_warmup"):
        name = "constant_with_warmup" if cfg.warmup else "constant"
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup, num_training_steps=total,
                         num_cycles=cfg.schedule_cycles, power=cfg.schedule_power)


def _optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names, with the settings kohya and ai-toolkit use for FLUX LoRAs."""
    def needs(package: str, pip: str):
        raise TrainError(f"optimizer = {cfg.optimizer} needs {package}; install it (pip install {pip}) or use "
                         "optimizer = adamw.") from None

    if cfg.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            needs("bitsandbytes", "bitsandbytes")
        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "prodigy":
        try:
            from prodigyopt import Prodigy
        except ImportError:
            needs("prodigyopt", "prodigyopt")
        if cfg.lr < 0.1:
            log.warning("optimizer = prodigy with lr = %g: Prodigy finds its own step size and lr multiplies it; its "
                        "authors, kohya and ai-toolkit use lr = 1.0.", cfg.lr)
        # safeguard_warmup and bias correction as the Prodigy README recommends for diffusion fine-tuning
        return Prodigy(params, lr=cfg.lr, weight_decay=cfg.weight_decay, safeguard_warmup=True,
                       use_bias_correction=True)
    if cfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # a fixed learning rate (kohya's FLUX recipe: relative_step, scale_parameter and warmup_init off)
        return Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay, relative_step=False, scale_parameter=False,
                         warmup_init=False)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _fill_cache(cfg: TrainConfig, items, item_buckets, captions: list[str], encoders: Encoders,
                cache: EmbeddingCache, echo, flipped: int = 0,
                masks: list | None = None) -> tuple[list[str], dict[str, str], list[str]]:
    """Cache every image's latents and every caption's embeddings, and for the first ``flipped`` items (the training
    ones, with ``flip_aug``) the latents of the image flipped left to right; with ``masks`` (each item's mask source,
    train/masks.py, or None) each latent entry also holds its loss mask. Return the latent keys per item, the text
    key per caption and the flipped latents' keys."""
    vae_id, text_id = encoders.vae_identity, encoders.text_identity
    digests = [file_digest(item.path) for item in items]
    masks = masks or [None] * len(items)
    marks = [() if m is None else (ALPHA,) if m == ALPHA else ("mask", file_digest(m)) for m in masks]
    image_keys = [content_key("latents", digest, vae_id, list(bucket), *mark)
                  for digest, bucket, mark in zip(digests, item_buckets, marks, strict=True)]
    flipped_keys = [content_key("latents", digests[i], vae_id, list(item_buckets[i]), "flipped", *marks[i])
                    for i in range(flipped)]

    def encoder_of(flip: bool):
        def encode_images(indices):
            out = []
            for i in indices:
                pixels = load_image(items[i].path, item_buckets[i])
                e = encoders.encode_image(pixels.flip(-1) if flip else pixels)
                e = e if isinstance(e, dict) else {"latents": e}
                if masks[i] is not None:
                    mask = load_mask(items[i].path, masks[i], item_buckets[i])
                    e["loss_mask"] = latent_mask(mask.flip(-1) if flip else mask, e["latents"])
                out.append(e)
            return out

        return encode_images

    text_keys = {c: content_key("text", c, text_id, cfg.max_sequence_length) for c in captions}
    unique = list(text_keys)

    def encode_texts(indices):
        return encoders.encode_prompts([unique[i] for i in indices], cfg.max_sequence_length)

    start = time.perf_counter()
    made = (cache.fill("latents", image_keys, encoder_of(False)) + cache.fill("latents", flipped_keys, encoder_of(True))
            + cache.fill("text", [text_keys[c] for c in unique], encode_texts))
    echo(f"cache {cache.root}: {made} new entries of {len(image_keys) + len(flipped_keys) + len(unique)} in "
         f"{time.perf_counter() - start:.1f} s")
    return image_keys, text_keys, flipped_keys


def _use_cuda_graphs(cfg: TrainConfig, device: torch.device, echo) -> bool:
    """``cuda_graphs`` settled for this run. ``auto`` is on with a CUDA GPU, except with an active LoRA dropout (its
    blocks are never captured, so graphs would only cost memory) and under a ``vram_budget``: the memory plan does not
    count the graphs' pool and static buffers (+0.3-0.5 GB on FLUX.1-12B), so it could not keep its promise. ``on``
    without a CUDA GPU is refused (:class:`TrainError`)."""
    if cfg.cuda_graphs == "on" and device.type != "cuda":
        raise TrainError(f"--cuda-graphs on needs a CUDA GPU and this run trains on {device}; use auto or off.")
    if cfg.cuda_graphs == "off" or device.type != "cuda":
        return False
    if cfg.cuda_graphs == "on":
        if cfg.vram_budget_bytes is not None:
            log.warning("cuda_graphs = on with vram_budget: the memory plan does not count the CUDA graphs' memory "
                        "(measured +0.3-0.5 GB on FLUX.1-12B); leave that much below the budget.")
        return True
    if cfg.lora_dropout:
        return False
    if cfg.vram_budget_bytes is not None:
        echo("cuda graphs auto: off, because vram_budget is set and the memory plan does not count their memory; "
             "--cuda-graphs on turns them on (about 0.3-0.5 GB more)")
        return False
    return True


def _check_trainable(slab, family: str) -> None:
    if family not in ADAPTERS or ADAPTERS[family].recipe is None:
        raise TrainError(f"{slab} holds a {family} model, which squareq train cannot train yet; the families it "
                         f"trains are: {', '.join(f for f, a in ADAPTERS.items() if a.recipe)}.")


def _masks(cfg: TrainConfig, dataset, items) -> list:
    """Each training entry's loss-mask source (train/masks.py), or Nones without ``masked_loss``."""
    if not cfg.masked_loss:
        return [None] * len(items)
    unique = list({item.path: item for item in items if not item.reg}.values())  # regularisation images: unmasked
    found = dict(zip((item.path for item in unique), mask_sources(unique, dataset.root, cfg.alpha_mask,
                                                                  cfg.mask_dir)))
    return [None if item.reg else found.get(item.path) for item in items]


@dataclass
class PreparedData:
    """The scanned dataset, its buckets and captions, and the cache keys of every latent and text embedding."""

    dataset: object
    buckets: list
    cache: EmbeddingCache
    captions: list[list[str]]  # per entry: its caption with the trigger word, or its shuffled orders
    dropped: str  # what a dropped caption becomes
    keys: tuple[list[str], dict[str, str]] | None  # latent keys: the training entries', then the validation ones
    computed: int = 0
    validation: list[str] = field(default_factory=list)  # the caption of each validation entry


def run_encoders(cfg: TrainConfig, record) -> EncoderSource:
    """The VAE and text encoders of a run on a slab with model ``record``: ``cfg.model`` (at ``cfg.revision``) or the
    slab's recorded ones, with ``cfg``'s single files in place of their components."""
    return encoder_source_for(recorded_encoders(record), record.family, record.config, cfg.model, cfg.revision,
                              cfg.encoder_files)


def prepare_data(cfg: TrainConfig, model, device: torch.device, echo=print, encode: bool = True) -> PreparedData:
    """Scan ``cfg.data`` and, with ``encode``, fill the cache through the encoders of ``cfg.model`` or the slab's
    source, for the slab's model record ``model`` (family and config; what ``squareq cache`` runs on its own). A family
    SquareQ cannot train has no encoders, which ``open_encoders`` says."""
    dataset = scan_dataset(cfg.data, caption_ext=cfg.caption_ext)
    held = None
    if cfg.validation_data:
        try:
            held = scan_dataset(cfg.validation_data, caption_ext=cfg.caption_ext).without_repeats()
        except DataError as exc:
            raise DataError(f"validation_data (--validation-data): {exc}") from None
    elif cfg.validation_split:
        dataset, held = hold_out(dataset, cfg.validation_split, cfg.seed)
    if cfg.reg_data:
        try:
            reg = scan_dataset(cfg.reg_data, caption_ext=cfg.caption_ext)
        except DataError as exc:
            raise DataError(f"reg_data (--reg-data): {exc}") from None
        dataset = with_regularisation(dataset, reg)
        echo(f"regularisation: {sum(it.repeats for it in dataset.items if it.reg) * len(cfg.resolution)} entries an "
             f"epoch from {reg.root}, loss weight {cfg.prior_loss_weight:g}")
    if held is not None:
        echo(f"validation: {len(held)} held-out images from {held.root}")
    placeholders = [item for item in dataset.items + (held.items if held else []) if TRIGGER_TOKEN in item.caption]
    if placeholders and not (cfg.trigger or "").strip():
        raise DataError(f"{len(placeholders)} captions use {TRIGGER_TOKEN} (e.g. the one of {placeholders[0].path}) "
                        "but no trigger word is set; pass --trigger WORD.")
    buckets = [make_buckets(r) for r in cfg.resolution]  # one list per resolution
    item_buckets = entry_buckets(dataset, buckets, cfg.no_upscale)
    items = dataset.training_items * len(cfg.resolution)  # what the batches index: entry i is this item
    # a regularisation image's caption is the class's own: the trigger word is the training images' alone
    orders = {(c, reg): caption_orders(c, None if reg else cfg.trigger, cfg.keep_tokens,
                                       cfg.caption_orders if cfg.shuffle_caption else 0, cfg.seed)
              for c, reg in {(item.caption, item.reg) for item in items}}
    captions = [orders[(item.caption, item.reg)] for item in items]
    if cfg.shuffle_caption:
        echo(f"shuffle_caption: {sum(map(len, orders.values()))} orders of {len(orders)} captions go into the cache")
    dropped = caption_for("", cfg.trigger, dropout=0.0) if cfg.trigger else ""
    # validation entries come after the training entries in the cache keys: every image once per resolution
    held_items = held.training_items * len(cfg.resolution) if held else []
    held_buckets = entry_buckets(held, buckets, cfg.no_upscale) if held else []
    held_captions = [caption_for(item.caption, cfg.trigger) for item in held_items]
    # images held out of --data keep their masks, so the validation loss measures what training does
    held_masks = _masks(cfg, held, held_items) if cfg.validation_split else [None] * len(held_items)
    cache = EmbeddingCache(cfg.cache_dir or Path(cfg.output) / "cache", echo)
    keys = None
    if encode:
        from diffusers.configuration_utils import FrozenDict  # attribute access to the recorded config, as on a model

        run = EncoderRun(cfg.vram_budget_bytes, cfg.max_sequence_length, max(cfg.resolution) ** 2, "vram_budget")
        with open_encoders(run_encoders(cfg, model), device, model.family, FrozenDict(model.config), run,
                           encoder_dtype(device, resolve_dtype(cfg.dtype, device)[0])) as encoders:
            if encoders.placement is not None:
                echo(encoders.placement.describe())
                cache.record_encoders(encoders.text_identity, encoders.placement.record())
            # the sample prompts too: sample images then need the VAE only, never the text encoders again
            texts = sorted({order for entry in captions for order in entry} | {dropped} | set(held_captions)
                           | {t for p in _sample_prompts(cfg, model.family) for t in p.texts})
            keys = _fill_cache(cfg, items + held_items, item_buckets + held_buckets, texts, encoders, cache, echo,
                               flipped=len(items) if cfg.flip_aug else 0,
                               masks=_masks(cfg, dataset, items) + held_masks)
        image_keys, text_keys, _ = keys
        cache.record_pairs([(image_keys[i], text_keys[c[0]]) for i, c in enumerate(captions)])
    return PreparedData(dataset, buckets, cache, captions, dropped, keys, cache.computed, held_captions)


# LoRA factors start below 1/sqrt(in_features) in size and stay far below 10 in any training that learns; one of
# 1e4 multiplies its layer's delta at least ten-thousandfold (the audit's --lr 1e6 saved weights of 9.8e7), so a
# step that reaches it has diverged.
DIVERGED_WEIGHT = 1e4


def train(cfg: TrainConfig, echo: Callable[[str], None] = print,
          after_step: Callable[[int], None] | None = None,
          on_gradients: Callable[[int, list[torch.Tensor]], None] | None = None,
          progress: bool | None = None) -> TrainResult:
    """Run the training ``cfg`` describes. ``after_step(step)`` is called after each finished step;
    ``on_gradients(step, grads)`` with the LoRA gradients about to be applied (averaged over ranks).
    ``progress``: a progress bar on stderr (default: when stderr is a terminal); without it, about ten
    progress lines through ``echo``."""
    if cfg.sample_every and not cfg.sample_prompts:
        raise TrainError(f"sample_every = {cfg.sample_every} needs prompts; add --sample-prompts \"...\" (repeat it "
                         "for several) or set sample_every = 0.")
    if cfg.log == "wandb":
        require("wandb", "--log wandb")  # before anything is cached or trained
    if cfg.resume and cfg.resume != "latest":
        check_resume_folder(cfg.resume)  # before anything is created, loaded or cached
    try:
        source_date_epoch()  # read again when the LoRA is written: refused now, not after the last step
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    out = ensure_output_dir(Path(cfg.output), "-o/--out")
    device = default_device()
    ranks = Ranks.from_env("nccl" if device.type == "cuda" else "gloo")
    try:
        return _train(cfg, out, device, ranks, echo if ranks.is_main else (lambda s: None), after_step, on_gradients,
                      progress)
    except OSError as exc:
        # checkpoints are atomic, so whatever failed here (a full disk, a folder made read-only) lost no saved step
        then = "pass --resume latest to continue" if latest_checkpoint(out) else "run the command again"
        raise TrainError(os_error_sentence(exc, f"training into {out}", then)) from None
    finally:
        ranks.close()


def _train(cfg: TrainConfig, out: Path, device: torch.device, ranks: Ranks, echo, after_step,
           on_gradients, progress) -> TrainResult:
    if device.type == "cuda":
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    if not cfg.resume and latest_checkpoint(out) is not None:
        raise TrainError(f"{out} already holds checkpoints of an earlier run; pass --resume latest to continue it, or "
                         "choose a new -o/--out folder.")
    if ranks.is_main:  # rank 0 writes every checkpoint and LoRA file, so only it knows their temporaries are dead
        _remove_debris(cfg, out, echo)
    torch.manual_seed(cfg.seed)
    run = _Run(cfg, out, device, ranks, echo, after_step, on_gradients)
    run.setup()
    try:
        run.load()
        run.resume()
        run.open_logs(progress)
        run.train()
    finally:
        run.close()
    return run.finish()


class _Run:
    """One training run: setup, the model and its optimizer, resuming, each optimizer step, metrics, checkpoints,
    validation, and the LoRA files at the end. ``step`` counts finished optimizer steps."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, ranks: Ranks, echo, after_step,
                 on_gradients) -> None:
        self.cfg, self.out, self.device, self.ranks, self.echo = cfg, out, device, ranks, echo
        self.after_step, self.on_gradients = after_step, on_gradients
        self.step = self.skipped = self.skipped_in_row = 0
        self.losses: list[float] = []
        self.metrics = self.board = self.bar = self.feed = self.model = self.decoder = None
        self.compute, self.compute_why = "bf16", ""  # the base layers' arithmetic and why, settled in setup()
        self.compile_blocks, self.compile_why = False, ""  # torch.compile of the blocks and why, settled in setup()

    # ------------------------------------------------------------------------------------------ before training

    def setup(self) -> None:
        """Open the slab, settle the configuration against it, check the memory plan, and fill the cache."""
        cfg, echo = self.cfg, self.echo
        self.slab = slab = open_slab(cfg.slab, verify="eager")
        self.cfg = cfg = _resumed_targets(cfg, self.out).with_family_defaults(slab.manifest.model.family)
        _check_variant(cfg, self.out, self.ranks.world)
        try:
            self.dtype, self.dtype_why = resolve_dtype(cfg.dtype, self.device)
        except ComputeError as exc:
            raise TrainError(f"--dtype {cfg.dtype}: {exc}") from None
        self.compute = self._compute()
        self.cuda_graphs = _use_cuda_graphs(cfg, self.device, echo)
        self.compile_blocks, self.compile_why = resolve_compile(cfg.compile, self.device,
                                                                family=slab.manifest.model.family)
        if cfg.vram_budget_bytes is not None and self.device.type == "cuda":
            plan = runtime.plan(slab, resolution=cfg.largest_resolution, batch=cfg.batch_size,
                                text_tokens=cfg.max_sequence_length, prefetch=cfg.start_prefetch, lora_rank=cfg.rank,
                                lora_targets=cfg.targets, compute=self.compute, dtype=self.dtype)
            echo("expected device memory:\n" + str(plan))
            if cfg.use_dora:
                log.warning("vram_budget: the memory plan does not count DoRA's own memory (measured on FLUX.1-12B: "
                            "1.7 GB more at 512², 2.1 GB at 1024²); leave that much below the budget.")
            plan.check(cfg.vram_budget_bytes)
        self.family = family = slab.manifest.model.family
        _check_trainable(cfg.slab, family)
        self.formats = save_formats(cfg, family)
        self.started = time.time()
        self.recipe = ADAPTERS[family].recipe
        self.encoder_source = run_encoders(cfg, slab.manifest.model)
        _check_stage_keys(cfg, family)
        # Würstchen's two pipeline folders, resolved (a Hub ID fetched) once, not at every round of samples
        self.sample_stages = _check_samples(cfg, family, self.encoder_source) if cfg.sample_every else None
        try:  # a negative prompt without --l: refused for a guidance-distilled family only; frames for a video one
            check_prompts(family, _sample_prompts(cfg, family))
        except (PromptError, SampleError) as exc:
            raise TrainError(f"sample_prompts: {exc}") from None
        self.objective = objective = training_objective(self.encoder_source, family)
        if objective != "flow" and (cfg.loss_weighting != "none" or cfg.timestep_sampling == "flux_shift"):
            raise TrainError(f"loss_weighting = {cfg.loss_weighting} and timestep_sampling = {cfg.timestep_sampling} "
                             f"are for flow-matching models; this {family} model trains with the {objective} "
                             "objective, so leave them at none and shift.")
        self.data = prepare_data(cfg, slab.manifest.model, self.device, echo, encode=self.ranks.is_main)
        echo(f"training a {family} LoRA with the {objective} objective")

    def _compute(self) -> str:
        """The base layers' arithmetic for ``cfg.compute`` on this device and the run's dtype; ``auto`` says what it
        chose (an fp16 run: no FP8)."""
        try:
            compute, why = resolve_compute(self.cfg.compute, self.device, self.dtype)
        except ComputeError as exc:
            raise TrainError(f"--compute {self.cfg.compute}: {exc}") from None
        self.compute_why = why
        return compute

    def load(self) -> None:
        """The streamed model with its LoRA, the batch order, the optimizer, its schedule and the run's RNG."""
        cfg, ranks, data = self.cfg, self.ranks, self.data
        # the other ranks wait here while rank 0 fills the cache, so encoders and slab are never in memory together
        image_keys, text_keys, flipped_keys = ranks.broadcast(data.keys if ranks.is_main else None)
        if self.dtype == "fp16":
            self.echo(f"dtype {cfg.dtype}: fp16: {self.dtype_why}; the LoRA trains in fp32 with a scaled loss, the "
                      "encoders and the sample VAE run in fp32")
        if cfg.compute == "auto":
            self.echo(f"compute auto: {'no FP8' if self.dtype == 'fp16' else self.compute}: {self.compute_why}")
        if cfg.compile == "auto":
            self.echo(f"compile auto: {'on' if self.compile_blocks else 'off'}: {self.compile_why}")
        asked = cfg.host
        if asked == "auto":
            asked, why = choose_host(sum(b.nbytes for b in self.slab.manifest.blocks))
            self.echo(f"host auto: {asked}: {why}")
        # several ranks on one host read the same blobs: one shared host copy instead of one pinned copy per rank
        host = "shared" if asked == "pinned" and ranks.local_world > 1 else asked
        load = dict(prefetch=cfg.start_prefetch, verify="off", compute=self.compute, cuda_graphs=self.cuda_graphs,
                    compile_blocks=self.compile_blocks, attention=cfg.attention, dtype=self.dtype)
        try:
            model = runtime.load(self.slab, self.device, host=host, **load)
        except HostMemoryError as exc:
            if host == asked:
                raise TrainError(f"--host {cfg.host}: {exc}") from None
            log.warning("%s; each rank pins its own copy of the slab instead (--host pinned).", exc)
            model = runtime.load(self.slab, self.device, host="pinned", **load)
        self.model = model
        if cfg.attention == "auto":
            rt = runtime.runtime_of(model)
            self.echo(f"attention auto: {'cuDNN first' if rt.prefer_cudnn else 'torch order'}: {rt.attention_reason}")
        self.tuner = self._tuner(model)
        self.params = runtime.add_lora(model, rank=cfg.rank, alpha=cfg.lora_alpha, targets=cfg.targets,
                                       seed=cfg.seed, variant=cfg.lora_variant)
        self.names = list(runtime.lora_parameters(model))
        model.enable_gradient_checkpointing()
        model.train()
        # one global batch per step, shared out to the ranks (equal shares, so the last short batch is dropped)
        self.batches = BucketBatches(data.dataset, data.buckets, cfg.batch_size * ranks.world, cfg.seed,
                                     drop_last=ranks.world > 1, no_upscale=cfg.no_upscale)
        self.total = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * len(self.batches)
                                                                           / cfg.grad_accum))
        self.optimizer = _optimizer(cfg, self.params)
        self.scheduler = lr_scheduler(cfg, self.optimizer, self.total)
        self.generator = torch.Generator().manual_seed(cfg.seed + 1)  # noise, timesteps and caption dropout
        self.ema = LoraEma(self.params, cfg.ema_decay) if cfg.ema_decay > 0 else None
        self.loss_scale = LossScale() if self.dtype == "fp16" else None
        self.feed = CacheFeed(data.cache, image_keys, text_keys, data.captions + [[c] for c in data.validation],
                              data.dropped, self.device, flipped_keys, cfg.seed)
        # each entry's loss weight where regularisation images are mixed in (prior_loss_weight), else None
        entries = data.dataset.training_items * len(cfg.resolution)
        self.entry_reg = [e.reg for e in entries]
        self.entry_weights = torch.tensor([cfg.prior_loss_weight if e.reg else 1.0 for e in entries]) \
            if cfg.reg_data else None
        # the validation entries of the feed come after the training entries
        self.held_out = list(range(len(data.captions), len(data.captions) + len(data.validation)))

    def resume(self) -> None:
        """With ``resume``: the checkpoint's LoRA, optimizer, schedule, batch position, RNG and moving average."""
        cfg, out, echo = self.cfg, self.out, self.echo
        path = _resume_path(cfg, out)
        if cfg.resume and path is None:
            echo(f"no checkpoint in {out / 'checkpoints'} yet; starting from step 0")
        if path is not None:
            ckpt = load_checkpoint(path, self.optimizer, self.names, self.scheduler)
            with torch.no_grad():
                for name, p in runtime.lora_parameters(self.model).items():
                    p.copy_(ckpt.lora[name])
            try:
                self.batches.load_state_dict(ckpt.data_state["batches"])
            except ValueError:
                raise TrainError(f"{path} was saved with another data set, batch size "
                                 f"({ckpt.config.get('batch_size')} per rank), seed or number of ranks; resume with "
                                 "the settings it was made with, or start a new run in a new -o folder.") from None
            self.generator.set_state(ckpt.extra["generator"])
            if self.ema is not None and not self.ema.load_state_dict(ckpt.extra, self.names):
                log.warning("%s holds no moving average of the LoRA (it was trained without ema_decay); the average "
                            "starts from its weights.", path)
                self.ema = LoraEma(self.params, cfg.ema_decay)
            if self.loss_scale is not None and not self.loss_scale.load_state_dict(ckpt.extra):
                log.info("%s holds no fp16 loss scale (it was trained in bf16); the scale starts at %g.", path,
                         self.loss_scale.value)
            self.step, self.skipped = ckpt.step, int(ckpt.data_state.get("skipped", 0))
            _apply_new_hyperparameters(cfg, self.optimizer, self.scheduler)
            changed = sorted(k for k, v in cfg.to_dict().items() if k != "resume" and ckpt.config.get(k, v) != v)
            if self.ranks.is_main:
                _truncate_metrics(out / METRICS_FILE, self.step)
                _truncate_metrics(out / VALIDATION_FILE, self.step)
            echo(f"resumed from {path} at step {self.step}"
                 + (f"; changed since: {', '.join(changed)}" if changed else ""))
        if self.step == 0 and self.ranks.is_main:
            _truncate_metrics(out / VALIDATION_FILE, -1)  # a fresh start: rows of an earlier attempt in this folder go
            (out / WANDB_RUN_ID).unlink(missing_ok=True)  # and a new W&B run

    def open_logs(self, progress) -> None:
        """metrics.jsonl, TensorBoard or W&B when asked, and a progress bar on a terminal (or when ``progress``)."""
        main = self.ranks.is_main
        self.every = max(1, min(10, self.total // 10))  # progress lines: about ten per run, at least every ten steps
        self.metrics = open(self.out / METRICS_FILE, "a") if main else open(os.devnull, "w")
        board = {"tensorboard": _tensorboard, "wandb": _wandb}.get(self.cfg.log)
        self.board = board(self.cfg, self.out) if board is not None and main else None
        if main and (sys.stderr.isatty() if progress is None else progress):
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.step, unit="step", dynamic_ncols=True, desc="train")
            self.echo = _above_bar(self.bar, self.echo)

    # ------------------------------------------------------------------------------------------ training

    def train(self) -> None:
        """Every optimizer step up to the total, then the last checkpoint; an out-of-memory error saves what it can."""
        cfg = self.cfg
        self.validate_every = cfg.validate_every or cfg.save_every or self.total
        self.batch_iter = iter(self.batches)
        step_start, self.updating = None, False
        try:
            if cfg.sample_every and self.step == 0 and self.ranks.is_main:
                self.samples()  # the base model's pictures, to compare
            if self.step == 0 or (self.step % self.validate_every == 0 and self.ranks.is_main
                                  and self.step not in {r["step"] for r in validation_history(self.out)}):
                self.validate()  # the base model's loss, to compare; or one a killed run did not get to write
            while self.step < self.total:
                # where this step starts: what an out-of-memory save must record, so that a resume redoes it
                step_start = (self.batches.state_dict(), self.generator.get_state())
                self.optimizer_step(step_start)
        except torch.OutOfMemoryError:
            self.out_of_memory(step_start)
        self.checkpoint()

    def optimizer_step(self, step_start) -> None:
        """One optimizer step over ``grad_accum`` micro-batches; a non-finite one is retried or skipped."""
        started = time.perf_counter()
        compiled_before = compile_seconds() if self.compile_blocks else 0.0
        self.updating = False
        self.tune(before=True)
        step_loss = self.micro_batches()
        params = self.params
        self.ranks.average_grads(params)
        step_loss = self.ranks.mean(step_loss, self.device)
        grads = [p.grad for p in params if p.grad is not None]
        if self.loss_scale is not None:
            self.loss_scale.unscale(grads)
        # one norm over all gradients (NaN or Inf if any element is): one device sync, not one per tensor
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not (math.isfinite(step_loss) and math.isfinite(float(norm))):
            if self.loss_scale is not None and math.isfinite(step_loss) and self.loss_scale.can_back_off():
                self.scale_overflowed(step_start)
            else:
                self.non_finite(step_start)
            return
        self.skipped_in_row = 0
        if self.on_gradients is not None:
            self.on_gradients(self.step + 1, [p.grad for p in params])
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
        self.update()
        if self.loss_scale is not None:
            self.loss_scale.stepped()
        self.tune(before=False)
        self.record(step_loss, float(norm), started)
        if self.compile_blocks:
            self.say_compile_time(compile_seconds() - compiled_before)
        self.after_update()

    def say_compile_time(self, seconds: float) -> None:
        """Say how long torch.compile took in this step, when it took long enough to notice (the first steps, a new
        resolution)."""
        if seconds >= 1.0:
            self.echo(f"step {self.step}: torch.compile compiled the blocks' graphs for {seconds:.1f} s "
                      f"({compile_seconds():.1f} s in this run so far); the next steps reuse them")

    def _tuner(self, model) -> StreamTuner | None:
        """``prefetch = "auto"`` or ``resident_blocks``: a StreamTuner that measures this process's second step, then
        grows the ring until the copies hide behind compute and keeps blocks on the device, within what
        ``vram_budget`` leaves beyond that step's peak (or what the device has free). Streamed results depend on
        neither, so a resumed run that sizes them otherwise trains the same."""
        if (self.cfg.prefetch != "auto" and not self.cfg.resident_blocks) or not runtime.runtime_of(model).streamed:
            return None
        budget = None
        if self.cfg.vram_budget_bytes is not None and self.device.type == "cuda":
            device, limit = self.device, self.cfg.vram_budget_bytes
            budget = lambda: max(0, limit - torch.cuda.max_memory_reserved(device))  # noqa: E731
        self.steps_here = 0
        return StreamTuner(model, prefetch=self.cfg.prefetch, resident=self.cfg.resident_blocks, probe_step=1,
                           budget_bytes=budget)

    def tune(self, before: bool) -> None:
        """Around each optimizer step of this process: time the probe step, then size the ring and say so."""
        if self.tuner is None:
            return
        if before:
            self.tuner.before_step(self.steps_here)
            return
        planned = self.tuner.plan
        self.tuner.after_step(self.steps_here)
        self.steps_here += 1
        if planned is None and self.tuner.plan is not None:
            what = "prefetch auto" if self.cfg.prefetch == "auto" else f"resident_blocks {self.cfg.resident_blocks}"
            self.echo(f"{what}: {self.tuner.plan.describe()}")

    def micro_batches(self) -> float:
        """Forward and backward over ``grad_accum`` batches; the summed loss (each divided by ``grad_accum``)."""
        cfg, ranks, feed, batches, generator = self.cfg, self.ranks, self.feed, self.batches, self.generator
        step_loss = 0.0
        for _ in range(cfg.grad_accum):
            epoch = batches.epoch  # the batch's own: the last one of an epoch moves the count on
            indices = next(self.batch_iter, None)
            if indices is None:
                self.batch_iter = iter(batches)
                epoch = batches.epoch
                indices = next(self.batch_iter)
            # Every rank draws for the whole global batch, then keeps its share: the same numbers as one process
            # training the whole batch.
            drops = [cfg.caption_dropout > 0 and float(torch.rand((), generator=generator)) < cfg.caption_dropout
                     for _ in indices]
            if self.entry_weights is not None:  # a regularisation image keeps its class caption (the draws stay)
                drops = [d and not self.entry_reg[i] for d, i in zip(drops, indices)]
            mine = ranks.share(len(indices))
            shape = feed.latent_shape(indices[mine][0], epoch)
            noise = torch.randn((len(indices), *shape), generator=generator)
            t = draw_times(self.objective, len(indices), generator, mode=cfg.timestep_sampling, shift=cfg.shift,
                           image_tokens=image_tokens(shape))
            indices, drops = indices[mine], drops[mine]
            noise, t = noise[mine].to(self.device), t[mine].to(self.device)
            latents, text = feed.batch(indices, drops, epoch)
            upcoming = batches.peek()
            feed.prefetch(upcoming[ranks.share(len(upcoming))], batches.epoch)  # read while this one computes
            weights = None if self.entry_weights is None else self.entry_weights[torch.as_tensor(indices)]
            loss = denoising_loss(self.model, self.recipe, self.objective, latents, noise, t, text, cfg.guidance,
                                  cfg.loss_weighting, weights) / cfg.grad_accum
            (loss if self.loss_scale is None else self.loss_scale.scale(loss)).backward()
            step_loss += float(loss.detach())
        return step_loss

    def again(self, step_start) -> None:
        """Take this step again: the same batch, noise and timesteps."""
        self.batches.load_state_dict(step_start[0])
        self.generator.set_state(step_start[1])
        self.batch_iter = iter(self.batches)

    def scale_overflowed(self, step_start) -> None:
        """An fp16 step whose loss is finite but whose scaled gradients overflowed: halve the loss scale and take the
        same step again (torch.amp.GradScaler halves it and skips the batch; here the batch is kept), at most
        ``loss_scale.RETRIES`` times; then the batch is skipped with the scale halved once, not counted as a NaN step
        (train/loss_scale.py)."""
        self.optimizer.zero_grad(set_to_none=True)
        scale, before = self.loss_scale, self.loss_scale.value
        if scale.can_retry():
            log.info("step %d: fp16 gradients overflowed at loss scale %g; the step runs again at %g.",
                     self.step + 1, before, scale.overflowed())
            self.again(step_start)
            return
        scale.skipped()
        self.skipped += 1
        log.info("step %d: fp16 gradients still overflowed at loss scale %g; this batch is skipped and the next "
                 "starts at %g.", self.step + 1, before, scale.value)

    def non_finite(self, step_start) -> None:
        """A NaN/Inf loss or gradient: the same step again without cuDNN attention when that may be the cause,
        otherwise skipped; ``nan_patience`` skips in a row stop the run."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scale is not None:
            self.loss_scale.skipped()
        if runtime.retry_without_cudnn(self.device):
            self.again(step_start)  # with the cuDNN attention backend off
            return
        self.skipped_in_row, self.skipped = self.skipped_in_row + 1, self.skipped + 1
        self.echo(f"step {self.step + 1}: the loss or a gradient is NaN/Inf; skipped ({self.skipped_in_row} in a row)")
        if self.skipped_in_row >= self.cfg.nan_patience:
            raise TrainError(f"{self.skipped_in_row} steps in a row had NaN/Inf losses or gradients, so the run "
                             f"stopped at step {self.step}; the last good checkpoint in {self.out / 'checkpoints'} is "
                             "untouched. Lower the learning rate or check the data, then --resume latest.")

    def update(self) -> None:
        """The optimizer's step, checked for diverged weights before anything of it can be saved."""
        params = self.params
        self.updating = True  # an error from here on may leave the LoRA or the optimizer half-updated
        self.optimizer.step()
        # a step can turn finite gradients into non-finite or exploded weights (a learning rate far too large): stop
        # before anything of it is saved, so every checkpoint on disk stays a good one
        largest = max(float(p.detach().abs().max()) for p in params)
        if not largest <= DIVERGED_WEIGHT:
            last = latest_checkpoint(self.out)
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
            what = "NaN/Inf" if not math.isfinite(largest) else f"as large as {largest:.3g}"
            raise TrainError(f"step {self.step + 1} made the LoRA weights {what} (learning rate "
                             f"{self.scheduler.get_last_lr()[0]:.3g}), so the run stopped without saving it; "
                             f"{where}. Lower --lr, then --resume latest or start again.")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update(params)
        self.step += 1
        self.updating = False  # the step is whole: an error from here on (validation, samples) loses nothing

    def record(self, step_loss: float, norm: float, started: float) -> None:
        """The step's line in metrics.jsonl (and TensorBoard), and the progress bar or line."""
        step = self.step
        self.losses.append(step_loss)
        record = {"step": step, "loss": step_loss, "lr": self.scheduler.get_last_lr()[0], "grad_norm": norm,
                  "seconds": time.perf_counter() - started, "skipped_total": self.skipped}
        if self.device.type == "cuda":
            stats = runtime.runtime_of(self.model).step_stats()
            record.update(peak_reserved_GB=stats.peak_reserved / 1e9, copy_wait_s=stats.copy_wait_s,
                          copied_GB=stats.bytes_copied / 1e9)
            if self.ranks.world > 1:  # each GPU's own figures: memory and copy waits can differ between ranks
                peaks, waits = self.ranks.gather([record["peak_reserved_GB"], stats.copy_wait_s], self.device)
                record.update(rank_peak_reserved_GB=peaks, rank_copy_wait_s=waits)
        self.metrics.write(json.dumps(record) + "\n")
        if self.board is not None:
            for key, value in record.items():
                if isinstance(value, list):  # one figure per rank
                    for rank, v in enumerate(value):
                        self.board.add_scalar(f"train/{key}/rank{rank}", v, step)
                elif key != "step":
                    self.board.add_scalar(f"train/{key}", value, step)
        self.metrics.flush()
        recent = self.losses[-self.every:]
        vram = f", {record['peak_reserved_GB']:.2f} GB reserved" if "peak_reserved_GB" in record else ""
        status = (f"loss {step_loss:.4f} (avg {sum(recent) / len(recent):.4f}), lr {record['lr']:.2e}, "
                  f"grad norm {norm:.3f}{vram}")
        if self.bar is not None:
            self.bar.set_postfix_str(status, refresh=False)
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            self.echo(f"step {step}/{self.total}: {status}, {1 / record['seconds']:.2f} it/s")

    def after_update(self) -> None:
        """What is due after this step: a checkpoint, samples, a validation pass, the caller's hook."""
        cfg, step = self.cfg, self.step
        if cfg.save_every and step % cfg.save_every == 0 and step < self.total:
            self.checkpoint()
        if cfg.sample_every and step % cfg.sample_every == 0 and self.ranks.is_main:
            self.samples()
        if step % self.validate_every == 0 or step == self.total:
            self.validate()
        if self.after_step is not None:
            self.after_step(step)

    # ------------------------------------------------------------------------------------------ saving and measuring

    def checkpoint(self, data_state=None, generator_state=None) -> Path:
        """A checkpoint of the finished steps (rank 0 writes it; every rank waits for it)."""
        path = checkpoint_dir(self.out, self.step)
        if self.ranks.is_main:
            cfg, names = self.cfg, self.names
            lora = runtime.lora_state_dict(self.model)
            extra = {"generator": self.generator.get_state() if generator_state is None else generator_state,
                     **(self.ema.state_dict(names) if self.ema else {}),
                     **(self.loss_scale.state_dict() if self.loss_scale else {})}
            path = save_checkpoint(self.out, self.step, lora, self.optimizer, names, self.scheduler,
                                   {"batches": data_state or self.batches.state_dict(), "skipped": self.skipped},
                                   cfg.to_dict(), extra=extra,
                                   lora_metadata=adapter_metadata(lora, cfg.rank, cfg.lora_alpha, cfg.lora_variant)
                                   if cfg.lora_type == "lora" else None)
            prune_checkpoints(self.out, max(1, cfg.keep_last))
            self.metrics.flush()
            plot_losses(self.out)
        self.ranks.barrier()
        return path

    def out_of_memory(self, step_start) -> None:
        """Save the finished steps where that is safe, and stop with the peak and the knobs to turn."""
        self.optimizer.zero_grad(set_to_none=True)
        device, step = self.device, self.step
        peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        knobs = ("Lower --resolution or --batch-size (raise --grad-accum to keep the effective batch) or use "
                 "--prefetch 1, then --resume latest.")
        what = f"the GPU ran out of memory in step {step + 1} (peak reserved {peak / 1e9:.2f} GB)"
        if self.ranks.world > 1 or self.updating or step_start is None or checkpoint_dir(self.out, step).exists():
            # Other ranks wait in a collective, or the state is half-updated, or already saved: keep what is on disk.
            last = latest_checkpoint(self.out)
            where = f"the last checkpoint is {last}" if last else "no checkpoint was written yet"
            raise TrainError(f"{what}; {where}. {knobs}") from None
        path = self.checkpoint(*step_start)  # the finished steps, with the data and RNG where the failed step began
        raise TrainError(f"{what}; steps up to {step} are saved in {path}. {knobs}") from None

    def validate(self) -> None:
        """The validation loss now (rank 0), recorded; a pass that runs out of memory is skipped."""
        if not self.held_out or not self.ranks.is_main:
            return
        cfg, step = self.cfg, self.step
        try:
            with _forward_only(self.model, self.device):
                result = validation_loss(self.model, self.recipe, self.objective, self.feed, self.held_out, cfg.seed,
                                         cfg.guidance, self.device, cfg.loss_weighting)
        except torch.OutOfMemoryError:
            # the step is done and intact: training goes on, without this measurement
            self.echo(f"step {step}: the validation pass ran out of GPU memory and was skipped; training goes on "
                      "(fewer or smaller validation images would fit)")
            return
        record_validation(self.out, step, result)
        if self.board is not None:
            self.board.add_scalar("val/loss", result["val_loss"], step)
        first = validation_history(self.out)[0]
        self.echo(f"step {step}: validation loss {result['val_loss']:.4f} on {result['images']} held-out images"
                  + (f" (step {first['step']}: {first['val_loss']:.4f})" if first["step"] != step else ""))

    def samples(self) -> None:
        """Sample images of the prompts: FLUX.1's from their cached embeddings through the VAE, which stays on the host
        between samples (loaded at the first); the other families' through their own diffusers pipeline folder, its
        text encoders and VAE opened for each round of samples (train/sample.py ``draw_through_pipeline``)."""
        if not ADAPTERS[self.family].samples:
            folder, step, cfg = self.out / "samples", self.step, self.cfg
            folder.mkdir(parents=True, exist_ok=True)
            draw = draw_through_pipeline
            if self.family in STAGES:  # Würstchen: both stages' pipelines, the model being trained as its own
                draw = lambda *args: draw_wuerstchen(self.sample_stages, *args)  # noqa: E731
            with _forward_only(self.model, self.device):
                images = draw(
                    self.encoder_source, self.family, self.model, _sample_prompts(cfg, self.family),
                    cfg.max_sequence_length, self.device, None,
                    lambda i, image: write_sample(image, folder / f"step-{step:08d}-{i}"))
            write_png(_side_by_side([first_frame(im) for im in images]), folder / f"step-{step:08d}-grid.png")
            return
        if self.decoder is None:
            self.decoder = open_decoder(self.encoder_source, self.family, encoder_dtype(self.device, self.dtype))
        text_keys = self.data.keys[1]
        embeds = {t: self.data.cache.load("text", text_keys[t]) for p in _sample_prompts(self.cfg, self.family)
                  for t in p.texts}
        _save_samples(self.cfg, self.model, self.decoder, embeds, self.out / "samples", self.step, self.device)

    def close(self) -> None:
        """Release the bar, the cache reader, the logs and the runtime's threads (also after an error)."""
        if self.bar is not None:
            self.bar.close()
        if self.feed is not None:
            self.feed.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.board is not None:
            self.board.close(failed=sys.exc_info()[0] is not None)
        if self.model is not None:
            runtime.runtime_of(self.model).close()

    def finish(self) -> TrainResult:
        """The LoRA files (the moving average when there is one), written by rank 0."""
        cfg, formats = self.cfg, self.formats
        files = lora_paths(cfg, self.out)
        if self.ema is not None:
            self.ema.copy_to(self.params)  # the final LoRA is the average (the checkpoints keep the trained weights)
        if self.ranks.is_main:
            files = _write_lora(cfg, self.out, runtime.lora_state_dict(self.model), self.slab.manifest.model,
                                self.objective, self.data.dataset, formats, self.step, self.started)
        self.ranks.barrier()
        written = [files[f] for f in formats]
        self.echo(f"LoRA written to {' and '.join(map(str, written))} after {self.step} steps ({self.skipped} "
                  "skipped)")
        return TrainResult(self.step, self.skipped, self.losses, written[0],
                           files["kohya"] if "kohya" in formats else None)


def _remove_debris(cfg: TrainConfig, out: Path, echo) -> None:
    """The temporaries a killed run left in ``out`` (a checkpoint, LoRA file or log it was writing: Python's cleanup
    never ran), one line each; only names this run's own writers make, never a user's file."""
    paths = lora_paths(cfg, out)
    written = [paths["diffusers"], paths["kohya"], paths["peft"] / PEFT_WEIGHTS, paths["peft"] / PEFT_CONFIG,
               out / METRICS_FILE, out / VALIDATION_FILE, out / "loss.png"]
    for debris in [*remove_checkpoint_debris(out), *(p for path in written for p in remove_debris(path))]:
        echo(f"removed {debris}, left by a run that was killed while writing it")


def _resume_path(cfg: TrainConfig, out: Path) -> Path | None:
    """The checkpoint ``resume`` names (``latest``: the newest in ``out``, None before the first), or None."""
    if not cfg.resume:
        return None
    return latest_checkpoint(out) if cfg.resume == "latest" else Path(cfg.resume)


def _check_variant(cfg: TrainConfig, out: Path, world: int) -> None:
    """Before anything loads: peft is there for a variant; a resumed run keeps its checkpoint's DoRA and rsLoRA (a
    LoRA cannot change kind halfway); dropout runs in one process (its masks come from each process's CUDA random
    state, which checkpoints keep for one process only, so a resume would not be exact)."""
    if not cfg.lora_variant.plain:
        runtime.require_peft()
    if cfg.lora_dropout and world > 1:
        raise TrainError(f"lora_dropout = {cfg.lora_dropout} with {world} processes: a resumed run would draw other "
                         "dropout masks than an unbroken one; train with lora_dropout = 0, or in one process.")
    path = _resume_path(cfg, out)
    saved = checkpoint_config(path) if path is not None else {}
    for key, flag in (("use_dora", "--use-dora"), ("use_rslora", "--use-rslora")):
        if key in saved and bool(saved[key]) != getattr(cfg, key):
            raise TrainError(f"{path} was trained with {key} = {str(bool(saved[key])).lower()}; resume with the same "
                             f"setting ({flag} {'on' if saved[key] else 'off'}), or start a new run in a new -o "
                             "folder.")
    for key in ("lora_type", "lokr_factor"):
        if key in saved and saved[key] != getattr(cfg, key):
            raise TrainError(f"{path} was trained with {key} = {saved[key]}; resume with the same setting "
                             f"(--{key.replace('_', '-')} {saved[key]}), or start a new run in a new -o folder.")


def _resumed_targets(cfg: TrainConfig, out: Path) -> TrainConfig:
    """A resumed run without --targets trains the layers its checkpoint has (a run started before the family's
    default changed keeps its own), not the current default."""
    if not cfg.resume or cfg.targets is not None:
        return cfg
    path = _resume_path(cfg, out)
    saved = checkpoint_config(path).get("targets") if path is not None else None
    return dataclasses.replace(cfg, targets=list(saved)) if isinstance(saved, list) and saved else cfg


def save_formats(cfg: TrainConfig, family: str) -> list[str]:
    """The LoRA layouts to write: ``cfg.save_format``, or by default the diffusers file and, for FLUX.1, the kohya
    file whose ``.alpha`` tensors carry the strength to ComfyUI. Refused before training where a layout cannot
    hold this family's LoRA."""
    if cfg.lora_type != "lora":  # config.py refused any other format for them
        return ["peft"]
    formats = cfg.save_format or (["diffusers", "kohya"] if family == "flux" and not cfg.use_dora else ["diffusers"])
    if "kohya" in formats and family != "flux":
        raise TrainError(f"save_format = {','.join(formats)}: the kohya/ComfyUI layout SquareQ writes is FLUX.1's, and "
                         f"this slab holds a {family} model; use --save-format diffusers.")
    if "kohya" in formats and cfg.use_dora:
        raise TrainError(f"save_format = {','.join(formats)} with use_dora: the kohya/ComfyUI layout has no DoRA that "
                         "kohya and ComfyUI read alike; use --save-format diffusers.")
    return formats


def lora_paths(cfg: TrainConfig, out: Path) -> dict[str, Path]:
    """Where each layout goes: ``OUT/pytorch_lora_weights.safetensors``, ``OUT/<title>_kohya.safetensors`` and the
    folder ``OUT/<title>_peft`` (the title made safe as a file name)."""
    title = cfg.title or out.name
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in title).strip("._") or "lora"
    # a title is checked against this limit up front; the default one, the -o folder's name, may be longer
    stem = stem.encode()[:MAX_TITLE_BYTES].decode("utf-8", "ignore")
    return {"diffusers": out / "pytorch_lora_weights.safetensors", "kohya": out / f"{stem}_kohya.safetensors",
            "peft": out / f"{stem}_peft"}


def _write_lora(cfg: TrainConfig, out: Path, lora, model_record, objective: str, dataset, formats: list[str],
                steps: int, started: float) -> dict[str, Path]:
    """The trained LoRA in each of ``formats``, each with the run's metadata (train/lora_metadata.py)."""
    family = model_record.family
    component = ADAPTERS[family].component
    provenance = {"base_model_signature": model_record.signature, "family": family, "component": component,
                  "objective": objective}
    trained = [item for item in dataset.items if not item.reg]
    dirs, tags = dataset_summary(dataset.root, trained)
    images = sum(item.repeats for item in trained) * len(cfg.resolution)
    pool = dataset.regularisation  # as kohya records them: the folder's images and repeats, not the epoch's share
    reg = {"ss_num_reg_images": str(len(pool.training_items)),
           "ss_reg_dataset_dirs": json.dumps(dataset_summary(pool.root, pool.items)[0], sort_keys=True),
           "ss_prior_loss_weight": str(float(cfg.prior_loss_weight))} if pool is not None else {}
    if cfg.masked_loss:
        reg["ss_masked_loss"] = "True"

    # kohya scales by alpha/rank: rsLoRA's alpha/sqrt(rank) is that scale with alpha·sqrt(rank), and the kohya file
    # then holds a plain LoRA (its header must not say rsLoRA, or a reader would apply the square root twice)
    kohya_alpha = cfg.lora_alpha * math.sqrt(cfg.rank) if cfg.use_rslora else cfg.lora_alpha

    def header(layout: str) -> dict[str, str]:
        kohya = layout == "kohya"
        return lora_header(dataclasses.replace(cfg, use_rslora=False) if kohya else cfg, family=family, layout=layout,
                           base_model=model_record.source, base_config=model_record.config, rank=cfg.rank,
                           alpha=kohya_alpha if kohya else cfg.lora_alpha, steps=steps, images=images, dirs=dirs,
                           tags=tags, started=started, finished=time.time()) | reg

    files = lora_paths(cfg, out)
    if "diffusers" in formats:
        files["diffusers"] = save_diffusers_lora(lora, out, cfg.rank, cfg.lora_alpha, cfg.targets,
                                                 extra_metadata=provenance, prefix=component,
                                                 header=header("diffusers"), variant=cfg.lora_variant)
    if "kohya" in formats:
        files["kohya"] = save_kohya_lora(lora, files["kohya"], cfg.rank, kohya_alpha, cfg.targets,
                                         extra_metadata=provenance, header=header("kohya"))
    if "peft" in formats:
        layers = sorted({name.rsplit(".", 1)[0] for name in lora})
        config = lycoris_config(cfg.lora_variant, cfg.rank, cfg.lora_alpha, layers)
        files["peft"] = save_peft_adapter(lora, files["peft"], config, header=header("peft"))
    return files


def _sample_prompts(cfg: TrainConfig, family: str) -> list[SamplePrompt]:
    """``cfg.sample_prompts`` with their options settled (train/prompt_options.py), ``--n`` under ``family``'s rule."""
    return list(_settled_prompts(tuple(cfg.sample_prompts), cfg.largest_resolution, cfg.sample_steps,
                                 cfg.sample_guidance, cfg.sample_seed, family))


@functools.lru_cache(maxsize=16)
def _settled_prompts(prompts: tuple[str, ...], resolution: int, steps: int, guidance: float,
                     seed: int, family: str) -> tuple[SamplePrompt, ...]:
    # parsed once per run and settings, not at every sample round (a skipped kohya option is said once anyway)
    return tuple(parse_prompt(p, negative_needs_true_cfg(family)).settled(resolution, steps, guidance, seed)
                 for p in prompts)


def _check_samples(cfg: TrainConfig, family: str, encoders) -> tuple[Path, Path] | None:
    """Refuse ``sample_every`` (:class:`TrainError`, one sentence) where squareq sample could not draw either: a
    family with neither SquareQ's own sampler nor a diffusers pipeline, or a pipeline family without its folder.
    Returns a Würstchen stage's two pipeline folders (``sample_prior``, ``sample_decoder``), else None."""
    try:
        if family in STAGES:
            return wuerstchen_training_folders(cfg.slab, family, cfg.sample_prior, cfg.sample_decoder)
        check_family(cfg.slab, family, encoders)
        return None
    except SampleError as exc:
        raise TrainError(f"sample_every = {cfg.sample_every}: {exc} (Or set sample_every = 0.)") from None


def _check_stage_keys(cfg: TrainConfig, family: str) -> None:
    """Refuse sample_prior / sample_decoder beside a slab that is not one of Würstchen's stages."""
    given = [k for k in ("sample_prior", "sample_decoder") if getattr(cfg, k)]
    if given and family not in STAGES:
        raise TrainError(f"{given[0]} is for a Würstchen slab's sample images; this slab holds a {family} model, so "
                         "leave it out.")


def _save_samples(cfg: TrainConfig, model, pipe, embeds: dict[str, dict], folder: Path, step: int,
                  device: torch.device) -> None:
    """PNG samples of ``cfg.sample_prompts`` (their texts' cached ``embeds``) from the model being trained (streamed
    forward under no_grad) through ``pipe``, a pipeline without text encoders whose VAE waits on the host. The
    training RNG is set aside while sampling, so samples do not change the run."""
    folder.mkdir(parents=True, exist_ok=True)
    pipe.transformer = model
    pipe.vae.to(device)
    try:
        with _forward_only(model, device):
            images = []
            for i, prompt in enumerate(_sample_prompts(cfg, "flux")):
                images.append(draw_image(pipe, prompt, cfg.max_sequence_length, device, embeds=embeds[prompt.text],
                                         negative=embeds.get(prompt.negative)))
                write_png(images[-1], folder / f"step-{step:08d}-{i}.png")
            write_png(_side_by_side(images), folder / f"step-{step:08d}-grid.png")
    finally:
        pipe.transformer = None
        pipe.vae.to("cpu")


@contextlib.contextmanager
def _forward_only(model, device: torch.device):
    """A pause in training for forward passes (samples, validation): eval mode, the training RNG set aside, and
    the ring lent FORWARD_SLOTS, since a forward-only pass needs more slots in flight than a training step to hide
    its copies; the extra slots go back before training goes on."""
    model.eval()
    streamer = runtime.runtime_of(model).streamer
    before = len(streamer.slots) if streamer is not None else 0
    try:
        if streamer is not None:
            streamer.add_slots(FORWARD_SLOTS - before)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        if streamer is not None:  # also the slots an add_slots that ran out of memory did add
            streamer.remove_slots(len(streamer.slots) - before)
        model.train()


def _side_by_side(images):
    """One image of ``images`` in a row (a sample step's grid: one column per prompt)."""
    from PIL import Image

    grid = Image.new("RGB", (sum(im.width for im in images), max(im.height for im in images)), "white")
    x = 0
    for im in images:
        grid.paste(im, (x, 0))
        x += im.width
    return grid


def plot_losses(out: Path) -> Path | None:
    """``out/loss.png``: every step's loss in ``out/metrics.jsonl`` (resumed runs included) and its trailing mean
    over a tenth of the steps; None before the first step."""
    metrics = out / METRICS_FILE
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    losses = [float(r["loss"]) for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]
    if not losses:
        return None
    window = max(1, len(losses) // 10)
    curves = {"loss": (losses, (170, 170, 170), 1), f"mean of {window}": (smooth(losses, window), (30, 90, 200), 2)}
    held = validation_history(out)
    if held:  # drawn at its steps (step 0's at step 1), joined by straight lines
        points = [math.nan] * len(losses)
        for row in held:
            if row["step"] <= len(losses):
                points[max(row["step"], 1) - 1] = row["val_loss"]
        curves["validation"] = (points, (210, 80, 30), 2)
    return plot_curves(out / "loss.png", f"training loss by step ({out.name})", curves)


def _apply_new_hyperparameters(cfg: TrainConfig, optimizer, scheduler) -> None:
    """A resumed run trains with the learning rate and weight decay it was given now, not the saved ones."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop the metrics of steps after the checkpoint a run resumes from (they are about to be redone)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line).get("step", 0) <= step]
    atomic_write_bytes(path, "".join(line + "\n" for line in kept).encode())


def _tensorboard(cfg: TrainConfig, out: Path):
    """A TensorBoard writer for ``out/tensorboard`` (``--log tensorboard``); the JSONL file is written as well."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrainError("--log tensorboard needs the tensorboard package: pip install tensorboard, or use --log "
                         "jsonl.") from None
    writer = SummaryWriter(str(out / "tensorboard"))
    return _Closing(writer)


class _Closing:
    """A TensorBoard writer whose ``close`` takes (and ignores) whether the run failed, as a W&B run's does."""

    def __init__(self, writer) -> None:
        self.writer = writer
        self.add_scalar = writer.add_scalar

    def close(self, failed: bool = False) -> None:
        self.writer.close()


WANDB_RUN_ID = "wandb-run-id"  # in the output folder: a resumed run logs on to the same W&B run


class _WandbBoard:
    """A Weights & Biases run behind the TensorBoard writer's two calls (``--log wandb``)."""

    def __init__(self, run) -> None:
        self.run = run

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed in W&B


def _wandb(cfg: TrainConfig, out: Path) -> _WandbBoard:
    """A W&B run in ``cfg.wandb_project``, named like the LoRA, its files under ``out/wandb``; its id is kept in
    ``out/wandb-run-id``, so a resumed run (``--resume``) continues it (W&B drops steps at or below the last it
    logged, which a resume from an earlier checkpoint repeats)."""
    wandb = require("wandb", "--log wandb")
    id_file = out / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
    atomic_write_bytes(id_file, run_id.encode())
    config = {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v)
              for k, v in dataclasses.asdict(cfg).items()}
    try:
        run = wandb.init(project=cfg.wandb_project, name=cfg.title or Path(cfg.output).name, dir=str(out), id=run_id,
                         resume="allow", config=config)
    except Exception as exc:  # noqa: BLE001 - no login, no network, a W&B server error: one sentence, then stop
        raise TrainError(f"--log wandb: Weights & Biases could not start a run ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:160]}); log in with `wandb login`, set WANDB_MODE=offline to "
                         "log without an account, or use --log jsonl. The cache is kept; rerun the same command.") \
            from None
    return _WandbBoard(run)


def _above_bar(bar, echo):
    """``echo`` that prints above the progress bar instead of through it."""
    def write(text: str) -> None:
        with bar.external_write_mode():
            echo(text)
    return write

