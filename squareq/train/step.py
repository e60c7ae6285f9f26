"""One optimizer step of a run (:class:`Stepper`): ``grad_accum`` micro-batches forward and backward (noise,
timesteps and caption dropout drawn from the run's generator for the whole global batch, each rank keeping its
share), the gradients averaged over ranks and checked, then the update, checked for diverged weights before anything
of it can be saved. A step whose loss or gradients are not finite is taken again (fp16 overflow: at a lower loss
scale; a NaN cuDNN attention may cause: without it) or skipped; ``nan_patience`` skips in a row stop the run. The
stream tuner (``prefetch = "auto"``, ``resident_blocks``) measures and sizes the ring around the steps."""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from .. import runtime
from ..runtime.block_compile import compile_seconds
from ..runtime.host.budget import anonymous_memory
from ..runtime.residency import StreamTuner
from .buckets import entries as dataset_entries
from .checkpoint import latest_checkpoint
from .config import TrainConfig
from .distributed import Ranks
from .errors import TrainError
from .feed import CacheFeed
from .objective import denoising_loss, draw_times, image_tokens
from .prepare import PreparedData
from .run_plan import RunPlan
from .run_state import RunState
from .sinks import RunLogs

log = logging.getLogger("squareq.train")

# LoRA factors start below 1/sqrt(in_features) in size and stay far below 10 in any training that learns; one of
# 1e4 multiplies its layer's delta at least ten-thousandfold (the audit's --lr 1e6 saved weights of 9.8e7), so a
# step that reaches it has diverged.
DIVERGED_WEIGHT = 1e4


def stream_tuner(cfg: TrainConfig, model, device: torch.device) -> StreamTuner | None:
    """``prefetch = "auto"`` or ``resident_blocks``: a StreamTuner that measures this process's second step, then
    grows the ring until the copies hide behind compute and keeps blocks on the device, within what
    ``vram_budget`` leaves beyond that step's peak (or what the device has free). Streamed results depend on
    neither, so a resumed run that sizes them otherwise trains the same."""
    if (cfg.prefetch != "auto" and not cfg.resident_blocks) or not runtime.runtime_of(model).streamed:
        return None
    budget = None
    if cfg.vram_budget_bytes is not None and device.type == "cuda":
        limit = cfg.vram_budget_bytes
        budget = lambda: max(0, limit - torch.cuda.max_memory_reserved(device))  # noqa: E731
    return StreamTuner(model, prefetch=cfg.prefetch, resident=cfg.resident_blocks, probe_step=1, budget_bytes=budget)


