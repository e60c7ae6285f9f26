"""What a run trains: the slab loaded through the runtime on the host copy the run settles (:func:`load_model`), and
:class:`RunState`, the LoRA on it with everything a checkpoint holds of the run: the batch order, the optimizer and
its schedule, the run's generator (noise, timesteps, caption dropout), the moving average, the fp16 loss scale and
the counts of finished and skipped steps."""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from .. import runtime
from ..runtime.host.pinned import HostMemoryError
from .buckets import BucketBatches
from .distributed import Ranks
from .ema import LoraEma
from .errors import TrainError
from .host_plan import HostPlan
from .loss_scale import LossScale
from .optimizers import lr_scheduler, make_optimizer
from .run_plan import RunPlan

log = logging.getLogger("squareq.train")


def load_model(plan: RunPlan, device: torch.device, ranks: Ranks, echo, host: HostPlan):
    """The streamed model of ``plan``'s slab, with its settings (compute, graphs, compile, attention, dtype), from the
    host copy the run's ``host`` plan names (it settles ``host = auto`` within the budget, train/host_plan.py)."""
    cfg = plan.cfg
    asked = host.slab_host
    if cfg.host == "auto":
        echo(f"host auto: {asked}: {host.slab_reason()}")
    # several ranks on one host read the same blobs: one shared host copy instead of one pinned copy per rank
    host = "shared" if asked == "pinned" and ranks.local_world > 1 else asked
    options = runtime.LoadOptions(host=host, prefetch=cfg.start_prefetch, verify="off", compute=plan.compute,
                                  cuda_graphs=plan.cuda_graphs, compile_blocks=plan.compile_blocks,
                                  attention=cfg.attention, dtype=plan.dtype)
    try:
        model = runtime.load(plan.slab, device, options=options)
    except HostMemoryError as exc:
        if host == asked:
            raise TrainError(f"--host {cfg.host}: {exc}") from None
        log.warning("%s; each rank pins its own copy of the slab instead (--host pinned).", exc)
        model = runtime.load(plan.slab, device, options=dataclasses.replace(options, host="pinned"))
    if plan.offload:  # the checkpointed block inputs wait in host memory (run_plan.py said why)
        runtime.runtime_of(model).activation_offload = runtime.ActivationOffload(device)
    if cfg.attention == "auto":
        rt = runtime.runtime_of(model)
        echo(f"attention auto: {'cuDNN first' if rt.prefer_cudnn else 'torch order'}: {rt.attention_reason}")
    return model


@dataclass
class RunState:
    """The LoRA being trained on ``model`` and what a checkpoint holds of the run; ``step`` counts finished optimizer
    steps, ``skipped`` the steps skipped for NaN/Inf or fp16 overflow, ``total`` the run's optimizer steps."""

    model: torch.nn.Module
    params: list[torch.nn.Parameter]
    names: list[str]  # the LoRA parameters' names, in ``params``' order
    batches: BucketBatches
    total: int
    optimizer: torch.optim.Optimizer
    scheduler: object
    generator: torch.Generator
    ema: LoraEma | None
    loss_scale: LossScale | None  # fp16 runs only
    step: int = 0
    skipped: int = 0

    @classmethod
    def start(cls, plan: RunPlan, model, world: int, dataset, buckets) -> RunState:
        """The LoRA attached to ``model`` (gradient checkpointing on, train mode), the batch order of ``dataset`` for
        ``world`` ranks, the optimizer and its schedule, and the run's generator, all at step 0."""
        cfg = plan.cfg
        params = runtime.add_lora(model, rank=cfg.rank, alpha=cfg.lora_alpha, targets=cfg.targets,
                                  seed=cfg.seed, variant=cfg.lora_variant)
        names = list(runtime.lora_parameters(model))
        model.enable_gradient_checkpointing()
        model.train()
        # one global batch per step, shared out to the ranks (equal shares, so the last short batch is dropped)
        sizes = [g.batch_size * world for g in dataset.groups] if len(dataset.groups) > 1 else cfg.batch_size * world
        batches = BucketBatches(dataset, buckets, sizes, cfg.seed, drop_last=world > 1,
                                no_upscale=cfg.no_upscale)
        total = cfg.steps if cfg.epochs is None else max(1, math.ceil(cfg.epochs * len(batches) / cfg.grad_accum))
        optimizer = make_optimizer(cfg, params)
        scheduler = lr_scheduler(cfg, optimizer, total)
        generator = torch.Generator().manual_seed(cfg.seed + 1)  # noise, timesteps and caption dropout
        ema = LoraEma(params, cfg.ema_decay) if cfg.ema_decay > 0 else None
        loss_scale = LossScale() if plan.dtype == "fp16" else None
        return cls(model, params, names, batches, total, optimizer, scheduler, generator, ema, loss_scale)
