"""What a run saves and reads back: its checkpoints (:class:`RunCheckpoints`: written by rank 0 every ``save_every``
steps and at the end, the save after running out of memory, and a resume from one), the finished LoRA in each layout
with the run's metadata, and the temporaries a killed run left behind."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import torch

from .. import runtime
from ..models import ADAPTERS
from ..runtime.peft_lora import lycoris_config
from ..slab.atomic import remove_debris
from .checkpoint import (
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_checkpoint_debris,
    resume_path,
    save_checkpoint,
)
from .config import MAX_TITLE_BYTES, TrainConfig
from .distributed import Ranks
from .ema import LoraEma
from .errors import TrainError
from .lora_files import (
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    adapter_metadata,
    save_diffusers_lora,
    save_kohya_lora,
    save_peft_adapter,
)
from .lora_metadata import dataset_summary, lora_header
from .optimizers import apply_new_hyperparameters
from .run_record import CONFIG_FILE, RUN_FILE
from .run_state import RunState
from .sinks import METRICS_FILE, WANDB_RUN_ID, plot_losses, truncate_metrics
from .validation import VALIDATION_FILE

log = logging.getLogger("squareq.train")


class RunCheckpoints:
    """The checkpoints of the run ``state`` in ``out/checkpoints``: rank 0 writes them, every rank waits for them."""

    def __init__(self, cfg: TrainConfig, out: Path, state: RunState, ranks: Ranks) -> None:
        self.cfg, self.out, self.state, self.ranks = cfg, out, state, ranks
        self.last = self.last_path = None  # the step and folder of this run's newest checkpoint

    def resume(self, echo) -> None:
        """With ``resume``: the checkpoint's LoRA, optimizer, schedule, batch position, RNG and moving average."""
        cfg, out, state = self.cfg, self.out, self.state
        path = resume_path(cfg, out)
        if cfg.resume and path is None:
            echo(f"no checkpoint in {out / 'checkpoints'} yet; starting from step 0")
        if path is not None:
            ckpt = load_checkpoint(path, state.optimizer, state.names, state.scheduler)
            with torch.no_grad():
                for name, p in runtime.lora_parameters(state.model).items():
                    p.copy_(ckpt.lora[name])
            try:
                state.batches.load_state_dict(ckpt.data_state["batches"])
            except ValueError:
                raise TrainError(f"{path} was saved with another data set, batch size "
                                 f"({ckpt.config.get('batch_size')} per rank), seed or number of ranks; resume with "
                                 "the settings it was made with, or start a new run in a new -o folder.") from None
            state.generator.set_state(ckpt.extra["generator"])
            if state.ema is not None and not state.ema.load_state_dict(ckpt.extra, state.names):
                log.warning("%s holds no moving average of the LoRA (it was trained without ema_decay); the average "
                            "starts from its weights.", path)
                state.ema = LoraEma(state.params, cfg.ema_decay)
            if state.loss_scale is not None and not state.loss_scale.load_state_dict(ckpt.extra):
                log.info("%s holds no fp16 loss scale (it was trained in bf16); the scale starts at %g.", path,
                         state.loss_scale.value)
            state.step, state.skipped = ckpt.step, int(ckpt.data_state.get("skipped", 0))
            apply_new_hyperparameters(cfg, state.optimizer, state.scheduler)
            changed = sorted(k for k, v in cfg.to_dict().items() if k != "resume" and ckpt.config.get(k, v) != v)
            if self.ranks.is_main:
                truncate_metrics(out / METRICS_FILE, state.step)
                truncate_metrics(out / VALIDATION_FILE, state.step)
            echo(f"resumed from {path} at step {state.step}"
                 + (f"; changed since: {', '.join(changed)}" if changed else ""))
        if state.step == 0 and self.ranks.is_main:
            truncate_metrics(out / VALIDATION_FILE, -1)  # a fresh start: rows of an earlier attempt in this folder go
            (out / WANDB_RUN_ID).unlink(missing_ok=True)  # and a new W&B run

    def save(self, metrics, data_state=None, generator_state=None) -> Path:
        """A checkpoint of the finished steps, and loss.png from ``metrics`` (the open metrics.jsonl) flushed;
        ``data_state`` and ``generator_state`` in place of the current ones (an out-of-memory save)."""
        state = self.state
        path = checkpoint_dir(self.out, state.step)
        if self.ranks.is_main:
            cfg, names = self.cfg, state.names
            lora = runtime.lora_state_dict(state.model)
            extra = {"generator": state.generator.get_state() if generator_state is None else generator_state,
                     **(state.ema.state_dict(names) if state.ema else {}),
                     **(state.loss_scale.state_dict() if state.loss_scale else {})}
            path = save_checkpoint(self.out, state.step, lora, state.optimizer, names, state.scheduler,
                                   {"batches": data_state or state.batches.state_dict(), "skipped": state.skipped},
                                   cfg.to_dict(), extra=extra,
                                   lora_metadata=adapter_metadata(lora, cfg.rank, cfg.lora_alpha, cfg.lora_variant)
                                   if cfg.lora_type == "lora" else None)
            prune_checkpoints(self.out, max(1, cfg.keep_last))
            metrics.flush()
            plot_losses(self.out)
        self.ranks.barrier()
        self.last, self.last_path = state.step, path
        return path

    def out_of_memory(self, metrics, device: torch.device, step_start, updating: bool) -> None:
        """Save the finished steps where that is safe, and stop with the peak and the knobs to turn. ``step_start``:
        the batch order's and the generator's state where the failed step began (None before the first);
        ``updating``: the state may be half-updated."""
        self.state.optimizer.zero_grad(set_to_none=True)
        step = self.state.step
        peak = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else 0
        knobs = ("Lower --resolution or --batch-size (raise --grad-accum to keep the effective batch) or use "
                 "--prefetch 1, then --resume latest.")
        what = f"the GPU ran out of memory in step {step + 1} (peak reserved {peak / 1e9:.2f} GB)"
        if self.ranks.world > 1 or updating or step_start is None or checkpoint_dir(self.out, step).exists():
            # Other ranks wait in a collective, or the state is half-updated, or already saved: keep what is on disk.
            last = latest_checkpoint(self.out)
            where = f"the last checkpoint is {last}" if last else "no checkpoint was written yet"
            raise TrainError(f"{what}; {where}. {knobs}") from None
        path = self.save(metrics, *step_start)  # the finished steps, with the data and RNG where the failed step began
        raise TrainError(f"{what}; steps up to {step} are saved in {path}. {knobs}") from None


