"""Gate: the LoRA gradient on the slab points where the one on the bf16 source points, and is as long.

What training sees is the gradient of its loss with respect to the LoRA factors. Both models (the bf16 reference
slab and the slab under test, streamed through the runtime as ``squareq train`` runs them) get the same LoRA
factors, and for each of ``steps`` batches, the same noise and each of ``timesteps`` times spread over the
family's training distribution, the gradient of the family's loss. Per (step, time) the gate records their
cosine and the norm ratio ``‖g_slab‖ / ‖g_bf16‖``. Between steps the factors follow the bf16 run (AdamW on the
reference's gradient, copied into both), so the later steps measure along a training trajectory, not only at
the initial factors (where LoRA's B = 0 and only half the gradient is non-zero).

PASS when the mean cosine is at least τ_cos and the mean norm ratio lies within [1 − τ_norm, 1 + τ_norm].
"""
from __future__ import annotations

import time

import torch

from .. import runtime
from ..devices import default_device
from ..models import ADAPTERS
from ..models.noising import calibration_times, image_tokens
from ..slab import Slab, open_slab
from ..sources import Source
from ..sources.encoder_source import EncoderSource, slab_encoders
from ..train.buckets import BucketBatches
from ..train.feed import CacheFeed
from ..train.objective import denoising_loss, training_objective
from ..train.prepare import prepare_data
from .convergence import ConvergenceSettings, cannot_run, reference_slab, training_config
from .gates import FAIL, PASS, GateResult, advance, gate_bar, skipped

NAME = "gradient agreement"


