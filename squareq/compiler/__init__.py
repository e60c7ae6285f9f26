"""The compiler: reads a source model block by block, calibrates, chooses a format per layer and writes a slab.

``open_source`` and ``Source`` moved to :mod:`squareq.sources` (issue 59); for one release ``squareq.compiler`` still
hands them out, with a ``FutureWarning`` naming the new import."""
import warnings

from .. import sources
from .budget import BudgetError, parse_size
from .compile_setup import check_budget
from .driver import compile_slab
from .options import CompileOptions
from .thresholds import Thresholds, ThresholdsError

__all__ = ["BudgetError", "CompileOptions", "Thresholds", "ThresholdsError", "check_budget", "compile_slab",
           "parse_size"]

_MOVED_TO_SOURCES = ("Source", "open_source")
# each moved name warns once per process, as load's old keywords do (``from ... import`` alone asks twice)
_warned: set[str] = set()


def __getattr__(name: str):
    """The names that moved to squareq.sources, for one release (PEP 562: asked only for names not found here)."""
    if name in _MOVED_TO_SOURCES:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"squareq.compiler.{name} moved to squareq.sources and will be removed from "
                          f"squareq.compiler in the next release; use `from squareq.sources import {name}`.",
                          FutureWarning, stacklevel=2)
        return getattr(sources, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
