"""The compiler's thresholds (τ), shared with `squareq accept` through one TOML file.

Defaults and what each one means are documented in docs/compiler.md.
"""
from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path


class ThresholdsError(ValueError):
    """A thresholds file cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class Thresholds:
    """τ values. A layer leaves a rung when any of its measurements exceeds the limit at that rung.

    mse: layer output rel-MSE ``‖XWᵀ − XŴᵀ‖² / ‖XWᵀ‖²`` on sampled calibration rows.
    act: activation outlier score (p99.9 / median of per-channel input absmax, after smoothing) at W4.
    scale: group-scale spread (max / median of the layer's group scales) at W4.
    block: a block's output rel-MSE against the bf16 block, on calibration inputs.
    conv: ``squareq accept``'s convergence gate: the largest relative gap between the final smoothed training
        losses of a LoRA on the slab and one on the bf16 source.
    conv_steps: Δ, how many steps later than the bf16 run the slab's run may reach its final smoothed loss.

    ``act`` and ``scale`` describe dynamic range, and a b-bit grid has 2^(b-4) times the levels of
    W4, so their limit at b bits is ``τ · 2^(b-4)``; ``mse`` and ``block`` are the same at every rung.
    """

    mse: float = 0.01
    act: float = 40.0
    scale: float = 30.0
    block: float = 0.02
    conv: float = 0.02
    conv_steps: int = 5

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "conv_steps":
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise ThresholdsError(f"threshold conv_steps={v!r} must be a whole number of steps, 0 or more.")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ThresholdsError(f"threshold {f.name}={v!r} must be a positive number.")

    def range_limit(self, name: str, bits: int) -> float:
        """The limit of a dynamic-range threshold (``act`` or ``scale``) at ``bits``."""
        return getattr(self, name) * 2.0 ** (bits - 4)

    def to_dict(self) -> dict:
        return asdict(self)

    def compile_dict(self) -> dict:
        """The values the compiler's decisions depend on (a change to ``conv`` must not void a resumable compile)."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("conv")}

    @classmethod
    def from_toml(cls, path: str | Path) -> "Thresholds":
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
        unknown = sorted(set(table) - known)
        if unknown:
            raise ThresholdsError(f"{path}: unknown threshold keys {unknown}; known keys are {sorted(known)}.")
        return cls(**table)
