"""SquareQ's optional dependencies (pip extras) and the one sentence a missing one gets.

``pip install squareq`` compiles (with ``--calib-data``), trains and samples. These extras add the rest:

* ``accept``: scipy (the convergence gate's paired tests) and torchmetrics (PSNR, SSIM, CLIP score) for
  ``squareq accept`` and ``squareq demo``;
* ``photos``: scikit-image, whose wheel carries the photographs the compiler calibrates image models on when no
  ``--calib-data`` is given;
* ``wandb``: Weights & Biases, for ``squareq train --log wandb``;
* ``video``: PyAV, which decodes the video files (``.mp4``, ``.webm``, ``.mov``, ``.mkv``) of a clip dataset (GIFs,
  animated WebPs and folders of frames need nothing more).
* ``ui``: Starlette and uvicorn, which serve ``squareq ui``'s page.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

# module -> (the PyPI package that provides it, the extra that installs it)
PROVIDERS = {"scipy": ("scipy", "accept"), "torchmetrics": ("torchmetrics", "accept"),
             "skimage": ("scikit-image", "photos"), "wandb": ("wandb", "wandb"), "av": ("av", "video"),
             "starlette": ("starlette", "ui"), "uvicorn": ("uvicorn", "ui")}


ACCEPT_MODULES = ("scipy.stats", "torchmetrics")  # what squareq accept's gates import


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the pip command that installs it."""


def missing_sentence(module: str, what: str) -> str:
    """The sentence for ``what`` needing ``module`` (a key of :data:`PROVIDERS`, or a submodule of one)."""
    package, extra = PROVIDERS[module.split(".")[0]]
    return f"{what} needs {package}, which is not installed; install SquareQ's {extra} extra with: {pip_command(extra)}"


PACKAGE_DIR = Path(__file__).resolve().parent


def pip_command(extra: str, package_dir: Path = PACKAGE_DIR) -> str:
    """The pip command that installs ``extra``: from the checkout (``pip install -e '.[extra]'``) when SquareQ runs
    from a clone, whose package folder sits beside pyproject.toml and .git, else from PyPI."""
    root = package_dir.parent
    if (root / "pyproject.toml").is_file() and (root / ".git").exists():
        return f"pip install -e '.[{extra}]'"
    return f"pip install 'squareq[{extra}]'"


def check_installed(modules: tuple[str, ...], what: str) -> None:
    """Refuse at once, before any long work, when one of ``modules`` that ``what`` will need is missing."""
    for module in modules:
        require(module, what)


def require(module: str, what: str) -> ModuleType:
    """``module`` imported, or :class:`MissingExtra` saying which extra ``what`` needs."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(missing_sentence(module, what) + ".") from None