class Stepper:
    """The optimizer steps of a run on ``state``, each recorded in ``logs``. ``updating`` is true while an error
    may leave the LoRA or the optimizer half-updated (an out-of-memory save must not save that)."""

    def __init__(self, plan: RunPlan, state: RunState, data: PreparedData, feed: CacheFeed,
                 tuner: StreamTuner | None, ranks: Ranks, device: torch.device, out: Path, logs: RunLogs,
                 on_gradients) -> None:
        self.plan, self.cfg, self.state, self.feed, self.tuner = plan, plan.cfg, state, feed, tuner
        self.ranks, self.device, self.out, self.logs, self.on_gradients = ranks, device, out, logs, on_gradients
        self.batch_iter = iter(state.batches)
        self.skipped_in_row = self.steps_here = 0  # steps_here: this process's steps, which the tuner counts
        self.updating = False
        # each entry's loss weight where regularisation images are mixed in (prior_loss_weight), else None
        entries = [item for item, _ in dataset_entries(data.dataset, data.buckets)]
        self.entry_reg = [e.reg for e in entries]
        self.entry_weights = torch.tensor([self.cfg.prior_loss_weight if e.reg else 1.0 for e in entries]) \
            if self.cfg.reg_data else None

    def optimizer_step(self, step_start) -> bool:
        """One optimizer step over ``grad_accum`` micro-batches, recorded; False where a non-finite one is taken
        again or skipped. ``step_start`` is the batch order's and the generator's state where it starts."""
        state = self.state
        started = time.perf_counter()
        compiled_before = compile_seconds() if self.plan.compile_blocks else 0.0
        self.updating = False
        self.tune(before=True)
        step_loss = self.micro_batches()
        params = state.params
        self.ranks.average_grads(params)
        step_loss = self.ranks.mean(step_loss, self.device)
        grads = [p.grad for p in params if p.grad is not None]
        if state.loss_scale is not None:
            state.loss_scale.unscale(grads)
        # one norm over all gradients (NaN or Inf if any element is): one device sync, not one per tensor
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not (math.isfinite(step_loss) and math.isfinite(float(norm))):
            if state.loss_scale is not None and math.isfinite(step_loss) and state.loss_scale.can_back_off():
                self.scale_overflowed(step_start)
            else:
                self.non_finite(step_start)
            return False
        self.skipped_in_row = 0
        if self.on_gradients is not None:
            self.on_gradients(state.step + 1, [p.grad for p in params])
        if self.cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.max_grad_norm, norm)
        self.update()
        if state.loss_scale is not None:
            state.loss_scale.stepped()
        self.tune(before=False)
        compiled = compile_seconds() - compiled_before if self.plan.compile_blocks else 0.0
        self.logs.write(self.figures(step_loss, float(norm), started, compiled))
        self.say_compile_time(compiled)
        return True

    def say_compile_time(self, seconds: float) -> None:
        """Say how long torch.compile took in this step, when it took long enough to notice (the first steps, a new
        resolution)."""
        if seconds >= 1.0:
            self.logs.echo(f"step {self.state.step}: torch.compile compiled the blocks' graphs for {seconds:.1f} s "
                           f"({compile_seconds():.1f} s in this run so far); the next steps reuse them")

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
            self.logs.echo(f"{what}: {self.tuner.plan.describe()}")

    def micro_batches(self) -> float:
        """Forward and backward over ``grad_accum`` batches; the summed loss (each divided by ``grad_accum``)."""
        cfg, ranks, feed, state = self.cfg, self.ranks, self.feed, self.state
        batches, generator = state.batches, state.generator
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
            t = draw_times(self.plan.objective, len(indices), generator, mode=cfg.timestep_sampling, shift=cfg.shift,
                           image_tokens=image_tokens(shape))
            indices, drops = indices[mine], drops[mine]
            noise, t = noise[mine].to(self.device), t[mine].to(self.device)
            latents, text = feed.batch(indices, drops, epoch)
            upcoming = batches.peek()
            feed.prefetch(upcoming[ranks.share(len(upcoming))], batches.epoch)  # read while this one computes
            weights = None if self.entry_weights is None else self.entry_weights[torch.as_tensor(indices)]
            loss = denoising_loss(state.model, self.plan.recipe, self.plan.objective, latents, noise, t, text,
                                  cfg.guidance, cfg.loss_weighting, weights) / cfg.grad_accum
            (loss if state.loss_scale is None else state.loss_scale.scale(loss)).backward()
            step_loss += float(loss.detach())
        return step_loss

    def again(self, step_start) -> None:
        """Take this step again: the same batch, noise and timesteps."""
        self.state.batches.load_state_dict(step_start[0])
        self.state.generator.set_state(step_start[1])
        self.batch_iter = iter(self.state.batches)

    def scale_overflowed(self, step_start) -> None:
        """An fp16 step whose loss is finite but whose scaled gradients overflowed: halve the loss scale and take the
        same step again (torch.amp.GradScaler halves it and skips the batch; here the batch is kept), at most
        ``loss_scale.RETRIES`` times; then the batch is skipped with the scale halved once, not counted as a NaN step
        (train/loss_scale.py)."""
        state = self.state
        state.optimizer.zero_grad(set_to_none=True)
        scale, before = state.loss_scale, state.loss_scale.value
        if scale.can_retry():
            log.info("step %d: fp16 gradients overflowed at loss scale %g; the step runs again at %g.",
                     state.step + 1, before, scale.overflowed())
            self.again(step_start)
            return
        scale.skipped()
        state.skipped += 1
        log.info("step %d: fp16 gradients still overflowed at loss scale %g; this batch is skipped and the next "
                 "starts at %g.", state.step + 1, before, scale.value)

    def non_finite(self, step_start) -> None:
        """A NaN/Inf loss or gradient: the same step again without cuDNN attention when that may be the cause,
        otherwise skipped; ``nan_patience`` skips in a row stop the run."""
        state = self.state
        state.optimizer.zero_grad(set_to_none=True)
        if state.loss_scale is not None:
            state.loss_scale.skipped()
        if runtime.retry_without_cudnn(self.device):
            self.again(step_start)  # with the cuDNN attention backend off
            return
        self.skipped_in_row, state.skipped = self.skipped_in_row + 1, state.skipped + 1
        self.logs.echo(f"step {state.step + 1}: the loss or a gradient is NaN/Inf; skipped ({self.skipped_in_row} in "
                       "a row)")
        if self.skipped_in_row >= self.cfg.nan_patience:
            last = latest_checkpoint(self.out)
            then = (f"the last good checkpoint, {last}, is untouched. Lower the learning rate or check the data, then "
                    "--resume latest" if last else "no checkpoint was written before them. Lower the learning rate or "
                    "check the data, then start again")
            raise TrainError(f"{self.skipped_in_row} steps in a row had NaN/Inf losses or gradients, so the run "
                             f"stopped at step {state.step}; {then}.")

    def update(self) -> None:
        """The optimizer's step, checked for diverged weights before anything of it can be saved."""
        state = self.state
        params = state.params
        self.updating = True  # an error from here on may leave the LoRA or the optimizer half-updated
        state.optimizer.step()
        # a step can turn finite gradients into non-finite or exploded weights (a learning rate far too large): stop
        # before anything of it is saved, so every checkpoint on disk stays a good one. One device-to-host copy for
        # all parameters, not one each; torch's max keeps a NaN wherever it is (Python's max() drops a later one)
        largest = torch.stack([p.detach().abs().amax().float() for p in params]).max().item()
        if not largest <= DIVERGED_WEIGHT:
            last = latest_checkpoint(self.out)
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was written"
            what = "NaN/Inf" if not math.isfinite(largest) else f"as large as {largest:.3g}"
            raise TrainError(f"step {state.step + 1} made the LoRA weights {what} (learning rate "
                             f"{state.scheduler.get_last_lr()[0]:.3g}), so the run stopped without saving it; "
                             f"{where}. Lower --lr, then --resume latest or start again.")
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)
        if state.ema is not None:
            state.ema.update(params)
        state.step += 1
        self.updating = False  # the step is whole: an error from here on (validation, samples) loses nothing

    def figures(self, step_loss: float, norm: float, started: float, compiled: float) -> dict:
        """The finished step's line of metrics.jsonl: loss, learning rate, gradient norm, seconds (``compile_s`` of
        them torch.compile's, which a new resolution costs once), skipped steps, the process's host memory and the
        ring's slots, and on a GPU the reserved peak and the copies (each rank's too, with several)."""
        state = self.state
        rt = runtime.runtime_of(state.model)
        record = {"step": state.step, "loss": step_loss, "lr": state.scheduler.get_last_lr()[0], "grad_norm": norm,
                  "seconds": time.perf_counter() - started, "compile_s": compiled, "skipped_total": state.skipped,
                  "host_GB": anonymous_memory() / 1e9, "ring_slots": rt.ring_slots}
        if self.device.type == "cuda":
            stats = rt.step_stats()
            record.update(peak_reserved_GB=stats.peak_reserved / 1e9, copy_wait_s=stats.copy_wait_s,
                          copied_GB=stats.bytes_copied / 1e9)
            if self.ranks.world > 1:  # each GPU's own figures: memory and copy waits can differ between ranks
                peaks, waits = self.ranks.gather([record["peak_reserved_GB"], stats.copy_wait_s], self.device)
                record.update(rank_peak_reserved_GB=peaks, rank_copy_wait_s=waits)
        return record
