"""A run's optimizer and learning-rate schedule: the optimizer ``optimizer`` names, diffusers' schedules after a
warm-up, and the learning rate and weight decay a resumed run takes from its command rather than its checkpoint."""
from __future__ import annotations

import logging

import torch

from .config import TrainConfig
from .errors import TrainError

log = logging.getLogger("squareq.train")


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


def make_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
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


def apply_new_hyperparameters(cfg: TrainConfig, optimizer, scheduler) -> None:
    """A resumed run trains with the learning rate and weight decay it was given now, not the saved ones."""
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
