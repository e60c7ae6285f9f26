"""PNG output (PIL only): a small line plot (the convergence gate's loss curves, the trainer's loss curve), its
trailing mean, and an atomic PNG write."""
from __future__ import annotations

import io
import math
from pathlib import Path

from PIL import Image, ImageDraw

from .slab import atomic

WIDTH, HEIGHT, MARGIN = 720, 420, 56


def plot_curves(path: str | Path, title: str, curves: dict[str, tuple[list[float], tuple[int, int, int], int]],
                marks: dict[str, int] | None = None) -> Path:
    """Draw ``curves`` (label -> (y values for steps 1..n, RGB colour, line width)) and vertical ``marks``
    (label -> step) into a PNG at ``path``, written atomically."""
    values = [v for ys, _, _ in curves.values() for v in ys if math.isfinite(v)]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    steps = max((len(ys) for ys, _, _ in curves.values()), default=1)
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = MARGIN, 30, WIDTH - 20, HEIGHT - MARGIN

    def xy(step: int, value: float) -> tuple[float, float]:
        x = left + (right - left) * (step - 1) / max(steps - 1, 1)
        y = bottom - (bottom - top) * (value - lo) / (hi - lo)
        return x, y

    draw.rectangle((left, top, right, bottom), outline=(90, 90, 90))
    for i in range(5):
        v = lo + (hi - lo) * i / 4
        _, y = xy(1, v)
        draw.line((left - 4, y, left, y), fill=(90, 90, 90))
        draw.text((4, y - 6), f"{v:.3g}", fill=(40, 40, 40))
    draw.text((left, bottom + 8), "step 1", fill=(40, 40, 40))
    draw.text((right - 60, bottom + 8), f"step {steps}", fill=(40, 40, 40))
    draw.text((left, 8), title, fill=(0, 0, 0))
    for label, step in (marks or {}).items():
        x, _ = xy(step, lo)
        draw.line((x, top, x, bottom), fill=(160, 160, 160))
        draw.text((x + 3, top + 3), label, fill=(110, 110, 110))
    legend_y = top + 6
    for label, (ys, colour, width) in curves.items():
        points = [xy(i + 1, v) for i, v in enumerate(ys) if math.isfinite(v)]
        if len(points) > 1:
            draw.line(points, fill=colour, width=width)
        draw.line((right - 170, legend_y + 6, right - 150, legend_y + 6), fill=colour, width=max(width, 2))
        draw.text((right - 145, legend_y), label, fill=(0, 0, 0))
        legend_y += 16
    return write_png(image, path)


def write_png(image: Image.Image, path: str | Path) -> Path:
    """``image`` as a PNG at ``path``, written atomically (temporary name, then rename)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    # looked up at call time: tests stand in for a full disk there
    atomic.atomic_write_bytes(Path(path), out.getvalue())
    return Path(path)


def write_frames(frames: list[Image.Image], path: str | Path, fps: int = 16) -> Path:
    """A video's frames as an animated WebP at ``path`` (looping, ``fps`` frames a second), written atomically."""
    out = io.BytesIO()
    frames[0].save(out, format="WEBP", save_all=True, append_images=list(frames[1:]), duration=round(1000 / fps),
                   loop=0, quality=90)
    atomic.atomic_write_bytes(Path(path), out.getvalue())
    return Path(path)


def write_sample(sample: Image.Image | list[Image.Image], stem: str | Path) -> Path:
    """A drawn sample at ``stem``: an image as ``stem.png``, a video's frames as ``stem.webp``."""
    stem = Path(stem)
    if isinstance(sample, list):
        return write_frames(sample, stem.with_name(stem.name + ".webp"))
    return write_png(sample, stem.with_name(stem.name + ".png"))


def first_frame(sample: Image.Image | list[Image.Image]) -> Image.Image:
    """A sample's picture for a grid: the image, or a video's first frame."""
    return sample[0] if isinstance(sample, list) else sample


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values at each step."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
