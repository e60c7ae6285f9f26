"""The compiler's thresholds (τ), shared with `squareq accept` through one TOML file.

Defaults and what each one means are documented in docs/compiler.md.
"""
from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ACCEPT_ONLY = ("drift", "psnr", "ssim", "grad_cos", "grad_norm", "conv")  # squareq accept's limits, not the compiler's


class ThresholdsError(ValueError):
    """A thresholds file cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Thresholds:
    """τ values.

    out: τ_OUT, the compiler's one decision limit: the plan's model-output rel-MSE ``‖ŷ − y‖² / ‖y‖²`` on the
        held-out calibration samples, the sum of its layers' measured effects (docs/compiler.md).

    Diagnostics (shown by ``squareq inspect``; they move no layer, docs/compiler.md says why):

    mse: layer output rel-MSE ``‖XWᵀ − XŴᵀ‖² / ‖XWᵀ‖²`` on sampled calibration rows.
    act: activation outlier score (p99.9 / median of per-channel input absmax, after smoothing) at W4.
    scale: group-scale spread (max / median of the layer's group scales) at W4.
    block: a block's output rel-MSE against the bf16 block (kept for old thresholds files; not measured).

    The rest are ``squareq accept``'s (docs/accept.md says how each default was chosen):

    drift: τ_DRIFT, the model's final-output rel-MSE with only one block quantized, on fresh inputs.
    psnr, ssim: τ_PSNR (dB) and τ_SSIM, the least mean PSNR and SSIM of images drawn from the slab against the same
        prompts and seeds drawn from the bf16 source.
    grad_cos, grad_norm: the least mean cosine between the slab's LoRA gradient and the bf16 source's, and the
        largest distance of their mean norm ratio from 1.
    conv: τ_CONV, the margin of the convergence gate: the slab's per-step training loss must be shown within
        ±conv (relative) of the bf16 run's, and the bf16 run must have learned more than conv.

    ``act`` and ``scale`` describe dynamic range, and a b-bit grid has 2^(b-4) times the levels of
    W4, so their limit at b bits is ``τ · 2^(b-4)``; ``mse`` and ``block`` are the same at every rung.
    """

    out: float = 0.01
    mse: float = 0.01
    act: float = 40.0
    scale: float = 30.0
    block: float = 0.02
    drift: float = 0.02
    psnr: float = 27.0
    ssim: float = 0.9
    grad_cos: float = 0.8
    grad_norm: float = 0.2
    conv: float = 0.03

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ThresholdsError(f"threshold {f.name}={v!r} must be a positive number.")
        for name in ("ssim", "grad_cos"):
            if getattr(self, name) > 1:
                raise ThresholdsError(f"threshold {name}={getattr(self, name)!r} must be at most 1 (a similarity).")

    def range_limit(self, name: str, bits: int) -> float:
        """The limit of a dynamic-range threshold (``act`` or ``scale``) at ``bits``."""
        return getattr(self, name) * 2.0 ** (bits - 4)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_toml(cls, path: str | Path) -> Thresholds:
        """Read the ``[thresholds]`` table of a TOML file; keys not given keep their defaults."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ThresholdsError(f"{path} does not exist; pass an existing thresholds TOML file.") from None
        except tomllib.TOMLDecodeError as exc:
            raise ThresholdsError(f"{path} is not valid TOML ({exc}); fix the file.") from None
        table = data.get("thresholds", {})
        known = {f.name for f in fields(cls)}
        if "conv_steps" in table:
            raise ThresholdsError(f"{path}: conv_steps is no longer used (squareq accept's convergence gate decides "
                                  "with a paired test now, docs/accept.md); delete the key.")
        unknown = sorted(set(table) - known)
        if unknown:
            raise ThresholdsError(f"{path}: unknown threshold keys {unknown}; known keys are {sorted(known)}.")
        return cls(**table)
