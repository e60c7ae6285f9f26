"""Validation loss: the training loss on held-out images at fixed timesteps and fixed noise.

Everything but the LoRA is fixed (the images, their captions as written, five times spread over the schedule and
one noise draw per image seeded by the run's seed), so two measurements differ only by what the LoRA learned: a
validation loss that climbs while the training loss falls is overfitting, which the training loss alone, drawn at
random times, cannot show. Results go to ``OUT/validation.jsonl`` (one line per measurement) and into loss.png.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.noising import DDPM_STEPS
from .objective import denoising_loss

# fractions of the schedule, nearly clean to nearly pure noise; DDPM models take the steps 100, 300, ..., 900
VALIDATION_TIMES = (0.1, 0.3, 0.5, 0.7, 0.9)
VALIDATION_FILE = "validation.jsonl"


def validation_times(objective: str) -> torch.Tensor:
    """The fixed times of :data:`VALIDATION_TIMES` in ``objective``'s convention (a DDPM step or a ratio)."""
    t = torch.tensor(VALIDATION_TIMES, dtype=torch.float32)
    return (t * DDPM_STEPS).long() if objective in ("epsilon", "v_prediction") else t


@torch.no_grad()
def validation_loss(model, recipe, objective: str, feed, entries: list[int], seed: int, guidance: float,
                    device: torch.device, weighting: str = "none") -> dict:
    """The mean loss of ``model`` over the feed's ``entries`` at each fixed time, weighted as training weights it:
    ``{"val_loss", "by_time", "images"}``. Entry ``n`` of ``entries`` gets its noise from ``seed`` and ``n`` alone,
    so the numbers do not depend on when, or after what, they are measured."""
    times = validation_times(objective)
    totals = torch.zeros(len(times), dtype=torch.float64)
    for n, index in enumerate(entries):
        latents, text = feed.batch([index], [False])
        generator = torch.Generator().manual_seed(seed * 1_000_003 + n)
        noise = torch.randn((len(times), *latents.shape[1:]), generator=generator).to(device)
        for i, t in enumerate(times):
            loss = denoising_loss(model, recipe, objective, latents, noise[i:i + 1], t.reshape(1).to(device), text,
                                  guidance, weighting)
            totals[i] += float(loss)
    by_time = (totals / max(1, len(entries))).tolist()
    return {"val_loss": sum(by_time) / len(by_time), "images": len(entries),
            "by_time": {f"{float(t):g}": v for t, v in zip(times, by_time, strict=True)}}


def record_validation(out: Path, step: int, result: dict) -> None:
    """Append one measurement to ``out/validation.jsonl`` (flushed at once: a killed run keeps it)."""
    with open(out / VALIDATION_FILE, "a") as fh:
        fh.write(json.dumps({"step": step, **result}) + "\n")


def validation_history(out: Path) -> list[dict]:
    """Every measurement in ``out/validation.jsonl`` by step (a resumed run's included)."""
    path = out / VALIDATION_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return sorted(rows, key=lambda r: r["step"])