def _flat(params: dict[str, torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([params[n].grad.detach().float().flatten() if params[n].grad is not None
                      else torch.zeros(params[n].numel(), device=params[n].device) for n in sorted(params)])


def gradient_gate(source: Source, slab: Slab, model: EncoderSource | str, workdir, settings: ConvergenceSettings,
                  tau_cos: float, tau_norm: float, steps: int = 4, timesteps: int = 4, device=None,
                  echo=print, progress: bool | None = False) -> GateResult:
    """Compare the slab's LoRA gradients with the bf16 reference's over ``steps`` × ``timesteps`` shared batches,
    each pair of gradients counted on a bar (``progress``) or in lines for ``echo`` (:func:`gate_bar`)."""
    started = time.perf_counter()
    why_not = cannot_run(source, model)
    if why_not:
        return skipped(NAME, why_not)
    device = default_device(device)
    ref_path = reference_slab(source, workdir, echo, progress)
    family = slab.manifest.model.family
    cfg = training_config(settings, ref_path, model, workdir / "gradients", workdir / "cache",
                          steps).with_family_defaults(family)
    recipe = ADAPTERS[family].recipe
    encoder_source = slab_encoders(slab.manifest.model, cfg.model, cfg.revision, cfg.encoder_files)
    objective = training_objective(encoder_source, family)
    data = prepare_data(cfg, slab.manifest.model, device, echo, progress=progress, encoder_source=encoder_source)
    image_keys, text_keys, _ = data.keys  # the gate compares unflipped images
    feed = CacheFeed(data.cache, image_keys, text_keys, data.captions, data.dropped, device)
    models, params = {}, {}
    bar = gate_bar(NAME, steps * timesteps, "gradient", progress, echo)
    try:
        _load_models(models, params, (("bf16", ref_path), ("slab", slab.path)), cfg, settings.compute, device)
        optimizer = torch.optim.AdamW(list(params["bf16"].values()), lr=cfg.lr, weight_decay=cfg.weight_decay)
        epochs = BucketBatches(data.dataset, data.buckets, cfg.batch_size, cfg.seed)
        batches = iter(epochs)
        generator = torch.Generator().manual_seed(cfg.seed + 1)
        rows = []
        for step in range(steps):
            indices = next(batches, None)
            if indices is None:  # fewer batches than steps: the next epoch
                batches = iter(epochs)
                indices = next(batches)
            latents, text = feed.batch(indices, [False] * len(indices))
            noise = torch.randn(latents.shape, generator=generator).to(device)
            times = calibration_times(objective, timesteps, cfg.seed + step, mode=cfg.timestep_sampling,
                                      shift=cfg.shift, image_tokens=image_tokens(latents.shape[1:]))
            reference_sum = None
            for t in times:
                t = t.expand(len(indices)).to(device)
                batch = (recipe, objective, latents, noise, t, text, cfg.guidance)
                grads = _lora_grads(models, params, batch)
                # as the trainer does: a cuDNN attention backward that returns NaN/Inf is turned off, and the
                # measurement redone (the same batch, noise and time)
                if not all(bool(torch.isfinite(v).all()) for v in grads.values()) and \
                        runtime.retry_without_cudnn(device):
                    grads = _lora_grads(models, params, batch)
                g, r = grads["slab"], grads["bf16"]
                rows.append({"step": step + 1, "t": round(float(t[0]), 4),
                             "cosine": float(torch.nn.functional.cosine_similarity(g, r, dim=0)),
                             "norm_ratio": float(g.norm() / r.norm().clamp_min(1e-30)),
                             "bf16_norm": float(r.norm())})
                reference_sum = r if reference_sum is None else reference_sum + r
                advance(bar)
            _follow_reference(params, reference_sum / len(times), optimizer)
    finally:
        bar.close()
        feed.close()
        for m in models.values():
            runtime.runtime_of(m).close()
    cosine = sum(r["cosine"] for r in rows) / len(rows)
    ratio = sum(r["norm_ratio"] for r in rows) / len(rows)
    worst = min(rows, key=lambda r: r["cosine"])
    ok = cosine >= tau_cos and abs(ratio - 1.0) <= tau_norm
    note = (f"over {steps} steps × {timesteps} times; lowest cosine {worst['cosine']:.3f} at step {worst['step']}, "
            f"t = {worst['t']:g}")
    return GateResult(NAME, PASS if ok else FAIL, f"cosine {cosine:.4f}, norm ratio {ratio:.3f}",
                      f"cosine ≥ {tau_cos:g}, norm ratio 1 ± {tau_norm:g}", note, time.perf_counter() - started,
                      {"cosine": cosine, "norm_ratio": ratio, "tau_cos": tau_cos, "tau_norm": tau_norm,
                       "steps": steps, "timesteps": timesteps, "per_step": rows, "reference_slab": str(ref_path)})


def _load_models(models: dict, params: dict, slabs, cfg, compute: str, device) -> None:
    """Each of ``slabs`` (label, path) streamed with a fresh LoRA, into ``models`` and its LoRA into ``params`` (as
    loaded, so that a failure later closes what was opened)."""
    for label, path in slabs:
        options = runtime.LoadOptions(prefetch=cfg.start_prefetch, verify="off",
                                      compute=compute if label == "slab" else "bf16")
        models[label] = runtime.load(open_slab(path, verify="off"), device, options=options)
        runtime.add_lora(models[label], rank=cfg.rank, alpha=cfg.lora_alpha, targets=cfg.targets, seed=cfg.seed)
        models[label].enable_gradient_checkpointing()
        models[label].train()
        params[label] = runtime.lora_parameters(models[label])


def _lora_grads(models: dict, params: dict, batch: tuple) -> dict:
    """Each model's LoRA gradient (flattened) of the denoising loss on ``batch``; the gradients are cleared after."""
    grads = {}
    for label, m in models.items():
        denoising_loss(m, *batch).backward()
        grads[label] = _flat(params[label])
        for p in params[label].values():
            p.grad = None
    return grads


def _follow_reference(params: dict, reference_grad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step of the bf16 model's LoRA on ``reference_grad``; the slab's LoRA gets the same factors."""
    offset = 0
    for name in sorted(params["bf16"]):
        p = params["bf16"][name]
        p.grad = reference_grad[offset:offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, p in params["slab"].items():
            p.copy_(params["bf16"][name])
