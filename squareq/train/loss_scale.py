"""Dynamic loss scaling for fp16 runs (``dtype = "fp16"``), with torch.amp.GradScaler's defaults.

fp16 keeps 10 mantissa bits but only 5 exponent bits: gradients flowing back through fp16 activations smaller than
about 6e-8 become zero. The loss is multiplied by :attr:`LossScale.value` before the backward, so those gradients stay
representable, and the LoRA's fp32 gradients are divided by it again before clipping and the optimizer (a power of
two, so both are exact). A step whose gradients overflow to Inf/NaN at that scale halves it and is taken again on the
same batch, at most :data:`RETRIES` times; a step still overflowing then is skipped, its batch spent, and the scale
left halved once from where the step began, as GradScaler leaves it after a bad step (so one bad batch does not
collapse the scale). Such skips do not count toward ``nan_patience`` until the scale reaches :data:`SMALLEST`. After
:data:`GROWTH_INTERVAL` good steps in a row the scale doubles. bf16 runs need none of this.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

INITIAL = 2.0 ** 16  # GradScaler's init_scale
GROWTH_INTERVAL = 2000  # GradScaler's growth_interval
SMALLEST = 1.0  # below this the overflow is in the forward, not the scale's doing: the step counts as non-finite
RETRIES = 4  # halvings in one step before the step counts as non-finite


class LossScale:
    """The scale, its halving on overflow and doubling after a run of good steps; saved in checkpoints."""

    def __init__(self, value: float | None = None, growth_interval: int = GROWTH_INTERVAL) -> None:
        self.value = float(INITIAL if value is None else value)
        self.growth_interval = growth_interval
        self.good_steps = 0
        self._step_start: float | None = None  # the scale this step began with, while it is being retried

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale, for the backward."""
        return loss * self.value

    def unscale(self, grads: Iterable[torch.Tensor]) -> None:
        """Divide the gradients by the scale, in place."""
        for g in grads:
            g.mul_(1.0 / self.value)

    def can_back_off(self) -> bool:
        """Whether an overflow may still be the scale's doing: the scale is above :data:`SMALLEST`."""
        return self.value > SMALLEST

    def can_retry(self) -> bool:
        """Whether this step has been taken again fewer than :data:`RETRIES` times."""
        return self._step_start is None or round(math.log2(self._step_start / self.value)) < RETRIES

    def overflowed(self) -> float:
        """The gradients overflowed: halve the scale for the same step again; returns the new one."""
        if self._step_start is None:
            self._step_start = self.value
        self.value = max(SMALLEST, self.value / 2)
        self.good_steps = 0
        return self.value

    def skipped(self) -> None:
        """The step is skipped as non-finite: the scale ends halved once from where the step began."""
        if self._step_start is not None:
            self.value = max(SMALLEST, self._step_start / 2)
        self._step_start = None
        self.good_steps = 0

    def stepped(self) -> None:
        """A step was taken: after ``growth_interval`` of them in a row, double the scale."""
        self._step_start = None
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.value *= 2
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"loss_scale": self.value, "loss_scale_good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> bool:
        """Take the scale saved in ``state`` (a checkpoint's extra); False if it holds none (a bf16 run's)."""
        if "loss_scale" not in state:
            return False
        self.value = float(state["loss_scale"])
        self.good_steps = int(state["loss_scale_good_steps"])
        return True
