"""An exponential moving average of the LoRA weights (ai-toolkit's and SimpleTuner's ``ema_decay``).

After every optimizer step ``ema ← decay · ema + (1 − decay) · weights``, in fp32 on the weights' device, starting
from the initial weights. The final LoRA file holds the average; checkpoints hold both, so a resumed run continues
the same average.
"""
from __future__ import annotations

import torch


class LoraEma:
    """The moving average of ``params`` (the trainer's LoRA parameters, in their order)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay {decay} is outside (0, 1).")
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self, params: list[torch.nn.Parameter]) -> None:
        """One step of the average toward the current weights."""
        torch._foreach_lerp_(self.shadow, [p.detach().float() for p in params], 1.0 - self.decay)

    def state_dict(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The average by parameter name (for a checkpoint)."""
        return {f"ema.{n}": t.detach().cpu() for n, t in zip(names, self.shadow, strict=True)}

    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str]) -> bool:
        """Continue from :meth:`state_dict`; False (and unchanged) when it lacks one of ``names``."""
        if not all(f"ema.{n}" in state for n in names):
            return False
        for t, n in zip(self.shadow, names, strict=True):
            t.copy_(state[f"ema.{n}"])
        return True

    @torch.no_grad()
    def copy_to(self, params: list[torch.nn.Parameter]) -> None:
        """Put the average into ``params`` (at the end of training, before the LoRA is written)."""
        for p, t in zip(params, self.shadow, strict=True):
            p.copy_(t.to(p.dtype))