def lora_paths(cfg: TrainConfig, out: Path) -> dict[str, Path]:
    """Where each layout goes: ``OUT/pytorch_lora_weights.safetensors``, ``OUT/<title>_kohya.safetensors`` and the
    folder ``OUT/<title>_peft`` (the title made safe as a file name)."""
    title = cfg.title or out.name
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in title).strip("._") or "lora"
    # a title is checked against this limit up front; the default one, the -o folder's name, may be longer
    stem = stem.encode()[:MAX_TITLE_BYTES].decode("utf-8", "ignore")
    return {"diffusers": out / "pytorch_lora_weights.safetensors", "kohya": out / f"{stem}_kohya.safetensors",
            "peft": out / f"{stem}_peft"}


def write_lora(cfg: TrainConfig, out: Path, lora, model_record, objective: str, dataset, formats: list[str],
                steps: int, started: float) -> dict[str, Path]:
    """The trained LoRA in each of ``formats``, each with the run's metadata (train/lora_metadata.py)."""
    family = model_record.family
    component = ADAPTERS[family].component
    # the model's config sizes the modules a family's kohya layout needs beyond the LoRA's own, also on export
    provenance = {"base_model_signature": model_record.signature, "family": family, "component": component,
                  "objective": objective, "base_config": model_record.config}
    trained = [item for item in dataset.items if not item.reg]
    dirs, tags = dataset_summary(dataset.root, trained)
    resolutions = [len(g.resolution) for g in dataset.groups] if len(dataset.groups) > 1 else None
    images = sum(item.repeats * (resolutions[item.group] if resolutions else len(cfg.resolution)) for item in trained)
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
    if "kohya" in formats:  # a LoKr or LoHa: LyCORIS's layout
        files["kohya"] = save_kohya_lora(lora, files["kohya"], cfg.rank, kohya_alpha, cfg.targets,
                                         extra_metadata=provenance, header=header("kohya"),
                                         config=model_record.config)
    if "peft" in formats:
        layers = sorted({name.rsplit(".", 1)[0] for name in lora})
        config = lycoris_config(cfg.lora_variant, cfg.rank, cfg.lora_alpha, layers)
        files["peft"] = save_peft_adapter(lora, files["peft"], config, header=header("peft"),
                                          extra_metadata=provenance)
    return files


def remove_run_debris(cfg: TrainConfig, out: Path, echo) -> None:
    """The temporaries a killed run left in ``out`` (a checkpoint, LoRA file or log it was writing: Python's cleanup
    never ran), one line each; only names this run's own writers make, never a user's file."""
    paths = lora_paths(cfg, out)
    written = [paths["diffusers"], paths["kohya"], paths["peft"] / PEFT_WEIGHTS, paths["peft"] / PEFT_CONFIG,
               out / METRICS_FILE, out / VALIDATION_FILE, out / "loss.png", out / RUN_FILE, out / CONFIG_FILE]
    for debris in [*remove_checkpoint_debris(out), *(p for path in written for p in remove_debris(path))]:
        echo(f"removed {debris}, left by a run that was killed while writing it")
