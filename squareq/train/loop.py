"""The training loop behind ``squareq train``: cache, then LoRA steps on the streamed slab with the family's objective.

1. The slab is loaded through the runtime (blocks streamed, gradient checkpointing on) and LoRA factors
   are attached. With ``vram_budget`` set on a GPU, the memory plan is checked before anything else.
2. Images and captions are scanned; VAE latents and text embeddings are computed once into the cache
   (only entries that are missing), and the encoders are released before training starts.
3. Each step draws a batch of one bucket, noise and timesteps from the run's own generator, computes
   the family's loss (rectified flow, or DDPM epsilon / v-prediction for the UNets; the family's recipe in
   squareq/models turns latents and captions into the denoiser's arguments) and updates the LoRA with the
   configured optimizer (AdamW, AdamW 8-bit, Prodigy or Adafactor).
   A step whose loss or gradients are not finite is skipped and counted; ``nan_patience`` skips in a row
   stop the run with the last good checkpoint left untouched.
4. Every ``save_every`` steps a checkpoint (LoRA, optimizer, schedule, RNG states, data position) is
   written atomically; ``resume="latest"`` continues from the newest one exactly (bitwise on a CPU). Ctrl-C during
   the steps (train/interrupt.py) finishes the step, writes its checkpoint and the LoRA so far, and raises
   :class:`TrainInterrupted`, whose message names ``--resume latest``.
   The finished LoRA is written in the layouts ``save_format`` names (default: diffusers, and for FLUX.1 the
   kohya file beside it); a LoKr or LoHa as a PEFT folder.

This module strings the stages together (:class:`TrainingRun`); each stage is a module of its own: the plan
(run_plan.py), the data and cache (prepare.py), the model and what trains on it (run_state.py, optimizers.py), the
step (step.py), samples (run_samples.py), checkpoints and LoRA files (saving.py), the logs (sinks.py) and what the run
says before its first step (run_summary.py).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import runtime
from ..devices import default_device
from ..extras import require
from ..runtime.host.budget import empty_host_cache
from ..slab.atomic import ensure_output_dir, os_error_sentence
from .checkpoint import check_resume_folder, latest_checkpoint
from .config import TrainConfig
from .distributed import Ranks
from .errors import TrainError, TrainInterrupted
from .feed import CacheFeed
from .host_plan import train_host_plan
from .interrupt import CtrlC
from .lora_metadata import source_date_epoch
from .prepare import prepare_data
from .run_plan import plan_run
from .run_record import recorded
from .run_samples import TrainingSamples, forward_only
from .run_state import RunState, load_model
from .run_summary import device_line, steps_line
from .saving import RunCheckpoints, lora_paths, remove_run_debris, write_lora
from .sinks import RunLogs
from .step import Stepper, stream_tuner
from .validation import record_validation, validation_history, validation_loss


@dataclass
class TrainResult:
    steps: int
    skipped_steps: int
    losses: list[float]
    lora_file: Path  # the diffusers layout (pytorch_lora_weights.safetensors)
    kohya_file: Path | None = None  # the kohya / ComfyUI layout, when save_format has it


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
        remove_run_debris(cfg, out, echo)
    with recorded(out, cfg, ranks.is_main, echo) as (record, echo):  # run.json, config.toml, train.log
        torch.manual_seed(cfg.seed)
        run = TrainingRun(cfg, out, device, ranks, echo, after_step, on_gradients)
        run.setup(progress)
        try:
            run.load()
            run.resume()
            if record is not None:
                record.update(total=run.state.total, first_step=run.state.step)
            run.open_logs(progress)
            run.train()
        finally:
            run.close()
        result = run.finish()
        if run.interrupted:
            raise TrainInterrupted(run.interrupted_message(result))
        return result


class TrainingRun:
    """One training run, stage by stage: the plan and the cache (``setup``), the model and what trains on it
    (``load``), ``resume``, the logs, the optimizer steps with what is due after each (a checkpoint, samples, a
    validation pass), and the LoRA files at the end (``finish``)."""

    def __init__(self, cfg: TrainConfig, out: Path, device: torch.device, ranks: Ranks, echo, after_step,
                 on_gradients) -> None:
        self.cfg, self.out, self.device, self.ranks, self.echo = cfg, out, device, ranks, echo
        self.after_step, self.on_gradients = after_step, on_gradients
        self.model = self.state = self.feed = self.logs = self.samples = None
        self.interrupted = False  # Ctrl-C stopped the steps early (train/interrupt.py)

    # ------------------------------------------------------------------------------------------ before training

    def setup(self, progress: bool | None = None) -> None:
        """The plan (train/run_plan.py: the configuration settled against the slab, the memory plan checked), then
        the cache filled by rank 0 (train/prepare.py), with a bar as ``progress`` says (as the steps' bar)."""
        self.progress = progress  # the samples' bar follows the steps' bar
        self.plan = plan = plan_run(self.cfg, self.out, self.device, self.ranks.world, self.echo)
        self.cfg = plan.cfg
        # host memory, before any work: refused here if the run cannot fit host_budget (train/host_plan.py)
        self.host = train_host_plan(plan.cfg, "train", self.device, [b.nbytes for b in plan.slab.manifest.blocks],
                                     plan.encoder_source, plan.family, encode=self.ranks.is_main,
                                     activations=plan.offload_bytes)
        # the device first, so that a run on the CPU says so in its first lines, before the cache is filled
        self.data = prepare_data(plan.cfg, plan.slab.manifest.model, self.device, self.echo,
                                 encode=self.ranks.is_main, progress=progress, encoder_source=plan.encoder_source,
                                 describe=[device_line(self.device, plan.dtype, plan.compute, self.ranks.world),
                                           self.host.line()], host=self.host)
        self.echo(f"training a {plan.family} LoRA with the {plan.objective} objective")

    def load(self) -> None:
        """The streamed model with its LoRA, the batch order, the optimizer, its schedule and the run's RNG, and the
        feed of cached tensors."""
        cfg, ranks, data, plan = self.cfg, self.ranks, self.data, self.plan
        # the other ranks wait here while rank 0 fills the cache, so encoders and slab are never in memory together
        image_keys, text_keys, flipped_keys = ranks.broadcast(data.keys if ranks.is_main else None)
        plan.say_choices(self.echo)
        self.model = load_model(plan, self.device, ranks, self.echo, self.host)
        self.tuner = stream_tuner(cfg, self.model, self.device)
        self.state = RunState.start(plan, self.model, ranks.world, data.dataset, data.buckets)
        self.checkpoints = RunCheckpoints(cfg, self.out, self.state, ranks)
        self.feed = CacheFeed(data.cache, image_keys, text_keys, data.captions + [[c] for c in data.validation],
                              data.dropped, self.device, flipped_keys, cfg.seed)
        # the validation entries of the feed come after the training entries
        self.held_out = list(range(len(data.captions), len(data.captions) + len(data.validation)))

    def resume(self) -> None:
        """With ``resume``: the run goes on from its checkpoint (train/saving.py)."""
        self.checkpoints.resume(self.echo)

    def open_logs(self, progress) -> None:
        """metrics.jsonl, TensorBoard or W&B when asked, and a progress bar on a terminal (or when ``progress``)."""
        self.logs = RunLogs(self.cfg, self.out, self.ranks.is_main, self.state.total, self.state.step, progress,
                            self.echo)
        self.echo = self.logs.echo

    # ------------------------------------------------------------------------------------------ training

    def train(self) -> None:
        """Every optimizer step up to the total, then the last checkpoint; an out-of-memory error saves what it can,
        and Ctrl-C (train/interrupt.py) stops after the step it came in, with its checkpoint."""
        cfg, state, plan = self.cfg, self.state, self.plan
        self.validate_every = cfg.validate_every or cfg.save_every or state.total
        self.stepper = Stepper(plan, state, self.data, self.feed, self.tuner, self.ranks, self.device, self.out,
                               self.logs, self.on_gradients)
        if cfg.sample_every and self.ranks.is_main:
            self.samples = TrainingSamples(cfg, plan.family, plan.encoder_source, plan.sample_stages, self.device,
                                           plan.dtype, self.out, self.data.cache, self.data.keys[1],
                                           progress=self.progress, echo=self.echo,
                                           encoder_host=self.host.encoders_beside_slab)
        self.step_start = None
        try:
            if self.samples is not None and state.step == 0:
                self.samples.draw(state.model, state.step)  # the base model's pictures, to compare
            if state.step == 0 or (state.step % self.validate_every == 0 and self.ranks.is_main
                                   and state.step not in {r["step"] for r in validation_history(self.out)}):
                self.validate()  # the base model's loss, to compare; or one a killed run did not get to write
        except torch.OutOfMemoryError:
            self.checkpoints.out_of_memory(self.logs.metrics, self.device, None, False)
        batch = [v.batch_size for v in cfg.dataset_views()] if cfg.datasets else cfg.batch_size
        self.echo(steps_line(state.total, state.step, batch, cfg.grad_accum, self.ranks.world,
                             len(state.batches)))
        with CtrlC() as ctrl_c:  # only around the steps and their checkpoint
            try:
                self.steps(ctrl_c)
            except torch.OutOfMemoryError:
                self.checkpoints.out_of_memory(self.logs.metrics, self.device, self.step_start, self.stepper.updating)
            if not (self.interrupted and self.checkpoints.last == state.step):  # save_every may have just written it
                self.checkpoints.save(self.logs.metrics)  # a second Ctrl-C stops this save; the last one stays whole

    def steps(self, ctrl_c: CtrlC) -> None:
        """The optimizer steps up to the total, or up to the one Ctrl-C came in (on any rank)."""
        state = self.state
        while state.step < state.total:
            # where this step starts: what an out-of-memory save must record, so that a resume redoes it
            self.step_start = (state.batches.state_dict(), state.generator.get_state())
            if self.stepper.optimizer_step(self.step_start):
                self.after_update(ctrl_c.pressed)
            if state.step < state.total and ctrl_c.stop(self.ranks.world, self.device):
                self.interrupted = True
                self.echo(f"Ctrl-C: stopping after step {state.step}; writing its checkpoint and the LoRA so far")
                return

    def after_update(self, stopping: bool = False) -> None:
        """What is due after this step: a checkpoint, samples, a validation pass, the caller's hook. ``stopping``
        (Ctrl-C was pressed): no samples or validation, which can take minutes; a resumed run makes up a missed
        validation (rank 0 alone draws and validates, so its own flag is enough)."""
        cfg, step = self.cfg, self.state.step
        if cfg.save_every and step % cfg.save_every == 0 and step < self.state.total:
            self.checkpoints.save(self.logs.metrics)
        if self.samples is not None and step % cfg.sample_every == 0 and not stopping:
            self.samples.draw(self.state.model, step)
        if (step % self.validate_every == 0 or step == self.state.total) and not stopping:
            self.validate()
        if self.after_step is not None:
            self.after_step(step)

    def validate(self) -> None:
        """The validation loss now (rank 0), recorded; a pass that runs out of memory is skipped."""
        if not self.held_out or not self.ranks.is_main:
            return
        cfg, step, plan, model = self.cfg, self.state.step, self.plan, self.state.model
        try:
            with forward_only(model, self.device):
                result = validation_loss(model, plan.recipe, plan.objective, self.feed, self.held_out, cfg.seed,
                                         cfg.guidance, self.device, cfg.loss_weighting)
        except torch.OutOfMemoryError:
            # the step is done and intact: training goes on, without this measurement
            self.echo(f"step {step}: the validation pass ran out of GPU memory and was skipped; training goes on "
                      "(fewer or smaller validation images would fit)")
            return
        record_validation(self.out, step, result)
        if self.logs.board is not None:
            self.logs.board.add_scalar("val/loss", result["val_loss"], step)
        first = validation_history(self.out)[0]
        self.echo(f"step {step}: validation loss {result['val_loss']:.4f} on {result['images']} held-out images"
                  + (f" (step {first['step']}: {first['val_loss']:.4f})" if first["step"] != step else ""))

    # ------------------------------------------------------------------------------------------ after training

    def close(self) -> None:
        """Release the cache reader, the logs and the runtime's threads (also after an error)."""
        failed = sys.exc_info()[0] is not None
        if self.feed is not None:
            self.feed.close()
        if self.logs is not None:
            self.logs.close(failed)
        if self.model is not None:
            runtime.runtime_of(self.model).close()
        empty_host_cache()  # the feed's pinned batches, which torch's pinned allocator would keep for the next run

    def finish(self) -> TrainResult:
        """The LoRA files (the moving average when there is one), written by rank 0."""
        cfg, plan, state = self.cfg, self.plan, self.state
        formats = plan.formats
        files = lora_paths(cfg, self.out)
        if state.ema is not None:
            state.ema.copy_to(state.params)  # the final LoRA is the average (the checkpoints keep the trained weights)
        if self.ranks.is_main:
            files = write_lora(cfg, self.out, runtime.lora_state_dict(state.model), plan.slab.manifest.model,
                               plan.objective, self.data.dataset, formats, state.step, plan.started)
        self.ranks.barrier()
        written = [files[f] for f in formats]
        self.echo(f"LoRA written to {' and '.join(map(str, written))} after {state.step} steps ({state.skipped} "
                  "skipped)")
        return TrainResult(state.step, state.skipped, self.logs.losses, written[0],
                           files["kohya"] if "kohya" in formats else None)

    def interrupted_message(self, result: TrainResult) -> str:
        """What a run stopped by Ctrl-C wrote, and how to go on."""
        written = " and ".join(map(str, [result.lora_file] + ([result.kohya_file] if result.kohya_file else [])))
        return (f"Ctrl-C: stopped after step {result.steps} of {self.state.total}; the checkpoint "
                f"{self.checkpoints.last_path} and the LoRA so far ({written}) are written; run the same command with "
                f"--resume latest to continue from step {result.steps}.")
