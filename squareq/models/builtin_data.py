"""The real data SquareQ calibrates on when the user gives none: photographs and text that ship inside packages.

* **Photographs**: the photographs in scikit-image's wheel (``skimage/data``: an astronaut, a cat, a coffee cup, a
  rocket launch, the Hubble deep field, coins, the moon, textures, microscopy, ...), each captioned with the first
  paragraph of the docstring scikit-image gives it ("Chelsea the cat.", "Launch photo of DSCOVR on Falcon 9 by
  SpaceX."). Files and captions are read from the installed package (its ``_fetchers.py`` parsed, not imported),
  so nothing is downloaded and nothing is written by us.
* **Text**: English sentences from CPython's own documentation (``pydoc_data.topics``, the language reference that
  ``help()`` shows), the prose paragraphs only (code and grammar excerpts are left out).

``read_text_samples`` reads a user's ``--calib-text`` file: one sample per non-empty line.
"""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..extras import missing_sentence
from .base import ModelError

# scikit-image data functions whose file is a photograph (of a scene, an object, a texture or through a microscope);
# drawings, logos, silhouettes and the stereo pair (whose docstring does not describe what it shows) are left out
PHOTOGRAPHS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "hubble_deep_field", "retina", "coins", "moon",
               "brick", "grass", "gravel", "immunohistochemistry", "cell", "clock", "page")


@dataclass(frozen=True)
class Photo:
    """One built-in photograph: its file and caption, and the scikit-image function that documents it."""

    name: str
    path: Path
    caption: str


def _skimage_root() -> Path:
    spec = importlib.util.find_spec("skimage")
    if spec is None or spec.origin is None:
        raise ModelError(missing_sentence("skimage", "calibrating on the built-in photographs") + ", or pass your "
                         "own images with --calib-data DIR.")
    return Path(spec.origin).parent


def skimage_version() -> str:
    """The installed scikit-image version (recorded in the manifest next to the photographs it supplied)."""
    return importlib.metadata.version("scikit-image")


def builtin_photos() -> list[Photo]:
    """The built-in photographs in :data:`PHOTOGRAPHS` order, each with its caption."""
    root = _skimage_root()
    fetchers = root / "data" / "_fetchers.py"
    try:
        tree = ast.parse(fetchers.read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as exc:
        raise ModelError(f"cannot read scikit-image's data index {fetchers} ({exc}); reinstall scikit-image or pass "
                         "your own images with --calib-data DIR.") from None
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    photos = []
    for name in PHOTOGRAPHS:
        node = functions.get(name)
        files = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                 and c.value.endswith((".png", ".jpg"))] if node else []
        doc = ast.get_docstring(node) if node else None
        path = root / files[0] if files else None
        if not doc or path is None or not path.is_file():
            raise ModelError(f"scikit-image {skimage_version()} at {root} does not ship the photograph {name!r} "
                             "SquareQ calibrates on; install scikit-image 0.22 or newer, or pass your own images with "
                             "--calib-data DIR.")
        photos.append(Photo(name, path, " ".join(doc.split("\n\n")[0].split())))
    return photos


def builtin_sentences() -> list[str]:
    """English sentences of CPython's documentation (``pydoc_data.topics``), prose paragraphs only, in file order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise ModelError("this Python has no pydoc_data (its documentation topics), which SquareQ's built-in text "
                         "calibration reads; pass your own text with --calib-text FILE.") from None
    sentences = []
    for key in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[key]):
            text = " ".join(paragraph.split())
            if _is_prose(text):
                sentences += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if len(s) >= 24]
    return sentences


def _is_prose(text: str) -> bool:
    """A paragraph of sentences rather than code, a grammar rule or a table."""
    if len(text) < 60 or not text[0].isupper() or not text.endswith((".", ":", "?", "!")):
        return False
    symbols = sum(c in "()[]{}=*<>_|\\" for c in text)
    return symbols <= 0.02 * len(text)


def text_source_name() -> str:
    """How the manifest names the built-in text."""
    return f"built-in: English prose of the CPython {sys.version.split()[0]} documentation (pydoc_data.topics)"


def read_text_samples(path: str | Path) -> list[str]:
    """The non-empty lines of a UTF-8 text file, one calibration sample each."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ModelError(f"--calib-text {path} does not exist; pass a UTF-8 text file with one sample per "
                         "line.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelError(f"--calib-text {path} cannot be read as UTF-8 text ({exc}); pass a UTF-8 text file with one "
                         "sample per line.") from None
    samples = [line.strip() for line in lines if line.strip()]
    if not samples:
        raise ModelError(f"--calib-text {path} holds no text; pass a UTF-8 text file with one sample per line.")
    return samples


def spread(items: list, count: int, seed: int) -> list:
    """``count`` items drawn from ``items`` in a seeded order, cycling when ``count`` exceeds them: a shuffled sample
    of the whole list rather than its beginning (the text corpus is sorted by topic)."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    return [items[order[i % len(order)]] for i in range(count)]
