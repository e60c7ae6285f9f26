"""The compiler: reads a source model block by block, calibrates, chooses a format per layer and writes a slab."""
from .budget import BudgetError, parse_size
from .driver import CompileOptions, check_budget, compile_slab
from .sources import Source, open_source
from .thresholds import Thresholds, ThresholdsError

__all__ = ["BudgetError", "CompileOptions", "Source", "Thresholds", "ThresholdsError", "check_budget", "compile_slab",
           "open_source", "parse_size"]
