"""Noise schedules and noising as each family trains: when t is drawn, and what x_t is at t.

The trainer (``squareq.train.objective``) adds the loss on top; the compiler builds its calibration inputs with the
same x_t, so every block is calibrated on the inputs it sees while a LoRA trains (a real latent, noised), never on
pure noise. Time conventions are documented in ``squareq/train/objective.py`` and ``squareq/models/recipe.py``.
"""
from __future__ import annotations

import math

import torch

# Default static shift for "shift" sampling: 3.0, the default ``--discrete_flow_shift`` of
# kohya sd-scripts' FLUX trainer (library/flux_train_utils.py) and a common FLUX LoRA setting.
DEFAULT_SHIFT = 3.0

# Embedded guidance passed to guidance-distilled FLUX.1-dev during training. diffusers'
# train_dreambooth_lora_flux.py and kohya sd-scripts both default ``--guidance_scale`` to 3.5
# (FluxPipeline's inference default); published FLUX.1-dev LoRA command lines often pass 1.0,
# which is the choice here. It only matters for models built with ``guidance_embeds=True``;
# the trainer should expose it as an option.
DEFAULT_GUIDANCE = 1.0

TIMESTEP_MODES = ("uniform", "logit_normal", "shift", "flux_shift")

# FLUX.1's resolution-dependent shift (its FlowMatchEulerDiscreteScheduler config and diffusers' calculate_shift):
# mu grows linearly from 0.5 at 256 image tokens to 1.15 at 4096, and the shift is e^mu
FLUX_SHIFT_TOKENS = (256, 4096)
FLUX_SHIFT_MU = (0.5, 1.15)


def flux_shift(image_tokens: int) -> float:
    """The time shift e^mu FLUX.1 uses for an image of ``image_tokens`` packed latent tokens ((h/2)·(w/2))."""
    (n0, n1), (m0, m1) = FLUX_SHIFT_TOKENS, FLUX_SHIFT_MU
    return math.exp(m0 + (m1 - m0) * (image_tokens - n0) / (n1 - n0))


def image_tokens(latent_shape) -> int:
    """Packed image tokens of one latent ``[C, h, w]`` (or ``[C, f, h, w]``): 2x2 patches of its last two axes,
    FLUX's packing and the patch size of the flow transformers SquareQ trains."""
    return int(latent_shape[-1]) // 2 * (int(latent_shape[-2]) // 2)


def _shifted(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1 + (shift - 1) * t)

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
    image_tokens: int | None = None,
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
      * ``"flux_shift"``: kohya sd-scripts' ``--timestep_sampling flux_shift``: t = sigmoid(N(0, 1)), then the
        same map with FLUX.1's resolution-dependent shift e^mu for ``image_tokens`` (:func:`flux_shift`: 1.65 at
        256 tokens, 512² images; 3.16 at 4096 tokens, 1024²).
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
        t = _shifted(u, shift)
    elif mode == "flux_shift":
        if image_tokens is None:
            raise ValueError("flux_shift needs the image's token count.")
        t = _shifted(torch.sigmoid(torch.randn(batch, generator=generator, device=device)), flux_shift(image_tokens))
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
               shift: float = DEFAULT_SHIFT, image_tokens: int | None = None) -> torch.Tensor:
    """One time per sample for ``objective``: a float in (0, 1) by :func:`sample_timesteps` for flow matching, a
    uniform integer step in [0, 1000) for DDPM (as kohya sd-scripts and diffusers' SD scripts draw them), a
    uniform ratio in (0, 1) for Würstchen (as its training examples draw it). ``image_tokens``: the batch's packed
    latent tokens, for ``flux_shift``."""
    if objective == "flow":
        return sample_timesteps(batch, generator, mode=mode, shift=shift, image_tokens=image_tokens)
    if objective == "cosine_epsilon":
        return sample_timesteps(batch, generator, mode="uniform")
    return torch.randint(0, DDPM_STEPS, (batch,), generator=generator, device=generator.device)


def calibration_times(objective: str, n: int, seed: int, mode: str = "shift", shift: float = DEFAULT_SHIFT,
                      phase: float = 0.5, image_tokens: int | None = None) -> torch.Tensor:
    """``n`` times spread over the training distribution of ``objective``: the quantiles (i + phase)/n of what
    :func:`draw_times` draws (the shifted flow time, a DDPM step, a cosine ratio), in an order shuffled by ``seed``.

    Stratified rather than drawn, so that a few calibration samples still cover the schedule from nearly clean to
    nearly pure noise, weighted as training weights it."""
    if not 0.0 < phase < 1.0:
        raise ValueError(f"phase={phase} must lie in (0, 1).")
    u = (torch.arange(n, dtype=torch.float64) + phase) / n
    u = u[torch.randperm(n, generator=torch.Generator().manual_seed(seed))]
    if objective == "flow":
        if mode == "uniform":
            t = u
        elif mode == "logit_normal":
            t = torch.sigmoid(math.sqrt(2.0) * torch.erfinv(2 * u - 1))
        elif mode == "shift":
            t = _shifted(u, shift)
        elif mode == "flux_shift":
            if image_tokens is None:
                raise ValueError("flux_shift needs the image's token count.")
            t = _shifted(torch.sigmoid(math.sqrt(2.0) * torch.erfinv(2 * u - 1)), flux_shift(image_tokens))
        else:
            raise ValueError(f"unknown timestep mode {mode!r}; choose one of {', '.join(TIMESTEP_MODES)}.")
        return t.float().clamp(_T_EPS, 1 - _T_EPS)
    if objective == "cosine_epsilon":
        return u.float()
    if objective in ("epsilon", "v_prediction"):
        return (u * DDPM_STEPS).floor().long().clamp(0, DDPM_STEPS - 1)
    raise ValueError(f"unknown objective {objective!r}.")
