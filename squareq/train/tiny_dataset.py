"""A built-in tiny dataset: coloured shapes on coloured grounds with matching captions, drawn from a seed.

``squareq demo`` and ``squareq accept`` (without ``--data``) train on it, so both run offline and
reproducibly. Every image is drawn by code here; nothing is downloaded.
"""
from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

from ..slab.atomic import atomic_directory

COLORS = {"red": (215, 40, 40), "green": (40, 170, 70), "blue": (40, 70, 215), "yellow": (235, 215, 40),
          "purple": (140, 60, 190), "white": (240, 240, 240), "black": (20, 20, 20), "orange": (240, 140, 30)}
SHAPES = ("square", "circle", "triangle")


def _draw(shape: str, color, ground, size: int, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (size, size), ground)
    draw = ImageDraw.Draw(image)
    r = rng.randint(size // 5, size // 3)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    if shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=color)
    elif shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    return image


def write_tiny_dataset(folder: str | Path, count: int = 8, size: int = 64, seed: int = 0) -> Path:
    """Write ``count`` PNG images of ``size`` pixels with same-name ``.txt`` captions into ``folder``.

    The folder appears complete or not at all; an existing folder with the same images is left as it is.
    """
    folder = Path(folder)
    if folder.is_dir() and len(list(folder.glob("*.png"))) == count:
        return folder
    rng = random.Random(seed)
    names = list(COLORS)
    with atomic_directory(folder, overwrite=True) as tmp:
        for i in range(count):
            shape = SHAPES[i % len(SHAPES)]
            color, ground = rng.sample(names, 2)
            _draw(shape, COLORS[color], COLORS[ground], size, rng).save(tmp / f"{i:03d}.png")
            (tmp / f"{i:03d}.txt").write_text(f"a {color} {shape} on a {ground} background")
    return folder
