"""Training objectives: rectified flow (every transformer family) and DDPM epsilon / v-prediction (the UNets).

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

import torch

from ..models.flux_latents import image_ids, pack_latents, text_ids, unpack_latents  # noqa: F401 (re-exported)

# Default static shift for "shift" sampling: 3.0, the default ``--discrete_flow_shift`` of
# kohya sd-scripts' FLUX trainer (library/flux_train_utils.py) and a common FLUX LoRA setting.
DEFAULT_SHIFT = 3.0

# Embedded guidance passed to guidance-distilled FLUX.1-dev during training. diffusers'
# train_dreambooth_lora_flux.py and kohya sd-scripts both default ``--guidance_scale`` to 3.5
# (FluxPipeline's inference default); published FLUX.1-dev LoRA command lines often pass 1.0,
# which is the choice here. It only matters for models built with ``guidance_embeds=True``;
# the trainer should expose it as an option.
DEFAULT_GUIDANCE = 1.0

TIMESTEP_MODES = ("uniform", "logit_normal", "shift")

# Samples are kept this far inside (0, 1): torch.rand can return exactly 0 and a sigmoid can
# round to exactly 1 in float32, and the contract is an open interval.
_T_EPS = 1e-6


def sample_timesteps(
    batch: int,
    generator: torch.Generator | None,
    mode: str = "shift",
    shift: float = DEFAULT_SHIFT,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """Draw ``batch`` float32 times in (0, 1) on the generator's device (CPU when ``generator`` is None).

    ``mode``:
      * ``"uniform"``: t ~ U(0, 1).
      * ``"logit_normal"``: t = sigmoid(N(logit_mean, logit_std)), the SD3 paper's density
        (as diffusers' ``compute_density_for_timestep_sampling``); median sigmoid(logit_mean).
      * ``"shift"`` (default): u ~ U(0, 1), then the SD3/FLUX time shift
        t = shift*u / (1 + (shift - 1)*u), the map ``FlowMatchEulerDiscreteScheduler`` applies to its
        sigmas. shift > 1 moves mass toward t = 1 (more noise), which suits high-resolution latents;
        shift = 1 is uniform.
    """
    device = generator.device if generator is not None else torch.device("cpu")
    if mode == "uniform":
        t = torch.rand(batch, generator=generator, device=device)
    elif mode == "logit_normal":
        z = torch.randn(batch, generator=generator, device=device) * logit_std + logit_mean
        t = torch.sigmoid(z)
    elif mode == "shift":
        if shift <= 0:
            raise ValueError(f"shift must be positive, got {shift}.")
        u = torch.rand(batch, generator=generator, device=device)
        t = shift * u / (1 + (shift - 1) * u)
    else:
        raise ValueError(f"unknown timestep mode {mode!r}; choose one of {', '.join(TIMESTEP_MODES)}.")
    return t.clamp(_T_EPS, 1 - _T_EPS)


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample values [B] so they broadcast over every non-batch dim of ``like``."""
    t = torch.as_tensor(t, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    if t.shape != (like.shape[0],):
        raise ValueError(f"expected one value per sample ({like.shape[0]}), got shape {tuple(t.shape)}.")
    return t.view(-1, *([1] * (like.ndim - 1)))


def flow_match(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified-flow interpolation: x_t = (1 - t)·x0 + t·noise, and the velocity target noise - x0.

    ``t`` has one value per sample. Both are computed in float32; x_t is returned in ``x0``'s dtype
    (it is the model input) and the target stays float32 (it only feeds the fp32 loss), so bf16
    latents lose no precision in the subtraction.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape.")
    x0f, nf = x0.float(), noise.float()
    tt = _per_sample(t, x0).float()
    x_t = (1 - tt) * x0f + tt * nf
    return x_t.to(x0.dtype), nf - x0f


def flow_loss(pred: torch.Tensor, target: torch.Tensor, weighting: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error in float32, a scalar.

    Without ``weighting`` it is the mean over all elements. With ``weighting`` (one weight per sample,
    shape [B]) it is the mean over samples of weight × that sample's MSE.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} must have the same shape.")
    # fp32 so that bf16 predictions do not round the squared error (as diffusers' FLUX scripts do).
    err = (pred.float() - target.float()).square()
    if weighting is None:
        return err.mean()
    per_sample = err.reshape(err.shape[0], -1).mean(dim=1)
    w = torch.as_tensor(weighting, device=per_sample.device).float().reshape(-1)
    if w.shape != per_sample.shape:
        raise ValueError(f"weighting must have one value per sample ({per_sample.shape[0]}), got {tuple(w.shape)}.")
    return (w * per_sample).mean()


# DDPM noise schedule of Stable Diffusion 1.x/2.x and SDXL (their scheduler_config.json): 1000 steps of
# "scaled_linear" betas from 0.00085 to 0.012, i.e. linear in sqrt(beta).
DDPM_STEPS = 1000
DDPM_BETAS = (0.00085, 0.012)


def ddpm_alphas_cumprod(steps: int = DDPM_STEPS, betas: tuple[float, float] = DDPM_BETAS) -> torch.Tensor:
    """ᾱ_t for t = 0 .. steps - 1 (float64 for the products, returned float32)."""
    beta = torch.linspace(betas[0] ** 0.5, betas[1] ** 0.5, steps, dtype=torch.float64) ** 2
    return torch.cumprod(1 - beta, dim=0).float()


# Würstchen's schedule offset (diffusers' DDPMWuerstchenScheduler default s = 0.008, scaler 1)
COSINE_S = 0.008


def cosine_alphas_cumprod(t: torch.Tensor, s: float = COSINE_S) -> torch.Tensor:
    """ᾱ at ratios ``t`` in [0, 1]: cos²((t + s)/(1 + s)·π/2) / cos²(s/(1 + s)·π/2), kept in [1e-4, 0.9999]."""
    import math

    start = math.cos(s / (1 + s) * math.pi / 2) ** 2
    return (torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2 / start).clamp(0.0001, 0.9999)


def noised(objective: str, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model input x_t (in ``x0``'s dtype) and the float32 target for ``objective`` (models/recipe.py).

    * ``flow``: :func:`flow_match`, t in (0, 1), target noise - x0.
    * ``epsilon`` / ``v_prediction``: x_t = sqrt(ᾱ)·x0 + sqrt(1 - ᾱ)·noise at the integer step t; the target is the
      noise, or v = sqrt(ᾱ)·noise - sqrt(1 - ᾱ)·x0 (diffusers' ``get_velocity``).
    * ``cosine_epsilon``: the same at the ratio t in (0, 1) with ᾱ of :func:`cosine_alphas_cumprod`; target the noise.
    """
    if objective == "flow":
        return flow_match(x0, noise, t)
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have the same shape.")
    if objective == "cosine_epsilon":
        abar = cosine_alphas_cumprod(t.float().to(x0.device))
    else:
        abar = ddpm_alphas_cumprod().to(x0.device)[t.long()]
    a, s = _per_sample(abar.sqrt(), x0), _per_sample((1 - abar).sqrt(), x0)
    x0f, nf = x0.float(), noise.float()
    x_t = (a * x0f + s * nf).to(x0.dtype)
    if objective in ("epsilon", "cosine_epsilon"):
        return x_t, nf
    if objective == "v_prediction":
        return x_t, a * nf - s * x0f
    raise ValueError(f"unknown objective {objective!r}.")


def draw_times(objective: str, batch: int, generator: torch.Generator, mode: str = "shift",
               shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """One time per sample for ``objective``: a float in (0, 1) by :func:`sample_timesteps` for flow matching, a
    uniform integer step in [0, 1000) for DDPM (as kohya sd-scripts and diffusers' SD scripts draw them), a
    uniform ratio in (0, 1) for Würstchen (as its training examples draw it)."""
    if objective == "flow":
        return sample_timesteps(batch, generator, mode=mode, shift=shift)
    if objective == "cosine_epsilon":
        return sample_timesteps(batch, generator, mode="uniform")
    return torch.randint(0, DDPM_STEPS, (batch,), generator=generator, device=generator.device)
