"""The loading boundary: a failure to read a model's files becomes one sentence (the path, what was wrong, what to do),
here rather than in each loader's own ``except`` clause.

Two parts:

* :func:`check_parts` looks at a pipeline's components before a library loads them: each has its ``config.json`` (a
  JSON object) and every ``*.safetensors`` file in it opens with a header that covers the file. A missing config or a
  cut file otherwise surfaces deep inside diffusers or transformers as an unrelated error (a "mismatched sizes"
  report, a failed allocation).
* :func:`reading` wraps a library's load or build: whatever it raises, except SquareQ's own sentences and an
  interrupt, becomes one sentence naming what was being read, the library's reason on one line, and what to do.

Both raise ``error`` (:class:`~squareq.models.ModelError` by default; the encoders' loaders pass their own).
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..models.base import ModelError
from ..slab.errors import brief
from .file_kind import unreadable


@contextlib.contextmanager
def reading(what: str, then: str, error: type[Exception] = ModelError) -> Iterator[None]:
    """Inside: any failure of the code that reads ``what`` (a path, or a model and its path) as one ``error``
    sentence ending in ``then`` (what to do). SquareQ's own sentences (ValueError subclasses raised as sentences:
    ``ModelError``, ``EncoderError``) and interrupts pass through as they are."""
    try:
        yield
    except (ModelError, error):
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: a library's error of any type, as one sentence
        raise error(f"cannot read {what} ({type(exc).__name__}: {brief(exc)}); {then}.") from None


def check_parts(folder: Path, parts: Iterable[str], then: str, error: type[Exception] = ModelError) -> None:
    """Refuse, in one ``error`` sentence naming the file and ending in ``then``, the first of a pipeline's component
    folders ``parts`` (those that exist) without a readable ``config.json`` or with a ``*.safetensors`` file that is
    not whole."""
    from safetensors import safe_open

    for part in parts:
        where = Path(folder) / part
        if not where.is_dir():
            continue  # the loader says which component is missing, with the download command
        config = where / "config.json"
        if not config.is_file():
            raise error(f"{config} is missing, so the {part} component cannot be built; {then}.")
        try:
            if not isinstance(json.loads(config.read_bytes()), dict):
                raise ValueError("it is not a JSON object")
        except (OSError, ValueError) as exc:
            raise error(f"{config} is not a readable JSON config ({brief(exc)}); {then}.") from None
        for file in sorted(where.glob("*.safetensors")):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    f.keys()
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a damaged file
                raise error(f"{unreadable(file, brief(exc))}; {then}.") from None
