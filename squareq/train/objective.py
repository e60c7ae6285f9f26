"""Training objectives: rectified flow (every transformer family) and DDPM epsilon / v-prediction (the UNets), and
which one a model trains with (:func:`training_objective`).

The families' recipes (squareq/models/recipe.py) map the time drawn here onto each model's own inputs. For
FLUX.1, the rectified-flow step reads::

    tokens  = pack_latents(latents)                       # [B, C, H, W] -> [B, H/2 * W/2, 4C]
    t       = sample_timesteps(B, generator)              # t in (0, 1), shifted toward noise
    x_t, v  = flow_match(latents, noise, t)               # x_t = (1-t) x0 + t noise, v = noise - x0
    pred    = transformer(hidden_states=pack_latents(x_t), img_ids=image_ids(H, W), txt_ids=text_ids(L),
                          timestep=t, guidance=..., ...)
    loss    = flow_loss(unpack_latents(pred, H, W), v)

Conventions, checked against the installed diffusers:

* Time runs from data (t = 0) to noise (t = 1), the same direction as diffusers'
  ``FlowMatchEulerDiscreteScheduler`` sigmas, and the model predicts the velocity ``noise - x0``.
* ``FluxTransformer2DModel.forward`` computes ``timestep.to(dtype) * 1000`` (and the same for
  ``guidance``), so the trainer passes ``t`` itself, in [0, 1], and the guidance scale itself (3.5,
  not 3500). diffusers' FLUX pipeline and its dreambooth LoRA script do the same
  (``timestep=timesteps / 1000`` where their timesteps are sigma * 1000).
* ``height`` and ``width`` here are always *latent* sizes (the VAE output), not pixels.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models import ADAPTERS
from ..models.flux_latents import image_ids, pack_latents, text_ids, unpack_latents  # noqa: F401 (re-exported)
from ..models.noising import (  # noqa: F401 (re-exported: the trainer's schedules are the models' own)
    COSINE_S,
    DDPM_BETAS,
    DDPM_STEPS,
    DEFAULT_GUIDANCE,
    DEFAULT_SHIFT,
    TIMESTEP_MODES,
    calibration_times,
    cosine_alphas_cumprod,
    ddpm_alphas_cumprod,
    draw_times,
    flow_match,
    flux_shift,
    image_tokens,
    noised,
    sample_timesteps,
)
from ..runtime import autocast_dtype
from ..sources.encoder_source import EncoderError, EncoderSource, pipeline_folder
from .masks import LOSS_MASK


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32, a scalar.

    Without ``weighting`` it is the mean over all elements. With ``weighting`` (one weight per sample,
    shape [B]) it is the mean over samples of weight × that sample's MSE. ``mask`` (``[B, 1, h, w]``, in [0, 1])
    multiplies each element's squared error first (``masked_loss``: a masked-out element adds nothing, and the mean
    is still over all elements, as kohya's masked loss is).
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} must have the same shape.")
    # fp32 so that bf16 predictions do not round the squared error (as diffusers' FLUX scripts do).
    err = (pred.float() - target.float()).square()
    if mask is not None:
        err = err * mask.float()
    if weighting is None:
        return err.mean()
    per_sample = err.reshape(err.shape[0], -1).mean(dim=1)
    w = torch.as_tensor(weighting, device=per_sample.device).float().reshape(-1)
    if w.shape != per_sample.shape:
        raise ValueError(f"weighting must have one value per sample ({per_sample.shape[0]}), got {tuple(w.shape)}.")
    return (w * per_sample).mean()


LOSS_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")


def loss_weights(scheme: str, t: torch.Tensor) -> torch.Tensor | None:
    """Per-sample weights of a flow-matching loss at times (sigmas) ``t``: diffusers' SD3/FLUX scripts' schemes
    (``training_utils.compute_loss_weighting_for_sd3``: ``sigma_sqrt`` 1/σ², ``cosmap`` 2 / (π (1 − 2σ + 2σ²))),
    or None for ``none`` (a plain mean)."""
    if scheme == "none":
        return None
    if scheme not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {scheme!r}; choose one of {', '.join(LOSS_WEIGHTINGS)}.")
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(scheme, sigmas=t.float())


def denoising_loss(model, recipe, objective: str, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
                   text: dict, guidance: float, weighting: str = "none",
                   sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The family's training loss of ``model`` on one batch: ``latents`` noised to x_t at times ``t``, the denoiser's
    prediction (autocast to the runtime's type, bf16 or fp16, as the trainer runs it) against the objective's
    target, mean squared error, each sample weighted by :func:`loss_weights` (flow matching only) times
    ``sample_weights`` (one per sample), each element by ``text["loss_mask"]`` where the batch has one."""
    text = dict(text)
    mask = text.pop(LOSS_MASK, None)  # cached with the latents (masked_loss), not an input of the denoiser
    x_t, target = noised(objective, latents, noise, t)
    with torch.autocast(latents.device.type, dtype=autocast_dtype(model)):
        output = model(**recipe.forward(model.config, x_t, t, text, guidance))
        pred = recipe.prediction(output, x_t)
    weights = loss_weights(weighting, t) if objective == "flow" else None
    if sample_weights is not None:  # regularisation images' prior_loss_weight
        sample_weights = sample_weights.to(latents.device, torch.float32)
        weights = sample_weights if weights is None else weights.float() * sample_weights
    return flow_loss(pred, target, weights, mask)


def training_objective(source: EncoderSource | str | Path, family: str) -> str:
    """The objective a ``family`` model from ``source`` trains with: the family's, except that a UNet pipeline's
    scheduler decides between epsilon and v-prediction (SD 2.x 768-v predicts v)."""
    recipe = ADAPTERS[family].recipe
    decide = recipe.pipeline.objective if recipe.pipeline is not None else None
    if decide is None:  # flow matching, Würstchen: the family decides alone
        return recipe.objective
    try:
        folder = pipeline_folder(source)
    except EncoderError:
        return recipe.objective
    config = folder / "scheduler" / "scheduler_config.json" if folder is not None else None
    if config is None or not config.is_file():
        return recipe.objective
    try:
        return decide(json.loads(config.read_text()))
    except ValueError as exc:
        raise EncoderError(f"{config} {exc}") from None
